"""fedfleet's server side: round orchestration, strategies, evaluation, checkpoints, the embedded
broker, fleet simulation, the ``fedfleet`` CLI and the communication audit."""
