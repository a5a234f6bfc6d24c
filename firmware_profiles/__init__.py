"""Firmware profiles: one TOML file per device class (read by :mod:`edge_agent.profiles`).

A package only so that the TOML files are installed with fedfleet."""
