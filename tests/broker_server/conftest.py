"""Fixtures shared by the server's test files (the suite-wide ones are in tests/conftest.py)."""

from __future__ import annotations

from typing import NoReturn

import pytest

from broker_server.server import AggregationServer


@pytest.fixture
def stopped_after_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every in-process server session ends as a Ctrl-C once its fleet joined: its round-0 checkpoint written."""

    def run(self: AggregationServer) -> NoReturn:
        if self.round == 0:
            self._checkpoint(accuracy=None)
        raise KeyboardInterrupt

    monkeypatch.setattr(AggregationServer, "run", run)
