"""The aggregation server: registry, round loop, evaluation, metrics and checkpoints.

One driver owns the round loop and the wire; the strategy only decides (``configure_round``)
and computes (``aggregate``). A round, as data (DESIGN.md §2):

1. select clients (participation rate, at least the quorum) among the joined, online ones;
2. publish ``global`` (the model) then ``round_start`` (who, deadline, training settings); the
   global as one broadcast on ``down/global``, or, by ``[server] global_delivery``
   (:func:`choose_delivery`: ``auto`` picks whichever moves fewer bytes over the broker), as one
   copy per selected device on ``down/{client}/global`` (the strategy's
   :meth:`~broker_server.strategies.Strategy.device_global` may make each copy its own), so that
   unselected devices download no model;
3. collect ``update`` messages until every selected client reported or the deadline passed;
   each accepted update gets a ``receipt``; duplicates (QoS 1 redelivery) are aggregated once,
   late updates for a closed round and updates from unselected clients are rejected and counted;
   a selected device that has nothing to send (no samples, diverged training) withdraws with an
   ``idle`` status for the round, and the round does not wait for it;
   **devices that come back**: a selected device that says ``online`` again while the round is
   open (it lost its link, perhaps while the global was on its way) is sent what its ``online``
   says it lacks (:attr:`protocol.messages.Status.holds`): the round's ``global`` and
   ``round_start``, or the ``round_start`` alone, on its own topics (``down/{client}/global``,
   ``down/{client}/round_start``, with the time left as ``deadline_s``), or, for an update this
   server counted, that update's receipt again: the others are not sent anything again, and an
   agent that already trained the round does not train it twice (it re-sends its update unless
   that copy is still on its way, answered as a duplicate). After the server's own reconnect
   the ``round_start`` goes again to each device the round awaits, on its own topic, the
   ``global`` only to those that do not say what they hold
   (:meth:`AggregationServer._resync_round`). **A lost round_start**: a device the server holds
   online whose ``online`` says it holds the open round's ``global`` but no ``round_start`` of it
   asks for one the broker dropped (:class:`edge_agent.agent.EdgeAgent`): a selected device is
   sent the ``round_start`` alone on its own topic (at most :data:`MAX_ROUND_RESENDS` times a
   round, as a device that comes back), an unselected one a ``round_start`` naming nobody on its
   own topic (as often at most), so it stops asking; ``round_start_asks`` and
   ``round_start_resends`` in ``metrics.jsonl`` count the asks and every ``round_start`` copy
   sent to one device, per device. A selected device whose last will (an
   ``offline`` status) arrives and that does not say ``online`` within ``offline_grace_s`` is
   **dropped**: the round no longer waits for it (``dropped`` in ``metrics.jsonl``);
   **refusals**: every refused update is answered with a receipt saying why and is a
   ``rejected`` row of the ledger; one refused while it was decoded is answered too when its
   header can be trusted (:attr:`protocol.channel.Rejected.answerable`), so the device does not
   send it again; the round stops waiting for the device at once when the fleet signs, else
   when the device withdraws itself (:meth:`AggregationServer._on_rejected`). ``invalid`` counts every message refused
   as invalid and ``rejected_by_reason`` splits it by reason code (:data:`REFUSAL_CODES` and the
   channel's and security checks' codes); the two always agree;
4. **quorum rule**: when fewer than ``quorum`` updates arrived by the deadline, the round is
   closed without aggregation (the global model is unchanged) and marked ``skipped`` in
   ``metrics.jsonl``; the updates it accepted were acknowledged, so a strategy that mirrors
   per-device state (SCAFFOLD's c, FedDyn's h) returns that state from ``skipped_round``
   (committed before the round's checkpoint);
5. **commit rule**: the round's new global state comes back as ONE
   :class:`~broker_server.strategies.GlobalUpdate` (the accumulator's ``result()``); the driver
   commits it (``strategy.commit``) only when every array is finite and encodable with the
   round's global/extras codecs (:func:`~broker_server.strategies.update_problem`), for every
   strategy alike; otherwise the old state stays and ``skip_reason`` says why. The round's
   strategy figures are the committed update's ``metrics`` (none when nothing was committed),
   so a skipped round never repeats the round before's;
6. evaluate on the held-out test split, write one ``metrics.jsonl`` line and a checkpoint.

**Evaluation rounds** (``[server] eval_every`` = E, default 1): the global model is evaluated on
the test split and each test domain only in rounds r with r mod E = 0 and in the last round
(:meth:`AggregationServer.evaluates_round`); the other rounds' lines carry no ``accuracy``,
``loss`` or ``accuracy_source`` (the keys are absent: not 0, not the last evaluated round's
copy, and no source named for a figure that is not there), no
``domain_accuracy``/``accuracy_avg``/``accuracy_worst``, and ``test_evaluated`` false. The
strategy's :meth:`Strategy.evaluate <broker_server.strategies.Strategy.evaluate>` runs every
round all the same (FedDO and FedAA compute their reward from it; an ``accuracy`` it returns
is the line's in every round), and nothing else changes: the evaluation draws from no generator
and only reads the model, so a run's training, selections and evaluated figures are those of
the same run with E = 1. ``share != "all"``: the line's accuracy is the devices' own
(``client_eval``, every ``client_eval_every``-th round), which E does not change.

**Evaluation overlap** (``[server] overlap_evaluation = "auto"``, the default, and a strategy
whose next plan does not read the round's evaluation: :attr:`Strategy.plans_from_evaluation
<broker_server.strategies.Strategy.plans_from_evaluation>` false): step 6 of round r, but the
last, is split. Everything that needs no model evaluation (the devices' figures, the strategy's
``aggregate_metrics`` and ``round_metrics``, counts, bytes) is gathered when the round closes,
and round r's checkpoint and ``registry.json`` are written then, before round r+1's selection
draws from the generator (so a killed and resumed run selects as an uninterrupted one); round
r+1 opens (selection, its ``global`` and ``round_start``), and round r's model — a copy of the
state checkpointed, since a lossy global codec changes the live model when round r+1 opens — is
evaluated (the test split, each test domain, :meth:`Strategy.evaluate
<broker_server.strategies.Strategy.evaluate>`) while the devices train round r+1, holding a
training slot (``eval_slot``: in a simulation the agents' slot semaphore, so evaluation and
trainings never outnumber the slots); then round r's line is written, before round r+1's, with
the figures the line would have had without overlap (only its timing fields differ). A crash
between round r's checkpoint and its line leaves the line in the checkpoint (its figures but
the evaluation's): :meth:`AggregationServer.resume` evaluates the checkpointed model and writes
it, so every completed round has exactly one line. What cannot overlap: the last round (no next
round), a round run alone (:meth:`AggregationServer.run_round`), and every round of a strategy
whose plan reads the evaluation (FedDO and FedAA: their ``evaluate`` computes the reward their
agent learns from). Skipped rounds, rounds after a resume and ``share != "all"`` (accuracy from
the devices' ``client_eval`` reports, which the line has when the round closes) overlap as any
other.

After the last round the server publishes ``finish`` and writes the final files (a ``finish``
the broker does not acknowledge is said, never fatal: :meth:`AggregationServer.run`). The
device registry (:mod:`broker_server.registry`), the open round's state
(:mod:`broker_server.round_state`) and the run folder (:mod:`broker_server.persistence`) live in
their own modules; this one holds the loop and the message handling.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.agent import STATE_ROUND_KEY, extras_codecs
from edge_agent.algorithms import local_entries, shared_indices
from edge_agent.data import ArraySplit
from edge_agent.models import manifest_hash, model_manifest
from edge_agent.state import load_arrays, state_arrays
from protocol import topics
from protocol.channel import Channel, Received, Rejected
from protocol.errors import TransportError
from protocol.link_log import LinkLog
from protocol.membership import JOIN_INFO_KEY, encode_members
from protocol.messages import (
    MAX_STR,
    SERVER_ID,
    Envelope,
    Finish,
    Global,
    Join,
    Kind,
    Receipt,
    RoundStart,
    Status,
    Update,
    encode,
    parse_extras_codec,
    payload_sha256,
)
from protocol.phases import PhaseClock
from protocol.tensors import Codec, TensorLimits, decode_tensor, encode_tensor
from protocol.transport_base import Will

from .admission import admit, model_requirement
from .checkpoint import Checkpoint
from .errors import RunError
from .metrics_file import missing_line, missing_line_text, read_metrics, rounds_without_line
from .persistence import RunStore
from .registry import LIMIT_RANGES, ClientRecord, DeviceRegistry, announced_limit
from .round_state import CountedUpdates, RoundState, RoundStats
from .strategies import (
    ClientReport,
    ClientResult,
    GlobalUpdate,
    Strategy,
    accumulator_for,
    client_metrics,
    round_config,
    round_result,
    server_evaluate,
    update_problem,
)
from .strategies._base import _guarded, _not_finite, checked_figures, classifier_shape
from .text import plural, round_list

if TYPE_CHECKING:
    from protocol.security import ChannelSecurity

__all__ = ["AggregationServer", "ClientRecord", "EVAL_METRICS", "OVERLAP_EVALUATIONS", "PRESENCE_WAIT_S", "RoundStats",
           "RunSummary", "ServerSettings", "client_eval_figures", "evaluate", "export_final_onnx",
           "final_accuracy_source", "final_accuracy_text", "final_figures", "run_troubles_text", "server_will",
           "write_final_model"]

log = logging.getLogger(__name__)


#: The keys of a round's metrics line that the driver writes: a strategy hook's figures
#: (``aggregate_metrics``, ``evaluate``) never replace them (``evaluate`` may give accuracy and loss).
DRIVER_KEYS = ("round", "accuracy", "loss", "accuracy_source", "test_evaluated", "share", "clients_selected",
               "clients_reported", "bytes_up", "bytes_down", "seconds", "skipped", "skip_reason", "duplicates", "late",
               "invalid", "global_receipts", "unsolicited", "withdrawn", "dropped", "resent_to", "round_start_resends",
               "round_start_asks", "unreported",
               "rejected_by_reason", "train_loss", "clients_train_s", "phase_s", "metrics_refused",
               "global_delivery", "non_finite")

#: Update metrics the server aggregates (client-side evaluation): each must be a number in [0, 1].
EVAL_METRICS = ("eval_accuracy", "eval_macro_f1")

#: Reason codes of the server's own refusals of decoded updates, with their help text: keys of
#: ``metrics.jsonl`` ``rejected_by_reason`` beside the channel's ``invalid`` (the bytes are no
#: valid message), ``resend_refused`` and the security codes (:data:`protocol.security.REASONS`).
REFUSAL_CODES: dict[str, str] = {
    "manifest_mismatch": "the update's tensors do not match the model manifest's shared entries (count, a "
                         "tensor's shape or dtype)",
    "num_samples": "num_samples exceeds the count the device announced at join",
    "metric_range": "a client evaluation metric is not a number in [0, 1]",
    "strategy_refused": "the algorithm's validate() refused the update (extras of the wrong shape, class ids …)",
    "aggregate_failed": "the accumulator could not fold the update in",
}


def _shape_text(t: np.ndarray) -> str:
    """``[8, 1, 3, 3] float32``: a tensor's shape and dtype as a refusal names them."""
    return f"[{', '.join(str(d) for d in t.shape)}] {t.dtype}"


