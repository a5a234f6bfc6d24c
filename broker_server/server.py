"""The aggregation server: registry, round loop, evaluation, metrics and checkpoints.

One driver owns the round loop and the wire; the strategy only decides (``configure_round``)
and computes (``aggregate``). A round, as data (DESIGN.md §2):

1. select clients (participation rate, at least the quorum) among the joined, online ones;
2. publish ``global`` (the model) then ``round_start`` (who, deadline, training settings);
3. collect ``update`` messages until every selected client reported or the deadline passed;
   each accepted update gets a ``receipt``; duplicates (QoS 1 redelivery) are aggregated once,
   late updates for a closed round and updates from unselected clients are rejected and counted;
   a selected device that has nothing to send (no samples, diverged training) withdraws with an
   ``idle`` status for the round, and the round does not wait for it;
4. **quorum rule**: when fewer than ``quorum`` updates arrived by the deadline, the round is
   closed without aggregation (the global model is unchanged) and marked ``skipped`` in
   ``metrics.jsonl``; the updates it accepted were acknowledged, so a strategy that mirrors
   per-device state (SCAFFOLD's c, FedDyn's h) takes them into that state through its optional
   ``skipped_round`` (before the round's checkpoint); an aggregate with NaN/Inf is likewise
   discarded, never broadcast;
5. evaluate on the held-out test split, write one ``metrics.jsonl`` line and a checkpoint.

After the last round the server publishes ``finish``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.agent import extras_codecs
from edge_agent.algorithms import algorithm_share, shared_indices
from edge_agent.data import ArraySplit
from edge_agent.models import manifest_hash, model_manifest
from edge_agent.state import load_arrays, state_arrays
from protocol import topics
from protocol.channel import Channel, Received, Rejected
from protocol.messages import (Finish, Global, Join, Kind, Receipt, RoundStart, Status, Update, parse_extras_codec,
                               payload_sha256)
from protocol.tensors import Codec, TensorLimits, decode_tensor, encode_tensor

from .aggregate import all_finite
from .checkpoint import Checkpoint, CheckpointStore
from .errors import RunError
from .strategies import Accumulator, ClientResult, Strategy, accumulator_for

log = logging.getLogger(__name__)


#: Update metrics the server aggregates (client-side evaluation): each must be a number in [0, 1].
EVAL_METRICS = ("eval_accuracy", "eval_macro_f1")


def _is_fraction(value: object) -> bool:
    """True for an int or float (not a bool) in [0, 1] (NaN is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0


@dataclass(frozen=True)
class ServerSettings:
    """Round-loop settings.

    Attributes:
        rounds: number of rounds T.
        quorum: least updates for a round to be aggregated.
        round_deadline_s: seconds after ``round_start`` within which updates count.
        join_timeout_s: seconds to wait for ``expected_clients`` joins before round 1.
        expected_clients: start as soon as this many clients joined (``None``: wait for quorum).
        seed: seeds the client-selection generator.
        eval_batch_size: samples per forward pass in evaluation.
        expected_data: ``(key, value)`` pairs a joining agent must announce identically in its
            ``join.info`` (data set, partition scheme, α, seed, shard count): a mismatch is refused
            with a receipt naming the differences, so a device cannot silently train on another
            split.
        client_eval: ask every agent to evaluate its own model after local training (round
            config ``client_eval``); the round's metrics then carry ``client_accuracy_mean``,
            ``client_accuracy_worst`` and ``client_f1_mean``; only every ``client_eval_every``-th
            round and the last.
        extras_codec: codec text of the named arrays a ``global`` carries (``[protocol]
            extras_codec``: one codec for all, or per name; ``""`` = ``global_codec``).
        global_codec: codec text of ``global`` broadcasts. With a lossy codec the server adopts
            the decoded model as its global state, so that server and fleet hold the same model
            (deltas from the agents are then exact against it).
    """

    rounds: int
    quorum: int = 1
    round_deadline_s: float = 300.0
    join_timeout_s: float = 60.0
    expected_clients: int | None = None
    seed: int = 0
    eval_batch_size: int = 1000
    client_eval: bool = False
    client_eval_every: int = 1
    global_codec: str = "fp32"
    extras_codec: str = ""
    expected_data: tuple[tuple[str, str], ...] = ()


@dataclass
class ClientRecord:
    """What the server knows of one device (the registry; ``info`` is what it announced at join:
    profile, device, precision, fallbacks …)."""

    client_id: str
    profile: str = ""
    num_samples: int = 0
    class_histogram: list[int] = field(default_factory=list)
    online: bool = True
    last_seen: float = 0.0
    joined_round: int = 0
    updates_accepted: int = 0
    info: dict = field(default_factory=dict)


@dataclass
class RoundStats:
    """Counters of one round (written to ``metrics.jsonl``)."""

    round: int
    selected: int = 0
    clients_reported: int = 0
    duplicates: int = 0
    late: int = 0
    unsolicited: int = 0
    invalid: int = 0
    global_receipts: int = 0
    withdrawn: int = 0
    skipped: bool = False
    skip_reason: str = ""


@dataclass(frozen=True)
class RunSummary:
    """The outcome of :meth:`AggregationServer.run`."""

    rounds_completed: int
    final_accuracy: float
    final_loss: float
    metrics: list[dict]


def evaluate(model: torch.nn.Module, split: ArraySplit, *, batch_size: int = 1000,
             device: torch.device | None = None) -> tuple[float, float]:
    """Accuracy (fraction 0–1) and mean cross-entropy of ``model`` on ``split``.

    Args:
        model: a classifier returning logits [N, num_classes].
        split: ``x`` float32 [N, C, H, W], ``y`` int64 [N].
        batch_size: samples per forward pass.

    Returns:
        ``(accuracy, loss)``; ``(0.0, 0.0)`` for an empty split.
    """
    n = len(split.y)
    if n == 0:
        return 0.0, 0.0
    device = device or torch.device("cpu")
    model.eval()
    correct, loss_sum = 0, 0.0
    x_all = torch.from_numpy(np.array(split.x, dtype=np.float32))  # writable copy: the split is read-only
    y_all = torch.from_numpy(np.array(split.y, dtype=np.int64))
    with torch.inference_mode():
        for s in range(0, n, batch_size):
            xb, yb = x_all[s:s + batch_size].to(device), y_all[s:s + batch_size].to(device)
            logits = model(xb)
            loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
    return correct / n, loss_sum / n


class AggregationServer:
    """Runs the rounds of one federation over a :class:`~protocol.channel.Channel`.

    Args:
        channel: connected server channel (its node id is ``"server"``).
        strategy: the algorithm's server half (its optional ``bind_model`` is called here with ``model``).
        model: the global model (its state is the initial global state).
        test: held-out split for evaluation after each round.
        settings: round-loop settings.
        test_domains: per-domain test splits (multi-domain data sets): the global model is also
            evaluated on each, giving ``domain_accuracy``, ``accuracy_avg`` (mean over domains)
            and ``accuracy_worst`` (min over domains) in every round's metrics.
        run_dir: where ``metrics.jsonl``, ``checkpoints.sqlite`` and ``model_final.pt`` go.
        on_round: called with each round's metrics dict (progress display).
    """

    def __init__(self, *, channel: Channel, strategy: Strategy, model: torch.nn.Module, test: ArraySplit,
                 settings: ServerSettings, run_dir: Path, on_round: Callable[[dict], None] | None = None,
                 test_domains: dict[str, ArraySplit] | None = None) -> None:
        self.channel = channel
        self.strategy = strategy
        self.model = model
        bind = getattr(strategy, "bind_model", None)
        if bind is not None:  # shapes of shared non-model arrays come from the model, not round 1
            bind(model)
        self.test = test
        self.test_domains = dict(test_domains or {})
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.on_round = on_round
        self.manifest_hash = manifest_hash(model_manifest(model))
        self.global_tensors: list[np.ndarray] = list(state_arrays(model))
        self.share = algorithm_share(strategy)
        self.shared_idx = shared_indices(list(model.state_dict()), self.share)
        if self.share != "all" and not settings.client_eval:
            # the server holds no complete model: the devices' own models are the only measure
            log.info("%s shares %s of the model: client-side evaluation switched on", strategy.name,
                     "only the backbone" if self.share == "backbone" else "none")
            self.settings = settings = dataclasses.replace(settings, client_eval=True)
        self.registry: dict[str, ClientRecord] = {}
        self.rng = np.random.default_rng(settings.seed)
        self.round = 0
        self._collecting: int | None = None
        self._selected: set[str] = set()
        self._results: dict[str, tuple[int, float, dict]] = {}  # client -> (num_samples, train_loss, metrics)
        self._counted: dict[int, set[str]] = {}  # round -> clients aggregated (the last few rounds)
        self._acc: Accumulator | None = None
        self._stats = RoundStats(round=0)
        self._global_sha256 = b""
        self.totals = {"rejected_invalid": 0, "late": 0, "duplicates": 0, "unsolicited": 0}
        self.rejected_by_reason: dict[str, int] = {}
        self.metrics: list[dict] = []
        self.checkpoints = CheckpointStore(self.run_dir / "checkpoints.sqlite")
        self.global_codec = Codec.parse(settings.global_codec)
        self.fed = channel.federation
        model_bytes = sum(t.nbytes for t in self.global_tensors)
        # what a peer may make this server hold: a few models' worth, from joined clients only
        self.channel.limits = dataclasses.replace(self.channel.limits,
                                                  max_total_bytes=max(64 << 20, 4 * model_bytes))
        self.channel.reassembler.max_transfer_bytes = max(16 << 20, 4 * model_bytes + (1 << 20))
        self.channel.transfer_filter = lambda sender: sender in self.registry
        self._deadline = float("inf")
        self._extra_codecs = None
        self._extras_seen: set[str] = set()  # names carried by a global or an accepted update
        self._extras_codec_checked = False
        self._extras_update_seen = False  # an update was accepted: the upload names are known
        self._withdrawn: set[str] = set()
        self._resync = False
        self._round_msgs: tuple[Global, RoundStart] | None = None
        self.resyncs = 0
        self.onnx_result: dict = {}
        if hasattr(channel.transport, "add_connect_listener"):
            channel.transport.add_connect_listener(self._on_reconnect)
        channel.transport.subscribe(topics.server_filters(self.fed), qos=channel.qos)

    # ------------------------------------------------------------------ message handling

    def _online(self) -> list[str]:
        return sorted(c for c, r in self.registry.items() if r.online)

    def _reply(self, rec: Received, accepted: bool, reason: str = "") -> None:
        env = rec.envelope
        self.channel.send(topics.down_to(self.fed, env.sender, Kind.RECEIPT),
                          Receipt(ref_kind=int(env.kind), ref_seq=env.seq, accepted=accepted, reason=reason,
                                  sha256=rec.sha256),
                          round=env.round, recipient=env.sender)

    def _handle(self, item: Received | Rejected) -> None:
        if isinstance(item, Rejected):
            self.totals["rejected_invalid"] += 1
            self._stats.invalid += 1
            # per reason code (security checks: protocol.security.REASONS), since the last metrics line
            self.rejected_by_reason[item.code] = self.rejected_by_reason.get(item.code, 0) + 1
            return
        env = item.envelope
        body = env.body
        now = time.monotonic()
        rec = self.registry.get(env.sender)
        if rec is not None and not isinstance(body, (Join, Status)):
            if not rec.online:
                log.info("%s is back online", env.sender)
            rec.online, rec.last_seen = True, now
        if isinstance(body, Join):
            if body.manifest_hash != self.manifest_hash:
                log.warning("join from %s refused: model manifest %s != server's %s",
                            env.sender, body.manifest_hash, self.manifest_hash)
                self._reply(item, False, f"model manifest {body.manifest_hash} does not match the server's "
                                         f"{self.manifest_hash}: same model architecture and data shape needed")
                return
            diffs = [f"{k} {body.info.get(k)!r} (server: {v!r})" for k, v in self.settings.expected_data
                     if str(body.info.get(k)) != v]
            if diffs:
                log.warning("join from %s refused: %s", env.sender, "; ".join(diffs))
                self._reply(item, False, "data settings differ from the server's configuration: " + "; ".join(diffs))
                return
            rec = self.registry.get(env.sender) or ClientRecord(env.sender, joined_round=self.round)
            rec.profile, rec.num_samples = body.profile, body.num_samples
            rec.class_histogram, rec.online, rec.last_seen = list(body.class_histogram), True, now
            rec.info = dict(body.info)  # device, precision, fallbacks … as the agent announced them
            if body.info.get("fallback_count"):
                log.info("%s runs with fallbacks: %s", env.sender, body.info.get("fallbacks"))
            self.registry[env.sender] = rec
            log.info("join: %s (%s, %d samples)", env.sender, body.profile, body.num_samples)
            self._reply(item, True)
        elif isinstance(body, Status):
            rec = self.registry.get(env.sender)
            if rec is not None:
                rec.online = body.state != "offline"
                rec.last_seen = now
                if not rec.online:
                    log.info("%s is offline (%s)", env.sender, body.detail)
            if (body.state == "idle" and env.round and env.round == self._collecting and env.sender in self._selected
                    and env.sender not in self._results and env.sender not in self._withdrawn):
                # the device says it will not contribute to the open round (no samples, training
                # diverged): the round need not wait for it until the deadline
                self._withdrawn.add(env.sender)
                self._stats.withdrawn += 1
                log.warning("%s withdrew from round %d: %s", env.sender, env.round, body.detail)
        elif isinstance(body, Update):
            self._on_update(item, body)
        elif isinstance(body, Receipt) and body.ref_kind == Kind.GLOBAL:
            if env.round == self._collecting and body.sha256 == self._global_sha256:
                self._stats.global_receipts += 1
            elif env.round == self._collecting:
                log.warning("%s received a global model with another hash", env.sender)
        else:
            self.totals["unsolicited"] += 1
            log.warning("unexpected %s from %s ignored", env.kind.label, env.sender)

    def _on_update(self, item: Received, body: Update) -> None:
        env = item.envelope
        if env.sender in self._counted.get(env.round, ()):
            # counted in this round (still open, perhaps past its deadline) or in one that has
            # closed since: a redelivery or a resend after a lost receipt. Acknowledge it as
            # counted, so the agent stops re-sending and keeps the state the server counted
            # (never "late": that would make it roll back); never count it again.
            self.totals["duplicates"] += 1
            self._stats.duplicates += 1
            self._reply(item, True, "duplicate: already counted")
            return
        if self._collecting is not None and env.round == self._collecting and item.received_at > self._deadline:
            self.totals["late"] += 1
            self._stats.late += 1
            self._reply(item, False, f"arrived after the deadline of round {env.round}")
            return
        if env.round > self.round + 1:
            self.totals["unsolicited"] += 1
            self._stats.unsolicited += 1
            self._reply(item, False, f"round {env.round} has not started")
            return
        if self._collecting is None or env.round != self._collecting:
            self.totals["late"] += 1
            self._stats.late += 1
            log.warning("update from %s for round %d rejected: round %s is open", env.sender, env.round,
                        self._collecting)
            self._reply(item, False, f"round {env.round} is closed")
            return
        if env.sender not in self._selected:
            self.totals["unsolicited"] += 1
            self._stats.unsolicited += 1
            self._reply(item, False, f"{env.sender} was not selected for round {env.round}")
            return
        if env.sender in self._results:
            self.totals["duplicates"] += 1
            self._stats.duplicates += 1
            self._reply(item, True, "duplicate: already counted")
            return
        shared = self._shared()
        shapes_ok = len(body.tensors) == len(shared) and all(
            t.shape == g.shape and t.dtype == g.dtype for t, g in zip(body.tensors, shared))
        if not shapes_ok:
            self._refuse(item, f"tensors do not match the model manifest (share={self.share!r}: "
                               f"{len(shared)} tensors expected, {len(body.tensors)} received)")
            return
        rec = self.registry.get(env.sender)
        if rec is not None and body.num_samples > rec.num_samples:
            self._refuse(item, f"num_samples {body.num_samples} exceeds the {rec.num_samples} announced at join")
            return
        bad = [k for k in EVAL_METRICS if k in body.metrics and not _is_fraction(body.metrics[k])]
        if bad:  # the round's client_accuracy_* figures are computed from these (float() of any scalar)
            self.totals["rejected_invalid"] += 1
            self._stats.invalid += 1
            self._reply(item, False, f"metrics {bad[0]} = {body.metrics[bad[0]]!r} is not a number in [0, 1]")
            return
        tensors = body.tensors
        if body.delta:  # w_i = w_global + (w_i − w_global); integer state is sent whole
            tensors = tuple(g + d if np.issubdtype(g.dtype, np.floating) else d
                            for g, d in zip(shared, body.tensors))
        result = ClientResult(env.sender, tensors, body.num_samples, body.train_loss, dict(body.metrics),
                              extras=dict(body.extras))
        check = getattr(self.strategy, "validate", None)
        reason = check(result) if check is not None else None
        if reason:
            self._refuse(item, reason)
            return
        self._extras_seen.update(result.extras)
        self._extras_update_seen = True
        try:
            self._acc.add(result)
        except ValueError as exc:  # shapes/dtypes were checked; anything left is the update's fault
            self._refuse(item, f"cannot aggregate: {exc}")
            return
        self._results[env.sender] = (body.num_samples, body.train_loss, dict(body.metrics))
        self._withdrawn.discard(env.sender)  # a corrected update after a refusal counts
        self._counted.setdefault(env.round, set()).add(env.sender)
        for old in [r for r in self._counted if r < env.round - 8]:
            del self._counted[old]
        rec = self.registry.get(env.sender)
        if rec is not None:
            rec.updates_accepted += 1
            rec.last_seen = time.monotonic()
        self._reply(item, True)

    def _refuse(self, item: Received, reason: str) -> None:
        """Refuse a selected client's update for the open round as invalid: counted, answered with
        the reason, and the client no longer awaited this round (its receipt is definite, it will
        not send the same update again)."""
        self.totals["rejected_invalid"] += 1
        self._stats.invalid += 1
        log.warning("update from %s refused: %s", item.envelope.sender, reason)
        self._withdrawn.add(item.envelope.sender)
        self._reply(item, False, reason)

    def _on_reconnect(self, n: int) -> None:
        if n > 1:
            self._resync = True  # handled on the round-loop thread (never publish from paho's thread)

    def _resync_round(self) -> None:
        """After the server's link came back (a broker restart), publish the open round's global
        model and round_start again: agents that missed them train now; agents that already
        trained send their update again unless it was refused (answered as a duplicate when
        counted)."""
        self._resync = False
        if self._collecting is None or self._round_msgs is None:
            return
        log.warning("reconnected to the broker: re-sending round %d", self._collecting)
        glob, start = self._round_msgs
        enc = self.channel.send(topics.down(self.fed, Kind.GLOBAL), glob, round=self._collecting,
                                codec=self.global_codec, extra_codecs=self._extra_codecs)
        self._global_sha256 = payload_sha256(enc.payload)  # receipts now confirm the re-sent copy
        self.channel.send(topics.down(self.fed, Kind.ROUND_START), start, round=self._collecting)
        self.resyncs += 1

    def pump(self, timeout_s: float) -> None:
        """Handle every message that arrives within ``timeout_s`` seconds (at least one wait)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._resync:
                self._resync_round()
            item = self.channel.receive(max(0.0, deadline - time.monotonic()))
            if item is not None:
                self._handle(item)
            if time.monotonic() >= deadline:
                return

    # ------------------------------------------------------------------ the run

    def wait_for_clients(self) -> None:
        """Wait until ``expected_clients`` (or the quorum) joined, or ``join_timeout_s`` passed."""
        want = self.settings.expected_clients or self.settings.quorum
        deadline = time.monotonic() + self.settings.join_timeout_s
        while len(self._online()) < want and time.monotonic() < deadline:
            self.pump(min(0.2, max(0.0, deadline - time.monotonic())))
        log.info("%d clients joined (wanted %d)", len(self._online()), want)

    def run(self) -> RunSummary:
        """Run rounds ``round+1 … rounds``, then publish ``finish``.

        Returns:
            :class:`RunSummary` with the final accuracy and every round's metrics.
        """
        self.wait_for_clients()
        if len(self._online()) < self.settings.quorum:
            raise RunError(
                f"only {len(self._online())} agent(s) joined federation {self.fed!r} within "
                f"{self.settings.join_timeout_s:g} s; the quorum is {self.settings.quorum}. Check that the agents "
                f"use --federation {self.fed} and the same broker, or raise [server] join_timeout_s")
        if self.round == 0:
            self._checkpoint(accuracy=None)
        last_acc, last_loss = float("nan"), float("nan")
        while self.round < self.settings.rounds:
            m = self.run_round(self.round + 1)
            if m["accuracy"] is not None:
                last_acc, last_loss = m["accuracy"], m["loss"] if m["loss"] is not None else float("nan")
        self.channel.send(topics.down(self.fed, Kind.FINISH),
                          Finish(reason="completed", rounds_completed=self.round), round=self.round, wait_s=10)
        self.pump(0.2)
        self.checkpoints.close()
        if self.share != "none":  # with share="backbone" its shared entries are the global backbone
            torch.save(self.model.state_dict(), self.run_dir / "model_final.pt")
        if self.share == "all":
            self.onnx_result = self._export_onnx()
        else:  # the server's copy is not a model anyone trained end to end: nothing to deploy
            self.onnx_result = {"onnx_skipped": f"{self.strategy.name} shares {self.share} of the model: the "
                                                "trained models stay on the devices"}
        if self.channel.ledger is not None:
            self.channel.ledger.flush()
        return RunSummary(self.round, last_acc, last_loss, self.metrics)

    def run_round(self, r: int) -> dict:
        """Run round ``r`` (steps 1–5 of the module docstring) and return its metrics."""
        t0 = time.monotonic()
        sent0 = self._bytes()
        self._stats = RoundStats(round=r)
        available = self._online()
        plan = self.strategy.configure_round(r, available, self.rng)
        self._selected, self._results, self._collecting = set(plan.selected), {}, r
        self._withdrawn: set[str] = set()
        self._stats.selected = len(plan.selected)
        if self.global_codec.lossy:
            self.global_tensors = [np.array(decode_tensor(encode_tensor(t, self.global_codec),
                                                          limits=TensorLimits(allow_nonfinite=True)))
                                   for t in self.global_tensors]
            load_arrays(self.model, self.global_tensors)
        # after the lossy codec: the strategy starts from the model the clients receive
        self._acc = accumulator_for(self.strategy, r, self._shared())
        extras_of = getattr(self.strategy, "global_extras", None)
        glob = Global(tensors=tuple(self._shared()), meta={"manifest_hash": self.manifest_hash, "share": self.share},
                      extras=dict(extras_of()) if extras_of is not None else {})
        config = dict(plan.config)
        if self.settings.client_eval and (r % self.settings.client_eval_every == 0 or r == self.settings.rounds):
            config["client_eval"] = True
        start = RoundStart(selected=plan.selected, deadline_s=self.settings.round_deadline_s, config=config)
        self._round_msgs = (glob, start)
        self._extra_codecs = extras_codecs(self.settings.extras_codec, glob.extras, self.global_codec)
        self._extras_seen.update(glob.extras)
        enc = self.channel.send(topics.down(self.fed, Kind.GLOBAL), glob, round=r, codec=self.global_codec,
                                extra_codecs=self._extra_codecs)
        self._global_sha256 = payload_sha256(enc.payload)
        self.channel.send(topics.down(self.fed, Kind.ROUND_START), start, round=r)
        deadline = t0 + self.settings.round_deadline_s
        self._deadline = deadline
        while len(self._results) + len(self._withdrawn) < len(self._selected) and time.monotonic() < deadline:
            self.pump(min(0.5, max(0.0, deadline - time.monotonic())))
        # what already arrived before the deadline still counts, however busy the server was
        for _ in range(100_000):
            if len(self._results) + len(self._withdrawn) >= len(self._selected):
                break
            item = self.channel.receive(0.0)
            if item is None:
                break
            self._handle(item)
        self._collecting = None
        self._round_msgs = None
        self._deadline = float("inf")
        results = [self._results[c] for c in sorted(self._results)]
        self._stats.clients_reported = len(results)
        acc_round, self._acc = self._acc, None
        if len(results) < self.settings.quorum:
            self._stats.skipped = True
            self._stats.skip_reason = f"{len(results)} updates < quorum {self.settings.quorum}"
            log.warning("round %d skipped: %s", r, self._stats.skip_reason)
            keep_state = getattr(self.strategy, "skipped_round", None)
            if keep_state is not None and results:
                # these updates got accepted receipts and their devices kept the state they
                # produced: the strategy's mirror of that state must count them too
                keep_state(r, acc_round)
        else:
            new = acc_round.result()
            if new is not None and not all_finite(new):
                self._stats.skipped = True
                self._stats.skip_reason = "aggregate contains NaN/Inf: discarded"
                log.error("round %d: aggregate has NaN/Inf; the global model is kept", r)
            elif new is not None:
                if len(new) != len(self.shared_idx):
                    raise RunError(f"strategy {self.strategy.name!r} returned {len(new)} tensors, "
                                   f"{len(self.shared_idx)} expected for share={self.share!r}")
                for i, t in zip(self.shared_idx, new):
                    self.global_tensors[i] = t
                load_arrays(self.model, self.global_tensors)
        acc, loss = evaluate(self.model, self.test, batch_size=self.settings.eval_batch_size)
        extra_metrics = self._extra_metrics(results)
        if self.share != "all":
            # the server's copy holds only the shared part (or nothing) of a model: its score means
            # nothing. The round's accuracy is the clients' own models' (client_eval), when measured.
            acc, loss = extra_metrics.get("client_accuracy_mean"), None
            extra_metrics["accuracy_source"] = "clients"
        self.round = r
        if (r >= 2 and self._extras_update_seen) or r >= self.settings.rounds:
            self._check_extras_codec_names()
        up, down = (b - a for a, b in zip(sent0, self._bytes()))
        metrics = {
            "round": r, "accuracy": acc, "loss": loss, "accuracy_source": "global",
            "clients_selected": self._stats.selected,
            "clients_reported": self._stats.clients_reported, "bytes_up": up, "bytes_down": down,
            "seconds": time.monotonic() - t0, "skipped": self._stats.skipped,
            "duplicates": self._stats.duplicates, "late": self._stats.late, "invalid": self._stats.invalid,
            "global_receipts": self._stats.global_receipts, "unsolicited": self._stats.unsolicited,
            "withdrawn": self._stats.withdrawn,
            "rejected_by_reason": self.rejected_by_reason,
            "train_loss": float(np.average([loss for _, loss, _ in results], weights=[n for n, _, _ in results]))
            if results else None,
            **extra_metrics,
        }
        self.rejected_by_reason = {}
        if self._stats.skip_reason:
            metrics["skip_reason"] = self._stats.skip_reason
        self.metrics.append(metrics)
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.channel.ledger is not None:
            self.channel.ledger.flush()
        self._checkpoint(accuracy=acc)
        self.write_registry()
        if self.on_round:
            self.on_round(metrics)
        return metrics

    def _shared(self) -> list[np.ndarray]:
        """The global model tensors the strategy exchanges (its ``share`` subset, manifest order)."""
        return [self.global_tensors[i] for i in self.shared_idx]

    def _check_extras_codec_names(self) -> None:
        """Warn once when ``extras_codec`` names an entry that no global or accepted update of
        this run has carried (checked from the first round ≥ 2 that closes with an update
        accepted so far, when both directions have had a turn, else after the last round): a
        typo there silently leaves that entry on the update codec."""
        if self._extras_codec_checked:
            return
        self._extras_codec_checked = True
        try:
            _, per_name = parse_extras_codec(self.settings.extras_codec)
        except ValueError:  # checked when the configuration was loaded; a direct caller's text
            return
        unknown = sorted(set(per_name) - self._extras_seen)
        if unknown:
            log.warning("[protocol] extras_codec names %s, which no message of this run carried (extras seen: %s): "
                        "a typo? Those codecs have no effect", ", ".join(map(repr, unknown)),
                        ", ".join(sorted(self._extras_seen)) or "none")

    def _extra_metrics(self, results: list[tuple[int, float, dict]]) -> dict:
        """Per-domain accuracy of the global model, the clients' own-model evaluation, and the
        strategy's ``round_metrics()`` for one round's ``metrics.jsonl`` line."""
        out: dict = {"share": self.share}
        if self.test_domains:
            dom = {name: evaluate(self.model, split, batch_size=self.settings.eval_batch_size)[0]
                   for name, split in self.test_domains.items()}
            out["domain_accuracy"] = dom
            out["accuracy_avg"] = float(np.mean(list(dom.values())))
            out["accuracy_worst"] = float(min(dom.values()))
        accs = [float(m["eval_accuracy"]) for _, _, m in results if "eval_accuracy" in m]
        if accs:
            f1s = [float(m["eval_macro_f1"]) for _, _, m in results if "eval_macro_f1" in m]
            out.update(client_accuracy_mean=float(np.mean(accs)), client_accuracy_worst=float(min(accs)),
                       client_accuracy_best=float(max(accs)), client_accuracy_std=float(np.std(accs)),
                       client_f1_mean=float(np.mean(f1s)) if f1s else None, clients_evaluated=len(accs))
        more = getattr(self.strategy, "round_metrics", None)
        if more is not None:
            out.update(more())
        return out

    def _bytes(self) -> tuple[int, int]:
        """(uplink, downlink) wire bytes on the server's link so far, from this side's ledger rows."""
        return self.channel.wire_bytes_received, self.channel.wire_bytes_sent

    def _export_onnx(self) -> dict:
        """Export the final model to ``model_final.onnx`` and evaluate it with ONNX Runtime on
        the test split (the deployable artefact is checked, not just written)."""
        from edge_agent.errors import EdgeAgentError

        try:
            from edge_agent.onnx_runtime import OnnxModel, export_onnx  # ImportError: onnx(runtime) unavailable

            path = export_onnx(self.model, self.run_dir / "model_final.onnx", input_shape=tuple(self.test.x.shape[1:]))
            om = OnnxModel(path)
            acc, loss = om.evaluate(np.asarray(self.test.x, dtype=np.float32), np.asarray(self.test.y))
            return {"onnx_accuracy": acc, "onnx_loss": loss, "onnx_providers": list(om.providers_used)}
        except (EdgeAgentError, OSError, ImportError) as exc:
            log.warning("final model not exported to ONNX: %s", exc)
            return {"onnx_error": str(exc)}

    def write_registry(self) -> None:
        """``registry.json`` in the run folder: every device with online/offline, seconds since it
        was last seen, profile, samples, accepted updates (rewritten atomically each round)."""
        now = time.monotonic()
        rows = [{**asdict(r), "last_seen_s_ago": round(now - r.last_seen, 1) if r.last_seen else None}
                for r in sorted(self.registry.values(), key=lambda r: r.client_id)]
        for row in rows:
            row.pop("last_seen", None)
        tmp = self.run_dir / "registry.json.tmp"
        tmp.write_text(json.dumps({"round": self.round, "devices": rows}, indent=1), encoding="utf-8")
        tmp.replace(self.run_dir / "registry.json")

    def resume(self, ckpt: Checkpoint) -> None:
        """Continue after ``ckpt.round``: restore the global model, strategy state, the selection
        RNG and the registry (every device offline until it joins again); drop ``metrics.jsonl``
        lines of rounds after the checkpoint (an interrupted round is run again)."""
        self.round = ckpt.round
        self.global_tensors = [np.array(t) for t in ckpt.tensors]
        load_arrays(self.model, self.global_tensors)
        self.strategy.load_state_dict(ckpt.strategy_state)
        self.rng.bit_generator.state = ckpt.rng_state
        for rec in ckpt.registry:
            r = ClientRecord(**{k: v for k, v in rec.items() if k in ClientRecord.__dataclass_fields__})
            r.online, r.last_seen = False, 0.0
            self.registry[r.client_id] = r
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line)["round"] <= ckpt.round]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            self.metrics = [json.loads(line) for line in kept]
        log.info("resuming after round %d", ckpt.round)

    def _checkpoint(self, accuracy: float | None) -> None:
        self.checkpoints.save(Checkpoint(
            round=self.round, tensors=self.global_tensors, strategy_state=self.strategy.state_dict(),
            rng_state=self.rng.bit_generator.state, registry=[asdict(r) for r in self.registry.values()],
            meta={"accuracy": accuracy, "manifest_hash": self.manifest_hash}))
