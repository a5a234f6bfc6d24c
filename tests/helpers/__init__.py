"""Helpers shared by the test modules (not test modules themselves: pytest collects nothing here).

- :mod:`helpers.brokers`: ``require_mosquitto()`` (skip without the binary, fail under CI=true).
- :mod:`helpers.federation`: ``small_config`` (the digits federation of the integration tests),
  ``Spy`` (a paho client on ``fedfleet/#``), ``spied``, ``run_with_spy``, ``read_metrics``,
  ``read_summary``.
- :mod:`helpers.memory_server`: an ``AggregationServer`` on :mod:`protocol.memory_transport`
  (``memory_server``, ``update_payload``, ``incoming``, ``receipts_to``).
- :mod:`helpers.checkpoints`: ``checkpoint_round`` (the newest round a run's checkpoint store holds).
- :mod:`helpers.waiting`: ``wait_for`` (poll a condition another thread makes true, with a bound).

Import them as ``from helpers.federation import small_config`` (``pythonpath = ["tests"]`` in
pyproject.toml); fixtures built on them live in tests/conftest.py.
"""
