"""``fedfleet-agent --receipt-timeout-s S --max-resends N``: how long an update waits for its receipt
before it is sent again, and how many times (``EdgeAgent``'s ``receipt_timeout_s`` and
``max_resends``, 10 s and 3 by default); a value out of range is refused by argparse (exit 2)
with the reason, before anything starts; ``--round-start-wait-s S``: how long it holds a round's
global without its round_start before it asks the server for it (10 s by default)."""

from __future__ import annotations

import inspect

import pytest

from edge_agent.agent import MAX_ROUND_START_ASKS, EdgeAgent
from edge_agent.agent import ROUND_START_WAIT_S as AGENT_ROUND_START_WAIT_S
from edge_agent.assembly import build_agent
from edge_agent.cli import MAX_RESENDS, RECEIPT_TIMEOUT_S, ROUND_START_WAIT_S, build_parser

REQUIRED = ["--broker", "mqtt://127.0.0.1:1883", "--federation", "f", "--client-id", "pi-1"]


def test_the_defaults_are_the_agents_own() -> None:
    args = build_parser().parse_args(REQUIRED)
    assert (args.receipt_timeout_s, args.max_resends) == (10.0, 3) == (RECEIPT_TIMEOUT_S, MAX_RESENDS)
    for fn in (EdgeAgent.__init__, build_agent):
        params = inspect.signature(fn).parameters
        assert (params["receipt_timeout_s"].default, params["max_resends"].default) == (10.0, 3), fn


def test_the_round_start_wait_defaults_to_the_agents_own_and_is_parsed() -> None:
    """``--round-start-wait-s`` (a round's global held without its round_start this long: ask the
    server for it): 10 s by default, the agent's and build_agent's default; at most 3 asks a round."""
    assert build_parser().parse_args(REQUIRED).round_start_wait_s == 10.0 == ROUND_START_WAIT_S
    assert AGENT_ROUND_START_WAIT_S == 10.0 and MAX_ROUND_START_ASKS == 3
    for fn in (EdgeAgent.__init__, build_agent):
        assert inspect.signature(fn).parameters["round_start_wait_s"].default == 10.0, fn
    assert build_parser().parse_args([*REQUIRED, "--round-start-wait-s", "2.5"]).round_start_wait_s == 2.5
    assert "--round-start-wait-s S" in " ".join(build_parser().format_help().split())


def test_the_options_are_parsed_and_shown_in_help() -> None:
    args = build_parser().parse_args([*REQUIRED, "--receipt-timeout-s", "2.5", "--max-resends", "0"])
    assert (args.receipt_timeout_s, args.max_resends) == (2.5, 0)
    text = " ".join(build_parser().format_help().split())
    assert "--receipt-timeout-s S" in text and "--max-resends N" in text
    assert "(default: 10.0)" in text and "(default: 3)" in text


@pytest.mark.parametrize(("flag", "value", "why"), [
    ("--receipt-timeout-s", "0", "0: need a positive number of seconds"),
    ("--receipt-timeout-s", "-1", "-1: need a positive number of seconds"),
    ("--receipt-timeout-s", "nan", "nan: need a positive number of seconds"),
    ("--receipt-timeout-s", "ten", "expected a number of seconds, got 'ten'"),
    ("--max-resends", "-1", "-1: need 0 or more (0: never sent again)"),
    ("--max-resends", "1.5", "expected a whole number, got '1.5'"),
    ("--round-start-wait-s", "0", "0: need a positive number of seconds"),
], ids=["timeout-zero", "timeout-negative", "timeout-nan", "timeout-text", "resends-negative", "resends-fraction",
        "round-start-wait-zero"])
def test_a_value_out_of_range_is_refused_with_the_reason(flag: str, value: str, why: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*REQUIRED, flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: {why}" in capsys.readouterr().err
