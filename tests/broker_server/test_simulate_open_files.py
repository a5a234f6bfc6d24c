"""simulate's open-files limit: raised to what the fleet needs (3 per agent + 256), refused with
the numbers when the hard limit is lower."""

from __future__ import annotations

import resource

import pytest

from broker_server import simulate as sim
from broker_server.errors import ConfigError

_HARD_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
_NEED_FILES = 3 * 300 + 256  # 1,156: three descriptors per agent for 300 agents, plus the fixed part


@pytest.mark.skipif(_HARD_FILES != resource.RLIM_INFINITY and _HARD_FILES < _NEED_FILES,
                    reason=f"needs a hard open-files limit of at least {_NEED_FILES} (300 agents); this machine's "
                           f"is {_HARD_FILES} (raise it with ulimit -Hn)")
def test_the_soft_limit_is_raised_to_three_files_per_agent_plus_the_fixed_part() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = _NEED_FILES
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (500, hard))
        assert sim.ensure_open_files(300) == need
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (need, hard)
        assert sim.ensure_open_files(10) == need  # enough already: left as it is
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == need
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_hard_limit_below_the_need_is_a_config_error_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim.resource, "getrlimit", lambda _which: (1024, 1024))
    with pytest.raises(ConfigError, match=r"500 virtual agents need about 1,756 open files .* at most 1,024"):
        sim.ensure_open_files(500)  # 3 x 500 + 256
