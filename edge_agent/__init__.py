"""fedfleet edge agent: data sets, partitioners, client models and the agent runtime."""
