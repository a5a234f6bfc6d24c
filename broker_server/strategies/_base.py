"""The strategy contract: one base class declaring every hook the server driver calls, and the
records it exchanges with the driver (:class:`RoundPlan`, :class:`ClientResult`,
:class:`GlobalUpdate`).

Which hook the driver (:class:`broker_server.server.AggregationServer`) calls when:

1. once, before round 1: :meth:`Strategy.bind_model` with the server's model; for every
   admitted join (before round 1 and later): :meth:`Strategy.on_join`;
2. each round: :meth:`Strategy.configure_round` → :class:`RoundPlan` (who, shared config,
   per-device instructions), with :meth:`Strategy.config_for_round` merged over its config
   (:func:`round_config`); :meth:`Strategy.global_extras` for the round's ``global``;
   :meth:`Strategy.device_global` for each selected device's own copy of it (unless the
   global is broadcast);
   :meth:`Strategy.accumulator` for the round's results;
3. each update that passed the driver's checks: :meth:`Strategy.validate`, then
   :meth:`Accumulator.add`;
4. at the close: :meth:`Accumulator.result` (quorum met) or :meth:`Strategy.skipped_round`
   (quorum missed, some updates accepted) → a :class:`GlobalUpdate` or ``None``; the driver
   checks it (:func:`update_problem`: every array finite and encodable with the round's codecs)
   and only then calls :meth:`Strategy.commit`; the round's ``metrics.jsonl`` line carries that
   committed update's ``metrics`` (none when nothing was committed in the round) and
   :meth:`Strategy.round_metrics` (standing figures, default none), and the figures of
   :meth:`Strategy.aggregate_metrics` (the devices' reports) and :meth:`Strategy.evaluate` (the
   global model on the strategy's own data); then :meth:`Strategy.state_dict` (checkpoint).

Nothing is found by ``getattr``: every hook has a default here.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from protocol.tensors import Codec

#: Scalar types allowed in a round's config and in per-device instructions (the wire's scalars).
Scalar = float | int | str | bool

#: ``share``: which model tensors travel (``edge_agent.algorithms.SHARES``).
SHARES = ("all", "backbone", "none")
#: ``buffers``: registered buffers (BatchNorm running statistics …) averaged with the model
#: (``"average"``) or kept on each device and never sent, in either direction (``"local"``, FedBN).
BUFFERS = ("average", "local")
#: ``model_requirement``: ``"manifest"`` = every device runs the assigned architecture (parameter
#: averaging); ``"prototype"`` = any architecture with the agreed prototype width and class count.
MODEL_REQUIREMENTS = ("manifest", "prototype")


def _check_scalars(m: Mapping[str, object], what: str) -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    for k, v in m.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"{what}: key {k!r} is not a non-empty string")
        if isinstance(v, np.generic):
            v = v.item()
        if not isinstance(v, (bool, int, float, str)):
            raise ValueError(f"{what}[{k!r}] = {v!r} is not a scalar (int, float, str, bool)")
        out[k] = v
    return out


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """What the driver sends for one round.

    Attributes:
        selected: client ids asked to train.
        config: scalars for every selected device's ``round_start.config`` (local_epochs, lr, …).
        instructions: client id → a few named scalars for that device only (its
            ``round_start.instructions``; the agent merges them over ``config``, so a
            ``local_epochs`` there applies to that device alone). Every key must be a selected
            client. Empty (the default): one broadcast ``round_start`` as in protocol v1; non-empty:
            each selected device gets its own ``round_start`` on ``down/{client}/round_start``.

    Raises:
        ValueError: an instruction for a client that is not selected, or a non-scalar value.
    """

    selected: tuple[str, ...]
    config: Mapping[str, Scalar] = field(default_factory=dict)
    instructions: Mapping[str, Mapping[str, Scalar]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.instructions) - set(self.selected))
        if unknown:
            raise ValueError(f"instructions for clients that are not selected: {unknown}")
        for cid, ins in self.instructions.items():
            _check_scalars(ins, f"instructions[{cid!r}]")


@dataclass(frozen=True, slots=True)
class ClientResult:
    """One accepted update.

    Attributes:
        client_id: sender.
        tensors: the shared model arrays (the strategy's ``share`` subset of the manifest, in
            manifest order; already validated: shapes, dtypes, finite; deltas resolved).
        num_samples: the client's sample count n_k (> 0).
        train_loss: the client's reported training loss.
        metrics: the client's other scalars.
        extras: the update's named non-model arrays (finite; checked by the strategy's
            :meth:`Strategy.validate`).
    """

    client_id: str
    tensors: tuple[np.ndarray, ...]
    num_samples: int
    train_loss: float
    metrics: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClientReport:
    """What one device reported with an accepted update, for :meth:`Strategy.aggregate_metrics`.

    Attributes:
        client_id: the device.
        num_samples: its sample count n_k.
        train_loss: its training loss.
        metrics: its other scalars (``train_accuracy``, ``train_seconds``, ``eval_accuracy`` when
            it evaluated, whatever a client algorithm puts in :attr:`LocalResult.metrics`).
    """

    client_id: str
    num_samples: int
    train_loss: float
    metrics: Mapping[str, float | int | str | bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GlobalUpdate:
    """The new global state of one round, as ONE value, not yet adopted.

    Attributes:
        tensors: the new shared model tensors (the ``share`` subset, manifest order, each in its
            input dtype); ``None`` = the model stays as it is (``()`` for ``share = "none"``).
        extras: the named arrays :meth:`Strategy.global_extras` returns once this update is
            committed (the next ``global``'s extras; checked against the extras codec).
        state: strategy attributes to set on :meth:`Strategy.commit` (name → new value; arrays,
            lists of arrays, scalars).
        metrics: the round's figures for ``metrics.jsonl`` (scalars, lists, string-keyed maps):
            the driver logs them for the round in which it commits this update, and only then
            (a skipped or refused round logs none of them); :attr:`Strategy.committed_metrics`
            keeps them after :meth:`Strategy.commit`.
    """

    tensors: Sequence[np.ndarray] | None = None
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)
    state: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)


class Accumulator(Protocol):
    """Collects one round's accepted results as they arrive (streaming aggregation).

    ``add(result)`` may raise ValueError (the driver then refuses that update and nothing of it
    must remain in the sums); ``result()`` returns the round's :class:`GlobalUpdate` (``None``:
    nothing to change) and never mutates the strategy."""

    def add(self, result: ClientResult) -> None: ...

    def result(self) -> GlobalUpdate | None: ...


class BufferedAccumulator:
    """For strategies without a streaming rule: keeps the results, calls ``aggregate`` at the end
    (in client-id order).

    Memory grows with the number of clients; streaming strategies (FedAvg) avoid it.
    """

    def __init__(self, strategy: Strategy, round: int, current: Sequence[np.ndarray]) -> None:
        self.strategy, self.round, self.current = strategy, round, current
        self.results: list[ClientResult] = []

    def add(self, result: ClientResult) -> None:
        self.results.append(result)

    def result(self) -> GlobalUpdate | None:
        return self.strategy.aggregate(self.round, self.current, sorted(self.results, key=lambda r: r.client_id))


def fold(accumulator: Accumulator, results: Sequence[ClientResult]) -> GlobalUpdate | None:
    """A streaming rule applied to a whole list: ``accumulator.add`` for each result, in the given
    order, then ``accumulator.result()``. A strategy whose rule is its :meth:`Strategy.accumulator`
    writes ``aggregate`` as ``return fold(self.accumulator(round, current), results)``.

    Raises:
        ValueError: from ``add`` (an unusable result), as the accumulator raises it.
    """
    for r in results:
        accumulator.add(r)
    return accumulator.result()


def _defined_by(cls: type, attr: str) -> type | None:
    return next((k for k in cls.__mro__ if attr in k.__dict__), None)


def accumulator_for(strategy: Strategy, round: int, current: Sequence[np.ndarray]) -> Accumulator:
    """The strategy's :meth:`Strategy.accumulator`, unless a subclass overrides ``aggregate``
    without its own ``accumulator`` (FedAdam over FedAvg, say): then it is aggregated by its own
    rule, from buffered results (:class:`BufferedAccumulator`)."""
    cls = type(strategy)
    if _defined_by(cls, "accumulator") is _defined_by(cls, "aggregate"):
        return strategy.accumulator(round, current)
    return BufferedAccumulator(strategy, round, current)


def _arrays(value: Any) -> list[np.ndarray]:
    """Every ndarray inside ``value`` (an array, or lists/tuples/dicts of them)."""
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, Mapping):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


def _finite_number(value: Any) -> bool:
    """False for a float NaN/±Inf anywhere inside ``value`` (numbers, lists, dicts)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return all(_finite_number(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite_number(v) for v in value)
    return True


def _not_finite(arrays: Sequence[np.ndarray]) -> bool:
    return any(np.issubdtype(np.asarray(a).dtype, np.floating) and not np.isfinite(a).all() for a in arrays)


def _codec_problem(name: str, array: np.ndarray, codec: Codec | None) -> str | None:
    """Why ``array`` cannot travel with ``codec`` (raises on encode, or NaN/Inf after decode)."""
    from protocol.errors import ProtocolError
    from protocol.tensors import TensorLimits, decode_tensor, encode_tensor

    if codec is None or not codec.lossy:
        return None
    try:
        back = decode_tensor(encode_tensor(array, codec, field=name), field=name,
                             limits=TensorLimits(allow_nonfinite=True))
    except (ProtocolError, ValueError, OverflowError) as exc:
        return f"{name} cannot be encoded with codec {codec.name}: {exc}"
    if _not_finite([np.asarray(back)]):
        return f"{name} holds NaN/Inf once encoded with codec {codec.name}"
    return None


def round_result(make: Callable[[], GlobalUpdate | None]) -> tuple[GlobalUpdate | None, str | None]:
    """Run one of the strategy's end-of-round calls (``accumulator.result()``,
    ``skipped_round(...)``) so that an exception in the strategy's own math never ends the run.

    Args:
        make: the call, without arguments.

    Returns:
        ``(update, None)`` when it returned, ``(None, reason)`` when it raised: the reason names the
        exception, and the driver then keeps the global state and records the reason
        (``skip_reason`` in ``metrics.jsonl``) as it does for an update it refuses to commit.
    """
    try:
        return make(), None
    except Exception as exc:  # noqa: BLE001 - any failure of the strategy's math is this round's, not the run's
        log.exception("the strategy's aggregation failed")
        return None, f"aggregation failed: {type(exc).__name__}: {exc}"


def update_problem(update: GlobalUpdate, *, n_tensors: int | None = None, codec: Codec | None = None,
                   extra_codecs: Mapping[str, Codec] | None = None) -> str | None:
    """Why the driver must not commit ``update``, or ``None`` when it may.

    Checks, in this order: the tensor count (``n_tensors``, the ``share`` subset's length), every
    floating array of ``tensors``, ``extras`` and ``state`` finite, every float in ``metrics``
    finite, and ``tensors`` / ``extras`` encodable with the round's ``codec`` / ``extra_codecs``
    (name → codec; names not listed use ``codec``): encoded, decoded, and still finite — an
    fp16 overflow (|x| > 65504) is refused here, not adopted.

    Returns:
        A reason for ``metrics.jsonl``'s ``skip_reason``, or ``None``.
    """
    tensors = [] if update.tensors is None else list(update.tensors)
    if update.tensors is not None and n_tensors is not None and len(tensors) != n_tensors:
        return f"{len(tensors)} tensors returned, {n_tensors} expected"
    if _not_finite(tensors):
        return "aggregate contains NaN/Inf: discarded"
    bad = [k for k, v in update.extras.items() if _not_finite([v])]
    if bad:
        return f"global extras {bad} contain NaN/Inf: discarded"
    bad = [k for k, v in update.state.items() if _not_finite(_arrays(v))]
    if bad:
        return f"strategy state {bad} contains NaN/Inf: discarded"
    bad = [k for k, v in update.metrics.items() if not _finite_number(v)]
    if bad:
        return f"round metrics {bad} are NaN/Inf: discarded"
    for i, t in enumerate(tensors):
        reason = _codec_problem(f"tensor {i}", np.asarray(t), codec)
        if reason:
            return reason + ": discarded"
    for k, v in update.extras.items():
        reason = _codec_problem(f"extras {k!r}", np.asarray(v), (extra_codecs or {}).get(k, codec))
        if reason:
            return reason + ": discarded"
    return None


def apply_update(strategy: Strategy, round: int, update: GlobalUpdate | None) -> list[np.ndarray] | None:
    """Commit ``update`` when :func:`update_problem` (no codec: fp32) finds nothing, and return its
    tensors (``None`` when ``update`` is ``None`` or keeps the model). What the driver does minus
    the codec check; for offline callers and tests. A refused update's tensors are still returned
    (so a caller can see what was discarded); the strategy is left as it was."""
    if update is None:
        return None
    if update_problem(update) is None:
        strategy.commit(round, update)
    return None if update.tensors is None else list(update.tensors)


def round_config(strategy: Strategy, round: int, config: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The round's ``round_start.config``: the plan's ``config`` with the strategy's
    :meth:`Strategy.config_for_round` merged over it (a key there wins).

    The settings a device trains with (``local_epochs``, ``batch_size``, ``lr``, ``momentum``,
    ``weight_decay``) are checked here as the device checks them
    (:meth:`edge_agent.algorithms.TrainConfig.from_mapping`), so a schedule that yields a value no
    device can use stops on the server, naming the round and the key.

    Raises:
        ValueError: a key that is not a non-empty string, a value that is not a scalar, or an
            unusable training setting (the message names the hook, the round and the key).
    """
    from edge_agent.algorithms import TrainConfig

    own = strategy.config_for_round(round)
    try:
        merged = {**dict(config), **_check_scalars(dict(own), f"{type(strategy).__name__}.config_for_round({round})")}
        TrainConfig.from_mapping(TrainConfig(), merged)
    except ValueError as exc:
        raise ValueError(f"round {round}: {exc} (from {type(strategy).__name__}.config_for_round)") from None
    return merged


_NOT_A_FIGURE = object()


def _figure(value: Any) -> Any:
    """``value`` as what a ``metrics.jsonl`` line can hold (JSON: a finite number, a string, a
    bool, ``None``, lists and string-keyed tables of those); numpy scalars and one-element
    numpy/torch arrays become Python numbers. ``_NOT_A_FIGURE`` for anything else (NaN/Inf
    included: JSON has no such number)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _NOT_A_FIGURE
    if isinstance(value, np.generic) or (hasattr(value, "numel") and hasattr(value, "item")) \
            or isinstance(value, np.ndarray):
        try:
            size = value.numel() if hasattr(value, "numel") else np.size(value)
            if size != 1:
                return _NOT_A_FIGURE
            return _figure(value.item())
        except (TypeError, ValueError, RuntimeError):
            return _NOT_A_FIGURE
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            f = _figure(v)
            if isinstance(k, bool) or not isinstance(k, (str, int)) or f is _NOT_A_FIGURE:  # JSON keys
                return _NOT_A_FIGURE
            out[k] = f
        return out
    if isinstance(value, (list, tuple)):
        items = [_figure(v) for v in value]
        return _NOT_A_FIGURE if any(f is _NOT_A_FIGURE for f in items) else items
    return _NOT_A_FIGURE


def checked_figures(what: str, round: int, figures: Mapping[Any, Any],
                    reserved: Sequence[str] = ()) -> dict[str, Any]:
    """A strategy's figures for the round's metrics line, each key a non-empty string and each
    value one that line can hold (:func:`_figure`: numpy/torch scalars become numbers). Refused:
    a key in ``reserved`` (the driver writes it), another key, a value that is no figure (a
    tensor, an object, NaN/Inf). A refusal is logged (warning, naming the hook, the key and why)
    and the key listed in ``metrics_refused``; the figures that pass are kept.

    Args:
        what: the hook's name, for the log.
        round: the round, for the log.
        figures: what the hook returned.
        reserved: keys the driver writes itself.
    """
    out: dict[str, Any] = {}
    refused: list[str] = []
    for key, value in figures.items():
        name = key if isinstance(key, str) else repr(key)
        if not isinstance(key, str) or not key:
            why = "a key that is not a non-empty string"
        elif key in reserved:
            why = "a key the driver writes itself: not taken"
        else:
            f = _figure(value)
            if f is not _NOT_A_FIGURE:
                out[key] = f
                continue
            why = f"{type(value).__name__} {str(value)[:60]!r} is not a finite number, string or list/table of them"
        log.warning("round %d: %s returned %s: %s", round, what, name, why)
        refused.append(name)
    if refused:
        out["metrics_refused"] = sorted(refused)
    return out


def _guarded(what: str, round: int, make: Callable[[], Mapping[str, Any] | None],
             reserved: Sequence[str]) -> dict[str, Any]:
    """A user hook's figures for the round's metrics line: ``{}`` when it returned nothing; what
    :func:`checked_figures` keeps of them (the driver's own keys and values no metrics line can
    hold are refused: a warning names them and ``metrics_refused`` lists them);
    ``{"<what>_error": reason}`` when it raised or returned no mapping (logged)."""
    try:
        got = make()
        if got is not None and not isinstance(got, Mapping):
            raise TypeError(f"returned a {type(got).__name__}, not a mapping of figures")
        figures = dict(got or {})
    except Exception as exc:  # noqa: BLE001 — a user's hook failing costs its figures, not the run
        log.exception("round %d: %s failed", round, what)
        return {f"{what}_error": f"{type(exc).__name__}: {exc}"}
    return checked_figures(what, round, figures, reserved)


def client_metrics(strategy: Strategy, round: int, reports: Sequence[ClientReport],
                   reserved: Sequence[str] = ()) -> dict[str, Any]:
    """:meth:`Strategy.aggregate_metrics` of the round's accepted reports (client-id order), for
    the round's metrics line; guarded as :func:`_guarded` says (``aggregate_metrics_error``)."""
    return _guarded("aggregate_metrics", round, lambda: strategy.aggregate_metrics(round, reports), reserved)


def server_evaluate(strategy: Strategy, round: int, model: torch.nn.Module,
                    reserved: Sequence[str] = ()) -> dict[str, Any]:
    """:meth:`Strategy.evaluate` of the round's global model (after the commit), for the round's
    metrics line; guarded as :func:`_guarded` says (``evaluate_error``). The model is put back
    in eval mode and no gradients are recorded. An ``accuracy`` that is not a fraction in
    [0, 1], or a ``loss`` that is not a finite number ≥ 0 (or ``None``), is refused as
    :func:`checked_figures` refuses a key (the driver's own measure stays the round's)."""
    import torch

    def run() -> Mapping[str, Any] | None:
        model.eval()
        with torch.no_grad():
            return strategy.evaluate(round, model)

    out = _guarded("evaluate", round, run, reserved)
    bad = []
    acc = out.get("accuracy")
    if "accuracy" in out and (isinstance(acc, bool) or not isinstance(acc, (int, float)) or not 0 <= acc <= 1):
        bad.append("accuracy")
    loss = out.get("loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float)) or loss < 0):
        bad.append("loss")
    for key in bad:
        log.warning("round %d: evaluate returned %s = %r: %s; not taken", round, key, out.pop(key),
                    "an accuracy is a fraction in [0, 1]" if key == "accuracy" else "a loss is a number >= 0")
    if bad:
        out["metrics_refused"] = sorted(set(out.get("metrics_refused", [])) | set(bad))
    return out


def classifier_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """(C, d) of the model's classifier: the shape of its ``classifier.weight`` state entry
    (the light CNN's head ``Linear(d, C)``: C classes, feature width d); ``None`` when the model
    has no 2-D ``classifier.weight``. For :meth:`Strategy.bind_model` implementations."""
    w = model.state_dict().get("classifier.weight")
    if w is None or w.dim() != 2:
        return None
    return int(w.shape[0]), int(w.shape[1])


def parameter_count(model: torch.nn.Module) -> int:
    """P, the model's trainable parameter count (Σ numel over ``model.parameters()``, the layout of
    flat control variates: :mod:`edge_agent.algorithms.scaffold`). For ``bind_model``."""
    return sum(int(p.numel()) for p in model.parameters())




class Strategy(ABC):
    """Server half of an algorithm: the base every strategy subclasses.

    Class attributes (declare them on every strategy; the join admission and the model groups
    read ``model_requirement`` and ``buffers`` from the class):

    * ``name``: the registry name.
    * ``share``: which model tensors travel, one of :data:`SHARES`; ``current`` and every result's
      ``tensors`` are that subset.
    * ``buffers``: one of :data:`BUFFERS`: registered buffers (BatchNorm running statistics)
      averaged with the model, or kept on the device (``"local"``: excluded from what travels,
      both directions).
    * ``model_requirement``: one of :data:`MODEL_REQUIREMENTS`.
    * ``instructions``: names of the per-device instruction keys the strategy may put in a
      :class:`RoundPlan` (``()`` for the strategies shipped today).
    * ``extra_keys``: ``[algorithm]`` keys the constructor takes through its own ``**kwargs`` and
      checks itself (hyperparameters it relays to the devices), besides its named keywords; the
      configuration check (:func:`broker_server.runtime.make_strategy`) accepts them.
    * ``setup_keys``: the constructor's keywords that :meth:`setup_kwargs` supplies (FedDO's
      ``validation``, ``run_seed``, ``run_data``): not ``[algorithm]`` keys, so the configuration
      check refuses them there and leaves them out of the keys it lists.
    * ``path_keys``: ``[algorithm]`` keys whose values are file paths (FedDO's ``policy``): made
      absolute against the current folder when a run starts (:func:`broker_server.cli.absolute_path_keys`),
      so that the run folder's config.toml finds the file from any folder on ``--resume``; the
      run's first line names them (:meth:`header_files`).
    * ``max_devices``: the most devices the strategy can serve (``None``, the default: any
      number); an instance may set it in its constructor (FedDO with a pre-trained policy: the
      policy's K). :func:`broker_server.runtime.make_strategy` refuses a configuration whose
      ``[data] clients`` is larger, before a broker starts or anything is written.
    * ``plans_from_evaluation``: ``True`` when anything the strategy does after a round depends
      on that round's evaluation — its next :meth:`configure_round`, instructions or config, its
      next aggregation or commit, its :meth:`state_dict` — as when :meth:`evaluate` computes a
      reward its agent learns from (FedDO, FedAA). The driver then evaluates each round before
      its checkpoint and before the next round opens. ``False`` (the default): the driver may
      evaluate round r (:meth:`evaluate` included, on a copy of its model) once round r+1 has
      opened, while the devices train (``[server] overlap_evaluation``).

    A strategy never publishes and never commits its own aggregate: :meth:`aggregate` and the
    accumulator's ``result()`` return a :class:`GlobalUpdate`; the driver adopts it through
    :meth:`commit` only when it is finite and encodable (:func:`update_problem`).
    """

    name: ClassVar[str] = ""
    share: ClassVar[str] = "all"
    buffers: ClassVar[str] = "average"
    model_requirement: ClassVar[str] = "manifest"
    instructions: ClassVar[tuple[str, ...]] = ()
    extra_keys: ClassVar[tuple[str, ...]] = ()
    setup_keys: ClassVar[tuple[str, ...]] = ()
    path_keys: ClassVar[tuple[str, ...]] = ()
    plans_from_evaluation: ClassVar[bool] = False
    max_devices: int | None = None

    #: the ``metrics`` of the last update :meth:`commit` adopted (``{}`` before any), for offline
    #: callers of :meth:`step` and tests; replaced on each commit, never mutated. The driver does
    #: not read it: it logs the metrics of the update it commits in the round itself.
    committed_metrics: Mapping[str, Any] = {}

    # ------------------------------------------------------------------ setup

    @classmethod
    def header_files(cls, params: Mapping[str, object], resumed_after: int | None = None) -> str:
        """What the run's first line says after the algorithm's name, in brackets, of the files
        its :attr:`path_keys` name in ``params`` (``[algorithm]``): ``"KEY PATH"`` for each key
        set (``""``: none). ``resumed_after``: the checkpoint round a ``--resume`` goes on from
        (``None``: a fresh run); a strategy whose state then comes from the checkpoint rather
        than from such a file says so (FedDO)."""
        return ", ".join(f"{k} {params[k]}" for k in cls.path_keys if params.get(k))

    @classmethod
    def setup_kwargs(cls, dataset: Any, params: Mapping[str, object], seed: int) -> dict:
        """Data-dependent constructor arguments (FedMCP++'s proxy labels), called by the runtime
        before the strategy is built, with the loaded data set, the ``[algorithm]`` table and the
        run seed; an override that also takes ``device_samples`` is given the training indices
        the devices' shards come from (int64, sorted; :func:`device_training_pool`), so a server
        set can be held out from them (FedDO's and FedAA's validation set), and one that takes
        ``data_settings`` the run's :func:`~broker_server.runtime.data_settings`. Default ``{}``."""
        return {}

    def bind_model(self, model: torch.nn.Module) -> None:
        """Called once by the driver (``AggregationServer.__init__``) with its global model,
        before any round, so that the shapes of shared non-model arrays (a parameter count P,
        the feature width d and class count C of :func:`classifier_shape`) come from the model,
        never from the first update of round 1. Default: nothing."""
        return None  # a default hook: nothing to do

    def on_join(self, client_id: str, profile: str, num_samples: int) -> None:
        """Called by the driver each time it admits a device's ``join`` (again after a
        reconnect, and after a resume when the fleet joins again), with the firmware profile name
        and the sample count |D_k| the device announced: Oort takes its system-speed prior from
        the profile, FedDO checks |S_k| against |D_k|. An exception is logged and costs nothing
        else. Default: nothing."""
        return None  # a default hook: nothing to do

    # ------------------------------------------------------------------ each round

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """Called at the start of each round with the online, joined client ids (sorted) and the
        server's seeded generator (checkpointed); returns who trains, the shared config and any
        per-device instructions. Default: every available client, empty config."""
        return RoundPlan(selected=tuple(sorted(available)))

    def config_for_round(self, round: int) -> Mapping[str, Scalar]:
        """Per-round settings from the server: scalars merged over the plan's config in the
        round's ``round_start`` (a key here wins), so they reach every selected device on the
        wire and are priced in the ledger with it — a learning-rate schedule (``{"lr": …}``),
        local epochs per round (``{"local_epochs": …}``), or any key the client half reads from
        ``params``. Called by the driver once per round after :meth:`configure_round`, and by
        the runtime for every round 1…T before the run starts (so a bad schedule stops it
        there): make it a function of ``round`` and the constructor's arguments only. Default
        ``{}``."""
        return {}

    def global_extras(self) -> dict[str, np.ndarray]:
        """Named arrays broadcast with each round's ``global`` (from the committed state).
        Called once per round after :meth:`configure_round`. Default ``{}``."""
        return {}

    def device_global(self, round: int, client_id: str, tensors: Sequence[np.ndarray],
                      extras: Mapping[str, np.ndarray]) -> tuple[Sequence[np.ndarray], Mapping[str, np.ndarray]] | None:
        """What one selected device's own copy of round ``round``'s ``global`` carries, when the
        global goes to each device on its own topic (``[server] global_delivery``; called for
        every selected device after :meth:`global_extras` unless delivery is ``"broadcast"``;
        under ``"auto"`` the copies' sizes decide between broadcast and per-device delivery).

        Args:
            round: the round.
            client_id: a device of the round's :class:`RoundPlan`.
            tensors: the round's shared tensors (the ``share`` subset, manifest order).
            extras: the round's :meth:`global_extras`.

        Returns:
            ``None`` (the default): the device gets the round's global as it is; else ``(tensors,
            extras)`` for that device alone: ``tensors`` shaped and typed as the round's (the
            device trains from them and its delta updates are resolved against them), ``extras``
            any named arrays (FedCross: the device's own middleware model as its tensors, no
            extras).
        """
        return None

    def validate(self, result: ClientResult) -> str | None:
        """Called for each update that passed the driver's checks (selected, shapes and dtypes of
        the ``share`` subset, finite, deltas resolved), before it is added to the round: a reason
        to refuse a malformed update (answered to the device), or ``None``. Default ``None``."""
        return None

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> Accumulator:
        """The round's :class:`Accumulator`, made after :meth:`configure_round` with the shared
        tensors the clients receive (``current``, after a lossy global codec). Default: a
        :class:`BufferedAccumulator` that calls :meth:`aggregate` at the close; streaming
        strategies (FedAvg) return one whose memory does not grow with the fleet."""
        return BufferedAccumulator(self, round, current)

    @abstractmethod
    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """The round's new global state from all its results at once (pure: reads ``self``,
        never assigns). ``None`` = nothing changes. Called by :class:`BufferedAccumulator`
        (client-id order) and by :meth:`step`.
        """

    def skipped_round(self, round: int, accumulator: Accumulator) -> GlobalUpdate | None:
        """Called when a round with accepted updates closes without aggregation for want of a
        quorum, with the round's :class:`Accumulator` holding them. A strategy whose state
        mirrors per-device state (SCAFFOLD's c, FedDyn's h) returns an update with
        ``tensors=None`` and that state, since those devices got accepted receipts and kept
        theirs; the driver commits it like any other (finite, encodable). Default ``None``."""
        return None

    def commit(self, round: int, update: GlobalUpdate) -> None:
        """Adopt ``update`` (the driver calls this only when :func:`update_problem` found
        nothing): set each ``state`` attribute and keep ``metrics`` in :attr:`committed_metrics`.

        Raises:
            AttributeError: a state name the strategy does not have (a typo).
        """
        for key, value in update.state.items():
            if not hasattr(self, key):
                raise AttributeError(f"{type(self).__name__} has no attribute {key!r} to commit")
            setattr(self, key, value)
        self.committed_metrics = dict(update.metrics)

    def aggregate_metrics(self, round: int, reports: Sequence[ClientReport]) -> Mapping[str, Any]:
        """How the devices' reported metrics become the round's: called by the driver at the
        close of each round (skipped ones too) with one :class:`ClientReport` per accepted update
        (client-id order); the figures returned are added to the round's ``metrics.jsonl`` line
        (keys the driver writes itself are not taken, see ``metrics_refused``). An exception
        costs the round these figures only (``aggregate_metrics_error``). Default ``{}`` (the
        driver still writes its own ``train_loss`` and ``client_accuracy_*``)."""
        return {}

    def evaluate(self, round: int, model: torch.nn.Module) -> Mapping[str, Any]:
        """Server-side evaluation on the user's own data: called by the driver after each round's
        commit (skipped rounds too) with the global model (eval mode, no gradients; do not
        modify it). The figures returned are added to the round's ``metrics.jsonl`` line; an
        ``accuracy`` (and ``loss``) among them replaces the test split's in the line's
        ``accuracy``/``loss`` (``accuracy_source = "strategy"``). Load the data in
        :meth:`setup_kwargs` or the constructor. An exception costs the round these figures only
        (``evaluate_error``). Default ``{}``.

        Under evaluation overlap (the default unless :attr:`plans_from_evaluation`) this runs
        after the checkpoint of ``round`` and after :meth:`configure_round` of ``round + 1``, on a
        copy of the round's model: it must then read nothing those change and change nothing
        they or :meth:`state_dict` read. A strategy whose evaluation feeds its own state (a
        reward) declares ``plans_from_evaluation = True`` and is evaluated before both."""
        return {}

    def run_summary(self) -> dict:
        """What the run's ``summary.json`` records of the strategy when the run ends (key
        ``strategy``; left out when empty): what a later reader needs to know which strategy state
        made the run, such as FedDO's pre-trained policy (its file's SHA-256, its pre-training)
        and its agent at the end. JSON values only. An exception is recorded as
        ``strategy_summary_error`` instead. Default ``{}``."""
        return {}

    def round_metrics(self) -> dict:
        """Figures of the strategy's standing state (not of one aggregation) added to every
        round's ``metrics.jsonl`` line, skipped rounds included; called by the driver after the
        round closed and after the round's :class:`GlobalUpdate.metrics` were merged (a key here
        wins). Per-aggregation figures (weights, norms) belong in :attr:`GlobalUpdate.metrics`,
        which the driver logs only for the round that committed them. Default ``{}``."""
        return {}

    def step(self, round: int, current: Sequence[np.ndarray],
             results: Sequence[ClientResult]) -> list[np.ndarray] | None:
        """:meth:`aggregate` then :func:`apply_update` (commit when finite): a whole round at once,
        for offline callers and tests; returns the new tensors (``None``: unchanged)."""
        return apply_update(self, round, self.aggregate(round, current, results))

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The strategy's state for the round's checkpoint (``--resume``). Default ``{}``."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (``{}`` = the start of a run). Default: nothing."""
        return None  # a default hook: nothing to do
