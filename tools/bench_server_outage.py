"""What a server outage costs the device links, with and without the server's presence
(``down/status``: its retained ``online``, its last will ``offline``; README *A real fleet*).

Usage (from the repository root)::

    python tools/bench_server_outage.py [--outage-s 8] [--timeout-s 1]

One process, a memory broker, time scaled 1/10 by default: 4 agents (scikit-learn's digits, the
light CNN, receipt timeout ``--timeout-s``, 3 re-sends), 3 rounds of FedAvg with a quorum of 4. The
server dies (its connection aborted, no DISCONNECT) when the first update of round 2 reaches it,
before any receipt of that round; it stays down ``--outage-s`` seconds, while a fifth agent starts
(a device restarted during the outage); then a server resumed from the run folder's checkpoint
(round 1) finishes the run. Run twice: the server's presence on (its last will, its ``online``: the
agents hold their re-sends), and off (as a server of an older version: no last will, no status;
they re-send on their timeouts, and the late device joins on its re-send schedule). Counted from
the broker's PUBLISHes: the update copies and their payload bytes before the crash, during the
outage and after the resume; the late agent's join after the resumed server came up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from broker_server.server import AggregationServer, ServerSettings, server_will  # noqa: E402
from broker_server.strategies import get_strategy  # noqa: E402
from edge_agent.agent import EdgeAgent  # noqa: E402
from edge_agent.algorithms import TrainConfig  # noqa: E402
from edge_agent.algorithms.fedavg import FedAvgClient  # noqa: E402
from edge_agent.data import load_dataset  # noqa: E402
from edge_agent.models import build_model  # noqa: E402
from protocol import topics  # noqa: E402
from protocol.channel import Channel  # noqa: E402
from protocol.memory_transport import MemoryBroker  # noqa: E402
from protocol.messages import Kind  # noqa: E402

FED = "outage"


class _Died(BaseException):
    """The server's process dying (nothing after it runs)."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)


def run(presence: bool, run_dir: Path, *, outage_s: float, timeout_s: float) -> dict:
    """One outage (see the module docstring); ``presence``: the server says its presence."""
    say = AggregationServer._say_presence
    try:
        return _run(presence, run_dir, outage_s=outage_s, timeout_s=timeout_s)
    finally:
        AggregationServer._say_presence = say  # type: ignore[method-assign]


def _run(presence: bool, run_dir: Path, *, outage_s: float, timeout_s: float) -> dict:
    hub = MemoryBroker()
    stamps: list[float] = []  # monotonic time of each PUBLISH in hub.published
    route = hub._route

    def timed(*args, **kwargs):
        stamps.append(time.monotonic())
        return route(*args, **kwargs)

    hub._route = timed  # type: ignore[method-assign]
    ds = load_dataset("digits")
    parts = np.array_split(np.random.default_rng(0).permutation(len(ds.train.y)), 5)

    def server(expected: int) -> AggregationServer:
        tr = hub.connect("server", will=server_will(FED) if presence else None)
        if not presence:  # a server of an older version says nothing of its presence
            AggregationServer._say_presence = lambda *a, **k: None  # type: ignore[method-assign]
        return AggregationServer(
            channel=Channel(tr, node_id="server", side="server", federation=FED, ledger=None),
            strategy=get_strategy("fedavg", min_clients=1), model=_model(), test=ds.test,
            settings=ServerSettings(rounds=3, quorum=4, round_deadline_s=120, join_timeout_s=60,
                                    expected_clients=expected), run_dir=run_dir)

    def agent(i: int) -> EdgeAgent:
        cid = f"dev-{i}"
        return EdgeAgent(channel=Channel(hub.connect(cid), node_id=cid, side="agent", federation=FED, ledger=None),
                         model=_model(), algorithm=FedAvgClient(), x=ds.train.x[parts[i]], y=ds.train.y[parts[i]],
                         num_classes=10, client_index=i, idle_timeout_s=300,
                         train_defaults=TrainConfig(local_epochs=1, batch_size=16), receipt_timeout_s=timeout_s,
                         max_resends=3)

    first = server(4)
    on_update = first._on_update

    def dies(item, body) -> None:
        if item.envelope.round == 2:
            raise _Died
        on_update(item, body)

    first._on_update = dies  # type: ignore[method-assign]
    agents = [agent(i) for i in range(4)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        first.run()
    except _Died:
        pass
    first.channel.transport.abort()  # the broker publishes the last will (when there is one)
    t_crash = time.monotonic()
    late = agent(4)
    late_thread = threading.Thread(target=late.run, daemon=True)
    late_thread.start()
    time.sleep(outage_s)
    t_resume = time.monotonic()
    second = server(5)
    ckpt = second.checkpoints.load()
    assert ckpt is not None
    second.resume(ckpt)
    summary = second.run()
    for t in [*threads, late_thread]:
        t.join(60)
    second.close("run finished")
    ups = [(s, m) for s, m in zip(stamps, hub.published, strict=True) if "/up/" in m.topic
           and m.topic.endswith("/update")]
    joins = [s for s, m in zip(stamps, hub.published, strict=True) if m.topic == topics.up(FED, "dev-4", Kind.JOIN)]

    def tally(lo: float, hi: float) -> tuple[int, int]:
        sel = [m for s, m in ups if lo <= s < hi]
        return len(sel), sum(len(m.payload) for m in sel)

    after = [s for s in joins if s >= t_resume]
    return {"presence": presence, "rounds": summary.rounds_completed,
            "before_crash": tally(0.0, t_crash), "outage": tally(t_crash, t_resume),
            "after_resume": tally(t_resume, float("inf")),
            "held": sum(a.held_resends["update"] for a in agents),
            "resends": sum(a.resends for a in agents),
            "late_joins_during_outage": sum(1 for s in joins if t_crash <= s < t_resume),
            "late_join_after_resume_s": round(after[0] - t_resume, 3) if after else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outage-s", type=float, default=8.0, help="seconds the server is down (8)")
    ap.add_argument("--timeout-s", type=float, default=1.0, help="the agents' receipt timeout in seconds (1)")
    args = ap.parse_args(argv)
    print("| server presence | update copies (bytes) before the crash | during the outage | after the resume "
          "| re-sends held | re-sends sent | late device's joins during the outage | its join after the resume |")
    print("|---|---|---|---|---|---|---|---|")
    for presence in (False, True):
        with tempfile.TemporaryDirectory() as d:
            r = run(presence, Path(d), outage_s=args.outage_s, timeout_s=args.timeout_s)

        def cell(x: tuple[int, int]) -> str:
            return f"{x[0]} ({x[1]:,} B)"

        print(f"| {'on' if presence else 'off (an older server)'} | {cell(r['before_crash'])} | "
              f"{cell(r['outage'])} | {cell(r['after_resume'])} | {r['held']} | {r['resends']} | "
              f"{r['late_joins_during_outage']} | {r['late_join_after_resume_s']} s |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