def _is_fraction(value: object) -> bool:
    """True for an int or float (not a bool) in [0, 1] (NaN is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0


def _train_seconds(results: list[tuple[int, float, dict]]) -> dict[str, float]:
    """Sum and maximum of the reporting devices' ``train_seconds`` (their own local-round time)."""
    ts = [float(m["train_seconds"]) for _, _, m in results
          if isinstance(m.get("train_seconds"), (int, float)) and not isinstance(m.get("train_seconds"), bool)]
    return {"sum": round(sum(ts), 4), "max": round(max(ts), 4) if ts else 0.0, "reported": len(ts)}


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
        eval_batch_size: samples per forward pass in evaluation. 256, not 1000: with one torch
            thread a light-CNN pass over 10,000 MNIST images took 1.47 s at 256 against 2.67 s
            at 1000 (the activations of a 1000-image batch leave the cache).
        expected_data: ``(key, value)`` pairs a joining agent must announce identically in its
            ``join.info`` (data set, partition scheme, α, seed, shard count): a mismatch is refused
            with a receipt naming the differences, so a device cannot silently train on another
            split.
        client_eval: ask every agent to evaluate its own model after local training (round
            config ``client_eval``); the round's metrics then carry the figures of
            :func:`client_eval_figures` (``client_accuracy_mean``, ``client_accuracy_weighted``,
            ``client_accuracy_worst``, ``client_f1_mean`` …); only every ``client_eval_every``-th
            round and the last.
        client_test: what the devices evaluate on (``[data] client_test``: ``"shared"``, the test
            split, or ``"local"``, each device's held-out share of its shard), written beside the
            client figures of every metrics line so two protocols cannot be confused.
        extras_codec: codec text of the named arrays a ``global`` carries (``[protocol]
            extras_codec``: one codec for all, or per name; ``""`` = ``global_codec``).
        global_codec: codec text of ``global`` broadcasts. With a lossy codec the server adopts
            the decoded model as its global state, so that server and fleet hold the same model
            (deltas from the agents are then exact against it).
        offline_grace_s: seconds a selected device whose last will (``offline`` status) arrived
            during a round may take to say ``online`` again before the round stops waiting for
            it (``[server] offline_grace_s``, default 30 s: several of paho's reconnect attempts,
            1 s doubling to 8 s, after a link blip or a broker restart; a device back within it
            is sent the round again). The round's deadline still bounds every wait.
        global_confirm_s: seconds after the global is sent within which at least one selected
            device must confirm it (its receipt); else it is sent again in smaller packets (a
            broker that drops oversize messages without saying so; :meth:`AggregationServer._confirm_global`),
            at most :data:`GLOBAL_RESENDS` times.
        global_delivery: ``"broadcast"``, ``"per_device"`` or ``"auto"`` (``[server]
            global_delivery``): how each round's ``global`` reaches the selected devices
            (:func:`choose_delivery`).
        overlap_evaluation: ``"auto"`` (evaluate each round but the last while the devices
            train the next, unless the strategy's plan reads the evaluation: the module
            docstring's "Evaluation overlap") or ``"off"`` (evaluate before the next round
            opens), ``[server] overlap_evaluation``; one of :data:`OVERLAP_EVALUATIONS`.
        eval_every: E ≥ 1, ``[server] eval_every``: the global model is evaluated on the test
            split (and the test domains) in every E-th round and the last only (the module
            docstring's "Evaluation rounds"); the strategy's ``evaluate`` runs every round.
    """

    rounds: int
    quorum: int = 1
    round_deadline_s: float = 300.0
    join_timeout_s: float = 60.0
    expected_clients: int | None = None
    seed: int = 0
    eval_batch_size: int = 256
    client_eval: bool = False
    client_eval_every: int = 1
    client_test: str = "shared"
    global_codec: str = "fp32"
    extras_codec: str = ""
    expected_data: tuple[tuple[str, str], ...] = ()
    offline_grace_s: float = 30.0
    global_confirm_s: float = 10.0
    global_delivery: str = "auto"
    overlap_evaluation: str = "auto"
    eval_every: int = 1


#: ``[server] global_delivery`` values.
GLOBAL_DELIVERIES = ("auto", "broadcast", "per_device")

#: ``[server] overlap_evaluation`` values.
OVERLAP_EVALUATIONS = ("auto", "off")


def global_array_bytes(tensors: tuple[np.ndarray, ...] | list[np.ndarray], extras: dict[str, np.ndarray]) -> int:
    """Bytes of a global's arrays before the codec (Σ ``nbytes`` of its tensors and extras): the
    measure :func:`choose_delivery` compares copies by."""
    return sum(int(np.asarray(t).nbytes) for t in tensors) + sum(int(np.asarray(a).nbytes) for a in extras.values())


def choose_delivery(setting: str, online: int, broadcast_bytes: int, copy_bytes: list[int]) -> str:
    """How a round's ``global`` goes out: ``"broadcast"`` or ``"per_device"``.

    ``setting`` ``"broadcast"`` / ``"per_device"`` decide alone. ``"auto"``: per device when
    that moves fewer bytes in total over the broker. The broker forwards a PUBLISH once to each
    matching subscription, so a broadcast of G bytes crosses the broker's links once in (server →
    broker) and once out per subscribed device: (N + 1)·G for N online devices, selected or not
    (every agent subscribes to ``down/+``). A copy of G_c bytes for one device on
    ``down/{client}/global`` crosses twice (in, then out to that device alone): 2·Σ_c G_c over
    the k selected devices. Per device iff 2·Σ_c G_c < (N + 1)·G; with copies equal to the
    broadcast (no :meth:`~broker_server.strategies.Strategy.device_global`) that is 2k < N + 1:
    fewer than about half the online devices selected. A tie goes to the broadcast (protocol
    v1's one ``down/global``), so with every online device selected the wire is as before. The
    server's own uplink carries k copies instead of one: the rule counts the broker's bytes, the
    devices' downloads among them.

    Args:
        setting: one of :data:`GLOBAL_DELIVERIES`.
        online: N, the joined devices online when the round opens (connected devices that never
            joined also receive a broadcast; they are not counted, in the broadcast's favour).
        broadcast_bytes: G, the broadcast global's size (:func:`global_array_bytes`: its arrays'
            bytes; the envelope and topic, tens of bytes either way, are left out, and the codec
            applies alike to every copy).
        copy_bytes: G_c of each selected device's copy, same measure.

    Raises:
        ValueError: ``setting`` is not one of :data:`GLOBAL_DELIVERIES`.
    """
    if setting not in GLOBAL_DELIVERIES:
        raise ValueError(f"global_delivery = {setting!r} is not one of {', '.join(GLOBAL_DELIVERIES)}")
    if setting != "auto":
        return setting
    return "per_device" if 2 * sum(copy_bytes) < (online + 1) * broadcast_bytes else "broadcast"


#: Times a global no device confirmed is sent again, each time in packets of half the size.
GLOBAL_RESENDS = 3

#: Times one round is sent again to one selected device that says ``online`` again while the round
#: waits for it (each time its global and round_start): a flapping link, or a forged status on a
#: broker without signing, cannot make the server send it the model without bound.
MAX_ROUND_RESENDS = 3


#: Seconds :meth:`AggregationServer.run` waits for the broker's acknowledgement of its ``finish``.
FINISH_WAIT_S = 10.0

#: Seconds :meth:`AggregationServer.close` waits for the broker's acknowledgement of the server's
#: retained ``offline`` status.
PRESENCE_WAIT_S = 5.0


def server_will(federation: str, security: ChannelSecurity | None = None) -> Will:
    """The MQTT last will of the server: its retained ``offline`` status on ``down/status``
    (:func:`protocol.topics.server_status`; QoS 1, ``seq`` 0, round 0, detail ``connection
    lost``), sealed with the server's keys when it signs, as an agent's own
    (:func:`edge_agent.assembly.offline_will`). The broker publishes it when the server's
    connection ends without DISCONNECT (a crash, a killed process, a lost link): the agents then
    hold their re-sends until the server says ``online`` again (:class:`edge_agent.agent.EdgeAgent`).

    Raises:
        FieldError: ``federation`` is not a valid topic level.
    """
    topic = topics.server_status(federation)
    payload = encode(Envelope(round=0, sender=SERVER_ID, seq=0, body=Status("offline", "connection lost"))).payload
    if security is not None:
        payload = security.seal(topic, payload).payload
    return Will(topic, payload, qos=1, retain=True)


@dataclass(frozen=True)
class RunSummary:
    """The outcome of :meth:`AggregationServer.run`.

    Attributes:
        rounds_completed: the rounds done (a resumed run's earlier ones included).
        final_accuracy, final_loss: the figures the run ends with (:func:`final_figures`).
        metrics: every round's metrics line.
        finish_unconfirmed: ``None`` when the broker acknowledged the run's ``finish`` (or none
            was sent), else what :attr:`AggregationServer.finish_unconfirmed` says of it.
    """

    rounds_completed: int
    final_accuracy: float
    final_loss: float
    metrics: list[dict]
    finish_unconfirmed: dict | None = None


def final_figures(metrics: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """``(accuracy, loss)`` a run ends with: those of the last metrics line that has an
    accuracy (``loss`` NaN when that line has none); ``(nan, nan)`` when no line has one."""
    acc, loss = float("nan"), float("nan")
    for m in metrics:
        if m.get("accuracy") is not None:
            acc, loss = m["accuracy"], m["loss"] if m.get("loss") is not None else float("nan")
    return acc, loss


def _scheduled(r: int, every: int, rounds: int) -> bool:
    """Whether round ``r`` is in an every-``every``-rounds schedule that always takes the last
    round (``rounds``): the global evaluation's (``eval_every``) and the devices' (``client_eval_every``)."""
    return r % every == 0 or r >= rounds


def final_accuracy_source(metrics: Sequence[Mapping[str, Any]]) -> str | None:
    """The ``accuracy_source`` of the line :func:`final_figures` takes its accuracy from (the last
    metrics line that has an accuracy): ``"global"`` when that line names none (lines written
    before the key existed), ``None`` when no line has an accuracy. A later line without an
    accuracy (a round the server did not evaluate) does not count."""
    source = None
    for m in metrics:
        if m.get("accuracy") is not None:
            source = m.get("accuracy_source") or "global"
    return source


#: How the end-of-run line names a final accuracy, by the ``accuracy_source`` of its line.
FINAL_ACCURACY_WORDS = {
    "global": "final test accuracy",
    "clients": "final test accuracy of the devices' own models (mean over clients)",
    "strategy": "final accuracy from the algorithm's own evaluation",
}


def final_accuracy_text(accuracy: float | None, source: str | None = "global") -> str:
    """The end-of-run words for a final ``accuracy`` (a fraction) whose line's
    ``accuracy_source`` is ``source`` (:func:`final_accuracy_source`): e.g. ``"final test
    accuracy 0.8329"``; ``"no accuracy was measured"`` when ``accuracy`` is ``None`` or NaN (no
    line had one, e.g. a personalised algorithm whose devices never evaluated). An unknown
    source is named as it is."""
    if accuracy is None or not math.isfinite(float(accuracy)):
        return "no accuracy was measured"
    words = FINAL_ACCURACY_WORDS.get(source or "global", f"final accuracy ({source})")
    return f"{words} {float(accuracy):.4f}"


def run_troubles_text(metrics: Sequence[Mapping]) -> str:
    """What an end-of-run line adds about rounds that went wrong, from the run's ``metrics.jsonl``
    lines: ``"; 2 rounds skipped (2, 3)"`` (at most five named) and ``"; the global model
    diverged in round 1 (test loss nan)"`` (the first line whose ``loss`` is NaN or infinite);
    ``""`` when neither happened."""
    out = ""
    skipped = [int(m["round"]) for m in metrics if m.get("skipped") and "round" in m]
    if skipped:
        out += f"; {plural(len(skipped), 'round')} skipped ({round_list(skipped)})"
    bad = next((m for m in metrics if isinstance(m.get("loss"), float) and not math.isfinite(m["loss"])), None)
    if bad is not None:
        out += f"; the global model diverged in round {bad.get('round')} (test loss {bad['loss']})"
    return out


def export_final_onnx(model: torch.nn.Module, run_dir: Path, test: ArraySplit) -> dict:
    """Export ``model`` to ``run_dir/model_final.onnx`` and evaluate it with ONNX Runtime on
    ``test`` (the deployable artefact is checked, not just written).

    Returns:
        ``{"onnx_accuracy", "onnx_loss", "onnx_providers"}``, or ``{"onnx_error": text}`` when
        ONNX / ONNX Runtime is unavailable or the export failed (logged as a warning).
    """
    from edge_agent.errors import EdgeAgentError

    try:
        from edge_agent.onnx_runtime import OnnxModel, export_onnx  # ImportError: onnx(runtime) unavailable

        path = export_onnx(model, Path(run_dir) / "model_final.onnx", input_shape=tuple(test.x.shape[1:]))
        om = OnnxModel(path)
        acc, loss = om.evaluate(np.asarray(test.x, dtype=np.float32), np.asarray(test.y))
        return {"onnx_accuracy": acc, "onnx_loss": loss, "onnx_providers": list(om.providers_used)}
    except (EdgeAgentError, OSError, ImportError) as exc:
        log.warning("final model not exported to ONNX: %s", exc)
        return {"onnx_error": str(exc)}


def write_final_model(store: RunStore, model: torch.nn.Module, *, share: str, algorithm: str,
                      test: ArraySplit) -> dict:
    """What the end of a run writes of its final global ``model``: ``model_final.pt`` unless
    the algorithm shares nothing (``share = "none"``; with ``"backbone"`` its shared entries are
    the global backbone), and ``model_final.onnx`` (:func:`export_final_onnx`) when it shares
    the whole model. Returns the ``onnx_*`` figures for ``summary.json`` (``onnx_skipped`` with
    the reason when the server's copy is no model anyone trained end to end)."""
    if share != "none":
        store.save_final_model(model)
    if share == "all":
        return export_final_onnx(model, store.run_dir, test)
    return {"onnx_skipped": f"{algorithm} shares {share} of the model: the trained models stay on the devices"}


@dataclass
class _PendingLine:
    """A round whose metrics line waits for its evaluation (evaluation overlap).

    Attributes:
        round: the round.
        tensors: the global state it closed with, in manifest order (the arrays checkpointed).
        line: its metrics line but the evaluation's figures (``accuracy``/``loss`` as far as known).
        t0: ``time.monotonic()`` when the round opened.
        closed: ``time.monotonic()`` when its checkpoint and ``registry.json`` were written.
        started: its evaluation has begun (a failure after that is not retried).
    """

    round: int
    tensors: list[np.ndarray]
    line: dict
    t0: float
    closed: float
    started: bool = False


def client_eval_figures(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The round's figures of the devices' own-model evaluations (client_eval).

    Args:
        metrics: the ``metrics`` of the round's accepted updates; those holding
            ``eval_accuracy`` (a fraction, checked on receipt) count, each with its
            ``eval_macro_f1`` and ``eval_samples`` M_k (the size of the device's evaluation split).

    Returns:
        ``{}`` when no update holds ``eval_accuracy``; else, over the K devices that evaluated,
        with a_k their accuracies: ``client_accuracy_mean`` = (1/K) Σ a_k (unweighted: each
        device counts once), ``client_accuracy_weighted`` = Σ a_k·M_k / Σ M_k (= correct
        predictions / test samples over the fleet: the mean PFLlib and HtFLlib report, their
        ``serverbase.evaluate`` ``sum(correct) / sum(samples)``; ``None`` when a device gave no
        positive integer ``eval_samples``), ``client_accuracy_worst`` / ``_best`` (min / max
        a_k), ``client_accuracy_std`` (population std of a_k), ``client_f1_mean`` (unweighted
        mean of the macro-F1s, ``None`` when none was given), ``clients_evaluated`` (K) and
        ``client_eval_samples`` (Σ M_k, ``None`` as for the weighted mean).
    """
    evaluated = [m for m in metrics if "eval_accuracy" in m]
    if not evaluated:
        return {}
    accs = [float(m["eval_accuracy"]) for m in evaluated]
    f1s = [float(m["eval_macro_f1"]) for m in evaluated if "eval_macro_f1" in m]
    counts = [int(n) for m in evaluated
              if isinstance(n := m.get("eval_samples"), int | np.integer) and not isinstance(n, bool) and n > 0]
    total: int | None = None
    weighted: float | None = None
    if len(counts) == len(evaluated):
        total = sum(counts)
        weighted = float(sum(a * n for a, n in zip(accs, counts, strict=True)) / total)
    return {"client_accuracy_mean": float(np.mean(accs)), "client_accuracy_weighted": weighted,
            "client_accuracy_worst": float(min(accs)), "client_accuracy_best": float(max(accs)),
            "client_accuracy_std": float(np.std(accs)), "client_f1_mean": float(np.mean(f1s)) if f1s else None,
            "clients_evaluated": len(accs), "client_eval_samples": total}


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
        strategy: the algorithm's server half (a :class:`~broker_server.strategies.Strategy`;
            its ``bind_model`` is called here with ``model``).
        model: the global model (its state is the initial global state).
        test: held-out split for evaluation after each round.
        settings: round-loop settings.
        test_domains: per-domain test splits (multi-domain data sets): the global model is also
            evaluated on each, giving ``domain_accuracy``, ``accuracy_avg`` (mean over domains)
            and ``accuracy_worst`` (min over domains) in every round's metrics.
        run_dir: where ``metrics.jsonl``, ``checkpoints.sqlite`` and ``model_final.pt`` go.
        on_round: called with each round's metrics dict (progress display), when its line is
            written (under evaluation overlap, while the next round trains).
        eval_slot: held (``with``) while the server evaluates a round during the next one's
            training (evaluation overlap): in a simulation one of the agents' training slots
            (:func:`broker_server.simulate.simulate`), so that the busy threads never outnumber
            the slots; ``None`` (a server on its own machine): nothing is held. Also settable
            as the :attr:`eval_slot` attribute before :meth:`run`.

    Raises:
        RunError: ``settings.global_delivery`` or ``settings.overlap_evaluation`` is not a known
            value, or ``settings.eval_every`` is not an integer ≥ 1.
    """

    def __init__(self, *, channel: Channel, strategy: Strategy, model: torch.nn.Module, test: ArraySplit,
                 settings: ServerSettings, run_dir: Path, on_round: Callable[[dict], None] | None = None,
                 test_domains: dict[str, ArraySplit] | None = None,
                 eval_slot: AbstractContextManager[Any] | None = None) -> None:
        self.channel = channel
        self.strategy = strategy
        self.model = model
        strategy.bind_model(model)  # shapes of shared non-model arrays come from the model, not round 1
        self.test = test
        self.test_domains = dict(test_domains or {})
        if settings.global_delivery not in GLOBAL_DELIVERIES:
            raise RunError(f"global_delivery = {settings.global_delivery!r} is not one of "
                           f"{', '.join(GLOBAL_DELIVERIES)}")
        if settings.overlap_evaluation not in OVERLAP_EVALUATIONS:
            raise RunError(f"overlap_evaluation = {settings.overlap_evaluation!r} is not one of "
                           f"{', '.join(OVERLAP_EVALUATIONS)}")
        if isinstance(settings.eval_every, bool) or not isinstance(settings.eval_every, int) or settings.eval_every < 1:
            raise RunError(f"eval_every = {settings.eval_every!r} must be an integer >= 1 (evaluate the global model "
                           "in every eval_every-th round and the last)")
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.on_round = on_round
        self.manifest_hash = manifest_hash(model_manifest(model))
        self.global_tensors: list[np.ndarray] = list(state_arrays(model))
        self.share = strategy.share
        # with buffers = "local" the model's buffers (BatchNorm statistics) stay on the devices
        self.shared_idx = shared_indices(list(model.state_dict()), self.share,
                                         local_entries(model, strategy.buffers))
        if self.share != "all" and not settings.client_eval:
            # the server holds no complete model: the devices' own models are the only measure
            log.info("%s shares %s of the model: client-side evaluation switched on", strategy.name,
                     "only the backbone" if self.share == "backbone" else "none")
            self.settings = settings = dataclasses.replace(settings, client_eval=True)
        self.devices = DeviceRegistry()
        self.rng = np.random.default_rng(settings.seed)
        self.round = 0
        self.open = RoundState()
        self._counted = CountedUpdates()
        #: device → SHA-256 of the last status payload handled from it: a retained copy of that one,
        #: handed to this server's subscription again after a reconnect of its own, is not news
        self._status_seen: dict[str, bytes] = {}
        #: devices whose last ``online`` said what they hold of the rounds (Status.holds): after this
        #: server's reconnect they get only what their next ``online`` says they lack
        self._holdings_known: set[str] = set()
        self.totals = {"rejected_invalid": 0, "late": 0, "duplicates": 0, "unsolicited": 0, "early": 0}
        self._early_between = 0  # early updates since the last round closed: the next round's line counts them
        self.rejected_by_reason: dict[str, int] = {}  # invalid messages since the last metrics line, by code
        self.run_rejected_by_reason: dict[str, int] = {}  # the same over the whole run
        self._manifest = model_manifest(model)
        self.metrics: list[dict] = []
        self.refused_joins: dict[str, str] = {}  # device → why its last join was refused (until admitted)
        #: device → the round in which it joined again without the state it had kept (join.info
        #: state_round 0 after accepted updates: a restart that lost it; summary.json)
        self.rejoined_without_state: dict[str, int] = {}
        self.store = RunStore(self.run_dir)
        self.checkpoints = self.store.checkpoints
        self.global_codec = Codec.parse(settings.global_codec)
        self.fed = channel.federation
        model_bytes = sum(t.nbytes for t in self.global_tensors)
        # what a peer may make this server hold: a few models' worth, from joined clients only
        self.channel.limits = dataclasses.replace(self.channel.limits,
                                                  max_total_bytes=max(64 << 20, 4 * model_bytes))
        self.channel.reassembler.max_transfer_bytes = max(16 << 20, 4 * model_bytes + (1 << 20))
        self.channel.transfer_filter = lambda sender: sender in self.devices
        self._extra_codecs: dict[str, Codec] | None = None
        self._extras_seen: set[str] = set()  # names carried by a global or an accepted update
        self._extras_codec_checked = False
        self._extras_update_seen = False  # an update was accepted: the upload names are known
        self._resync = 0  # the connection whose reconnect is still to be handled (0: none)
        self.resyncs = 0
        self._resend_capped: set[tuple[int, str]] = set()  # (round, client) told "nothing more is sent"
        self.onnx_result: dict = {}
        #: the run's ``finish`` when the broker did not acknowledge it (:meth:`run`), else ``None``
        self.finish_unconfirmed: dict | None = None
        self.eval_slot: AbstractContextManager[Any] = eval_slot if eval_slot is not None else nullcontext()
        self._eval_model: torch.nn.Module | None = None  # the overlapped evaluations' copy of the model
        self._started = time.monotonic()  # metrics.jsonl "ended_s" counts from here
        self._ended_before = 0.0  # a resumed run's: its last kept line's ended_s (the run goes on counting)
        self.metrics_lines_missing: list[int] = []  # rounds before the resumed checkpoint whose line is gone
        self._diverged_round: int | None = None  # the first round whose global's test loss was NaN/Inf
        # per-phase seconds of each round (metrics.jsonl "phase_s"): the channel's accept (decode,
        # signature check, ledger rows) and the handling of what arrived are timed at every call
        self.phases = PhaseClock()
        channel.accept = self.phases.timed("receive", channel.accept)  # type: ignore[method-assign]
        self._on_update = self.phases.timed("accumulate", self._on_update)  # type: ignore[method-assign]
        #: progress observer, ``(kind, round, client, info)`` (:mod:`broker_server.progress`)
        self.on_event: Callable[[str, int, str | None, dict], None] | None = None
        if hasattr(channel.transport, "add_connect_listener"):
            channel.transport.add_connect_listener(self._on_reconnect)
        #: the log of the server's link to the broker: lost (WARNING), back (INFO)
        #: (:mod:`protocol.link_log`)
        self.link_log = LinkLog(log)
        self.link_log.attach(channel.transport)
        #: devices of the resumed checkpoint's registry not heard from since the resume
        #: (:meth:`_heard_again` says each once; a join is said as a join); empty without a resume
        self.not_back: set[str] = set()
        self._resumed_after = 0
        #: the server's presence as it last said it on ``down/status`` (``"online"``, ``"offline"``;
        #: ``None``: not said yet), and the reconnect whose ``online`` is still to be said (0: none)
        self.presence: str | None = None
        self._announce = 0
        channel.transport.subscribe(topics.server_filters(self.fed), qos=channel.qos)
        # serving from here on: agents that saw this federation's server go away (its last will,
        # live) send what they held back, and one started before it sends its join again now
        self._say_presence("online", "serving", wait_s=PRESENCE_WAIT_S)

    @property
    def registry(self) -> dict[str, ClientRecord]:
        """Client id → :class:`ClientRecord` (the device registry's records)."""
        return self.devices.records

    # ------------------------------------------------------------------ message handling

    def _online(self) -> list[str]:
        return self.devices.online()

    def _reply(self, rec: Received, accepted: bool, reason: str = "", member_index: int | None = None) -> None:
        """Answer ``rec`` with a receipt (an accepted join's with the device's ``member_index``
        when it reads ``round_start.members``); a refusal also turns its ledger row into a
        ``rejected`` row with the reason (:meth:`protocol.channel.Channel.record_refusal`)."""
        env = rec.envelope
        if not accepted:
            self.channel.record_refusal(rec, reason)
        self._send_receipt(env.sender, env.kind, env.seq, env.round, accepted, reason, rec.sha256, member_index)

    def _send_receipt(self, client: str, kind: Kind, seq: int, round: int, accepted: bool, reason: str,
                      sha256: bytes, member_index: int | None = None) -> None:
        packet, chunk = self._limits([client])
        self.channel.send(topics.down_to(self.fed, client, Kind.RECEIPT),
                          Receipt(ref_kind=int(kind), ref_seq=seq, accepted=accepted, reason=reason[:MAX_STR],
                                  sha256=sha256, member_index=member_index),
                          round=round, recipient=client, max_packet_bytes=packet, chunk_bytes=chunk)

    def _limits(self, client_ids: list[str] | None = None) -> tuple[int, int]:
        """(max_packet_bytes, chunk_bytes) for a download to ``client_ids`` (``None``: a broadcast,
        every joined device): the smallest each of them announced in its join (0: none)."""
        return self.devices.limits(client_ids)

    def _count_invalid(self, code: str) -> None:
        """One more message refused as invalid, under reason ``code``: ``invalid`` and
        ``rejected_by_reason`` are counted here only, so they always agree."""
        self.totals["rejected_invalid"] += 1
        self.rejected_by_reason[code] = self.rejected_by_reason.get(code, 0) + 1
        self.run_rejected_by_reason[code] = self.run_rejected_by_reason.get(code, 0) + 1

    def refusal_totals(self) -> dict:
        """Refusals over the whole run (``summary.json``): ``invalid`` and its split by reason
        code ``rejected_by_reason`` (they add up), ``late``, ``duplicates``, ``unsolicited``, the
        devices each round dropped (``dropped``: round → ids), and, not refused but left
        unanswered, ``early``: updates for a round not open yet (the device sends each again when
        that round starts)."""
        return {"invalid": self.totals["rejected_invalid"], "rejected_by_reason": dict(self.run_rejected_by_reason),
                "late": self.totals["late"], "duplicates": self.totals["duplicates"],
                "unsolicited": self.totals["unsolicited"],
                "early": sum(int(m.get("early") or 0) for m in self.metrics) + self._early_between,
                "dropped": {str(m["round"]): m["dropped"] for m in self.metrics if m.get("dropped")}}

    def _on_rejected(self, item: Rejected) -> None:
        """A payload the channel refused (already logged and a ``rejected`` ledger row): counted
        as invalid under its code. An update whose header can be trusted
        (:attr:`~protocol.channel.Rejected.answerable`) from a joined device is answered with a
        refusal receipt for its ``seq``, so the agent does not send it again. With signing on the
        update is the device's own (its signature checked), so the open round it belongs to no
        longer waits for that device; with signing off anyone who can publish on the device's
        topic could have sent it, so the round keeps waiting, and the device, whose own ``seq``
        the receipt names, withdraws itself (:class:`edge_agent.agent.EdgeAgent`; a receipt for a
        ``seq`` it never sent it ignores): a malformed update forged in a device's name can
        neither knock the device out of the round nor make it drop its real update. Nothing is
        answered for a payload that failed its signature check: its sender id and ``seq`` are
        whatever a forger wrote."""
        self._count_invalid(item.code)
        if not item.answerable or item.kind is not Kind.UPDATE or item.sender not in self.devices:
            return
        assert item.sender is not None and item.seq is not None and item.round is not None  # answerable
        reason = f"refused while decoding: {item.reason}"
        log.warning("update from %s (round %d, seq %d) refused while decoding: %s", item.sender, item.round,
                    item.seq, item.reason)
        self._send_receipt(item.sender, Kind.UPDATE, item.seq, item.round, False, reason, item.sha256)
        o = self.open
        if self.channel.security is not None and o.collecting is not None and item.round == o.collecting \
                and item.sender in o.awaited():
            o.withdrawn.add(item.sender)
            log.warning("round %d no longer waits for %s: its update was refused", o.collecting, item.sender)

    def _admission_problem(self, body: Join) -> str | None:
        """Why a join is refused (model manifest, data settings), or ``None``."""
        shape = classifier_shape(self.model) or (0, 0)  # (C, d) of the agreed head
        refusal = admit(body, requirement=model_requirement(type(self.strategy)),
                        expected_manifest_hash=self.manifest_hash, feature_dim=shape[1], num_classes=shape[0])
        if refusal is not None:
            return refusal
        for key in LIMIT_RANGES:
            why = announced_limit(dict(body.info), key)
            if isinstance(why, str):
                return why
        diffs = [f"{k} {body.info.get(k)!r} (server: {v!r})" for k, v in self.settings.expected_data
                 if str(body.info.get(k)) != v]
        if diffs:
            return "settings differ from the server's configuration (data and algorithm): " + "; ".join(diffs)
        return None

    def _handle(self, item: Received | Rejected) -> None:
        if isinstance(item, Rejected):
            self._on_rejected(item)
            return
        env = item.envelope
        body = env.body
        now = time.monotonic()
        if not isinstance(body, (Join, Status)) and self.devices.seen(env.sender, now):
            if env.sender in self.not_back:  # a device of the resumed checkpoint
                self._heard_again(env.sender, f"its {env.kind.label}")
            else:
                log.info("%s is back online", env.sender)
        if isinstance(body, Join):
            reason = self._admission_problem(body)
            if reason:
                log.warning("join from %s refused: %s", env.sender, reason)
                self.refused_joins[env.sender] = reason
                self._reply(item, False, reason)
                return
            self.refused_joins.pop(env.sender, None)
            before = self.devices.records.get(env.sender)
            counted = before.updates_accepted if before is not None else 0
            if counted and body.info.get(STATE_ROUND_KEY) == 0:
                # a restarted agent without its state file (another --out, a wiped disk): what its
                # algorithm keeps between rounds starts afresh, which the server's state still counts
                log.warning("%s joined again with no kept state (join.info %s = 0) after %d accepted updates: what "
                            "its algorithm keeps between rounds starts afresh on the device, while the server's state "
                            "still counts what it had (fedfleet-agent keeps it in its --out folder, a simulation in "
                            "its run folder)", env.sender, STATE_ROUND_KEY, counted)
                self.rejoined_without_state[env.sender] = self.round
            joined = self.devices.admit(env.sender, body, round=self.round, now=now)
            self.not_back.discard(env.sender)  # back by joining again: said as a join
            try:  # the strategy's view of the fleet (Oort's speed prior, FedDO's |D_k|)
                self.strategy.on_join(env.sender, body.profile, int(body.num_samples))
            except Exception:  # noqa: BLE001 - a strategy's bookkeeping failing costs the join nothing
                log.exception("%s.on_join(%s) failed", type(self.strategy).__name__, env.sender)
            if body.info.get("fallback_count"):
                log.info("%s runs with fallbacks: %s", env.sender, body.info.get("fallbacks"))
            log.info("join: %s (%s, %d samples)", env.sender, body.profile, body.num_samples)
            # a device that reads round_start.members learns its member index (membership.py)
            self._reply(item, True, member_index=joined.index if body.info.get(JOIN_INFO_KEY) is True else None)
            self._event("joined", env.sender, profile=body.profile, samples=body.num_samples,
                        online=len(self._online()))
        elif isinstance(body, Status):
            before = self.devices.get(env.sender)
            was_online = before is not None and before.online and env.sender not in self.open.offline_since
            rec = self.devices.set_status(env.sender, body.state, now)
            if rec is not None and not rec.online:
                log.info("%s is offline (%s)", env.sender, body.detail)
            elif rec is not None and (item.retain or body.state != "online" or body.detail):
                # (a live plain "online" is an agent starting, EdgeAgent.join: its join follows, said as a join)
                kept = " (kept by the broker)" if item.retain else ""
                self._heard_again(env.sender, f"its {body.state} status{kept}")
            o = self.open
            holds = body.holds if body.state == "online" else None
            if body.state == "online":
                (self._holdings_known.add if holds is not None else self._holdings_known.discard)(env.sender)
            news = not item.retain or (holds is not None and self._status_seen.get(env.sender) != item.sha256)
            self._status_seen[env.sender] = item.sha256
            if rec is not None and body.state == "offline":
                self._went_offline(env.sender, body.detail, now)
            elif rec is not None and body.state == "online" and news:
                # a live "online", or a retained one this server never handled (published while its
                # own link was down: a broker restart the device was back from first); any other
                # retained one is only a copy handed to a new subscription
                self._came_back(env.sender, body.detail, holds, was_online=was_online)
            if (body.state == "idle" and env.round and env.round == o.collecting
                    and env.sender in o.awaited()):
                # the device says it will not contribute to the open round (no samples, training
                # diverged): the round need not wait for it until the deadline
                o.withdrawn.add(env.sender)
                o.offline_since.pop(env.sender, None)
                o.stats.withdrawn += 1
                log.warning("%s withdrew from round %d: %s", env.sender, env.round, body.detail)
                self._event("withdrew", env.sender, reason=body.detail)
        elif isinstance(body, Update):
            self._on_update(item, body)
        elif isinstance(body, Receipt) and body.ref_kind == Kind.GLOBAL:
            o = self.open
            if env.round == o.collecting and body.sha256 in o.global_hashes:
                if env.sender not in o.global_confirmed:  # devices, not copies: a re-sent copy confirms once
                    o.global_confirmed.add(env.sender)
                    o.stats.global_receipts += 1
                    self._event("model_received", env.sender)
            elif env.round == o.collecting:
                log.warning("%s received a global model with another hash", env.sender)
        else:
            self.totals["unsolicited"] += 1
            log.warning("unexpected %s from %s ignored", env.kind.label, env.sender)

    def _on_update(self, item: Received, body: Update) -> None:
        env = item.envelope
        o = self.open
        if (env.round, env.sender) in self._counted:
            # counted in this round (still open, perhaps past its deadline) or in one that has
            # closed since: a redelivery or a resend after a lost receipt. Acknowledge it as
            # counted, so the agent stops re-sending and keeps the state the server counted
            # (never "late": that would make it roll back); never count it again.
            self.totals["duplicates"] += 1
            o.stats.duplicates += 1
            self._reply(item, True, "duplicate: already counted")
            return
        if o.collecting is not None and env.round == o.collecting and item.received_at > o.deadline:
            self.totals["late"] += 1
            o.stats.late += 1
            self._reply(item, False, f"arrived after the deadline of round {env.round}")
            self._event("late", env.sender)
            return
        if env.round > (o.collecting if o.collecting is not None else self.round):
            # a round not open yet: an update a device trained before this server stopped (a resumed
            # server runs that round again), or a copy of one delayed since. Not answered: a refusal is
            # final for the device (it rolls its state back and never offers that update again); it
            # sends it again when that round starts (a round_start of a round it trained), and then it
            # counts. Unanswered copies of it also end at the device's max_resends.
            self.totals["early"] += 1
            if o.collecting is not None:
                o.stats.early += 1
            else:  # between rounds (a resumed server before its first): the next round's line counts it
                self._early_between += 1
            log.info("update from %s for round %d, which is not open (%s): not answered; the device sends it again "
                     "when that round starts", env.sender, env.round,
                     f"round {o.collecting} is" if o.collecting is not None else f"round {self.round} was the last")
            return
        if o.collecting is None or env.round != o.collecting:
            self.totals["late"] += 1
            o.stats.late += 1
            log.warning("update from %s for round %d rejected: round %s is open", env.sender, env.round,
                        o.collecting)
            self._reply(item, False, f"round {env.round} is closed")
            return
        if env.sender not in o.selected:
            self.totals["unsolicited"] += 1
            o.stats.unsolicited += 1
            self._reply(item, False, f"{env.sender} was not selected for round {env.round}")
            return
        if env.sender in o.results:
            self.totals["duplicates"] += 1
            o.stats.duplicates += 1
            self._reply(item, True, "duplicate: already counted")
            return
        shared = list(o.delta_base.get(env.sender, ())) or self._shared()  # what its global copy carried
        mismatch = self._manifest_problem(body.tensors)
        if mismatch:
            self._refuse(item, mismatch, "manifest_mismatch")
            return
        rec = self.devices.get(env.sender)
        if rec is not None and body.num_samples > rec.num_samples:
            self._refuse(item, f"num_samples {body.num_samples} exceeds the {rec.num_samples} announced at join",
                         "num_samples")
            return
        bad = [k for k in EVAL_METRICS if k in body.metrics and not _is_fraction(body.metrics[k])]
        if bad:  # the round's client_accuracy_* figures are computed from these (float() of any scalar)
            self._refuse(item, f"metrics.{bad[0]} = {body.metrics[bad[0]]!r} is not a number in [0, 1]",
                         "metric_range")
            return
        tensors = body.tensors
        if body.delta:  # w_i = w_global + (w_i − w_global); integer state is sent whole
            tensors = tuple(g + d if np.issubdtype(g.dtype, np.floating) else d
                            for g, d in zip(shared, body.tensors, strict=True))
        result = ClientResult(env.sender, tensors, body.num_samples, body.train_loss, dict(body.metrics),
                              extras=dict(body.extras))
        reason = self.strategy.validate(result)
        if reason:
            self._refuse(item, reason, "strategy_refused")
            return
        self._extras_seen.update(result.extras)
        self._extras_update_seen = True
        assert o.accumulator is not None  # an update reaches here only while a round collects
        try:
            o.accumulator.add(result)
        except ValueError as exc:  # shapes/dtypes were checked; anything left is the update's fault
            self._refuse(item, f"cannot aggregate: {exc}", "aggregate_failed")
            return
        o.results[env.sender] = (body.num_samples, body.train_loss, dict(body.metrics))
        o.withdrawn.discard(env.sender)  # a corrected update after a refusal counts
        o.dropped.discard(env.sender)  # … and so does one from a device dropped while offline
        o.offline_since.pop(env.sender, None)
        self._counted.add(env.round, env.sender, env.seq, item.sha256)
        self.devices.count_update(env.sender)
        self._reply(item, True)
        self._event("reported", env.sender, samples=body.num_samples, train_s=body.metrics.get("train_seconds"))

    def _manifest_problem(self, tensors: tuple[np.ndarray, ...]) -> str | None:
        """Why an update's ``tensors`` do not fit the model manifest's shared entries (their count,
        or the first tensor whose shape or dtype differs, named by its position, its manifest
        name and index, with both shapes and dtypes), or ``None``."""
        shared = self._shared()
        if len(tensors) != len(shared):
            return (f"tensors: {len(shared)} expected (the model manifest's entries shared with share="
                    f"{self.share!r}), {len(tensors)} received")
        for pos, (t, g) in enumerate(zip(tensors, shared, strict=True)):
            if t.shape != g.shape or t.dtype != g.dtype:
                entry = self.shared_idx[pos]
                return (f"tensors[{pos}] ({self._manifest[entry][0]!r}, manifest entry {entry}): "
                        f"{_shape_text(g)} expected, {_shape_text(t)} received")
        return None

    def _refuse(self, item: Received, reason: str, code: str) -> None:
        """Refuse a selected client's update for the open round as invalid under reason ``code``
        (:data:`REFUSAL_CODES`): counted, answered with the reason, its ledger row ``rejected``.
        With signing on the update is the client's own, so the round no longer awaits it (its
        receipt is definite, it will not send the same update again); with signing off the
        client withdraws itself on the receipt for its own ``seq`` (:meth:`_on_rejected` says
        why)."""
        self._count_invalid(code)
        log.warning("update from %s refused: %s", item.envelope.sender, reason)
        if self.channel.security is not None:
            self.open.withdrawn.add(item.envelope.sender)
            self.open.offline_since.pop(item.envelope.sender, None)
        self._reply(item, False, reason)
        self._event("refused", item.envelope.sender, reason=reason)

    def _event(self, kind: str, client: str | None = None, **info: object) -> None:
        """Tell :attr:`on_event` (the progress display) what just happened, with the server link's
        wire bytes so far (``up`` received, ``down`` sent). A failing observer is dropped with a
        warning: the display never stops a round."""
        if self.on_event is None:
            return
        up, down = self._bytes()
        try:
            self.on_event(kind, self.open.collecting or self.round, client, {**info, "up": up, "down": down})
        except Exception as exc:
            log.warning("progress display failed (%s: %s); it is switched off", type(exc).__name__, exc)
            self.on_event = None

    def _await_quorum(self, r: int) -> None:
        """Before round ``r`` selects: with fewer devices online than the quorum because some went
        offline less than ``offline_grace_s`` ago (a restart, a dropped link; the time of their
        ``offline`` status), wait for enough of them to come back, at most until the last of them
        has been offline ``offline_grace_s``, handling messages meanwhile. The round then selects
        among those online (and is skipped, as before, when fewer than the quorum report); a
        device gone for longer than the grace is not waited for again. Without this wait a round
        started at once with too few devices selected and was skipped, though the missing device
        came back seconds later."""
        quorum, grace = self.settings.quorum, self.settings.offline_grace_s
        if len(self._online()) >= quorum or grace <= 0:
            return
        gone = [rec.last_seen for rec in self.devices.records.values() if not rec.online and rec.last_seen > 0]
        until = max(gone, default=0.0) + grace
        if not gone or time.monotonic() >= until:
            return
        log.warning("round %d waits up to %.0f s (offline_grace_s) for devices that went offline to come back: "
                    "%d of %d joined are online, the quorum is %d", r, until - time.monotonic(), len(self._online()),
                    len(self.devices.records), quorum)
        while len(self._online()) < quorum and time.monotonic() < until:
            self.pump(min(0.2, max(0.0, until - time.monotonic())))
        log.info("round %d starts with %d device(s) online (quorum %d)", r, len(self._online()), quorum)

    def _heard_again(self, client: str, how: str) -> None:
        """``client``, a device of the resumed checkpoint's registry (:attr:`not_back`), is heard
        from for the first time since the resume, ``how`` (its online status, retained or live,
        or a message of the run) and is online again: said once, in the log (``INFO``) and to the
        progress display (event ``back``, whose line mirrors a join's). Nothing for any other
        device, nor again."""
        if client not in self.not_back:
            return
        self.not_back.discard(client)
        rec = self.devices.get(client)
        online = len(self._online())
        log.info("%s is back (in the registry of the checkpoint of round %d; %s): %d online", client,
                 self._resumed_after, how, online)
        self._event("back", client, profile=rec.profile if rec is not None else "",
                    samples=rec.num_samples if rec is not None else 0, online=online, how=how)

    def _went_offline(self, client: str, detail: str, now: float) -> None:
        """A selected device still awaited by the open round said ``offline`` (its last will, or
        its own offline status): the round waits at most ``offline_grace_s`` for it to return."""
        o = self.open
        if o.collecting is None or client not in o.awaited() or client in o.offline_since:
            return
        o.offline_since[client] = (now, detail)
        log.warning("%s went offline during round %d (%s): the round waits at most %g s (offline_grace_s) for it "
                    "to come back", client, o.collecting, detail or "no detail", self.settings.offline_grace_s)

    def _drop_overdue(self, now: float) -> None:
        """Drop the awaited devices of the open round that have been offline for
        ``offline_grace_s``: the round no longer waits for them (they stay selected: an update
        that still arrives before the round closes counts)."""
        o = self.open
        for client, (since, detail) in sorted(o.offline_since.items()):
            if now - since >= self.settings.offline_grace_s:
                del o.offline_since[client]
                if client in o.awaited():
                    o.dropped.add(client)
                    log.warning("round %d: %s dropped: offline (%s) and not back within offline_grace_s = %g s; "
                                "the round goes on without it", o.collecting, client, detail or "no detail",
                                self.settings.offline_grace_s)

    def _came_back(self, client: str, detail: str, holds: tuple[int, int, int] | None = None, *,
                   was_online: bool = False) -> None:
        """A device says ``online`` again: it may have missed messages while its link was down,
        or, ``was_online`` (this server held it online: no ``offline`` of it since), it asks for a
        ``round_start`` the broker dropped (:class:`edge_agent.agent.EdgeAgent`, *A lost
        round_start*): its ``holds`` name the open round's global and an older ``round_start``.

        ``holds``: what its status says it holds of the rounds (:attr:`protocol.messages.Status.holds`:
        global, round_start, update still without a receipt), ``None`` when it does not say (an
        agent of an older version). An update of it that was counted but whose receipt it has not
        read (lost with the link) gets its receipt again, not a request for the update. A
        selected device the open round still waits for (or dropped) is sent again what it lacks
        of the round (:meth:`_send_round_to`): the ``global`` unless it holds the round's (and
        the ``round_start`` with it), the ``round_start`` alone when it holds the global but not
        the round_start, or when its update of the round awaits a receipt and was not counted (the
        agent sends it again unless its copy is still on its way); nothing when it holds both and
        trains. Without ``holds``, both are sent, as to every device before. When the round's
        global it lacks went out after this server's own reconnect, it may still reach the device
        (:meth:`_global_may_follow`): its own copy then waits until ``global_confirm_s`` passed
        without the device confirming that one (:meth:`_send_deferred`).

        An **unselected** device that asks (``was_online``, holding the open round's global but no
        ``round_start`` of it: a broadcast ``round_start`` dropped by the broker) is sent one
        naming nobody on its own topic (:meth:`_tell_unselected`), so that it stops asking; one
        that comes back is sent nothing (it asks if it lacks it). Every ask is counted
        (``round_start_asks`` in ``metrics.jsonl``)."""
        o = self.open
        r_open = o.collecting
        asks = (was_online and holds is not None and r_open is not None and holds[0] >= r_open > holds[1]
                and client not in o.results)
        if asks:
            o.start_asks[client] = o.start_asks.get(client, 0) + 1
        if holds is not None and holds[2] and (copy := self._counted.copy(holds[2], client)) is not None:
            log.info("%s is back online (%s): its update of round %d was counted; its receipt is sent again",
                     client, detail or "no detail", holds[2])
            try:
                self._send_receipt(client, Kind.UPDATE, copy[0], holds[2], True, "", copy[1])
            except TransportError as exc:
                log.error("the receipt of %s's update of round %d could not be sent again: %s", client, holds[2], exc)
        if asks and client not in o.selected and o.messages is not None and time.monotonic() < o.deadline:
            self._tell_unselected(client, detail)
            return
        if (o.collecting is None or o.messages is None or client not in o.selected or client in o.results
                or client in o.withdrawn or time.monotonic() >= o.deadline):
            return
        o.offline_since.pop(client, None)
        o.dropped.discard(client)
        r = o.collecting
        lacks_global = holds is None or holds[0] < r
        if not lacks_global and holds is not None and holds[1] >= r and holds[2] != r:
            log.info("%s is back online during round %d (%s) and holds the round's global and round_start: "
                     "nothing is sent again", client, r, detail or "no detail")
            return
        if lacks_global and holds is not None and self._global_may_follow(client):
            if client not in o.deferred:
                o.deferred[client] = time.monotonic()
                log.info("%s is back online during round %d (%s) without the round's global, which went out after "
                         "this server's reconnect and may reach it still: its own copy goes only if it does not "
                         "confirm that one within %g s (global_confirm_s)", client, r, detail or "no detail",
                         self.settings.global_confirm_s)
            return
        self._send_lacking(client, detail, lacks_global, asked=asks)

    def _tell_unselected(self, client: str, detail: str) -> None:
        """``client``, not selected in the open round, asked for its ``round_start`` (the broadcast
        one did not reach it): send it one naming nobody on ``down/{client}/round_start`` (no
        ``config``, no ``members``; ``deadline_s`` the time left), at most
        :data:`MAX_ROUND_RESENDS` times a round. A transport failure is logged, never raised."""
        o = self.open
        r = o.collecting
        assert r is not None  # checked by the caller
        told = o.told_unselected.get(client, 0)
        if told >= MAX_ROUND_RESENDS:
            if (r, client) not in self._resend_capped:
                self._resend_capped.add((r, client))
                log.warning("%s, not selected in round %d, asks for its round_start again (%s): it was answered %d "
                            "times already, nothing more is sent to it this round", client, r, detail or "no detail",
                            MAX_ROUND_RESENDS)
            return
        log.warning("%s, not selected in round %d, lacks the round_start (%s): sending it one naming nobody", client,
                    r, detail or "no detail")
        packet, chunk = self._limits([client])
        try:
            self.channel.send(topics.down_to(self.fed, client, Kind.ROUND_START),
                              RoundStart(selected=(), deadline_s=max(0.1, o.deadline - time.monotonic())),
                              round=r, recipient=client, max_packet_bytes=packet, chunk_bytes=chunk)
        except TransportError as exc:
            log.error("round %d: the round_start naming nobody could not be sent to %s: %s", r, client, exc)
            return
        o.told_unselected[client] = told + 1
        o.start_resends[client] = o.start_resends.get(client, 0) + 1

    def _global_may_follow(self, client: str) -> bool:
        """Whether the open round's global copy for ``client`` (the broadcast, or its own with
        per-device delivery) went out on this server's current connection and that connection is
        a reconnect: after a broker restart, a device back and subscribed before that copy reached
        the broker gets it, one back after it does not, and its ``online``, published as it came
        back, cannot say which (the server and the broker order things the device cannot see)."""
        o = self.open
        connects = getattr(self.channel.transport, "connects", 0)
        if not isinstance(connects, int) or connects <= 1:
            return False
        seq = o.global_seq_to.get(client, 0) if o.delivery == "per_device" else o.global_seq
        return bool(seq) and self.channel.handed_on(seq) >= connects

    def _send_deferred(self) -> None:
        """Send the devices whose ``online`` said they lack the open round's global while it may
        still reach them (:meth:`_global_may_follow`) their own copy once ``global_confirm_s``
        passed without their confirming the round's global; one that confirmed it (or reported,
        withdrew) needs nothing."""
        o = self.open
        if not o.deferred:
            return
        now = time.monotonic()
        for client, since in sorted(o.deferred.items()):
            if o.collecting is None or client in o.global_confirmed or client not in o.awaited():
                del o.deferred[client]
            elif now - since >= self.settings.global_confirm_s and now < o.deadline:
                del o.deferred[client]
                log.warning("%s did not confirm round %d's global within %g s of saying online without it: sending "
                            "it its own copy", client, o.collecting, self.settings.global_confirm_s)
                self._send_lacking(client, "no confirmation", True)

    def _send_lacking(self, client: str, detail: str, lacks_global: bool, *, asked: bool = False) -> None:
        """Send ``client`` what it lacks of the open round (:meth:`_send_round_to`), at most
        :data:`MAX_ROUND_RESENDS` times a round; ``asked``: it did not come back, it asks for the
        ``round_start`` it lacks (said so in the log)."""
        o = self.open
        r = o.collecting
        assert r is not None  # checked by the callers
        sent = o.resent.get(client, 0)
        if sent >= MAX_ROUND_RESENDS:  # a flapping link (or a forged status) costs at most this many models
            if (r, client) not in self._resend_capped:  # said once per device and round
                self._resend_capped.add((r, client))
                log.warning("%s %s during round %d again (%s): it was sent the round %d times already, nothing "
                            "more is sent to it this round", client,
                            "asks for the round_start" if asked else "is back online", o.collecting,
                            detail or "no detail", MAX_ROUND_RESENDS)
            return
        if asked:
            log.warning("%s holds round %d's global but lacks the round_start (%s): sending it the round_start "
                        "again (%d/%d)", client, r, detail or "no detail", sent + 1, MAX_ROUND_RESENDS)
        else:
            log.warning("%s is back online during round %d (%s): sending it the round's %s again", client, r,
                        detail or "no detail", "global and round_start" if lacks_global else "round_start")
        self._send_round_to(client, with_global=lacks_global)

    def _send_round_to(self, client: str, *, with_global: bool = True) -> None:
        """Send the open round's ``global`` (unless ``with_global`` is false) and ``round_start``
        to ``client`` alone, on its own topics (``down/{client}/global``, ``down/{client}/round_start``).

        A per-device copy rather than a re-broadcast: the other devices have the round already
        (a broadcast would cost every device a model download, and each would confirm it again);
        the ledger shows the copy as sent to ``client``. The copy is the one this device was
        sent at the round's start (:meth:`_send_global_to`: its own, with per-device delivery).
        The ``round_start`` names only ``client`` (with its own instructions, if the round has
        per-device ones) and carries the time left before the round's deadline as
        ``deadline_s``, so the agent does not train
        for a round that is over. An agent that already trained the round does not train it
        again: it sends its update again, which is answered as a duplicate. A transport failure
        is logged, never raised: the device can still come back again."""
        o = self.open
        assert o.messages is not None and o.collecting is not None  # checked by the caller
        starts = o.messages[1]
        start = next((st for c, st in starts if c is None or c == client), None)
        if start is None:  # pragma: no cover - a selected client always has its round_start
            return
        remaining = max(0.1, o.deadline - time.monotonic())
        r = o.collecting
        try:
            packet, chunk = self._limits([client])
            if with_global:
                self._send_global_to(client, r)
            self.channel.send(topics.down_to(self.fed, client, Kind.ROUND_START),
                              dataclasses.replace(start, selected=(client,), deadline_s=remaining, members=b""),
                              round=r, recipient=client, max_packet_bytes=packet, chunk_bytes=chunk)
        except TransportError as exc:
            log.error("round %d could not be sent again to %s: %s", r, client, exc)
            return
        o.resent[client] = o.resent.get(client, 0) + 1
        o.start_resends[client] = o.start_resends.get(client, 0) + 1

    def _say_presence(self, state: str, detail: str, wait_s: float | None = None) -> None:
        """Publish the server's retained presence ``state`` on ``down/status``
        (:func:`protocol.topics.server_status`): ``online`` once its subscriptions are made (at
        construction, before it waits for joins) and again after each reconnect (the broker
        published its last will, ``offline``, when the link broke), ``offline`` when it stops
        (:meth:`close`). An ``online`` says where the rounds are: ``global_round`` = the last
        round completed (:attr:`round`), ``start_round`` = the round collecting updates now (0:
        none), ``update_round`` = 0, so that an agent back from holding its re-sends sends its
        update at once only where it can count or be answered (not into a round a resumed server
        has still to open, whose ``round_start`` asks for it). A failure is logged, never raised:
        the agents then go on re-sending on their timeouts, as with a server that says nothing."""
        body = (Status(state, detail, global_round=self.round, start_round=self.open.collecting or 0, update_round=0)
                if state == "online" else Status(state, detail))
        try:
            self.channel.send(topics.server_status(self.fed), body, round=0, retain=True, wait_s=wait_s)
        except TransportError as exc:
            log.warning("could not say %s on %s: %s", state, topics.server_status(self.fed), exc)
            return
        self.presence = state

    def close(self, detail: str = "stopped") -> None:
        """Say ``offline`` (retained, waiting up to :data:`PRESENCE_WAIT_S` seconds for the broker's
        acknowledgement; not when the link is down: the broker published the last will then, nor
        when said already) and close the channel (idempotent). A clean DISCONNECT fires no last
        will: without this the agents would not learn that the server went (a finished run, a
        stopped one to be resumed) and would keep re-sending into nothing."""
        if self.presence != "offline" and getattr(self.channel.transport, "connected", True):
            self._say_presence("offline", detail, wait_s=PRESENCE_WAIT_S)
        self.channel.close()

    def _on_reconnect(self, n: int) -> None:
        if n > 1:
            self._announce = n  # said online again from the round-loop thread (pump), after any resync
        if n > 1 and getattr(self.channel.transport, "closed_for_refusal", False):
            # the broker closed the link for a PUBLISH it refused (a size limit it does not announce):
            # the channel sends that message again smaller, paho the rest of its queue; the fleet's
            # links did not break, so nothing needs re-broadcasting
            log.info("reconnected to the broker after it refused a PUBLISH: the round is not re-sent")
        elif n > 1:
            self._resync = n  # handled on the round-loop thread (never publish from paho's thread)

    def _publish_round(self, r: int) -> None:
        """Publish the open round's ``global`` then its ``round_start`` message(s).

        The global: one broadcast on ``down/global``, or, with per-device delivery
        (:func:`choose_delivery`), each selected device's copy on ``down/{client}/global``
        (:meth:`_send_global_to`, the path of a device that came back). The ``round_start``: one
        broadcast on ``down/round_start``, or, when the plan has per-device instructions, one per
        selected device on ``down/{client}/round_start`` carrying only that device's
        instructions; when it goes per device and some online device was not selected, a
        broadcast ``round_start`` naming nobody goes too, so that every device still hears from
        the server each round (an agent gives up after ``idle_timeout_s`` of silence) and every
        device that gets the broadcast global gets a ``round_start`` of its round (a device that
        holds a round's global without its ``round_start`` asks for it: the broker dropped it)."""
        o = self.open
        assert o.messages is not None  # called only for the open round, after its messages are made
        glob, starts = o.messages
        packet, chunk = self._limits()
        connects = getattr(self.channel.transport, "connects", 0)
        if isinstance(connects, int):  # queued while the link is down: they go out on the next connection
            o.opened_on = connects + (0 if getattr(self.channel.transport, "connected", True) else 1)
        if o.delivery == "per_device":
            for device in sorted(o.device_globals):
                self._send_global_to(device, r, note=True)
        else:
            self._send_global(r, glob, packet, chunk)
        if all(c is not None for c, _ in starts) and set(self._online()) - o.selected:
            self.channel.send(topics.down(self.fed, Kind.ROUND_START),
                              RoundStart(selected=(), deadline_s=self.settings.round_deadline_s), round=r,
                              max_packet_bytes=packet, chunk_bytes=chunk)
        for client, start in starts:
            if client is None:
                self.channel.send(topics.down(self.fed, Kind.ROUND_START), start, round=r, max_packet_bytes=packet,
                                  chunk_bytes=chunk)
            else:
                p1, c1 = self._limits([client])
                self.channel.send(topics.down_to(self.fed, client, Kind.ROUND_START), start, round=r,
                                  recipient=client, max_packet_bytes=p1, chunk_bytes=c1)

    def _send_global(self, r: int, glob: Global, packet: int, chunk: int) -> None:
        """Broadcast round ``r``'s global in packets of at most ``packet`` bytes (0: the channel's
        limit) and note every hash a device's receipt may confirm it by.

        Chunked, it is cut with room for the longest joined device's own topic
        (``down/{id}/global``: ``budget_topic`` of :meth:`protocol.channel.Channel.send`), so a
        chunk a device asks for again goes to it alone on that topic and still fits the limit
        (:meth:`protocol.channel.Channel._publish_resend`); a device that joins later with a
        longer id gets such chunks on the broadcast topic. Costs a few data bytes per chunk
        (``len("/" + id)``), at times one chunk more."""
        longest = max(self.devices.records, key=len, default="")
        room = topics.down_to(self.fed, longest, Kind.GLOBAL) if longest else ""
        enc = self.channel.send(topics.down(self.fed, Kind.GLOBAL), glob, round=r, codec=self.global_codec,
                                extra_codecs=self._extra_codecs, max_packet_bytes=packet, chunk_bytes=chunk,
                                budget_topic=room)
        o = self.open
        o.global_sha256 = payload_sha256(enc.payload)  # receipts confirm this copy
        self._note_global_hashes(enc.payload)
        o.global_bytes, o.global_sent_at, o.global_seq = len(enc.payload), time.monotonic(), enc.seq

    def _send_global_to(self, client: str, r: int, *, packet_cap: int = 0, note: bool = False) -> None:
        """Send ``client`` alone its copy of round ``r``'s global on ``down/{client}/global``, in
        packets sized for that device (:meth:`_limits` of ``[client]``; at most ``packet_cap``
        bytes when given), and note every hash its receipt may confirm it by. The copy is the
        device's own (:attr:`RoundState.device_globals`) with per-device delivery, else the
        round's broadcast global. ``note``: record its size and time, which decide a re-send
        when no device confirms the global (:meth:`_confirm_global`).

        Raises:
            TransportError: from the channel.
        """
        o = self.open
        assert o.messages is not None  # called only for the open round, after its messages are made
        glob = o.device_globals.get(client, o.messages[0])
        codecs = (self._extra_codecs if glob is o.messages[0]
                  else extras_codecs(self.settings.extras_codec, dict(glob.extras), self.global_codec))
        packet, chunk = self._limits([client])
        if packet_cap:
            packet = min(packet, packet_cap) if packet else packet_cap
            chunk = min(chunk, packet) if chunk else packet
        enc = self.channel.send(topics.down_to(self.fed, client, Kind.GLOBAL), glob, round=r,
                                codec=self.global_codec, extra_codecs=codecs, recipient=client,
                                max_packet_bytes=packet, chunk_bytes=chunk)
        self._note_global_hashes(enc.payload)
        if note:
            o.global_bytes_to[client] = len(enc.payload)
            o.global_seq_to[client] = enc.seq
            o.global_sent_at = time.monotonic()

    def _note_global_hashes(self, payload: bytes) -> None:
        """Note every hash a device's receipt may confirm the copy of the global just sent by
        (``payload``'s, and the inner payload's when it was sealed whole: a chunked re-send
        carries the inner one)."""
        o = self.open
        o.global_hashes.add(payload_sha256(payload))
        inner = self.channel.last_payload
        if inner is not None and inner is not payload:
            o.global_hashes.add(payload_sha256(inner))

    def _confirm_global(self) -> None:
        """No selected device confirmed the open round's global within ``global_confirm_s``: a
        broker that drops messages above a size it does not say (MQTT 3.1.1 with Mosquitto's
        ``message_size_limit``) took it. Send it again in packets of a quarter of the size (or
        of the largest the broker delivered to the server, when that is at least an eighth), at
        most :data:`GLOBAL_RESENDS` times; when its packets were larger than any the broker
        delivered to the server, the channel learns that limit (:meth:`protocol.channel.Channel.suspect_dropped`)
        and sizes every later message under it, so later rounds do not wait for this again."""
        o = self.open
        if (o.collecting is None or o.messages is None or o.stats.global_receipts or not o.selected
                or o.stats.global_resends >= GLOBAL_RESENDS
                or time.monotonic() - o.global_sent_at < self.settings.global_confirm_s):
            return
        o.stats.global_resends += 1
        if o.delivery == "per_device":  # each copy again, in smaller packets than its own
            log.warning("round %d: no device confirmed its copy of the global model within %.0f s: sending each "
                        "copy again in smaller packets (%d/%d)", o.collecting,
                        self.settings.global_confirm_s, o.stats.global_resends, GLOBAL_RESENDS)
            for client in sorted(o.device_globals):
                cap = (self.channel.suspect_dropped(o.global_seq_to.get(client, 0))
                       or max(1024, o.global_bytes_to.get(client, 0) // 2))
                try:
                    self._send_global_to(client, o.collecting, note=True, packet_cap=cap)
                except TransportError as exc:
                    log.error("round %d: the global could not be sent again to %s: %s", o.collecting, client, exc)
            return
        packet, chunk = self._limits()
        half = self.channel.suspect_dropped(o.global_seq) or max(1024, o.global_bytes // 2)
        packet = min(packet, half) if packet else half
        log.warning("round %d: no device confirmed the global model (%d bytes) within %.0f s: sending it again in "
                    "packets of at most %d bytes (%d/%d)", o.collecting, o.global_bytes,
                    self.settings.global_confirm_s, packet, o.stats.global_resends, GLOBAL_RESENDS)
        self._send_global(o.collecting, o.messages[0], packet, min(chunk, packet) if chunk else packet)

    def _resync_round(self) -> None:
        """After the server's link came back (a broker restart, or its own link alone), send the
        open round's ``round_start`` again to each device it still awaits, on the device's own
        topic (``down/{client}/round_start``, naming only it, with its instructions if the round
        has per-device ones and the time left as ``deadline_s``); a device whose update was
        counted, or that withdrew or was dropped, gets nothing, and nothing is sent again for a
        round whose messages went out on the connection that came back (opened after the
        reconnect, or queued while the link was down). An awaited agent that trained the
        round sends its update again (the server may have missed it while its link was down)
        unless that copy is still on its way, went out on the connection the agent made since its
        own link came back (the copy paho held through a broker restart), or went out after this
        round_start came; one that missed the round_start trains. A broadcast naming the awaited
        devices would not do: to the agent it would not say that the server's link, not its own,
        broke, and the copy paho re-sent after the restart would go again.

        The ``global`` is not sent again to a device whose statuses say what it holds
        (:attr:`protocol.messages.Status.holds`): a device whose link broke too says ``online``
        once it is back and subscribed (live, or retained when it was back first), and
        :meth:`_came_back` sends it the global only if it lacks it; a re-broadcast besides cost
        every device that subscribed in time a second download. Awaited devices that do not say
        (older agents) are each sent their copy again (:meth:`_send_global_to`)."""
        back, self._resync = self._resync, 0
        o = self.open
        if o.collecting is None or o.messages is None:
            return
        r = o.collecting
        if o.opened_on >= back:  # the round's messages went out on the connection that came back: none lost
            log.info("reconnected to the broker: round %d went out on this connection, nothing is sent again", r)
            return
        self.resyncs += 1
        awaited = tuple(sorted(o.awaited()))
        if not awaited:
            log.info("reconnected to the broker: round %d awaits no device, nothing is sent again", r)
            return
        legacy = [c for c in awaited if c not in self._holdings_known]
        log.warning("reconnected to the broker: round %d's round_start goes again to the %d device(s) it awaits%s",
                    r, len(awaited),
                    f", its global to {', '.join(legacy)} (they do not say what they hold)" if legacy else "")
        for device in legacy:
            self._send_global_to(device, r, note=True)
        remaining = min(self.settings.round_deadline_s, max(0.1, o.deadline - time.monotonic()))
        starts = o.messages[1]
        for client in awaited:
            start = next((st for c, st in starts if c is None or c == client), None)
            if start is None:  # pragma: no cover - a selected client always has its round_start
                continue
            p1, c1 = self._limits([client])
            self.channel.send(topics.down_to(self.fed, client, Kind.ROUND_START),
                              dataclasses.replace(start, selected=(client,), deadline_s=remaining, members=b""),
                              round=r, recipient=client, max_packet_bytes=p1, chunk_bytes=c1)
            o.start_resends[client] = o.start_resends.get(client, 0) + 1

    def pump(self, timeout_s: float, until: Callable[[], bool] | None = None) -> None:
        """Handle every message that arrives within ``timeout_s`` seconds (at least one wait),
        returning early once ``until()`` is true after a handled message (the round loop passes
        "no update awaited", so a round closes when its last update arrives, not at the next
        half-second tick)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._resync:
                self._resync_round()
            if self._announce:
                # after the round's round_start copies: an agent that held its re-sends while the
                # server was away (its last will) answers those first, then finds nothing pending
                self._announce = 0
                self._say_presence("online", "reconnected")
            self._confirm_global()
            self._send_deferred()
            item = self.channel.receive(max(0.0, min(deadline - time.monotonic(), 1.0)))
            if item is not None:
                self._handle(item)
                if until is not None and until():
                    return
            if time.monotonic() >= deadline:
                return

    # ------------------------------------------------------------------ the run

    def wait_for_clients(self) -> None:
        """Wait until ``expected_clients`` (or the quorum) joined, or ``join_timeout_s`` passed."""
        want = self.settings.expected_clients or self.settings.quorum
        deadline = time.monotonic() + self.settings.join_timeout_s
        self._event("waiting", want=want, timeout_s=self.settings.join_timeout_s)
        while len(self._online()) < want and time.monotonic() < deadline:
            self.pump(min(0.2, max(0.0, deadline - time.monotonic())))
        log.info("%d clients joined (wanted %d)", len(self._online()), want)

    def run(self) -> RunSummary:
        """Run rounds ``round+1 … rounds``, then publish ``finish`` (broadcast, waiting up to
        :data:`FINISH_WAIT_S` seconds for the broker's acknowledgement) and write the final files
        (``model_final.pt``, ``model_final.onnx``; the run store closed, the ledger flushed).

        A ``finish`` the broker did not acknowledge does not stop the final files: its wait ended
        first (a slow or stalled link: the MQTT client keeps it queued, and it may yet go out), or
        the transport did not take it (closed, offline buffer full: never sent). Either way a
        WARNING says so, naming the devices online at the end (each stops at its
        ``--idle-timeout-s`` if the finish never reaches it), and :attr:`finish_unconfirmed` (and
        the summary's) holds ``{"round", "queued", "devices", "error"}``: the last round, whether
        the MQTT client holds the finish, those devices' ids (sorted) and the transport's error.

        Returns:
            :class:`RunSummary` with the final accuracy and every round's metrics.

        Raises:
            RunError: fewer agents than the quorum joined.
        """
        self.wait_for_clients()
        if len(self._online()) < self.settings.quorum:
            refused = "".join(f"; {c}'s join was refused: {why}" for c, why in sorted(self.refused_joins.items()))
            raise RunError(
                f"only {len(self._online())} agent(s) joined federation {self.fed!r} within "
                f"{self.settings.join_timeout_s:g} s; the quorum is {self.settings.quorum}{refused}. Check that the "
                f"agents use --federation {self.fed} and the same broker, or raise [server] join_timeout_s")
        if self.round == 0:
            self._checkpoint(accuracy=None)
        pending: _PendingLine | None = None
        try:
            while self.round < self.settings.rounds:
                r = self.round + 1
                got = self._run_round(r, previous=pending, defer=self.overlaps_evaluation and r < self.settings.rounds)
                pending = got if isinstance(got, _PendingLine) else None
        except Exception:
            if pending is not None and not pending.started:  # the next round failed before evaluating it
                try:
                    self._complete_pending(pending)
                except Exception:  # noqa: BLE001 - the first failure is the one raised; resume writes the line
                    log.exception("round %d could not be evaluated; --resume evaluates its checkpoint", pending.round)
            raise
        last_acc, last_loss = final_figures(self.metrics)  # a resumed run's rounds before this session's too
        packet, chunk = self._limits()
        try:
            self.channel.send(topics.down(self.fed, Kind.FINISH),
                              Finish(reason="completed", rounds_completed=self.round), round=self.round,
                              wait_s=FINISH_WAIT_S, max_packet_bytes=packet, chunk_bytes=chunk)
        except TransportError as exc:  # the rounds are done: their final files are written all the same
            self._finish_unconfirmed(exc)
        self.pump(0.2)
        self.store.close()
        self.onnx_result = write_final_model(self.store, self.model, share=self.share, algorithm=self.strategy.name,
                                             test=self.test)
        if self.channel.ledger is not None:
            self.channel.ledger.flush()
        return RunSummary(self.round, last_acc, last_loss, self.metrics, self.finish_unconfirmed)

    def _finish_unconfirmed(self, exc: TransportError) -> None:
        """The run's ``finish`` was not acknowledged by the broker (``exc``; see :meth:`run`):
        note it in :attr:`finish_unconfirmed` and say it in a WARNING."""
        queued = exc.seq is not None  # the MQTT client took it: its wait ended first
        devices = sorted(self._online())
        self.finish_unconfirmed = {"round": self.round, "queued": queued, "devices": devices, "error": str(exc)}
        how = (f"its wait for the acknowledgement ended after {FINISH_WAIT_S:g} s; it stays queued in the MQTT client "
               "and may yet go out" if queued else "the MQTT client did not take it: never sent")
        one = len(devices) == 1
        who = (f"{', '.join(devices)}, online at the end, {'stops at its' if one else 'stop at their'} "
               f"--idle-timeout-s if {'it never gets' if one else 'they never get'} it" if devices
               else "no device was online at the end")
        log.warning("the finish of round %d was not confirmed by the broker (%s: %s); %s; the final files are written "
                    "all the same", self.round, how, exc, who)

    def _round_starts(self, selected: tuple[str, ...], config: dict,
                      instructions: dict) -> list[tuple[str | None, RoundStart]]:
        """The round's ``round_start`` messages: ``[(None, broadcast)]`` without instructions,
        else one ``(client, message)`` per selected client naming only it, with its instructions.

        The broadcast names the selected devices that read ``members`` (they said so at join and
        have a member index) in ``members`` (:func:`protocol.membership.encode_members`: a bitmap
        or delta varints, exact), the others by id in ``selected``, unless listing them all by id
        is no longer than the ``members`` field would be (one or two devices)."""
        deadline = self.settings.round_deadline_s
        if not instructions:
            readers = {c: rec.index for c in selected
                       if (rec := self.devices.get(c)) is not None and rec.index >= 0
                       and rec.info.get(JOIN_INFO_KEY) is True}
            if readers:
                members = encode_members(readers.values())
                # the members field costs an empty instructions map (1 byte) + its bin (2–3 bytes header)
                field_cost = 1 + len(msgpack.packb(members, use_bin_type=True))
                ids_cost = sum(len(msgpack.packb(c)) for c in readers)
                if field_cost < ids_cost:
                    return [(None, RoundStart(selected=tuple(c for c in selected if c not in readers),
                                              deadline_s=deadline, config=config, members=members))]
            return [(None, RoundStart(selected=selected, deadline_s=deadline, config=config))]
        return [(c, RoundStart(selected=(c,), deadline_s=deadline, config=config,
                               instructions=dict(instructions.get(c, {})))) for c in selected]

    def _plan_delivery(self, r: int, glob: Global, online: int) -> None:
        """Decide how the open round's ``glob`` goes out (:func:`choose_delivery` with
        ``[server] global_delivery``, ``online`` devices) and, for per-device delivery, make each
        selected device's copy: the strategy's :meth:`~broker_server.strategies.Strategy.device_global`
        for it, or ``glob`` itself. A copy's tensors pass the round's lossy global codec once, as
        the round's own do, so that a device's delta is resolved against exactly what it decoded.

        Raises:
            RunError: the strategy's copy has tensors of another count, shape or dtype than the
                round's shared ones, extras that are not named arrays, or NaN/Inf in either.
        """
        o = self.open
        o.delivery, o.device_globals, o.delta_base = "broadcast", {}, {}
        if self.settings.global_delivery == "broadcast" or not o.selected:
            return
        copies: dict[str, Global] = {}
        bases: dict[str, tuple[np.ndarray, ...]] = {}
        for client in sorted(o.selected):
            mine = self.strategy.device_global(r, client, glob.tensors, dict(glob.extras))
            if mine is None:
                copies[client] = glob
                continue
            tensors, extras = self._checked_copy(client, mine)
            copies[client] = dataclasses.replace(glob, tensors=tensors, extras=extras)
            bases[client] = tensors
        size = global_array_bytes(glob.tensors, dict(glob.extras))
        o.delivery = choose_delivery(self.settings.global_delivery, online, size,
                                     [global_array_bytes(g.tensors, dict(g.extras)) for g in copies.values()])
        if o.delivery == "per_device":
            o.device_globals, o.delta_base = copies, bases
            for g in copies.values():
                self._extras_seen.update(g.extras)
        log.info("round %d: the global goes %s (%d of %d online devices selected)", r,
                 "to each selected device on its own topic" if o.delivery == "per_device" else "as one broadcast",
                 len(o.selected), online)

    def _checked_copy(self, client: str, mine: object) -> tuple[tuple[np.ndarray, ...], dict[str, np.ndarray]]:
        """The strategy's ``device_global`` answer for ``client`` as (tensors, extras), its
        tensors through the round's lossy global codec (if any), checked against the round's
        shared tensors (count, shape, dtype).

        Raises:
            RunError: naming the strategy, the device and what does not fit, or which arrays are
                not finite (NaN/Inf, also after the global codec: an fp16 overflow).
        """
        name = self.strategy.name or type(self.strategy).__name__
        if not isinstance(mine, tuple) or len(mine) != 2:
            raise RunError(f"strategy {name!r}: device_global for {client!r} returned {type(mine).__name__}, "
                           "not None or a (tensors, extras) pair")
        shared = self._shared()
        tensors = tuple(np.asarray(t) for t in mine[0])
        if len(tensors) != len(shared):
            raise RunError(f"strategy {name!r}: device_global for {client!r} returned {len(tensors)} tensors, "
                           f"{len(shared)} expected for share={self.share!r}")
        for pos, (t, g) in enumerate(zip(tensors, shared, strict=True)):
            if t.shape != g.shape or t.dtype != g.dtype:
                raise RunError(f"strategy {name!r}: device_global for {client!r}: tensors[{pos}] is {_shape_text(t)}, "
                               f"{_shape_text(g)} expected")
        if not isinstance(mine[1], Mapping) or not all(isinstance(k, str) and k for k in mine[1]):
            raise RunError(f"strategy {name!r}: device_global for {client!r}: extras must map names to arrays")
        extras = {k: np.asarray(v) for k, v in mine[1].items()}
        if self.global_codec.lossy:
            tensors = tuple(np.array(decode_tensor(encode_tensor(t, self.global_codec),
                                                   limits=TensorLimits(allow_nonfinite=True))) for t in tensors)
        # a device refuses a global with NaN/Inf (its channel rejects the message): sent anyway,
        # the device would sit out every round to the deadline with only a warning on its side
        bad = [f"tensors[{pos}]" for pos, t in enumerate(tensors) if _not_finite([t])]
        bad += [f"extras[{k!r}]" for k, v in extras.items() if _not_finite([v])]
        if bad:
            raise RunError(f"strategy {name!r}: device_global for {client!r}: {', '.join(bad)} contain NaN or Inf "
                           f"(after the global codec {self.global_codec.name!r}); no device accepts such a global")
        return tensors, extras

    @property
    def overlaps_evaluation(self) -> bool:
        """Whether :meth:`run` evaluates each round but the last while the devices train the next
        (the module docstring's "Evaluation overlap"): ``[server] overlap_evaluation = "auto"`` and
        a strategy whose ``plans_from_evaluation`` is false."""
        return self.settings.overlap_evaluation == "auto" and not type(self.strategy).plans_from_evaluation

    def run_round(self, r: int) -> dict:
        """Run round ``r`` (steps 1–6 of the module docstring) and return its metrics: evaluated,
        its line written and its checkpoint saved before this returns (no overlap)."""
        line = self._run_round(r, previous=None, defer=False)
        assert isinstance(line, dict)  # defer=False: the round is complete
        return line

    def _run_round(self, r: int, *, previous: _PendingLine | None, defer: bool) -> dict | _PendingLine:
        """Run round ``r``. ``previous``: the round before, waiting for its evaluation, which runs
        once this round's ``global`` and ``round_start`` are out (then its line is written).
        ``defer``: close this round without evaluating it — its figures gathered, its checkpoint
        and ``registry.json`` written — and return it as a :class:`_PendingLine` for the next
        round to complete; otherwise evaluate it, write its line and checkpoint, and return
        the line."""
        t0 = time.monotonic()
        sent0 = self._bytes()
        # the previous round's checkpoint and registry (timed after its metrics line); the rest of
        # what happened between rounds (joins, status) is not this round's
        carried = {k: v for k, v in self.phases.take().items() if k in ("checkpoint", "registry")}
        ledger0 = self.channel.ledger.write_s if self.channel.ledger is not None else 0.0
        mark = self.phases.lap()
        refused0, undeliverable0 = self.channel.refused, self.channel.undeliverable
        self._await_quorum(r)
        available = self._online()
        plan = self.strategy.configure_round(r, available, self.rng)
        undeclared = sorted({k for ins in plan.instructions.values() for k in ins} - set(self.strategy.instructions))
        if undeclared:
            raise RunError(f"strategy {self.strategy.name!r} sent instructions {undeclared} it does not declare in "
                           f"its class attribute instructions = {self.strategy.instructions!r}")
        o = self.open = RoundState(collecting=r, selected=set(plan.selected), stats=RoundStats(round=r))
        o.stats.selected = len(plan.selected)
        o.stats.early, self._early_between = self._early_between, 0  # those that came before it opened
        if self.global_codec.lossy:
            self.global_tensors = [np.array(decode_tensor(encode_tensor(t, self.global_codec),
                                                          limits=TensorLimits(allow_nonfinite=True)))
                                   for t in self.global_tensors]
            load_arrays(self.model, self.global_tensors)
        # after the lossy codec: the strategy starts from the model the clients receive
        o.accumulator = accumulator_for(self.strategy, r, self._shared())
        glob = Global(tensors=tuple(self._shared()), meta={"manifest_hash": self.manifest_hash, "share": self.share},
                      extras=dict(self.strategy.global_extras()))
        try:  # the plan's config with the strategy's per-round settings over it, checked
            config = round_config(self.strategy, r, plan.config)
        except ValueError as exc:
            raise RunError(f"strategy {self.strategy.name!r}: {exc}") from None
        if self.settings.client_eval and _scheduled(r, self.settings.client_eval_every, self.settings.rounds):
            config["client_eval"] = True
        o.messages = (glob, self._round_starts(tuple(plan.selected), config, dict(plan.instructions)))
        # set before anything is handled: a device that comes back while the previous round is
        # still evaluated is sent the time left (never an infinite deadline_s, which it refuses)
        o.deadline = t0 + self.settings.round_deadline_s
        self._extra_codecs = extras_codecs(self.settings.extras_codec, dict(glob.extras), self.global_codec)
        self._extras_seen.update(glob.extras)
        self._plan_delivery(r, glob, len(available))
        mark("select")
        self._publish_round(r)
        self._event("round_open", selected=tuple(plan.selected), deadline_s=self.settings.round_deadline_s,
                    rounds=self.settings.rounds, start_up=sent0[0], start_down=sent0[1])
        mark("publish")
        if previous is not None:  # the devices train now: the round before is evaluated meanwhile
            self._complete_pending(previous)
            mark("evaluate_prev")
            # what arrived meanwhile (receipts of this round's global among it) is handled before
            # anything decides from it (a resend of the global for want of receipts)
            self._drain()
        deadline = o.deadline
        while True:
            self._drop_overdue(time.monotonic())
            if not o.awaiting() or time.monotonic() >= deadline:
                break
            self.pump(min(0.5, max(0.0, deadline - time.monotonic())), until=lambda: not o.awaiting())
        # what already arrived before the deadline still counts, however busy the server was
        self._drain(until=lambda: not o.awaiting())
        self._log_unreported(r)
        o.close()
        mark("collect")
        results = [o.results[c] for c in sorted(o.results)]
        o.stats.clients_reported = len(results)
        o.stats.dropped, o.stats.resent_to = sorted(o.dropped), sorted(o.resent)
        o.stats.round_start_resends = dict(sorted(o.start_resends.items()))
        o.stats.round_start_asks = dict(sorted(o.start_asks.items()))
        acc_round, o.accumulator = o.accumulator, None
        if len(results) < self.settings.quorum:
            o.stats.skipped = True
            o.stats.skip_reason = f"{len(results)} updates < quorum {self.settings.quorum}"
            if o.dropped:
                o.stats.skip_reason += f" (dropped after going offline: {', '.join(sorted(o.dropped))})"
            log.warning("round %d skipped: %s", r, o.stats.skip_reason)
            if results:
                # these updates got accepted receipts and their devices kept the state they
                # produced: the strategy's mirror of that state must count them too
                self._commit(r, self._strategy_result(r, lambda: self.strategy.skipped_round(r, acc_round)))
        else:
            self._commit(r, self._strategy_result(r, acc_round.result))
        mark("aggregate")
        line = self._round_line(r, results, sent0, refused0, undeliverable0)
        if defer:
            mark("aggregate")  # the round's figures from the reports and the strategy
            line["seconds"] = time.monotonic() - t0
            line["phase_s"] = self._phase_seconds(ledger0, carried)
            # the checkpoint before the next round's selection draws from the generator; it holds
            # the line, so that a crash before the line is written leaves it to --resume
            t = time.perf_counter()
            self._checkpoint(accuracy=None, pending_line=line)
            t1 = time.perf_counter()
            self.write_registry()
            line["phase_s"].update(checkpoint=round(t1 - t, 4), registry=round(time.perf_counter() - t1, 4))
            return _PendingLine(r, list(self.global_tensors), line, t0, time.monotonic())
        self._evaluate_line(r, line, self.model)
        mark("evaluate")
        line["seconds"] = time.monotonic() - t0
        line["phase_s"] = self._phase_seconds(ledger0, carried)
        self._write_line(line)
        # after the metrics line (a crash between the two re-runs the round): timed into the next line
        mark = self.phases.lap()
        self._checkpoint(accuracy=line.get("accuracy"))
        mark("checkpoint")
        self.write_registry()
        mark("registry")
        if self.on_round:
            self.on_round(line)
        return line

    def _round_line(self, r: int, results: list[tuple[int, float, dict]], sent0: tuple[int, int], refused0: int,
                    undeliverable0: int) -> dict:
        """Round ``r``'s metrics line as the round closes: every figure that needs no evaluation of
        its model (counts, bytes, the devices' figures, the strategy's ``aggregate_metrics``,
        ``round_metrics`` and committed ``metrics``); ``accuracy``/``loss`` ``None`` (or the
        clients' mean own-model accuracy when ``share != "all"``), ``seconds`` 0 until
        :meth:`_evaluate_line` and the caller complete it. Sets :attr:`round` to ``r``."""
        o = self.open
        acc: float | None = None
        extra_metrics = self._extra_metrics(r, results, o.strategy_metrics)
        if self.share != "all":
            # the server's copy holds only the shared part (or nothing) of a model: its score means
            # nothing. The round's accuracy is the clients' own models' (client_eval), when measured.
            acc = extra_metrics.get("client_accuracy_mean")
            extra_metrics["accuracy_source"] = "clients"
        # the strategy's aggregation of device metrics (its evaluation of the model: _evaluate_line)
        reports = [ClientReport(c, *o.results[c]) for c in sorted(o.results)]
        refused = list(extra_metrics.pop("metrics_refused", []))
        from_clients = client_metrics(self.strategy, r, reports, DRIVER_KEYS)
        refused += from_clients.pop("metrics_refused", [])
        extra_metrics.update(from_clients)
        if refused:  # the strategy's figures the line cannot take (each logged as a warning)
            extra_metrics["metrics_refused"] = sorted(set(refused))
        self.round = r
        if (r >= 2 and self._extras_update_seen) or r >= self.settings.rounds:
            self._check_extras_codec_names()
        up, down = (b - a for a, b in zip(sent0, self._bytes(), strict=True))
        st = o.stats
        # refused as invalid since the last round closed (this round, and the gap before it)
        st.invalid = sum(self.rejected_by_reason.values())
        reached_none = st.selected > 0 and st.global_receipts == 0
        if reached_none:
            log.warning("round %d: the global model reached no device (0 of %d selected confirmed it%s)", r,
                        st.selected, f"; sent again smaller {st.global_resends}×" if st.global_resends else "")
        metrics = {
            "round": r, "accuracy": acc, "loss": None, "accuracy_source": "global",
            "clients_selected": st.selected,
            "clients_reported": st.clients_reported, "bytes_up": up, "bytes_down": down,
            "seconds": 0.0, "skipped": st.skipped,
            "duplicates": st.duplicates, "late": st.late, "invalid": st.invalid,
            "global_receipts": st.global_receipts, "global_reached_no_device": reached_none,
            "global_resends": st.global_resends, "broker_refusals": self.channel.refused - refused0,
            "undeliverable": self.channel.undeliverable - undeliverable0, "unsolicited": st.unsolicited,
            "early": st.early, "withdrawn": st.withdrawn, "dropped": st.dropped, "resent_to": st.resent_to,
            "round_start_resends": st.round_start_resends, "round_start_asks": st.round_start_asks,
            "unreported": st.unreported, "global_delivery": o.delivery,
            "rejected_by_reason": self.rejected_by_reason,
            "train_loss": float(np.average([loss for _, loss, _ in results], weights=[n for n, _, _ in results]))
            if results else None,
            # the training samples behind the round's accepted updates (Σ num_samples: samples, not
            # sample-epochs), which participation or FedDO's ratios change
            "samples_trained": int(sum(n for n, _, _ in results)),
            **extra_metrics,
        }
        self.rejected_by_reason = {}
        if st.skip_reason:
            metrics["skip_reason"] = st.skip_reason
        metrics["clients_train_s"] = _train_seconds(results)
        return metrics

    def evaluates_round(self, r: int) -> bool:
        """Whether round ``r`` is an evaluation round (the module docstring's "Evaluation
        rounds"): ``r`` a multiple of ``eval_every``, or the last round."""
        return _scheduled(r, self.settings.eval_every, self.settings.rounds)

    def _evaluates_model(self, r: int) -> bool:
        """Whether completing round ``r``'s line reads its model: an evaluation round, or a
        strategy that overrides :meth:`Strategy.evaluate <broker_server.strategies.Strategy.evaluate>`."""
        return self.evaluates_round(r) or type(self.strategy).evaluate is not Strategy.evaluate

    def _evaluate_line(self, r: int, line: dict, model: torch.nn.Module) -> None:
        """Complete round ``r``'s ``line`` (:meth:`_round_line`) with the evaluations of its global
        ``model``: in an evaluation round (:meth:`evaluates_round`) ``accuracy``/``loss`` on the
        test split (``share = "all"`` only: otherwise the clients' figures stand) and each test
        domain's accuracy; in every round :meth:`Strategy.evaluate
        <broker_server.strategies.Strategy.evaluate>`'s figures (whose ``accuracy`` replaces the
        line's). A figure the strategy's hooks already gave the line is not replaced by a
        domain figure; the strategy's evaluation replaces any. ``test_evaluated``: whether the
        test split was evaluated; a round that was not has no ``accuracy``/``loss`` keys
        (``share = "all"``), never a stand-in value, and no ``accuracy_source`` (unless the
        strategy's evaluation gives the accuracy: ``"strategy"``)."""
        tested = self.evaluates_round(r)
        if self.share == "all":
            if tested:
                line["accuracy"], line["loss"] = evaluate(model, self.test, batch_size=self.settings.eval_batch_size)
            else:  # no figure, so no source of one either
                for key in ("accuracy", "loss", "accuracy_source"):
                    line.pop(key, None)
        line["test_evaluated"] = tested and self.share == "all"
        if tested:
            for key, value in self._domain_metrics(model).items():
                line.setdefault(key, value)
        own = server_evaluate(self.strategy, r, model, [k for k in DRIVER_KEYS if k not in ("accuracy", "loss")])
        refused = own.pop("metrics_refused", [])
        if "accuracy" in own:
            line["accuracy"], line["loss"] = own.pop("accuracy"), own.pop("loss", None)
            line["accuracy_source"] = "strategy"
        line.update(own)
        self._say_divergence(r, line.get("loss"))
        if refused:
            line["metrics_refused"] = sorted(set(line.get("metrics_refused", [])) | set(refused))

    def _say_divergence(self, r: int, loss: object) -> None:
        """Warn, once a run, when round ``r``'s global model has a NaN or infinite test loss: it
        diverged (an update or a server step too large), and the rounds that follow train from
        it (devices refuse to send NaN updates, so they are usually skipped)."""
        if self._diverged_round is not None or not isinstance(loss, float) or math.isfinite(loss):
            return
        self._diverged_round = r
        log.warning("round %d: the global model's test loss is %s: the model has diverged, and the rounds that follow "
                    "train from it (lower [train] lr or the strategy's server learning rate, e.g. [algorithm] "
                    "server_lr)", r, loss)

    def _write_line(self, line: dict) -> None:
        """Append a completed round's ``line`` to :attr:`metrics` and ``metrics.jsonl``, with its
        ``ended_s`` (seconds from this server's start to now; after a ``--resume``, plus the last
        kept line's: the run's time goes on counting, the time it was down left out)."""
        line["ended_s"] = round(self._ended_before + time.monotonic() - self._started, 4)
        self.metrics.append(line)
        self.store.append_metrics(line)
        if self.channel.ledger is not None:
            self.channel.ledger.flush()

    def _complete_pending(self, p: _PendingLine) -> None:
        """Evaluate the round ``p`` waits for on a copy of its model, holding :attr:`eval_slot`,
        and write its line (then :attr:`on_round`). Its ``phase_s`` gains ``open_next`` (from its
        checkpoint to now: the next round's opening), ``slot_wait`` and ``evaluate_overlapped``;
        its ``seconds`` run from its opening to its line. A round that is no evaluation round of a
        strategy without its own ``evaluate`` reads no model: no slot is held, no copy loaded."""
        p.started = True
        t_open = time.monotonic()
        reads_model = self._evaluates_model(p.round)
        with self.eval_slot if reads_model else nullcontext():
            t_slot = time.monotonic()
            model = self.model  # not read when reads_model is false
            if reads_model:
                if self._eval_model is None:
                    self._eval_model = copy.deepcopy(self.model)
                load_arrays(self._eval_model, p.tensors)
                model = self._eval_model
            self._evaluate_line(p.round, p.line, model)
            t_done = time.monotonic()
        p.line["phase_s"].update(open_next=round(t_open - p.closed, 4), slot_wait=round(t_slot - t_open, 4),
                                 evaluate_overlapped=round(t_done - t_slot, 4))
        p.line["seconds"] = t_done - p.t0
        self._write_line(p.line)
        if self.on_round:
            self.on_round(p.line)

    def _drain(self, until: Callable[[], bool] | None = None) -> None:
        """Handle every message already waiting (at most 100,000), without waiting for more;
        ``until``: stop early once it returns true (checked before each message)."""
        for _ in range(100_000):
            if until is not None and until():
                return
            item = self.channel.receive(0.0)
            if item is None:
                return
            self._handle(item)

    def _phase_seconds(self, ledger0: float, carried: dict[str, float]) -> dict[str, float]:
        """This round's seconds per phase (rounded to 0.1 ms), for ``metrics.jsonl``'s ``phase_s``.

        Consecutive, adding up to the round's ``seconds`` (but for the metrics figures
        themselves): ``select`` (selection, the global's codec round trip, the messages),
        ``publish`` (encode and publish the global and ``round_start``), ``collect`` (waiting for
        the updates: the devices train then), ``aggregate`` (under evaluation overlap also the
        round's figures from the reports), ``evaluate``. Inside ``collect`` and ``aggregate``:
        ``receive`` (the channel decoding, verifying and ledgering what arrived) and
        ``accumulate`` (admitting each update and adding it to the aggregate).
        ``checkpoint_prev`` and ``registry_prev``: the previous round's checkpoint and
        ``registry.json``, written after its metrics line (a crash between them re-runs that
        round). ``ledger``: the time every writer of this run's ledger spent writing rows during
        the round (the agents' too, in a simulation).

        A round evaluated while the next one trains (evaluation overlap) has, instead of
        ``evaluate``: its own ``checkpoint`` and ``registry`` (written as it closed, before its
        line), ``open_next`` (the next round's selection and publish), ``slot_wait`` (waiting
        for a training slot) and ``evaluate_overlapped`` (its evaluation, while the devices
        trained the next round); its ``seconds`` run to its line, so consecutive rounds'
        ``seconds`` overlap: the interval between their ``ended_s`` is the time a round adds.
        The round after it has ``evaluate_prev`` (between its ``publish`` and ``collect``: that
        evaluation and the line, in its own loop's time). A line completed by ``--resume``
        (:meth:`resume`) has ``evaluate_on_resume``."""
        out = {k: round(v, 4) for k, v in self.phases.take().items()}
        out.update({f"{k}_prev": round(v, 4) for k, v in carried.items()})
        if self.channel.ledger is not None:
            out["ledger"] = round(self.channel.ledger.write_s - ledger0, 4)
        return out

    def _log_unreported(self, r: int) -> None:
        """At the close of round ``r``: name each selected device the round waited for until its
        deadline in vain, with what the server knows of it (``unreported`` in the metrics)."""
        o = self.open
        missing = sorted(o.awaited())
        o.stats.unreported = missing
        for c in missing:
            rec = self.devices.get(c)
            facts = [f"global confirmed: {'yes' if c in o.global_confirmed else 'no'}",
                     f"asked for the round_start: {o.start_asks.get(c, 0)}x",
                     f"round sent again: {o.resent.get(c, 0)}x",
                     f"round_start sent again: {o.start_resends.get(c, 0)}x",
                     "online" if rec is not None and rec.online else "offline"]
            if c in o.offline_since:
                facts.append(f"offline since {time.monotonic() - o.offline_since[c][0]:.1f} s "
                             f"({o.offline_since[c][1] or 'no detail'})")
            log.warning("round %d closed at its deadline without an update from %s (%s)", r, c, "; ".join(facts))

    def _strategy_result(self, r: int, make: Callable[[], GlobalUpdate | None]) -> GlobalUpdate | None:
        """The strategy's end-of-round value through :func:`~broker_server.strategies.round_result`:
        when its math raised, round ``r`` is marked skipped with the reason and ``None`` returned."""
        update, reason = round_result(make)
        if reason:
            self.open.stats.skipped = True
            self.open.stats.skip_reason = reason
            log.error("round %d: %s; the global state is kept", r, reason)
        return update

    def _commit(self, r: int, update: GlobalUpdate | None) -> bool:
        """Adopt round ``r``'s ``update`` when :func:`~broker_server.strategies.update_problem`
        finds nothing wrong with it under this round's codecs: the strategy commits its state and
        the driver its shared tensors. Otherwise the round is marked skipped with the reason and
        everything stays as it was. Returns whether it was adopted (``None``: nothing to adopt)."""
        if update is None:
            return False
        try:
            extra = extras_codecs(self.settings.extras_codec, dict(update.extras), self.global_codec)
        except ValueError:  # checked when the configuration was loaded; a direct caller's text
            extra = None
        if update.tensors is not None and len(update.tensors) != len(self.shared_idx):
            raise RunError(f"strategy {self.strategy.name!r} returned {len(update.tensors)} tensors, "
                           f"{len(self.shared_idx)} expected for share={self.share!r}")
        reason = update_problem(update, codec=self.global_codec, extra_codecs=extra)
        if reason:
            self.open.stats.skipped = True
            self.open.stats.skip_reason = reason
            log.error("round %d: %s; the global state is kept", r, reason)
            return False
        self.strategy.commit(r, update)
        self.open.strategy_metrics = dict(update.metrics)  # this round's figures, logged with it only
        if update.tensors is not None:
            for i, t in zip(self.shared_idx, update.tensors, strict=True):
                self.global_tensors[i] = np.asarray(t)
            load_arrays(self.model, self.global_tensors)
        return True

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

    def _domain_metrics(self, model: torch.nn.Module) -> dict:
        """``domain_accuracy`` ({domain: accuracy of ``model`` on its test split}), ``accuracy_avg``
        (their mean) and ``accuracy_worst`` (their minimum), fractions; ``{}`` without test domains."""
        if not self.test_domains:
            return {}
        dom = {name: evaluate(model, split, batch_size=self.settings.eval_batch_size)[0]
               for name, split in self.test_domains.items()}
        return {"domain_accuracy": dom, "accuracy_avg": float(np.mean(list(dom.values()))),
                "accuracy_worst": float(min(dom.values()))}

    def _extra_metrics(self, r: int, results: list[tuple[int, float, dict]], committed: dict | None = None) -> dict:
        """The clients' own-model evaluation, the ``metrics`` of the :class:`GlobalUpdate`
        committed in round ``r`` (``committed``; ``{}`` when the round committed none: skipped,
        refused) and the strategy's standing ``round_metrics()``, for one round's
        ``metrics.jsonl`` line (the global model's per-domain accuracy: :meth:`_domain_metrics`).
        The strategy's figures pass :func:`~broker_server.strategies._base.checked_figures` (no
        driver key, only what a JSON line holds; refusals in ``metrics_refused``); a
        ``round_metrics`` that raises costs its figures (``round_metrics_error``), not the round."""
        out: dict = {"share": self.share}
        figures = client_eval_figures([m for _, _, m in results])
        if figures:
            out.update(figures, client_test=self.settings.client_test)
        refused: list[str] = []
        for part in (checked_figures("the committed GlobalUpdate's metrics", r, committed or {}, DRIVER_KEYS),
                     _guarded("round_metrics", r, self.strategy.round_metrics, DRIVER_KEYS)):
            refused += part.pop("metrics_refused", [])
            out.update(part)
        if refused:
            out["metrics_refused"] = refused
        return out

    def _bytes(self) -> tuple[int, int]:
        """(uplink, downlink) wire bytes on the server's link so far, from this side's ledger rows."""
        return self.channel.wire_bytes_received, self.channel.wire_bytes_sent

    def write_registry(self) -> None:
        """``registry.json`` in the run folder (:meth:`DeviceRegistry.write`), rewritten each round."""
        self.devices.write(self.run_dir, self.round)

    def resume(self, ckpt: Checkpoint) -> None:
        """Continue after ``ckpt.round``: restore the global model, strategy state, the selection
        RNG and the registry (every device offline until it joins again or is heard from: its
        online status, kept by the broker or live, or a message of the run; each is said once,
        :meth:`_heard_again`); drop ``metrics.jsonl``
        lines of rounds after the checkpoint (an interrupted round is run again). When the
        checkpoint's round has no line yet (the server stopped while that round was evaluated
        under evaluation overlap), its line is completed from the checkpoint (``meta``'s
        ``pending_line``: every figure but the evaluation's) by evaluating the checkpointed model
        and written (``phase_s`` ``evaluate_on_resume``; its ``seconds`` are those up to its
        checkpoint plus that evaluation): every completed round has exactly one line.

        Raises:
            RunError: the strategy cannot take the checkpoint's state (its ``load_state_dict``
                raised ValueError, KeyError or TypeError: a checkpoint of another configuration or
                version, a policy file it needs and cannot read …); the message names the round,
                the strategy and its reason. Or ``metrics.jsonl`` cannot be read, has a damaged
                line (:func:`~broker_server.metrics_file.read_metrics`: named in the message), or
                lacks the checkpoint round's line where the checkpoint holds none to write again.
        """
        try:
            self.strategy.load_state_dict(ckpt.strategy_state)
        except (ValueError, KeyError, TypeError) as exc:
            name = self.strategy.name or type(self.strategy).__name__
            reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
            raise RunError(f"the checkpoint of round {ckpt.round} in {self.run_dir}: strategy {name!r} cannot restore "
                           f"its state from it ({reason})") from exc
        path = self.store.metrics_path
        try:
            lines = read_metrics(path) if path.exists() else []
        except ValueError as exc:  # names the file and the line
            raise RunError(f"cannot resume after round {ckpt.round}: {exc}") from None
        except OSError as exc:
            raise RunError(f"cannot resume after round {ckpt.round}: cannot read {path}: {exc}") from None
        if missing_line(lines, ckpt.round, ckpt.meta):
            raise RunError(f"cannot resume after round {ckpt.round}: {missing_line_text(path, ckpt.round)}")
        if (gone := rounds_without_line(lines, ckpt.round)):
            self.metrics_lines_missing = gone
            log.warning("%s has no line for %s (edited or replaced since): their figures are lost; the run goes on "
                        "from the checkpoint of round %d (summary.json: metrics_lines_missing)", path,
                        f"round {gone[0]}" if len(gone) == 1 else f"{len(gone)} rounds ({round_list(gone)})",
                        ckpt.round)
        if path.exists():
            self.metrics = self.store.keep_metrics_until(ckpt.round, lines)
        ended = self.metrics[-1].get("ended_s") if self.metrics else None
        self._ended_before = float(ended) if isinstance(ended, (int, float)) and math.isfinite(ended) else 0.0
        self.round = ckpt.round
        self.global_tensors = [np.array(t) for t in ckpt.tensors]
        load_arrays(self.model, self.global_tensors)
        self.rng.bit_generator.state = ckpt.rng_state
        self.devices.restore(ckpt.registry)
        self.not_back = {str(row["client_id"]) for row in ckpt.registry if "client_id" in row}
        self._resumed_after = ckpt.round
        line = ckpt.meta.get("pending_line")
        if isinstance(line, dict) and not any(m.get("round") == ckpt.round for m in self.metrics):
            log.warning("round %d has a checkpoint but no metrics line (the server stopped while evaluating it): "
                        "evaluating its checkpointed model", ckpt.round)
            t = time.monotonic()
            self._evaluate_line(ckpt.round, line, self.model)
            dt = time.monotonic() - t
            line["seconds"] = float(line.get("seconds") or 0.0) + dt
            line.setdefault("phase_s", {})["evaluate_on_resume"] = round(dt, 4)
            self._write_line(line)
            if self.on_round:
                self.on_round(line)
        log.info("resuming after round %d", ckpt.round)

    def _checkpoint(self, accuracy: float | None, pending_line: dict | None = None) -> None:
        """Save the checkpoint of :attr:`round`; ``pending_line``: that round's metrics line but its
        evaluation, kept in ``meta`` while the line waits for it (evaluation overlap)."""
        meta: dict[str, Any] = {"accuracy": accuracy, "manifest_hash": self.manifest_hash}
        if pending_line is not None:
            meta["pending_line"] = pending_line
        self.store.save_checkpoint(Checkpoint(
            round=self.round, tensors=self.global_tensors, strategy_state=self.strategy.state_dict(),
            rng_state=dict(self.rng.bit_generator.state), registry=self.devices.rows(), meta=meta))
