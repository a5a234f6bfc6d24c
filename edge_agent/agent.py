"""The edge agent: join, wait for rounds, train locally, publish the update.

The MQTT network loop runs on paho's thread; training runs on the agent's own thread (the one
that calls :meth:`EdgeAgent.run`), never inside a message callback, so keepalive continues while
a slow device trains.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol import topics
from protocol.channel import Channel, Received
from protocol.errors import PublishDropped, TransportError
from protocol.link_log import LinkLog
from protocol.membership import JOIN_INFO_KEY, members_contain
from protocol.messages import (
    Body,
    Encoded,
    Finish,
    Global,
    Join,
    Kind,
    Receipt,
    RoundStart,
    Status,
    Update,
    parse_extras_codec,
)
from protocol.phases import PhaseClock
from protocol.tensors import Codec, ErrorFeedback

from .algorithms import ClientAlgorithm, LocalResult, TrainConfig, predict_scores, private_entries
from .data import class_histogram
from .errors import EdgeAgentError, ModelError, PartitionError
from .models import manifest_hash, model_manifest
from .partition import parse_domain_clients
from .slots import SlotsClosed
from .state_store import StateStoreError

if TYPE_CHECKING:
    from .runtime import AgentRuntime
    from .slots import TrainingSlots
    from .state_store import DeviceStateStore

log = logging.getLogger(__name__)
#: images per forward pass of :meth:`EdgeAgent.evaluate` (the server's ``eval_batch_size`` default:
#: activations of larger batches leave the cache and a pass gets slower per image)
EVAL_BATCH = 256


#: seconds after taking a round's ``global`` without a ``round_start`` of that round before the agent
#: first asks the server for it (:class:`EdgeAgent`'s ``round_start_wait_s``, ``fedfleet-agent
#: --round-start-wait-s``): the server's ``global_confirm_s`` default. A ``round_start`` follows its
#: global within milliseconds; one not there after this long was dropped by the broker.
ROUND_START_WAIT_S = 10.0
#: asks for one round's missing ``round_start`` at most, the k-th (k = 1, 2, …) after
#: (2^k − 1) · ``round_start_wait_s`` (10, 30, 70 s by default); the server answers at most
#: ``broker_server.server.MAX_ROUND_RESENDS`` (3) of them a round
MAX_ROUND_START_ASKS = 3


#: ``join.info`` key of a device whose algorithm keeps state between rounds: the newest round its
#: kept state is as of (0: its initial state; :mod:`edge_agent.state_store`), so that a server
#: that has counted this device's updates can tell a restart that lost that state
STATE_ROUND_KEY = "state_round"
#: the device state file's entries holding the error-feedback residuals, ``ef.<tensor index>``
_EF_PREFIX = "ef."


def data_announcement(*, dataset: str, partition: str, alpha: float | None, seed: int, shards: int,
                      min_samples: int = 10, train_samples: int = 0, domain_clients: str = "",
                      domain_train_cap: int = 0, domain_test_cap: int = 0, algorithm: str = "fedavg",
                      algorithm_params: Mapping[str, object] | None = None, client_test: str = "shared",
                      client_test_fraction: float = 0.25) -> dict[str, str]:
    """What an agent announces about its data and algorithm in ``join.info`` and the server
    checks against its configuration (:func:`broker_server.runtime.expected_data`): every
    setting that shapes the device's shard or its model share, so a device that would train on
    another split, or run another algorithm (whose global it could not load), is refused at join
    with the differing keys named.

    Args:
        dataset, partition, seed, shards: ``[data] dataset``/``partition``, ``[run] seed``,
            ``[data] clients``.
        alpha: Dirichlet α (announced for ``"dirichlet"`` only, else ``"-"``).
        min_samples: ``[data] min_samples``; announced for ``"dirichlet"`` only (its redraw loop
            depends on it), else ``"-"``.
        train_samples: ``[data] train_samples`` (0 = the whole split).
        domain_clients: ``[data] domain_clients`` (``"domain-silo"`` only, else ``"-"``), as
            sorted ``name=count`` entries without the zero counts, so spelling and order do not
            matter (``""`` = the default 3/4/2/1).
        domain_train_cap, domain_test_cap: ``[data]`` caps per domain (0 = none).
        algorithm: ``[train] algorithm``.
        algorithm_params: the ``[algorithm]`` table (``--param KEY=VALUE``), as sorted
            ``key=value`` entries of :func:`param_text` values.
        client_test: ``[data] client_test`` (``"shared"`` / ``"local"``): under ``"local"`` the
            device trains on its shard minus its held-out test set.
        client_test_fraction: ``[data] client_test_fraction``, announced (``repr`` of the float)
            for ``"local"`` only, else ``"-"``.

    Returns:
        ``{key: text}`` (all values text, so number formatting is the same on both sides).
    """
    if partition == "domain-silo":
        try:
            alloc = parse_domain_clients(domain_clients or "")
            domain_text = ",".join(f"{k}={v}" for k, v in sorted(alloc.items()) if v)
        except PartitionError:
            domain_text = str(domain_clients).strip()  # refused where the partition is made
    else:
        domain_text = "-"
    params = dict(algorithm_params or {})
    return {"dataset": dataset, "partition": partition,
            "alpha": f"{alpha:g}" if partition == "dirichlet" and alpha is not None else "-",
            "seed": str(seed), "shards": str(shards),
            "min_samples": str(min_samples) if partition == "dirichlet" else "-",
            "train_samples": str(train_samples), "domain_clients": domain_text,
            "domain_train_cap": str(domain_train_cap), "domain_test_cap": str(domain_test_cap),
            "algorithm": algorithm,
            "algorithm_params": ",".join(f"{k}={param_text(params[k])}" for k in sorted(params)),
            "client_test": client_test,
            "client_test_fraction": repr(float(client_test_fraction)) if client_test == "local" else "-"}


def param_value(text: str) -> bool | int | float | str:
    """An ``[algorithm]`` value from its command-line text (``fedfleet-agent --param KEY=VALUE``):
    ``true``/``false``, an int, a float, or the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def param_text(value: object) -> str:
    """The canonical text of an ``[algorithm]`` value in a join announcement: a TOML value and
    the same value given as ``--param`` text read alike (``1``, ``1.0`` and ``"1"`` →
    ``"1.0"``; ``true`` → ``"true"``; floats by ``repr``, so no digits are lost)."""
    if isinstance(value, str):
        value = param_value(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(float(value))
    return str(value)


def round_params(start: RoundStart) -> dict:
    """The round's settings for this device: ``round_start.config`` with the device's own
    ``instructions`` merged over it (an instruction wins over a shared key of the same name)."""
    return {**start.config, **start.instructions}


def _all_finite(result: LocalResult) -> bool:
    """Whether every floating value of a local result (tensors, extras, loss) is finite."""
    arrays = [*result.tensors, *result.extras.values()]
    return bool(np.isfinite(result.train_loss)) and all(
        np.isfinite(a).all() for a in arrays if np.issubdtype(np.asarray(a).dtype, np.floating))


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Unweighted mean over classes (those in ``y_true`` or ``y_pred``) of F1 = 2·TP/(2·TP+FP+FN).

    Args:
        y_true, y_pred: int labels [M].

    Returns:
        A fraction in [0, 1]; 0.0 for empty input.
    """
    if len(y_true) == 0:
        return 0.0
    classes = np.union1d(y_true, y_pred)
    f1 = []
    for c in classes:
        tp = int(np.sum((y_pred == c) & (y_true == c)))
        fp = int(np.sum((y_pred == c) & (y_true != c)))
        fn = int(np.sum((y_pred != c) & (y_true == c)))
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(f1))


def extras_codecs(text: str, extras: dict, default: Codec) -> dict[str, Codec] | None:
    """Codec per ``extras`` entry from the round's ``extras_codec`` setting
    (:func:`protocol.messages.parse_extras_codec`, the grammar the server's configuration is
    checked with).

    ``""`` = every entry uses ``default`` (the update codec); ``"int8"`` = every entry int8;
    ``"soft_predictions=int8+zstd,prototypes=fp16"`` = per name (names not listed use ``default``).

    Raises:
        ValueError: unparsable codec text (the agent reports it and sends its extras with the
            update codec instead).
    """
    if not text.strip() or not extras:
        return None
    every, per_name = parse_extras_codec(text)
    if every is not None:
        return {n: every for n in extras}
    return {n: per_name.get(n, default) for n in extras}


class SharedGlobal:
    """A decoded ``global``'s arrays, held by every agent of the process that received the same
    payload (:func:`shared_global`). The arrays are read-only (``np.frombuffer`` views of the
    payload, or made read-only here): an agent never writes into a global it received.

    Attributes:
        tensors: the model share, in manifest order.
        extras: the named arrays.
    """

    __slots__ = ("__weakref__", "extras", "tensors")

    def __init__(self, tensors: tuple[np.ndarray, ...], extras: dict[str, np.ndarray]) -> None:
        self.tensors = tensors
        self.extras = extras


_NO_GLOBAL = SharedGlobal((), {})
_SHARED_GLOBALS: weakref.WeakValueDictionary[bytes, SharedGlobal] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def shared_global(sha256: bytes, tensors: tuple[np.ndarray, ...], extras: dict[str, np.ndarray]) -> SharedGlobal:
    """The process's one copy of the ``global`` whose payload has digest ``sha256``.

    Every virtual agent of a simulated fleet receives the round's broadcast global over its own
    connection and decodes its own copy; between its arrival and that agent's turn in a training
    slot, every copy would be held at once (500 agents × a 0.4 MB light CNN = 200 MB in each round).
    The first agent to decode a payload keeps its arrays here (made read-only), as long as any agent
    holds them; the others take those and drop their own. Per-device copies (``down/{client}/global``,
    each with its own envelope) differ in their payload and are not shared. On a real device, one
    agent per process, this changes nothing.

    Args:
        sha256: digest of the payload (:attr:`protocol.channel.Received.sha256`).
        tensors, extras: the arrays just decoded from it.
    """
    with _SHARED_LOCK:
        held = _SHARED_GLOBALS.get(sha256)
        if held is not None:
            return held
        for a in (*tensors, *extras.values()):
            if isinstance(a, np.ndarray) and a.flags.writeable:
                a.flags.writeable = False
        held = SharedGlobal(tuple(tensors), dict(extras))
        _SHARED_GLOBALS[sha256] = held
        return held


class AgentError(EdgeAgentError):
    """The agent cannot take part (join refused, server silent past the idle timeout)."""


@dataclass(frozen=True)
class AgentSummary:
    """What an agent did in a run.

    Attributes:
        client_id: its id.
        rounds_trained: rounds in which it published an update.
        receipts_accepted: updates the server acknowledged as accepted.
        finished: whether the run ended with the server's ``finish``.
        link_s: seconds of emulated link time (uploads + downloads) when link emulation is on.
    """

    client_id: str
    rounds_trained: int
    receipts_accepted: int
    finished: bool
    link_s: float = 0.0


class EdgeAgent:
    """One device's side of a federation.

    Args:
        channel: connected agent channel (node id = client id).
        model: the device model (architecture must match the server's manifest).
        algorithm: the client half of the configured algorithm.
        x: local training inputs, float32 [N, C, H, W]; with ``indices``, the whole data set
            the shard is drawn from (shared, only read: a simulated fleet passes one cached array
            to every virtual agent instead of a float copy of each shard).
        y: local labels, int64 [N]; with ``indices``, the whole data set's labels.
        indices: the shard's rows of ``x``/``y`` (int [n]), or ``None`` when ``x``/``y`` are the
            shard. The agent keeps the shared ``x`` (no copy), the index array and the shard's
            labels (``y[indices]``, 8 bytes a sample); a contiguous ascending run of rows trains on
            a view, any other shard gathers its inputs (``x[indices]``, the same values and order
            as a copy made up front) for the length of one local round, inside ``train_lock``,
            so a fleet holds at most ``train_slots`` gathered shards at once.
        num_classes: classes of the task (for the join histogram).
        train_defaults: local training settings; ``round_start.config`` overrides them per round.
        client_index: position in the fleet (seeds private generators).
        profile: firmware profile name announced in ``join``.
        device: torch device to train on.
        train_lock: shared lock/semaphore limiting concurrent trainers in a simulated fleet.
        slots: the simulated fleet's training slots (:class:`edge_agent.slots.TrainingSlots`):
            each local round (and its ``client_eval``) runs on a slot's thread, not the agent's;
            when the algorithm declares ``borrows_model`` the agent keeps only its model's
            private state entries (:func:`~edge_agent.algorithms.private_entries`; none under
            ``share = "all"``), as tensors, and trains on the slot's working model, into which they
            are loaded for the round (with the model's training and ``requires_grad`` flags as it
            left them). ``None`` (a real device): the agent trains its own model on its own
            thread, under ``train_lock`` when given.
        idle_timeout_s: give up when nothing arrives for this many seconds.
        info: scalars announced in ``join.info`` (see :func:`data_announcement`).
        on_trained: called with (round, result, payload bytes) after each published update.
        receipt_timeout_s: an update without a receipt after this long is sent again …
        max_resends: … at most this many times, and only before the round's deadline.
        round_start_wait_s: seconds after taking a round's ``global`` without any ``round_start``
            of that round (selecting it or not) before the agent asks the server for it (*A lost
            round_start* below; default :data:`ROUND_START_WAIT_S`); > 0.
        runtime: the firmware profile fitted to this hardware (:mod:`edge_agent.runtime`): caps
            the batch size, may force a cheaper update codec, and is announced in ``join``.
        emulate_link: make each transfer take the time the profile's link needs (simulated
            fleets): sleep ``bytes·8/uplink + RTT`` before an upload and the downlink time after a
            download, and record those seconds in ``link_s``.
        eval_x, eval_y: the device's evaluation split (float32 [M, C, H, W], int64 [M]); when a
            round's config has ``client_eval`` true, the agent evaluates its own model on it after
            local training (through the algorithm's ``predict``) and adds ``eval_accuracy``,
            ``eval_macro_f1`` and ``eval_samples`` to the update's metrics (personalised methods
            are judged on the clients' own models).
        state_store: the device's state file (:class:`edge_agent.state_store.DeviceStateStore`),
            for an algorithm whose device keeps something between rounds beyond what every
            global brings (:func:`~edge_agent.algorithms.restarted_device_state`: the model's
            private entries, SCAFFOLD's c_i, FedDyn's ∇L_k, MOON's previous model): the state
            after a local round is written there, unsettled, when its update goes out, and
            settled or dropped by the update's receipt; a restarted agent carries on from the
            newest settled one (:attr:`restored_round`, and :attr:`taken_as_accepted` for an
            update whose answer it never read, module :mod:`edge_agent.state_store`), and a
            round that a resumed server runs again is trained from the state as of the round
            before it. The error-feedback residuals of a lossy update codec
            (``[protocol] error_feedback``) are kept there the same way, for any algorithm
            (rows ``ef.<tensor index>``): a restarted device sends what its codec held back
            instead of losing it, and a refused update's residual goes back with its state.
            ``None``: kept in memory only.

    A ``round_start`` may come broadcast or on this device's own topic with its ``instructions``
    (named scalars for this device only), which are merged over the round's ``config``
    (:func:`round_params`) before training: ``local_epochs`` there trains this device that many
    epochs. The algorithm's ``local_round`` is told this device's client id. The agent announces
    in ``join.info`` that it reads ``round_start.members`` and keeps the member index its join
    receipt gives it; it trains a round whose ``round_start`` names its id in ``selected`` or its
    index in ``members`` (:meth:`selected_by`).

    Each update's definite answer reaches the algorithm's ``on_update_receipt(round,
    accepted)`` once: an accepted or refused receipt, ``accepted=False`` when nothing was sent
    (no samples, non-finite result), and ``accepted=False`` with a warning when the device is
    about to train again and the previous update still has no definite receipt. Algorithms
    with per-device state (SCAFFOLD, FedDyn) keep a round's new state only when it was accepted.
    When a round it already trained is started again (the server re-sends it after a reconnect,
    or a server resumed from the checkpoint before that round runs it again) and its update
    was not refused, the agent sends that update again: counted once either way, so a resumed
    server's c / h again holds what the device committed. It answers once however many copies of
    that ``round_start`` were queued, not while the last copy of the update is still being
    delivered (its packets await the broker's acknowledgement, or it is being sent again smaller
    after a refusal), not for a copy that arrived before the last copy of the update was sent
    (the server sent it before it could have that copy: one queued while the device trained),
    and not for a copy addressed to this device alone (the server's answer to its reconnect)
    when the update, still without a receipt, went out on the connection made since; such
    copies are counted in ``round_starts_not_answered``.

    After a reconnect (once the broker acknowledged the renewed subscriptions) the agent says
    ``online`` with what it holds of the rounds (:meth:`holdings`), so the server sends it again
    only what it lacks: no second download of a global it holds, a receipt again instead of a
    request for an update the server counted.

    The agent says in its log when its link to the broker is lost (``WARNING``, with the MQTT
    client's reason, the messages then awaiting the broker's acknowledgement and an update still
    awaiting its receipt) and when it is back (``INFO``, the connection's number and the seconds
    it was down): :attr:`link_log`, :class:`protocol.link_log.LinkLog`.

    **Server presence.** The server says ``online`` / ``offline`` (retained) on ``down/status``
    (:func:`protocol.topics.server_status`), which this agent's ``down/+`` subscription takes, and
    registers ``offline`` there as its MQTT last will. The rule:

    * The agent **holds** (does not publish) its update re-sends (:meth:`_maybe_resend`) and its
      join re-sends only while the server is known offline, and it is known offline only from an
      ``offline`` delivered **live** (MQTT retain flag 0 on delivery) on this agent's connection:
      the broker publishing the server's last will (a crash, a lost link) or the server's own
      ``offline`` at its stop, seen as they happen. A **retained** ``offline`` (handed over on
      subscribing, or again after a reconnect) is never a hold: it is a fact about some earlier
      moment, possibly about the server of an earlier run under the same federation id on a
      shared broker, and a new agent that held on it would wait for a server that may never say
      ``online`` (a server of an older version says nothing). The first join is never held.
    * The hold ends on any ``online`` of the server, live or retained (a retained one comes
      after this agent's own reconnect when the server came back meanwhile), and on any other
      message from the server delivered live (its messages reach the broker before its last will,
      so one after it comes from a server that is back); the server publishes ``online`` once
      its subscriptions are made, before it waits for joins, and again after each of its own
      reconnects, after re-sending the open round's ``round_start`` copies.
    * On the ``online`` that ends a hold the agent sends at once what is pending: its join when
      no join was answered yet, and its update still without a receipt (one re-send, within
      ``max_resends`` and before its round's deadline, not while its last copy is still being
      delivered), instead of waiting out its timeout, unless the ``online`` says the server
      neither collects nor completed that update's round (its round fields: the last round
      completed, the round collecting): a resumed server runs that round again and its
      ``round_start`` asks for the update, while a copy before it would go unanswered (the
      receipt timeout then counts from the ``online``). A live ``online`` while this agent's
      join is not answered (a server started after the join, which then went to no one) sends
      the join again at once too.
    * Held copies do not use up ``max_resends``: each receipt timeout that passes while the server
      is offline holds one copy the timeout would have sent (counted in :attr:`held_resends`,
      within ``max_resends``), and the join's re-send schedule (5 s doubling to 30 s) goes on
      counting held joins. The first hold of an outage is said once (``WARNING``); the end of the
      outage says how long it lasted, how many re-sends were held and what goes at once
      (``INFO``; :attr:`sent_on_online`). An update's first copy is never held (it goes when its
      training ends), nor a receipt, a withdrawal or a status.

    An agent that does not know the server's presence (an older version) receives its status on
    ``down/+`` and ignores it; with a server that says nothing (an older version) this agent never
    holds.

    **A lost round_start.** The server sends every device that gets a round's ``global`` a
    ``round_start`` of that round right after it (broadcast, on the device's own topic, or one
    naming nobody), so a device that holds round r's global (the newest it took, a round it has
    not trained) and has seen no ``round_start`` of round r ``round_start_wait_s`` seconds after it
    took that global lost it: a broker dropped it (Mosquitto drops messages for a client whose
    queue is full, ``max_queued_messages``, without telling anyone). It asks the server for it by
    saying ``online`` again (retained, as after a reconnect) with its holdings (:meth:`holdings`:
    global round r, an older ``round_start``), which the server answers on this device's own topic
    with the ``round_start`` alone (selected) or one naming nobody (not selected); a WARNING says
    each ask. At most :data:`MAX_ROUND_START_ASKS` asks a round, the k-th after
    (2^k − 1)·``round_start_wait_s``; none while the server is known offline (its ``round_start``
    copies come after its reconnect), before the join is answered, or once a newer global or any
    ``round_start`` of round r came. A device whose ``round_start`` arrives sends nothing extra.
    :attr:`round_start_asks` counts the asks per round.
    """

    def __init__(self, *, channel: Channel, model: torch.nn.Module, algorithm: ClientAlgorithm, x: np.ndarray,
                 y: np.ndarray, num_classes: int, train_defaults: TrainConfig, client_index: int = 0,
                 profile: str = "x86-cpu", device: torch.device | None = None,
                 train_lock: threading.Semaphore | threading.Lock | None = None,
                 idle_timeout_s: float = 600.0, info: dict | None = None,
                 on_trained: Callable[[int, LocalResult, int], None] | None = None,
                 receipt_timeout_s: float = 10.0, max_resends: int = 3,
                 runtime: AgentRuntime | None = None, emulate_link: bool = False,
                 eval_x: np.ndarray | None = None, eval_y: np.ndarray | None = None,
                 indices: np.ndarray | None = None, slots: TrainingSlots | None = None,
                 state_store: DeviceStateStore | None = None,
                 round_start_wait_s: float = ROUND_START_WAIT_S) -> None:
        if not round_start_wait_s > 0:
            raise ValueError(f"round_start_wait_s must be > 0 seconds, got {round_start_wait_s!r}")
        self.channel = channel
        # seconds per phase over the run: wait_slot, train, evaluate, prepare_update, send_update
        # (encode, chunk, publish) and receive (the channel's decoding of what arrives)
        self.phases = PhaseClock()
        if hasattr(channel, "accept"):
            channel.accept = self.phases.timed("receive", channel.accept)  # type: ignore[method-assign]
        self.client_id = channel.node_id
        self.fed = channel.federation
        self.algorithm = algorithm
        self.device = device or torch.device("cpu")
        model.to(self.device)
        self.slots = slots
        #: keep the whole trained state after each round, so that :attr:`model` can be rebuilt
        #: exactly after the run even when the agent borrows a slot's model (set it before the run)
        self.keep_model = False
        self._model: torch.nn.Module | None = model  # the agent's own model, unless it borrows one
        self._private: dict[str, torch.Tensor] = {}  # a borrowing agent's model state between rounds
        self._kept: dict[str, torch.Tensor] | None = None  # with keep_model: the last trained state
        self._flags: tuple[tuple[bool, ...], tuple[bool, ...]] = ((), ())  # modules' training, requires_grad
        self._model_key: tuple[str, ...] | None = None
        with warnings.catch_warnings():  # a fleet shares one read-only data set; training only reads it
            warnings.simplefilter("ignore", UserWarning)
            self.x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        self.indices: torch.Tensor | None = None
        self._rows: slice | None = None  # the shard as a slice of x, when its rows are one ascending run
        if indices is None:
            self.y = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
        else:
            idx = np.asarray(indices)
            if idx.ndim != 1 or (idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0
                                               or idx.max() >= len(self.x))):
                raise ValueError(f"indices must be a 1-d integer array of rows 0..{len(self.x) - 1}, "
                                 f"got {idx.dtype} {idx.shape}")
            idx = idx.astype(np.int64, copy=False)
            self.indices = torch.from_numpy(np.array(idx, copy=True))
            self.y = torch.from_numpy(np.ascontiguousarray(np.asarray(y)[idx], dtype=np.int64))
            if idx.size and int(idx[-1]) - int(idx[0]) == idx.size - 1 and bool((np.diff(idx) == 1).all()):
                self._rows = slice(int(idx[0]), int(idx[-1]) + 1)
        self.num_classes = num_classes
        self.eval_x = None
        if eval_x is not None:
            with warnings.catch_warnings():  # a fleet shares one read-only evaluation array; it is only read
                warnings.simplefilter("ignore", UserWarning)
                self.eval_x = torch.from_numpy(np.ascontiguousarray(eval_x, dtype=np.float32))
        self.eval_y = None if eval_y is None else np.ascontiguousarray(eval_y, dtype=np.int64)
        self.train_defaults = train_defaults
        self.client_index = client_index
        self.profile = profile
        self.train_lock = train_lock
        self.idle_timeout_s = idle_timeout_s
        self.runtime = runtime
        self.emulate_link = emulate_link and runtime is not None
        self.link_s = 0.0
        if runtime is not None:  # every agent-side ledger row carries its simulated link time
            channel.link_time = runtime.link_s
        self.info = {**(runtime.join_info if runtime is not None else {}), **dict(info or {})}
        self.on_trained = on_trained
        self.manifest_hash = manifest_hash(model_manifest(model))
        if slots is not None and algorithm.borrows_model:
            self._lend(model, info)
        self._global: tuple[int, SharedGlobal] | None = None  # the round of the last global and its arrays
        self._global_at = 0.0  # time.monotonic() when this agent took the global of the round in _global
        self._start_seen = 0  # the newest round of which any round_start arrived (selecting this device or not)
        #: seconds after taking a round's global without its round_start before asking for it (the class docstring)
        self.round_start_wait_s = round_start_wait_s
        #: round → asks sent for its missing round_start (*A lost round_start*)
        self.round_start_asks: dict[int, int] = {}
        self._pending: tuple[int, RoundStart] | None = None
        self._stop = threading.Event()
        self._join_seq = -1
        self._last_trained_round = 0
        self._unacked: tuple | None = None
        self._unsettled: int | None = None  # round whose update awaits a definite receipt (algorithm state)
        # (round, update, codec, extra codecs) of the last update sent, until the server refuses it: sent
        # again when that round is started again (a resumed server lost what it had counted)
        self._last_update: tuple | None = None
        self.receipt_timeout_s = receipt_timeout_s
        self.max_resends = max_resends
        self._update_seqs: set[int] = set()
        # seqs of update copies already answered (the last few): a receipt sent again for one of
        # them (the server's answer to an online that crossed the first receipt) is no stranger's
        self._answered_seqs: collections.deque[int] = collections.deque(maxlen=64)
        self._update_seq: int | None = None  # envelope seq of the last copy of the update sent
        self.resends = 0
        #: round_starts of a round already trained that asked for its update again and were not
        #: answered: one arrived with others in the same batch, or while a copy was still being delivered
        self.round_starts_not_answered = 0
        # rounds whose round_start came again in the batch being handled -> whether every copy was
        # addressed to this device alone (down/{client_id}/round_start)
        self._again: dict[int, bool] = {}
        self._pending_at = 0.0
        self._training_round = 0  # the newest round this device took up to train (0: none)
        self._receipt_round = 0  # the round of the last update whose accepted receipt was read
        self._update_sent_at = 0.0  # time.monotonic() when the last copy of the last update was handed over
        self._ef: ErrorFeedback | None = None
        self.rounds_trained = 0
        self.receipts_accepted = 0
        # rounds whose last update's accepted receipt was counted in receipts_accepted: once per update,
        # whenever it comes (after the re-sends ran out too), never again for a copy's duplicate receipt
        self._counted_rounds: set[int] = set()
        self.joined = False
        self._join_seqs: set[int] = set()  # seq of every join sent (a re-sent join's answer is ours too)
        self._join_sent_at = 0.0
        self.join_refused: str | None = None  # the server's reason when it refused the join
        #: give up (AgentError) when no join was answered this many seconds after the first (None: never)
        self.join_timeout_s: float | None = None
        self._joining_since = 0.0
        self.member_index: int | None = None  # this device's index in round_start.members (join receipt)
        # the newest round_start naming devices by member index that came before the join receipt
        # (a resumed server opens a round for the devices of its registry as soon as they are
        # online, and its join receipt may arrive after it): (round, start, received at), decided
        # when the receipt brings the member index
        self._before_join: tuple[int, RoundStart, float] | None = None
        self.finished = False
        # the server's presence (down/status): monotonic time since which it is known offline (a live
        # offline: its last will or its stop), None while it is not; see the class docstring
        self._server_gone_at: float | None = None
        self._server_gone_why = ""
        self._held_now = {"update": 0, "join": 0}  # re-sends held in the current outage
        self._held_update = 0  # re-sends of the update now awaiting its receipt held (not sent)
        #: re-sends held over the run because the server was offline (not published): ``update``, ``join``
        self.held_resends = {"update": 0, "join": 0}
        #: messages sent at once when the server said ``online`` again (``update``, ``join``)
        self.sent_on_online = {"update": 0, "join": 0}
        #: seconds before an unanswered join is first sent again (run(): the period doubles to 30 s)
        self.join_resend_s = 5.0
        self._join_every_s = 5.0  # the join's re-send period now
        #: where the device keeps what it carries between rounds (None: memory only, lost on a restart)
        self.state_store: DeviceStateStore | None = None
        self._state_round = 0  # the round of the last accepted update the kept state is as of (0: initial)
        #: the round whose kept state a restarted device carried on from (None: none was kept): its
        #: newest settled state, or an update taken as accepted, or where it went back to
        self.restored_round: int | None = None
        #: the round of an update sent before a restart whose answer was never read, taken as
        #: accepted since the server had finished that round (None: none)
        self.taken_as_accepted: int | None = None
        #: why the state file stopped being written during the run (None: it never failed)
        self.state_store_error: str | None = None
        self._unread_answer: int | None = None
        #: the state file of an agent whose algorithm keeps nothing between rounds: opened when a
        #: round's update codec first keeps error-feedback residuals (:meth:`_encode_update`)
        self._idle_store: DeviceStateStore | None = None
        #: (round, the error-feedback residuals before that round's update): restored when the
        #: update is refused, as the algorithm's state is
        self._ef_before: tuple[int, dict[int, np.ndarray]] | None = None
        if state_store is not None:
            self._open_state(state_store)
        channel.transport.subscribe(topics.agent_filters(self.fed, self.client_id), qos=channel.qos)
        channel.transfer_filter = lambda sender: sender == "server"
        channel.keep_last_payload = False  # never read here; it would hold the update until the next message
        if hasattr(channel.transport, "add_connect_listener"):
            channel.transport.add_connect_listener(self._on_connect)
        #: the log of the link to the broker: lost (WARNING: paho's reason, the messages awaiting
        #: acknowledgement, an update awaiting its receipt), back (INFO: the connection's number,
        #: the seconds it was down)
        self.link_log = LinkLog(log, prefix=f"{self.client_id}: ", pending=self._in_flight)
        self.link_log.attach(channel.transport)

    def _in_flight(self) -> str:
        """What the link log adds at a loss of the link (paho's thread: one attribute read): the
        round whose update awaits its receipt, or ``""``."""
        unacked = self._unacked
        return "" if unacked is None else f"its update of round {unacked[0]} awaits its receipt"

    def _on_connect(self, n: int) -> None:
        """After a reconnect the broker may have published this agent's last will (offline):
        say online again, so the server selects it again, with what this device holds of the
        rounds (:meth:`holdings`), so that the server sends it again only what it lacks. The
        transport calls this once the broker acknowledged the renewed subscriptions, so the
        server's answer cannot miss them."""
        if n > 1 and self.joined and not self._stop.is_set():
            try:
                self.channel.send(topics.status(self.fed, self.client_id), self._online("reconnected"), round=0,
                                  retain=True)
            except Exception as exc:  # never break paho's network thread
                log.warning("%s: could not republish online status: %s", self.client_id, exc)

    def holdings(self) -> tuple[int, int, int]:
        """What this device holds of the rounds, as its ``online`` status says
        (:class:`protocol.messages.Status`): (the newest round whose ``global`` it holds or
        trained, the newest round whose ``round_start`` selecting it it holds, trains or trained,
        the round of its last update whose receipt it has not read; 0: none). Read on paho's
        thread while the agent's own runs: each value is read once, whole."""
        held = self._global
        pending = self._pending
        trained, training = self._last_trained_round, self._training_round
        last, answered = self._last_update, self._receipt_round
        return (max(held[0] if held is not None else 0, trained),
                max(pending[0] if pending is not None else 0, training, trained),
                last[0] if last is not None and last[0] > answered else 0)

    def _online(self, detail: str = "") -> Status:
        """The ``online`` status with what this device holds of the rounds (:meth:`holdings`)."""
        g, st, up = self.holdings()
        return Status("online", detail, global_round=g, start_round=st, update_round=up)

    def stop(self) -> None:
        """Ask :meth:`run` to return at its next check (within about a second)."""
        self._stop.set()

    def _lend(self, model: torch.nn.Module, info: Mapping | None) -> None:
        """Give up the own model for the slots' working model of its architecture: keep copies of
        its private entries and its flags; the model itself becomes that architecture's template
        (the first agent's) or is dropped."""
        assert self.slots is not None, "called only with slots"
        names = private_entries(model, self.algorithm.share, self.algorithm.buffers)
        state = model.state_dict()
        self._private = {n: state[n].detach().clone() for n in names}
        self._flags = (tuple(m.training for m in model.modules()), tuple(p.requires_grad for p in model.parameters()))
        arch = str((info or {}).get("model", "")) or type(model).__qualname__
        self._model_key = (arch, type(model).__module__, type(model).__qualname__, self.manifest_hash, str(self.device))
        self.slots.offer_template(self._model_key, model)
        self._model = None

    @property
    def error_feedback(self) -> ErrorFeedback | None:
        """The error-feedback memory of this device's updates (``None`` until a round's lossy
        update codec runs with ``error_feedback``): what the codec held back, per tensor."""
        return self._ef

    def _private_names(self) -> tuple[str, ...]:
        if self._model is None:
            return tuple(self._private)
        return private_entries(self._model, self.algorithm.share, self.algorithm.buffers)

    def _open_state(self, store: DeviceStateStore) -> None:
        """Carry on from the newest state ``store`` keeps for this device (a restart), or keep
        the initial state there as round 0; nothing when the algorithm keeps nothing between
        rounds beyond what every global brings and the file holds no error-feedback residual of
        this device (then the file is opened when a round's codec first keeps one)."""
        if not self._private_names() and not self.algorithm.device_state:
            try:  # its newest settled row, and an update sent whose answer was never read
                rows = [store.newest(self.client_id), store.newest(self.client_id, settled=False)]
            except StateStoreError as exc:
                log.error("%s: its state file cannot be read (%s): error-feedback residuals are kept in memory only "
                          "(a restart would start them afresh)", self.client_id, exc)
                self.state_store_error = str(exc)
                return
            if not any(row is not None and any(k.startswith(_EF_PREFIX) for k in row[1]) for row in rows):
                self._idle_store = store
                return
        if not type(self.algorithm).keeps_device_state_on_disk():
            log.warning("%s: algorithm %r keeps %s between rounds but cannot write it (it does not override "
                        "device_state_arrays): that part starts afresh when this device restarts", self.client_id,
                        self.algorithm.name, self.algorithm.device_state)
        self.state_store = store
        row = store.newest(self.client_id)
        if row is None:
            store.put(self.client_id, 0, self._state_snapshot())
            self.info[STATE_ROUND_KEY] = 0
            return
        self._apply_state(*row)
        self.restored_round = row[0]
        self._unread_answer = store.unsettled(self.client_id)
        # announced at join: a server that counted updates of this device learns whether it kept its state
        self.info[STATE_ROUND_KEY] = max(row[0], self._unread_answer or 0)
        log.info("%s: carries on from its state as of round %d (%s)%s", self.client_id, row[0], store.path,
                 "" if self._unread_answer is None else
                 f"; the answer to its update of round {self._unread_answer} was never read")

    def _server_at(self, rnd: int) -> None:
        """A ``round_start`` of round ``rnd`` (selecting this device or not) that this process has
        not trained: where the server is tells a restarted device what its kept state must be
        (:mod:`edge_agent.state_store`). An update whose answer it never read is taken as
        accepted when ``rnd`` is a later round (the server finished that round; a warning and
        :attr:`taken_as_accepted` say so), else dropped (the server runs that round again);
        then, when the kept state is not older than ``rnd`` (a server resumed from a checkpoint
        taken before that state's round was aggregated), the device goes back to its newest
        state before ``rnd`` and forgets the later ones."""
        if rnd <= self._last_trained_round or self.state_store is None:
            return  # a round trained in this process: answered by sending its update again
        store = self.state_store
        if self._unread_answer is not None:
            t, self._unread_answer = self._unread_answer, None
            row = None
            if rnd > t:
                try:
                    row = store.newest(self.client_id, settled=False)
                except StateStoreError as exc:
                    log.error("%s: its update of round %d, sent before a restart, cannot be taken as accepted: %s; "
                              "the device carries on from its state as of round %d, which differs from what the "
                              "server counted if it accepted that update", self.client_id, t, exc, self._state_round)
            if row is not None and row[0] == t:
                log.warning("%s: restarted after sending its update of round %d and before reading the answer; the "
                            "server has finished that round, so the update is taken as accepted and its state kept "
                            "(were it refused, this device's state would differ from what the server counted)",
                            self.client_id, t)
                self._apply_state(*row)
                self._state_io("settle", store.settle, self.client_id, t, True)
                self.taken_as_accepted = t
                if self.rounds_trained == 0:
                    self.restored_round = t  # what this restarted device carries on from
            else:
                self._state_io("drop", store.settle, self.client_id, t, False)
        if self.state_store is None or self._state_round < rnd:
            return
        row = self._state_io("read", store.newest, self.client_id, before=rnd)
        if row is None:
            if self.state_store is not None:
                log.error("%s: round %d runs while its kept state is as of round %d, and no earlier state is kept "
                          "(%s): it carries on from that state, which the server has not counted", self.client_id,
                          rnd, self._state_round, store.path)
            return
        log.warning("%s: round %d runs again while its kept state is as of round %d: back to its state as of round %d",
                    self.client_id, rnd, self._state_round, row[0])
        self._apply_state(*row)
        if self.rounds_trained == 0 and self.restored_round is not None:
            self.restored_round = row[0]  # what this restarted device carries on from
        self._state_io("forget", store.forget_from, self.client_id, rnd)

    def _state_io(self, what: str, fn, *args, **kw):
        """``fn(*args, **kw)`` on the state file; when the file fails (read-only, full disk,
        damaged) the error is logged, kept in :attr:`state_store_error`, and the device goes on
        with its state in memory only (``None`` is returned)."""
        try:
            return fn(*args, **kw)
        except StateStoreError as exc:
            log.error("%s: %s: %s; from now on this device keeps its state in memory only (a restart would start "
                      "it afresh)", self.client_id, what, exc)
            self.state_store_error = str(exc)
            self.state_store = None
            return None

    def _state_snapshot(self, *, settled: bool = True) -> dict[str, np.ndarray]:
        """The model's private entries (``model.<name>``) and the algorithm's device state as
        of the last accepted update (``settled=False``: after the last local round), as arrays
        (copies)."""
        if self._model is None:
            private = {n: t.detach().to("cpu", copy=True).numpy() for n, t in self._private.items()}
        else:
            state = self._model.state_dict()
            private = {n: state[n].detach().to("cpu", copy=True).numpy() for n in self._private_names()}
        own = (self.algorithm.device_state_arrays(settled=settled)
               if type(self.algorithm).keeps_device_state_on_disk() else {})
        ef = {} if self._ef is None else {f"{_EF_PREFIX}{i}": e for i, e in self._ef.state_dict().items()}
        return {**{f"model.{n}": a for n, a in private.items()}, **own, **ef}

    def _apply_state(self, rnd: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Make ``arrays`` (:meth:`_state_snapshot`'s, as of round ``rnd``) this device's state.

        Raises:
            AgentError: entries of another model, or state the algorithm does not keep.
        """
        model_part = {k.removeprefix("model."): v for k, v in arrays.items() if k.startswith("model.")}
        names = set(self._private_names())
        where = self.state_store.path if self.state_store is not None else "its state file"
        if set(model_part) != names:
            raise AgentError(f"{self.client_id}: the kept state of round {rnd} ({where}) holds model entries "
                             f"{sorted(model_part)[:4]}, this model's private entries are "
                             f"{sorted(names)[:4]}: another model or algorithm wrote it")
        target = self._private if self._model is None else self._model.state_dict()
        with torch.no_grad():
            for n, a in model_part.items():
                if tuple(a.shape) != tuple(target[n].shape):
                    raise AgentError(f"{self.client_id}: kept entry {n} of round {rnd} ({where}) has shape "
                                     f"{tuple(a.shape)}, the model {tuple(target[n].shape)}")
                target[n].copy_(torch.from_numpy(np.array(a, copy=True)))
        ef = {k: v for k, v in arrays.items() if k.startswith(_EF_PREFIX)}
        if ef or self._ef is not None:
            try:
                residuals = {int(k.removeprefix(_EF_PREFIX)): v for k, v in ef.items()}
                if self._ef is None:
                    self._ef = ErrorFeedback()
                self._ef.load_state_dict(residuals)
            except ValueError as exc:
                raise AgentError(f"{self.client_id}: the kept error-feedback residuals of round {rnd} ({where}): "
                                 f"{exc}") from None
        own = {k: v for k, v in arrays.items() if not k.startswith(("model.", _EF_PREFIX))}
        if type(self.algorithm).keeps_device_state_on_disk():
            try:
                self.algorithm.load_device_state_arrays(own)
                self.algorithm.check_device_state(self._model if self._model is not None else self.model_template())
            except ValueError as exc:
                raise AgentError(f"{self.client_id}: the kept state of round {rnd} ({where}): {exc}") from None
        self._state_round = rnd

    def model_template(self) -> torch.nn.Module:
        """A model of this device's architecture (its own, or the training slots' template of a
        borrowing agent): for shapes only, never trained."""
        if self._model is not None:
            return self._model
        assert self.slots is not None and self._model_key is not None, "a borrowing agent has slots"
        return self.slots.template(self._model_key)

    @property
    def borrows_model(self) -> bool:
        """Whether the agent trains on a training slot's working model (it keeps no model of its own)."""
        return self._model is None

    @property
    def model(self) -> torch.nn.Module:
        """The device's model: its own, or, for an agent that borrows a slot's model, a model
        rebuilt from its architecture with the state the agent keeps: exact when that state is
        the whole model (every entry private, or :attr:`keep_model` set before the run).

        Raises:
            AgentError: a borrowing agent without :attr:`keep_model` whose algorithm shares
                entries it does not keep (the trained values of those are gone after each round).
        """
        if self._model is not None:
            return self._model
        assert self.slots is not None and self._model_key is not None, "a borrowing agent has slots"
        template = self.slots.template(self._model_key)
        names = list(template.state_dict())
        state = self._kept if self._kept is not None else self._private
        if state is not self._private or len(self._private) == len(names):
            m = copy.deepcopy(template)
            m.load_state_dict(state)
            self._set_flags(m)
            return m
        raise AgentError(f"{self.client_id} trains on a training slot's model and keeps only its {len(self._private)} "
                         f"private state entries of {len(names)} (algorithm {self.algorithm.name!r}): set "
                         f"keep_model = True before the run (e.g. in simulate's agent_hook) to read its model after it")

    def _set_flags(self, model: torch.nn.Module) -> None:
        modes, grads = self._flags
        for m, flag in zip(model.modules(), modes, strict=True):
            m.training = flag
        for p, flag in zip(model.parameters(), grads, strict=True):
            p.requires_grad_(flag)

    def _take_model(self) -> torch.nn.Module:
        """The model to train this round: the own one, or the slot's working model with this
        agent's private entries and flags loaded (on a slot thread)."""
        if self._model is not None:
            return self._model
        assert self.slots is not None and self._model_key is not None, "a borrowing agent has slots"
        model = self.slots.working_model(self._model_key)
        if self._private:
            model.load_state_dict(self._private, strict=False)
        self._set_flags(model)
        return model

    def _give_back(self, model: torch.nn.Module) -> None:
        """After a round: drop the gradients (no loop reads them before it zeroes them, and they
        are a model's size); a borrowing agent copies its private entries and flags back."""
        for p in model.parameters():
            p.grad = None
        if model is self._model:
            return
        state = model.state_dict()
        with torch.no_grad():
            for n, t in self._private.items():
                t.copy_(state[n])
        self._flags = (tuple(m.training for m in model.modules()), tuple(p.requires_grad for p in model.parameters()))
        if self.keep_model:
            self._kept = {n: t.detach().clone() for n, t in state.items()}

    def join(self, wait_s: float = 30.0) -> None:
        """Publish the retained ``online`` status and the ``join`` message, each waiting up to
        ``wait_s`` seconds to be acknowledged (QoS 1) or written (QoS 0); under QoS 0 each waits
        for the link when it is down (:meth:`_send_linked`).

        A wait that ends before the broker's acknowledgement (:class:`~protocol.errors.PublishTimeout`
        on a slow link, the error's ``seq`` set: the MQTT client holds the message, which goes out
        as the link moves) is no failure: a WARNING says so, the join follows the status, and a
        join whose wait ended is one not answered yet (its seq is this agent's, :meth:`run` sends
        it again on its schedule).

        Raises:
            TransportError: a message the MQTT client did not take (``seq`` ``None``): the transport
                is closed, its offline buffer is full, or, under QoS 0, the link stayed down for
                ``wait_s`` seconds (:class:`~protocol.errors.PublishDropped`).
        """
        try:
            self._send_linked(topics.status(self.fed, self.client_id), self._online(), what="online status",
                              wait_s=wait_s, retain=True)
        except TransportError as exc:
            if exc.seq is None:
                raise
            self._queued("online status", exc)
        self._joining_since = time.monotonic()
        try:
            self._send_join(wait_s)
        except TransportError as exc:
            if exc.seq is None:
                raise
            self._join_sent_at = time.monotonic()  # sent again on run()'s schedule, from now
            self._queued("join", exc, "; waiting for the server's answer to it (the join is sent again every 5 s, "
                                      "doubling to 30 s)")

    def _queued(self, what: str, exc: TransportError, then: str = "") -> None:
        """Say (WARNING) that the wait for the broker's acknowledgement of ``what`` ended first
        (``exc``, its ``seq`` set): the message stays queued in the MQTT client."""
        log.warning("%s: its %s (seq %d) is not acknowledged by the broker yet (%s): it stays queued and goes out as "
                    "the link moves%s", self.client_id, what, exc.seq, exc, then)

    def _send_join(self, wait_s: float) -> None:
        """Publish the ``join`` (again: a join the server never answered, e.g. one published before
        the server had subscribed, is re-sent by :meth:`run` every 5 s, doubling to 30 s). Every
        join's seq is kept, so the answer to any of them is this agent's own: also one whose wait
        ended before its acknowledgement (its PUBLISH stays queued and may yet arrive)."""
        hist = class_histogram(self.y.numpy(), self.num_classes)
        try:
            self._join_seq = self._send_linked(topics.up(self.fed, self.client_id, Kind.JOIN),
                                               Join(profile=self.profile, manifest_hash=self.manifest_hash,
                                                    num_samples=int(self.y.shape[0]), class_histogram=tuple(hist),
                                                    info={**self.info, JOIN_INFO_KEY: True}),
                                               what="join", wait_s=wait_s).seq
        except TransportError as exc:
            if exc.seq is not None:  # the wait ended first: the join may yet reach the server, its answer is ours
                self._join_seqs.add(exc.seq)
            raise
        self._join_seqs.add(self._join_seq)
        self._join_sent_at = time.monotonic()

    def _send_linked(self, topic: str, body: Body, *, what: str, wait_s: float, retain: bool = False) -> Encoded:
        """``channel.send`` of a round-0 message waiting up to ``wait_s`` seconds for it to go out.

        Under QoS 1 the transport keeps a message while the link is down and sends it after the
        reconnect. Under QoS 0 nothing is kept: a message sent while the link is down, or lost
        with the connection before the socket took it, is dropped
        (:class:`~protocol.errors.PublishDropped`). So here, under QoS 0, the send waits for the
        link when it is down, and a dropped message is sent again once the link is back (each
        copy dropped is one ``undeliverable`` ledger row of the channel; none reached the wire),
        until ``wait_s`` runs out.

        Raises:
            PublishDropped: QoS 0, and the link did not take the message within ``wait_s`` seconds
                (the message says how long and why).
            TransportError: any other failure of the send (as ``channel.send`` raises it).
        """
        deadline = time.monotonic() + wait_s
        transport = self.channel.transport
        qos0 = self.channel.qos == 0
        tries = 0
        while True:
            if qos0 and hasattr(transport, "wait_connected") and not getattr(transport, "connected", True):
                transport.wait_connected(max(0.0, deadline - time.monotonic()))  # a send now would be dropped
            tries += 1
            try:
                return self.channel.send(topic, body, round=0, retain=retain,
                                         wait_s=max(deadline - time.monotonic(), 0.001))
            except PublishDropped as exc:
                if not qos0:  # the transport was closed: nothing will take it
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PublishDropped(f"{self.client_id}: {what} not sent within {wait_s:g} s ({tries} "
                                         f"tr{'y' if tries == 1 else 'ies'}; QoS 0 keeps no message while the link "
                                         f"is down): {exc}", client_id=self.client_id, topic=topic) from exc
                log.warning("%s: %s not sent (%s): sending it again once the link is up (%.0f s left)",
                            self.client_id, what, exc, left)
                if hasattr(transport, "wait_connected"):
                    transport.wait_connected(left)
                else:
                    time.sleep(min(left, 0.5))

    def train_x(self) -> torch.Tensor:
        """The shard's training inputs (float32 [n, C, H, W], row i = sample i of :attr:`y`):
        ``x`` itself, or a view of it (a contiguous run of ``indices``), or ``x[indices]``
        gathered now (freed when the caller drops it)."""
        if self.indices is None:
            return self.x
        if self._rows is not None:
            return self.x[self._rows]
        return self.x[self.indices]

    def run(self) -> AgentSummary:
        """Join, then serve rounds until ``finish``, :meth:`stop`, or the idle timeout.

        A first join (or ``online`` status) whose wait for the broker's acknowledgement ends
        first is taken as a join not answered yet (:meth:`join`).

        Raises:
            AgentError: the server refused the join, no join was answered within
                :attr:`join_timeout_s`, or nothing arrived for ``idle_timeout_s``.
            TransportError: the MQTT client did not take a message the run cannot go on without
                (:meth:`join`: the transport is closed, its offline buffer is full, a QoS 0 link
                stayed down), or a receipt for a ``global``.
        """
        self.join()
        last = time.monotonic()
        self._join_every_s = self.join_resend_s
        while not self._stop.is_set():
            if (not self.joined and self.join_timeout_s is not None
                    and time.monotonic() - self._joining_since > self.join_timeout_s):
                # checked whatever arrives: an unenrolled device still hears the server's broadcasts
                raise AgentError(f"{self.client_id}: no answer to its join within {self.join_timeout_s:g} s")
            item = self.channel.receive(0.5)
            if item is None:
                if time.monotonic() - last > self.idle_timeout_s:
                    raise AgentError(f"{self.client_id}: nothing from the server for {self.idle_timeout_s:g} s")
                if not self.joined and time.monotonic() - self._join_sent_at >= self._join_every_s:
                    if self._server_gone_at is not None:  # into nothing: held until the server's online
                        self._hold("join")
                        self._join_sent_at = time.monotonic()
                    else:
                        log.info("%s: join not answered after %.0f s: sent again", self.client_id,
                                 self._join_every_s)
                        self._resend_join()
                    self._join_every_s = min(2 * self._join_every_s, 30.0)
                self._maybe_resend()
                self._maybe_ask_round_start()
                continue
            last = time.monotonic()
            done = False
            # take everything already queued before training, so only the newest round is trained
            for _ in range(10_000):
                if isinstance(item, Received) and self._handle(item):
                    done = True
                    break
                item = self.channel.receive(0.0)
                if item is None:
                    break
            if done:
                break
            self._answer_again()
            self._maybe_train()
            self._maybe_ask_round_start()
        self._leave()
        return AgentSummary(self.client_id, self.rounds_trained, self.receipts_accepted, self.finished, self.link_s)

    def _handle(self, item: Received) -> bool:
        env = item.envelope
        body = env.body
        if env.sender != "server":
            return False
        if isinstance(body, Status):
            if item.topic_info.direction == "down" and item.topic_info.client_id is None:  # down/status
                self._server_status(body, retained=item.retain)
            return False
        if self._server_gone_at is not None and not item.retain:
            # the server's messages reach the broker before its last will: one after it is from a
            # server that is back (one that said nothing of its presence, say): the hold ends here,
            # and what this message asks for is answered as usual
            self._server_back(f"its {env.kind.label}", send_pending=False)
        if isinstance(body, Global):
            if self.emulate_link:
                self._emulate("down", item.decoded.payload_bytes)
            # the newest round's global, unless that round was trained already (a copy sent again)
            if env.round > self._last_trained_round and (self._global is None or env.round >= self._global[0]):
                if self._global is None or env.round != self._global[0]:
                    # taken now (not when it arrived: a global queued while this device trained
                    # is handled with the round_start behind it)
                    self._global_at = time.monotonic()
                self._global = (env.round, shared_global(item.sha256, body.tensors, dict(body.extras)))
            # confirm the (possibly chunked) transfer with its hash, as the protocol asks
            self.channel.send(topics.up(self.fed, self.client_id, Kind.RECEIPT),
                              Receipt(ref_kind=int(Kind.GLOBAL), ref_seq=env.seq, accepted=True, sha256=item.sha256),
                              round=env.round)
        elif isinstance(body, RoundStart):
            self._start_seen = max(self._start_seen, env.round)
            if env.round <= self._last_trained_round:
                # already trained: the server re-sent it after a reconnect, or a server resumed
                # from an older checkpoint runs it again (answered once the batch is handled)
                if (self._last_update is not None and self._last_update[0] == env.round
                        and self.selected_by(body)):
                    if item.received_at and item.received_at < self._update_sent_at:
                        # here before the last copy of the update went out (queued while this device
                        # trained): sent before the server could have had that copy, it asks nothing
                        self.round_starts_not_answered += 1
                        return False
                    if env.round in self._again:
                        self.round_starts_not_answered += 1
                    own = item.topic_info.client_id == self.client_id
                    self._again[env.round] = self._again.get(env.round, True) and own
                return False
            if self.state_store is not None:
                self._server_at(env.round)
            if self.selected_by(body):
                self._take_round(env.round, body, item.received_at or time.monotonic())
            elif body.members and self.member_index is None and not self.joined:
                # it may name this device by the member index its join receipt has not brought yet
                if self._before_join is None or env.round >= self._before_join[0]:
                    self._before_join = (env.round, body, item.received_at or time.monotonic())
        elif isinstance(body, Receipt):
            if body.ref_kind == Kind.JOIN:
                if body.ref_seq not in self._join_seqs:
                    log.warning("%s: receipt for a join it did not send (seq %d) ignored", self.client_id, body.ref_seq)
                elif not body.accepted and not self.joined:
                    self.join_refused = body.reason or "refused"
                    raise AgentError(f"{self.client_id}: the server refused the join: {body.reason}")
                else:
                    self.joined = True
                    if body.member_index is not None:  # the server names this device in round_start.members
                        self.member_index = body.member_index
                    held, self._before_join = self._before_join, None
                    if held is not None and held[0] > self._last_trained_round and self.selected_by(held[1]):
                        log.info("%s: round %d's start came before the join receipt and names it by member "
                                 "index %d: taken", self.client_id, held[0], self.member_index)
                        self._take_round(*held)
            elif body.ref_kind == Kind.UPDATE:
                if body.ref_seq in self._answered_seqs:
                    log.info("%s: receipt again for its update of round %d (seq %d), answered already", self.client_id,
                             env.round, body.ref_seq)
                elif body.ref_seq not in self._update_seqs:
                    log.warning("%s: receipt for an update it did not send (seq %d) ignored", self.client_id,
                                body.ref_seq)
                elif body.accepted:
                    self._update_seqs.discard(body.ref_seq)
                    self._answered_seqs.append(body.ref_seq)
                    self._receipt_round = max(self._receipt_round, env.round)
                    if self._again.pop(env.round, None) is not None:
                        # a round_start copy of this round came before this receipt in the batch: the
                        # server counted the update after it sent that copy, which asks for nothing more
                        self.round_starts_not_answered += 1
                    if self._unacked is not None and self._unacked[0] == env.round:
                        self._unacked = None
                    if env.round not in self._counted_rounds:  # late (re-sends ran out) or not: it counts
                        self._counted_rounds.add(env.round)
                        self.receipts_accepted += 1
                    self._settle(env.round, True)
                else:
                    self._update_seqs.discard(body.ref_seq)
                    self._answered_seqs.append(body.ref_seq)
                    if self._unacked is not None and self._unacked[0] == env.round:
                        self._unacked = None  # a definite answer: do not send it again
                    log.warning("%s: update of round %d rejected: %s", self.client_id, env.round, body.reason)
                    self._settle(env.round, False)
                    if self._last_update is not None and self._last_update[0] == env.round:
                        self._last_update = None  # rolled back: never offered again
                    # its own update (the seq is one it sent): the round need not wait for it (an
                    # unsigned server cannot tell this device's refused update from a forged one)
                    self._withdraw(env.round, f"its update was refused: {body.reason}")
        elif isinstance(body, Finish):
            self.finished = True
            return True
        return False

    @property
    def server_offline(self) -> bool:
        """Whether the server is known offline now (a live ``offline``, not yet followed by its
        ``online`` or another message of it): this agent's re-sends are held."""
        return self._server_gone_at is not None

    def _server_status(self, body: Status, *, retained: bool) -> None:
        """The server's presence (``down/status``): hold on a live ``offline``, end the hold on any
        ``online`` (the rule: the class docstring, *Server presence*)."""
        if body.state == "offline":
            if retained:
                # kept by the broker from some earlier moment, perhaps from an earlier server of this
                # federation name: no fact about the server this device is to meet, never a hold
                log.debug("%s: the server's retained offline status (%s) is not taken as its presence",
                          self.client_id, body.detail)
            elif self._server_gone_at is None:
                self._server_gone_at = time.monotonic()
                self._server_gone_why = body.detail
                self._held_now = {"update": 0, "join": 0}
                log.info("%s: the server is offline (%s): its re-sends wait for its online", self.client_id,
                         body.detail or "no reason given")
        elif body.state == "online":
            if self._server_gone_at is not None:
                self._server_back("its online status" + (" (kept by the broker)" if retained else ""),
                                  send_pending=True, rounds=body.holds)
            elif not retained and not self.joined and self._join_seqs and self.join_refused is None:
                # a server that (re)started after this device's join: that join went to no one
                log.info("%s: the server says online and the join is not answered yet: sent again now",
                         self.client_id)
                self._resend_join(on_online=True)

    def _hold(self, what: str) -> None:
        """One re-send of ``what`` (``"update"``, ``"join"``) held while the server is offline;
        the first of an outage is said (WARNING)."""
        if not any(self._held_now.values()):
            log.warning("%s: holds its %s re-send: the server is offline (%s); what is pending goes at once when "
                        "it says online again", self.client_id, what, self._server_gone_why or "no reason given")
        self._held_now[what] += 1
        self.held_resends[what] += 1

    def _server_back(self, how: str, *, send_pending: bool,
                     rounds: tuple[int, int, int] | None = None) -> None:
        """The server known offline is back (``how``: what said so): the hold ends; with
        ``send_pending`` (its ``online``), the join not answered yet, or the update still without
        a receipt, goes at once (a re-send, within ``max_resends``) instead of at its timeout.
        ``rounds``: where the server's ``online`` says the rounds are (the last round it
        completed, the round it collects now or 0; ``None``: not said): an update of a round the
        server has neither completed nor opened (a resumed server that runs it again) is not sent
        now, its ``round_start`` asks for it; its receipt timeout starts again from now."""
        assert self._server_gone_at is not None, "called only while the server is known offline"
        now = time.monotonic()
        gone_s = now - self._server_gone_at
        held, self._held_now = self._held_now, {"update": 0, "join": 0}
        self._server_gone_at = None
        self._held_update = 0
        join = send_pending and not self.joined and bool(self._join_seqs) and self.join_refused is None
        unacked = self._unacked if send_pending else None
        if unacked is not None and (now > unacked[5] or unacked[4] >= self.max_resends
                                    or (self._update_seq is not None and self.channel.in_flight(self._update_seq))):
            # its round's deadline passed (a resumed server's round_start asks for it again), no re-send
            # is left, or its last copy is still being delivered (this device's own link is down)
            unacked = None
        waits = ""
        if unacked is not None and rounds is not None and unacked[0] > rounds[0] and unacked[0] != rounds[1]:
            # the server will open that round and ask for the update (its round_start): a copy now
            # would come before the round and go unanswered
            waits = (f"; its update of round {unacked[0]} waits for the server's round_start (the server completed "
                     f"round {rounds[0]} and collects {f'round {rounds[1]}' if rounds[1] else 'none'})")
            self._unacked = unacked[:3] + (now,) + unacked[4:]
            unacked = None
        pending = (["join"] if join else []) + ([f"update of round {unacked[0]}"] if unacked is not None else [])
        log.info("%s: the server is back (%s) after %.1f s offline; %d update and %d join re-send(s) were held%s%s",
                 self.client_id, how, gone_s, held["update"], held["join"],
                 f"; sending its {' and '.join(pending)} at once" if pending else "", waits)
        if join:
            self._resend_join(on_online=True)
        if unacked is not None:
            rnd, update, codec, _, tries, deadline_at, extra_codecs = unacked
            self._unacked = (rnd, update, codec, time.monotonic(), tries + 1, deadline_at, extra_codecs)
            self._resend_update(rnd, update, codec, extra_codecs)
            self.sent_on_online["update"] += 1

    def _resend_join(self, *, on_online: bool = False) -> None:
        """Send the join again (:meth:`_send_join`); ``on_online``: at once on the server's
        ``online``, and the re-send period starts again at :attr:`join_resend_s`."""
        try:
            self._send_join(wait_s=5.0)
        except TransportError as exc:
            log.warning("%s: could not send the join again: %s", self.client_id, exc)
            self._join_sent_at = time.monotonic()
            return
        if on_online:
            self.sent_on_online["join"] += 1
            self._join_every_s = self.join_resend_s

    def _maybe_ask_round_start(self) -> None:
        """Ask the server for a ``round_start`` the broker dropped (the class docstring, *A lost
        round_start*): when this device holds round r's global, untrained, and no ``round_start``
        of round r came within (2^k − 1)·:attr:`round_start_wait_s` seconds of taking it (k − 1
        asks sent for r so far, k ≤ :data:`MAX_ROUND_START_ASKS`), say ``online`` again with what
        it holds (retained, on its status topic). A transport failure is logged; the ask counts."""
        held = self._global
        if (held is None or not self.joined or self.finished or self._server_gone_at is not None
                or self._stop.is_set()):
            return
        rnd = held[0]
        if rnd <= self._start_seen or rnd <= self._last_trained_round or rnd <= self._training_round:
            return
        asked = self.round_start_asks.get(rnd, 0)
        if asked >= MAX_ROUND_START_ASKS:
            return
        waited_s = time.monotonic() - self._global_at
        if waited_s < self.round_start_wait_s * (2 ** (asked + 1) - 1):
            return
        self.round_start_asks[rnd] = asked + 1
        detail = f"no round_start of round {rnd}"  # free text, in the server's log: kept short (bytes)
        log.warning("%s: %s %.0f s after its global (lost by the broker?): asks the server for it (%d/%d)",
                    self.client_id, detail, waited_s, asked + 1, MAX_ROUND_START_ASKS)
        try:
            self.channel.send(topics.status(self.fed, self.client_id), self._online(detail), round=0, retain=True)
        except TransportError as exc:
            log.warning("%s: could not ask for the round_start of round %d: %s", self.client_id, rnd, exc)

    def _take_round(self, rnd: int, start: RoundStart, received_at: float) -> None:
        """Make round ``rnd`` (whose ``start`` selects this device) the one to train next,
        unless a newer round is pending already; its deadline counts from ``received_at``
        (monotonic seconds)."""
        if self._pending is None or rnd >= self._pending[0]:
            self._pending = (rnd, start)
            self._pending_at = received_at

    def selected_by(self, start: RoundStart) -> bool:
        """Whether ``start`` selects this device: its id is in ``selected``, or its member index
        (from the join receipt) is in ``members`` (:func:`protocol.membership.members_contain`)."""
        if self.client_id in start.selected:
            return True
        return self.member_index is not None and members_contain(start.members, self.member_index)

    def _maybe_train(self) -> None:
        if self._pending is None or self._global is None or self._global[0] != self._pending[0]:
            return
        rnd, start = self._pending
        self._training_round = max(self._training_round, rnd)  # before the pending round is let go (holdings)
        self._pending = None
        if time.monotonic() > self._pending_at + start.deadline_s:
            log.info("%s: round %d is already over (deadline %.1f s); not training it", self.client_id, rnd,
                     start.deadline_s)
            return
        # this device's instructions over the round's shared config: a TrainConfig key among
        # them (local_epochs …) applies to this device only
        params = round_params(start)
        try:
            cfg = TrainConfig.from_mapping(self.train_defaults, params)
        except ValueError as exc:  # an instruction or setting this device cannot apply
            log.error("%s: round %d not trained: %s", self.client_id, rnd, exc)
            self._withdraw(rnd, f"unusable round settings: {exc}")
            return
        if self.runtime is not None and cfg.batch_size > self.runtime.plan.batch_size:
            cfg = dataclasses.replace(cfg, batch_size=self.runtime.plan.batch_size)  # the device's memory rule
        global_tensors, global_extras = self._global[1].tensors, self._global[1].extras
        if self._unsettled is not None:
            log.warning("%s: no definite receipt for the update of round %d before round %d: the device state "
                        "it produced is discarded", self.client_id, self._unsettled, rnd)
            self._settle(self._unsettled, False)
        mark = self.phases.lap()
        client_eval = bool(params.get("client_eval", False)) and self.eval_x is not None

        def work() -> tuple[LocalResult, dict]:
            mark("wait_slot")
            model = self._take_model()
            try:
                result = self.algorithm.local_round(model, global_tensors, self.train_x(), self.y, cfg, round=rnd,
                                                    client_id=self.client_id, client_index=self.client_index,
                                                    device=self.device, params=params, global_extras=global_extras)
                metrics = dict(result.metrics)
                mark("train")
                if client_eval and result.num_samples:
                    metrics.update(self.evaluate(model))
                    mark("evaluate")
            finally:
                self._give_back(model)
            return result, metrics

        try:
            if self.slots is not None:
                # the costliest waiting training goes first (TrainingSlots: a balanced round)
                result, metrics = self.slots.run(work, cost=len(self.y) * max(1, cfg.local_epochs))
            else:
                with self.train_lock if self.train_lock is not None else nullcontext():
                    result, metrics = work()
        except ModelError as exc:  # e.g. a server of another algorithm: its global is another share
            raise self._not_my_model(rnd, global_tensors, exc) from exc
        except (ValueError, TypeError) as exc:  # an algorithm hyperparameter it cannot use
            log.error("%s: round %d not trained: %s", self.client_id, rnd, exc)
            self._settle(rnd, False)
            self._withdraw(rnd, f"local training failed: {exc}")
            return
        except SlotsClosed:  # the run is ending: the fleet's training slots were closed
            log.info("%s: round %d not trained: the training slots were closed", self.client_id, rnd)
            return
        self._global = (rnd, _NO_GLOBAL)  # trained: the round's global is no longer needed (its round is kept)
        self._last_trained_round = rnd
        self._unsettled = rnd
        if result.num_samples == 0:
            log.warning("%s: no training samples: nothing to send for round %d", self.client_id, rnd)
            self._settle(rnd, False)
            self._withdraw(rnd, "no training samples")
            return
        if not _all_finite(result):
            log.error("%s: local training of round %d diverged (NaN/Inf in the result); no update sent",
                      self.client_id, rnd)
            self._settle(rnd, False)
            self._withdraw(rnd, "local training diverged (NaN/Inf); no update sent")
            return
        codec, tensors, delta = self._encode_update(params, result.tensors, global_tensors, rnd=rnd)
        if self.state_store is not None:  # the state this update goes with (its residuals too), settled by its answer
            self._state_io("write", self.state_store.put, self.client_id, rnd, self._state_snapshot(settled=False),
                           settled=False)
        try:
            extra_codecs = extras_codecs(str(params.get("extras_codec", "")), result.extras, codec)
        except ValueError as exc:  # a server of another version, or a hand-made round_start
            log.error("%s: extras_codec %r: %s; the extras go with the update codec", self.client_id,
                      params.get("extras_codec"), exc)
            extra_codecs = None
        update = Update(tensors=tensors, num_samples=result.num_samples, train_loss=result.train_loss,
                        metrics=metrics, delta=delta, extras=result.extras)
        deadline_at = self._pending_at + start.deadline_s
        self._unacked = (rnd, update, codec, time.monotonic(), 0, deadline_at, extra_codecs)
        self._held_update = 0
        self._last_update = (rnd, update, codec, extra_codecs)
        self._counted_rounds.discard(rnd)  # a new update of the round (trained again): its receipt counts
        try:
            if self.emulate_link:
                self._emulate("up", self.channel.encoded_size(update, codec, extra_codecs))
            mark("prepare_update")
            self._update_sent_at = time.monotonic()
            enc = self.channel.send(topics.up(self.fed, self.client_id, Kind.UPDATE), update, round=rnd, codec=codec,
                                    extra_codecs=extra_codecs)
            mark("send_update")
        except TransportError as exc:  # e.g. offline buffer full: kept, sent again by _maybe_resend
            log.error("%s: update of round %d not sent now: %s", self.client_id, rnd, exc)
            self.rounds_trained += 1
            return
        self._update_seqs.add(enc.seq)
        self._update_seq = enc.seq
        self.rounds_trained += 1
        if self.on_trained is not None:
            self.on_trained(rnd, result, len(enc.payload))

    def _settle(self, rnd: int, accepted: bool) -> None:
        """Pass the definite answer for the update of round ``rnd`` to the algorithm's
        ``on_update_receipt`` (commit or roll back its per-device state), once per round and
        only for the round awaiting one."""
        if self._unsettled != rnd:
            return
        self._unsettled = None
        self.algorithm.on_update_receipt(rnd, accepted)
        if self._ef_before is not None and self._ef_before[0] == rnd:
            if not accepted and self._ef is not None:  # the residuals go back with the state
                self._ef.load_state_dict(self._ef_before[1])
            self._ef_before = None
        if self.state_store is not None:
            self._state_io("settle", self.state_store.settle, self.client_id, rnd, accepted)
            if accepted:
                self._state_round = rnd

    def _not_my_model(self, rnd: int, global_tensors: tuple[np.ndarray, ...], exc: ModelError) -> AgentError:
        """When round ``rnd``'s global does not fit this device's model share (the server runs
        another algorithm or model): log it, withdraw from the round so the server need not wait
        for its deadline, say offline; returns the :class:`AgentError` to raise, which names the
        algorithm, its share and what arrived."""
        name = self.algorithm.name or type(self.algorithm).__name__
        share = self.algorithm.share
        why = (f"the global model of round {rnd} ({len(global_tensors)} tensors) does not fit this device's "
               f"algorithm {name!r} (share={share!r}): {exc}")
        log.error("%s: %s; stopping", self.client_id, why)
        self._withdraw(rnd, why)
        self._leave()
        return AgentError(f"{self.client_id}: {why}. The server runs another algorithm or model: start the agent "
                          f"with the --algorithm and --param options `fedfleet server` printed")

    def _withdraw(self, rnd: int, why: str) -> None:
        """Tell the server this device will not contribute to round ``rnd`` (a non-retained
        ``idle`` status carrying the round), so the round need not wait for its deadline."""
        try:
            self.channel.send(topics.status(self.fed, self.client_id), Status("idle", f"round {rnd}: {why}"), round=rnd)
        except TransportError as exc:
            log.warning("%s: could not say it withdrew from round %d: %s", self.client_id, rnd, exc)

    def evaluate(self, model: torch.nn.Module | None = None) -> dict[str, float]:
        """Accuracy and macro-F1 of this device's own model (``model``: the one it trains this
        round; default :attr:`model`) on its evaluation split.

        Returns:
            ``{"eval_accuracy": fraction, "eval_macro_f1": fraction, "eval_samples": M}``; the
            macro-F1 averages the per-class F1 over the classes present in the split or
            predicted (scikit-learn's ``f1_score(average="macro")`` convention).

        Raises:
            AgentError: the agent was built without ``eval_x`` and ``eval_y``.
        """
        eval_x, eval_y = self.eval_x, self.eval_y
        if eval_x is None or eval_y is None:
            raise AgentError(f"{self.client_id}: no evaluation split (build the agent with eval_x and eval_y)")
        if model is None:
            model = self.model
        model.eval()
        preds = []
        with torch.inference_mode():
            for s in range(0, len(eval_y), EVAL_BATCH):
                xb = eval_x[s:s + EVAL_BATCH].to(self.device)
                preds.append(predict_scores(self.algorithm, model, xb).argmax(1).cpu().numpy())
        pred = np.concatenate(preds) if preds else np.zeros(0, np.int64)
        return {"eval_accuracy": float((pred == eval_y).mean()) if len(pred) else 0.0,
                "eval_macro_f1": macro_f1(eval_y, pred), "eval_samples": int(len(pred))}

    def _emulate(self, direction: str, nbytes: int) -> None:
        """Take the time the profile's link needs for ``nbytes`` (simulated fleets only)."""
        assert self.runtime is not None, "emulate_link is only set with a runtime"
        seconds = self.runtime.link_s(nbytes, direction)
        self.link_s += seconds
        time.sleep(seconds)

    def _answer_again(self) -> None:
        """Send the update of each round whose ``round_start`` came again in the batch just handled,
        once per round however many copies were queued (:meth:`_send_again`), and not while the
        last copy is still being delivered (a packet of it awaits the broker's acknowledgement, or
        it is being sent again smaller after a refusal): the receipt timeout still sends it again
        if it never arrives."""
        again, self._again = self._again, {}
        for rnd, own in sorted(again.items()):
            if self._last_update is None or self._last_update[0] != rnd:
                continue
            if self._update_seq is not None and self.channel.in_flight(self._update_seq):
                self.round_starts_not_answered += 1
                log.info("%s: round %d started again while its update is still being delivered: not sent again",
                         self.client_id, rnd)
                continue
            connects = getattr(self.channel.transport, "connects", 0)
            if (own and connects > 1 and self._update_seq is not None and self._unacked is not None
                    and self._unacked[0] == rnd and self.channel.handed_on(self._update_seq) == connects):
                # the server's copy for a device that came back answers this device's last reconnect;
                # the update went out on the connection made since and awaits its receipt: not lost
                # to that link break (the receipt timeout sends it again if it never arrives)
                self.round_starts_not_answered += 1
                log.info("%s: round %d sent again after this device reconnected; its update went out since: not "
                         "sent again", self.client_id, rnd)
                continue
            self._send_again(rnd)

    def _send_again(self, rnd: int) -> None:
        """Send the update of round ``rnd`` again because the server started that round again.

        The server that counted it answers "duplicate: already counted"; a server resumed from
        a checkpoint older than that round has lost it and counts it now, so its state (SCAFFOLD's
        c, FedDyn's h) again holds what this device committed on the first receipt."""
        assert self._last_update is not None, "called only when an update of rnd was sent"
        _, update, codec, extra_codecs = self._last_update
        log.warning("%s: round %d started again: sending its update again", self.client_id, rnd)
        self._resend_update(rnd, update, codec, extra_codecs)
        if self._unacked is not None and self._unacked[0] == rnd:  # the receipt timeout counts from this copy
            self._unacked = self._unacked[:3] + (time.monotonic(),) + self._unacked[4:]

    def _resend_update(self, rnd: int, update, codec, extra_codecs, max_packet_bytes: int = 0) -> None:
        """Publish an update of round ``rnd`` once more (its receipt is matched by the new seq), in
        packets of at most ``max_packet_bytes`` (0: the channel's limit); a transport failure is
        logged, not raised: the caller's next chance retries."""
        try:
            self._update_sent_at = time.monotonic()
            enc = self.channel.send(topics.up(self.fed, self.client_id, Kind.UPDATE), update, round=rnd, codec=codec,
                                    extra_codecs=extra_codecs, max_packet_bytes=max_packet_bytes)
            self._update_seqs.add(enc.seq)
            self._update_seq = enc.seq
            self.resends += 1
        except TransportError as exc:
            log.error("%s: resend of round %d failed: %s", self.client_id, rnd, exc)

    def _maybe_resend(self) -> None:
        """Send the last update again when no receipt came back within ``receipt_timeout_s`` of
        the broker's acknowledgement of its last copy (a message lost in a broker restart, say):
        not while that copy is still being delivered (the transport sends it after a reconnect),
        at most ``max_resends`` times and only while its round is still open. The server counts
        an update once per (client, round)."""
        if self._unacked is None:
            return
        rnd, update, codec, sent_at, tries, deadline_at, extra_codecs = self._unacked
        now = time.monotonic()
        if now > deadline_at:
            self._unacked = None
            return
        if self._update_seq is not None and self.channel.in_flight(self._update_seq):
            # its last copy still awaits the broker's acknowledgement (the link is down, say): the
            # transport sends it after the reconnect; the timeout counts from when the broker has it
            self._unacked = (rnd, update, codec, now, tries, deadline_at, extra_codecs)
            return
        if now - sent_at < self.receipt_timeout_s:
            return
        if self._server_gone_at is not None and tries < self.max_resends:
            # the server is offline: a copy now goes into nothing; held (one for each copy the timeout
            # would send, within max_resends), the update goes at once when the server says online
            if tries + self._held_update < self.max_resends:
                self._held_update += 1
                self._hold("update")
            self._unacked = (rnd, update, codec, now, tries, deadline_at, extra_codecs)
            return
        if tries >= self.max_resends:  # the last copy had its receipt_timeout_s too
            self._unacked = None
            log.warning("%s: no receipt for the update of round %d after %d re-send%s: not sent again unless "
                        "the server starts round %d again (a receipt that comes later still counts)",
                        self.client_id, rnd, tries, "" if tries == 1 else "s", rnd)
            return
        self._unacked = (rnd, update, codec, now, tries + 1, deadline_at, extra_codecs)
        # a broker may drop a message above a size it does not announce (MQTT 3.1.1 with Mosquitto's
        # message_size_limit acknowledges it all the same): when its packets were larger than any the
        # broker delivered here, the channel learns a smaller limit, which this copy and every later
        # message is sized under
        packet = self.channel.suspect_dropped(self._update_seq) if self._update_seq is not None else 0
        log.warning("%s: no receipt for the update of round %d after %.0f s; sending it again (%d/%d)%s",
                    self.client_id, rnd, now - sent_at, tries + 1, self.max_resends,
                    f" in packets of at most {packet:,} bytes" if packet else "")
        self._resend_update(rnd, update, codec, extra_codecs)

    def leave(self, detail: str) -> None:
        """Publish the retained ``offline`` status with ``detail`` (waiting up to 5 s for the
        broker's acknowledgement), as the device does when its run ends: for a process stopped by
        SIGTERM/SIGINT, whose clean DISCONNECT fires no last will, so that the server stops waiting
        for it. A failure to publish is logged, never raised."""
        self._leave(detail)

    def _encode_update(self, config, tensors, global_tensors, *, rnd: int):
        """Apply the round's update encoding: codec (the firmware profile may force a cheaper
        one), deltas against the received global model, and error feedback.

        Error feedback (Seide et al., Interspeech 2014; Karimireddy et al., ICML 2019): the
        agent sends C(x + e) and keeps e ← (x + e) − C(x + e), so the codec's error is not lost
        but carried into the next round. The tensors returned are already C(x + e) (decoded), so
        the channel's encoding of them reproduces the same wire values.
        """
        text = str(config.get("update_codec", "fp32"))
        if self.runtime is not None:
            text = self.runtime.update_codec(text, n_values=sum(int(t.size) for t in tensors
                                                                if np.issubdtype(t.dtype, np.floating)))
        codec = Codec.parse(text)
        delta = bool(config.get("delta", False))
        out = list(tensors)
        if delta:
            out = [w - g if np.issubdtype(w.dtype, np.floating) else w
                   for w, g in zip(out, global_tensors, strict=False)]
        if codec.lossy and bool(config.get("error_feedback", False)):
            if self._ef is None:
                self._ef = ErrorFeedback()
            if self.state_store is None and self._idle_store is not None:  # the first residuals: kept from now on
                store, self._idle_store = self._idle_store, None
                # rows of an earlier run that kept no residual hold nothing of this one: dropped, so
                # they can neither be gone back to nor prune this run's newer rows as the newest
                self._state_io("forget", store.forget_from, self.client_id, 1)
                self._state_io("write", store.put, self.client_id, 0, {})  # the initial state: no residual
                if self.state_store_error is None:
                    self.state_store = store
                    log.info("%s: keeps its error-feedback residuals in %s (a restart carries them on)",
                             self.client_id, store.path)
            self._fit_residuals(out)
            self._ef_before = (rnd, self._ef.state_dict())
            out = [self._ef.compress(i, t, codec)[1] if np.issubdtype(t.dtype, np.floating) else t
                   for i, t in enumerate(out)]
        return codec, tuple(np.ascontiguousarray(t) for t in out), delta

    def _fit_residuals(self, tensors: list[np.ndarray]) -> None:
        """Forget the error-feedback residuals, saying so, when they do not fit ``tensors`` (this
        round's update, by shape and dtype): kept for another model (a state file from a run of
        other shapes or precision under the same federation id), they cannot be added to it."""
        assert self._ef is not None
        kept = self._ef.layout()
        bad = [(i, shape, dtype) for i, (shape, dtype) in kept.items()
               if i >= len(tensors) or (np.issubdtype(tensors[i].dtype, np.floating)
                                        and (shape != tuple(tensors[i].shape) or dtype != tensors[i].dtype))]
        if not bad:
            return
        i, shape, dtype = bad[0]
        where = self.state_store.path if self.state_store is not None else "memory"
        want = f"{tuple(tensors[i].shape)} {tensors[i].dtype}" if i < len(tensors) else "no such tensor"
        log.error("%s: its kept error-feedback residuals (%s) fit another model (tensor %d: kept %s %s, this update "
                  "%s; %d of %d differ): they start afresh at zero", self.client_id, where, i, shape, dtype, want,
                  len(bad), len(kept))
        self._ef.reset()

    def _leave(self, detail: str = "run finished") -> None:
        try:
            self._send_linked(topics.status(self.fed, self.client_id), Status("offline", detail),
                              what="offline status", wait_s=5, retain=True)
        except Exception as exc:  # leaving must not mask the run's outcome: said, not raised
            log.warning("%s: could not publish offline status: %s", self.client_id, exc)
