"""A scripted server for agent tests over a real broker: a server-side :class:`Channel` on a
thread that answers each join as its ``mode`` says and records what the agents sent."""

from __future__ import annotations

import threading

from protocol import topics
from protocol.channel import Channel, Received
from protocol.messages import Finish, Global, Join, Kind, Receipt, RoundStart, Status
from protocol.transport import MqttTransport

MODES = ("listen", "silent", "mismatch")


class ScriptedServer:
    """A server channel over the broker at ``127.0.0.1:port`` that answers each join as ``mode``
    says: ``"listen"``: never answer; ``"silent"``: never acknowledge it, end the run with
    ``finish``; ``"mismatch"``: accept it, then send round 1 with a global of 0 tensors (what a
    FedMCP++ server sends) selecting the agent.

    Records the joins it got (:attr:`joins`) and the agents' status messages as ``(round, state,
    detail)`` (:attr:`statuses`). Raises ``ValueError`` for another ``mode``."""

    def __init__(self, port: int, federation: str, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.fed, self.mode = federation, mode
        tr = MqttTransport(f"{federation}-scripted", "127.0.0.1", port)
        tr.connect()
        tr.subscribe(topics.server_filters(federation), qos=1)
        self.ch = Channel(tr, node_id="server", side="server", federation=federation, ledger=None)
        self.joins = 0
        self.statuses: list[tuple[int, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self.ch.receive(0.2)
            if not isinstance(item, Received):
                continue
            env = item.envelope
            if isinstance(env.body, Status):
                self.statuses.append((env.round, env.body.state, env.body.detail))
            elif isinstance(env.body, Join):
                self.joins += 1
                self._answer(env)

    def _answer(self, env) -> None:
        if self.mode == "silent":
            self.ch.send(topics.down(self.fed, Kind.FINISH), Finish("done", 1), round=1)
        elif self.mode == "mismatch":
            self.ch.send(topics.down_to(self.fed, env.sender, Kind.RECEIPT),
                         Receipt(ref_kind=int(Kind.JOIN), ref_seq=env.seq, accepted=True), round=0)
            self.ch.send(topics.down(self.fed, Kind.GLOBAL), Global(tensors=()), round=1)
            self.ch.send(topics.down(self.fed, Kind.ROUND_START), RoundStart((env.sender,), 30.0, {}), round=1)

    def close(self) -> None:
        """Stop the thread and close the channel."""
        self._stop.set()
        self._thread.join(5)
        self.ch.close()
