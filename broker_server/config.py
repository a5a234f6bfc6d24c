"""Run configuration: a TOML file, strictly checked (unknown keys and bad values are refused).

Example (``examples/mnist-fedavg.toml``)::

    [run]
    name = "mnist-fedavg"
    seed = 0
    rounds = 10

    [data]
    dataset = "mnist"
    partition = "dirichlet"
    alpha = 0.5
    clients = 10

    [train]
    algorithm = "fedavg"
    local_epochs = 1
    batch_size = 32
    lr = 0.05

Every section and key is listed in :data:`SCHEMA` with its type and allowed range; the error
for a typo names the file, the section and the key, and lists the allowed keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edge_agent.partition import CLIENT_TEST_FRACTION_RANGE
from protocol.broker_url import has_login, login_placeholder_url, public_broker_url, shown_broker_url

from .errors import ConfigError


@dataclass(frozen=True)
class RunSection:
    """[run]: name (used in the run id), seed, rounds, out (parent folder of run folders)."""

    name: str = "run"
    seed: int = 0
    rounds: int = 10
    out: str = "runs"


@dataclass(frozen=True)
class DataSection:
    """[data]: data set name, optional folder, partition scheme, Dirichlet α, client count.

    ``partition = "domain-silo"`` (multi-domain sets ``pacs``, ``digits_domains``) gives each
    client one domain: ``domain_clients`` = ``"photo=3,art_painting=4,cartoon=2,sketch=1"``
    (names from the set; the counts sum to ``clients``; ``""`` = 3/4/2/1 by domain position, as
    FedPAD; the stronger imbalance is 6/2/1/1). ``domain_train_cap`` / ``domain_test_cap``: at
    most that many samples per domain (seeded, stratified; 0 = all), multi-domain sets only.
    ``train_samples`` partitions a seeded, class-stratified subset of that many training samples
    (0 = the whole split): the data-scarce regime (FedMCP++'s protocol), or a quick trial.
    ``partition = "classes"``: each client holds ``classes_per_client`` classes only (the
    pathological split, :func:`edge_agent.partition.classes_per_client`); ``fedfleet simulate``
    only (:data:`edge_agent.partition.SIMULATION_ONLY_SCHEMES`: ``fedfleet server`` refuses it).

    ``client_test`` chooses what client-side evaluation (``[server] client_eval``) measures:
    ``"shared"`` (default, the behaviour before the key existed): every device trains on its
    whole shard and is evaluated on the data set's test split; ``"local"``: each device's test set
    is ``client_test_fraction`` of its own shard, held out per class before training
    (:func:`edge_agent.partition.hold_out_local_tests`; the personalised-FL protocol of PFLlib /
    HtFLlib, 75/25, SPECS.md §3.1/§3.5), so a personalised model is judged on data like its own.
    ``"shared"`` stays the default because the global-model methods (FedAvg and the other
    FedPAD/FedPGP/FedMCP++ protocols of SPECS.md) are evaluated on the shared test split; the
    personalised / model-heterogeneous protocols (FedOCP, FedTGP, FedGH, FedProto, SPECS.md §3.5)
    set ``"local"``.
    """

    dataset: str = "digits"
    data_dir: str = ""
    partition: str = "dirichlet"
    alpha: float = 0.5
    clients: int = 10
    min_samples: int = 10
    train_samples: int = 0
    domain_clients: str = ""
    domain_train_cap: int = 0
    domain_test_cap: int = 0
    classes_per_client: int = 2
    client_test: str = "shared"
    client_test_fraction: float = 0.25


@dataclass(frozen=True)
class TrainSection:
    """[train]: algorithm name and local training settings."""

    algorithm: str = "fedavg"
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass(frozen=True)
class ServerSection:
    """[server]: participation rate C, quorum, deadlines (seconds), evaluation.

    ``client_eval`` asks every agent to evaluate its own model after local training (the
    measure for personalised methods: FedPer, FedRep, FedMCP++, Local); each uses at most
    ``client_eval_max`` test samples (0 = the whole test split, minus a proxy set if any; it caps
    the shared split only and must be 0 with ``[data] client_test = "local"``, where each device
    evaluates on its whole local test set), in every ``client_eval_every``-th round and the last.
    ``eval_every``: the server evaluates the global model on the test split (and each test
    domain) in every ``eval_every``-th round and the last (default 1: every round); the other
    rounds' ``metrics.jsonl`` lines have no ``accuracy``/``loss`` (``test_evaluated`` false), so
    rounds to a target are resolved to ``eval_every`` rounds. A strategy's own
    :meth:`~broker_server.strategies.Strategy.evaluate` (FedDO's and FedAA's reward from their
    validation set) still runs every round, and training is the same whatever the value (the
    evaluation draws from no generator). It does not apply to the devices' own evaluations
    (``client_eval_every``), the accuracy of an algorithm that shares less than the whole model.
    ``offline_grace_s``: seconds a selected device whose last will (``offline``) arrived during a
    round may take to come back before the round stops waiting for it (default 30).
    ``global_delivery``: how a round's ``global`` reaches the selected devices: ``"broadcast"``
    (one message on ``down/global``, which every online device downloads, selected or not),
    ``"per_device"`` (one copy per selected device on ``down/{client}/global``; the unselected
    download nothing) or ``"auto"`` (the default: per device when that moves fewer bytes over the
    broker, see :func:`broker_server.server.choose_delivery`).
    ``global_confirm_s``: seconds within which a selected device must confirm a round's global
    model before it is sent again in smaller packets (a broker that acknowledges and drops
    messages above a size limit it does not announce; default 10).
    ``overlap_evaluation``: ``"auto"`` (the default) evaluates each round but the last while the
    devices train the next one, unless the algorithm's next plan reads that evaluation (FedDO,
    FedAA: ``plans_from_evaluation``); ``"off"`` evaluates each round before the next one opens.
    The figures are the same either way (see :mod:`broker_server.server`, "Evaluation overlap").
    """

    participation_rate: float = 1.0
    quorum: int = 1
    round_deadline_s: float = 300.0
    join_timeout_s: float = 60.0
    eval_batch_size: int = 256
    client_eval: bool = False
    client_eval_max: int = 0
    client_eval_every: int = 1
    eval_every: int = 1
    offline_grace_s: float = 30.0
    global_delivery: str = "auto"
    global_confirm_s: float = 10.0
    overlap_evaluation: str = "auto"


@dataclass(frozen=True)
class BrokerSection:
    """[broker]: ``url`` empty = start an embedded broker of ``kind`` (auto/mosquitto/amqtt).

    ``mqtts://`` URLs use TLS: ``ca_file`` is the CA that signed the broker's certificate (empty:
    the system's CAs); ``cert_file`` + ``key_file`` (PEM) are a client certificate for brokers
    that require one. ``username`` + ``password_file`` (a file holding the password) log in.
    ``mqtt_version``: ``auto`` (MQTT 5 where the broker speaks it, else 3.1.1), ``5`` or
    ``3.1.1``. Over MQTT 3.1.1 a broker cannot announce its packet limit: declare it as
    ``[protocol] max_packet_bytes``.
    """

    url: str = ""
    kind: str = "auto"
    mqtt_version: str = "auto"
    username: str = ""
    password_file: str = ""
    ca_file: str = ""
    keepalive_s: int = 30
    cert_file: str = ""
    key_file: str = ""


@dataclass(frozen=True)
class ProtocolSection:
    """[protocol]: QoS, tensor codecs, deltas, chunking.

    ``codec`` applies to every tensor-carrying kind; ``update_codec`` / ``global_codec``
    override it per kind when not empty. Codec text: ``fp32``, ``fp16``, ``bf16``, ``int8``,
    ``int8-channel``, ``topk:FRACTION`` or ``topk:K`` (optionally ``:fp16`` values), each with an
    optional ``+zstd`` (see :class:`protocol.tensors.Codec`). ``delta`` sends updates as
    w_local − w_global; ``error_feedback`` keeps each agent's codec error and adds it to the next
    update (lossy codecs). ``chunk_bytes`` and ``max_packet_bytes`` (the broker's limit; 0 = none)
    decide when a message goes as a chunked transfer. ``extras_codec`` encodes the named non-model
    arrays of updates (prototypes, soft predictions): ``""`` = as ``update_codec``, one codec
    for all, or per name: ``"soft_predictions=int8+zstd,prototypes=fp16+zstd"``.
    """

    qos: int = 1
    codec: str = "fp32"
    update_codec: str = ""
    global_codec: str = ""
    extras_codec: str = ""
    delta: bool = False
    error_feedback: bool = False
    chunk_bytes: int = 1024 * 1024
    max_packet_bytes: int = 0

    def codec_for(self, kind: str) -> str:
        """Codec text for ``"update"`` or ``"global"`` messages."""
        own = self.update_codec if kind == "update" else self.global_codec
        return own or self.codec


@dataclass(frozen=True)
class AgentsSection:
    """[agents]: firmware profiles of the simulated fleet, concurrent trainers, torch threads.

    ``profile`` is one profile name (``"rpi4"``) or a mix with fractions summing to 1
    (``"rpi4=0.4,jetson-orin-nano=0.4,x86-cpu=0.2"``); each virtual agent gets one, seeded.
    ``emulate_link`` makes every transfer take the time its profile's link needs.
    ``train_slots`` (virtual devices training at once) and ``torch_threads`` (intra-op threads,
    process-wide): 0 = chosen from the cores (:func:`edge_agent.device.plan_threads`).
    """

    profile: str = "x86-cpu"
    train_slots: int = 0
    torch_threads: int = 0
    emulate_link: bool = False

    def profile_mix(self) -> list[tuple[str, float]]:
        """``[(name, fraction), …]`` from ``profile``.

        Raises:
            ValueError: malformed text, a fraction outside (0, 1], or fractions not summing to 1.
        """
        parts = [p.strip() for p in self.profile.split(",") if p.strip()]
        if len(parts) == 1 and "=" not in parts[0]:
            return [(parts[0], 1.0)]
        mix = []
        for p in parts:
            name, eq, frac = p.partition("=")
            try:
                f = float(frac)
            except ValueError:
                raise ValueError(f"{p!r}: expected NAME=FRACTION") from None
            if not eq or not name or not 0 < f <= 1:
                raise ValueError(f"{p!r}: expected NAME=FRACTION with 0 < FRACTION <= 1")
            mix.append((name.strip(), f))
        if abs(sum(f for _, f in mix) - 1) > 1e-6:
            raise ValueError(f"fractions sum to {sum(f for _, f in mix):g}, not 1")
        return mix


@dataclass(frozen=True)
class SecuritySection:
    """[security]: signed and encrypted messages (:mod:`protocol.security`).

    ``sign`` puts an Ed25519 signature on every message and refuses unsigned, unenrolled,
    forged, altered or replayed ones; ``encrypt`` (needs ``sign``) encrypts every upload's body
    with AES-256-GCM. ``key_dir`` is the server's key folder (``fedfleet keys gen --out DIR``):
    its keys sign, its ``enrolled/`` folder is the allow-list; required by ``fedfleet server``
    when signing, optional for ``fedfleet simulate`` (empty: fresh keys for the server and every
    virtual agent in ``RUN_DIR/keys``, enrolled automatically). ``replay_window``: sequence
    numbers remembered per sender. ``clock_skew_s``: tolerance (seconds) of the start-up check
    of certificate validity periods against this machine's clock; the protocol itself reads no
    clock.
    """

    sign: bool = False
    encrypt: bool = False
    key_dir: str = ""
    replay_window: int = 1024
    clock_skew_s: float = 300.0


@dataclass(frozen=True)
class ModelSection:
    """[model]: the devices' architecture(s) (:mod:`edge_agent.models`).

    ``name`` is a zoo name (``lightcnn``, ``resnet18``, ``resnet8``, ``mobilenet_v2``,
    ``inception_small``) or a user's factory ``"package.module:function"``; it is also the
    server's model. ``feature_dim`` is the agreed prototype width d (``features(x)`` is
    ``[N, d]``). ``group`` makes a *model group*: a list of architectures assigned round-robin by
    shard index (device ``i`` runs ``group[i % len(group)]``), or a table by firmware profile
    (``{rpi4 = "lightcnn", "jetson-orin-nano" = "resnet18"}``; profiles it does not name run
    ``name``), or the name of a group of :data:`edge_agent.models.MODEL_GROUPS`
    (``"htfe4-cpu"``, ``"fleet"`` …). Several architectures need a prototype-only algorithm (FedProto): parameter
    averaging needs one architecture on every device. Stored as a tuple of names, or of
    ``(profile, name)`` pairs.
    """

    name: str = "lightcnn"
    feature_dim: int = 64
    group: tuple = ()

    def group_spec(self) -> list[str] | dict[str, str]:
        """``group`` as :func:`edge_agent.models.assign_model` takes it: a list, or a dict by profile."""
        if self.group and isinstance(self.group[0], tuple):
            return dict(self.group)
        return list(self.group)

    def architecture(self, shard: int, profile: str) -> str:
        """The architecture of device ``shard`` (0-based) running firmware ``profile``."""
        from edge_agent.models import assign_model

        return assign_model(self.name, self.group_spec(), shard=shard, profile=profile)

    def architectures(self) -> list[str]:
        """Every architecture of the fleet, distinct, ``name`` first."""
        from edge_agent.models import group_architectures

        return group_architectures(self.name, self.group_spec())


@dataclass(frozen=True)
class TrackingSection:
    """[tracking]: each round's metrics and ledger bytes to TensorBoard and/or MLflow
    (:mod:`broker_server.tracking`; ``pip install 'fedfleet[tracking]'``). Off by default.

    ``tensorboard``: write event files to ``tensorboard_dir`` (``""``: ``RUN_DIR/tensorboard``).
    ``mlflow``: log a run into experiment ``mlflow_experiment`` at ``mlflow_uri`` (``""``:
    ``file:RUN_DIR/mlruns``; any MLflow tracking URI, e.g. ``http://mlflow.lan:5000``).
    """

    tensorboard: bool = False
    tensorboard_dir: str = ""
    mlflow: bool = False
    mlflow_uri: str = ""
    mlflow_experiment: str = "fedfleet"


@dataclass(frozen=True)
class Config:
    """A whole run configuration (every section with defaults)."""

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    server: ServerSection = field(default_factory=ServerSection)
    broker: BrokerSection = field(default_factory=BrokerSection)
    protocol: ProtocolSection = field(default_factory=ProtocolSection)
    agents: AgentsSection = field(default_factory=AgentsSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    model: ModelSection = field(default_factory=ModelSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    algorithm: dict[str, Any] = field(default_factory=dict)
    source: str = "<defaults>"

    def replace(self, section: str, **changes: Any) -> Config:
        """A copy with ``changes`` applied to one section (values re-validated)."""
        sec = dataclasses.replace(getattr(self, section), **changes)
        cfg = dataclasses.replace(self, **{section: sec})
        validate(cfg)
        return cfg

    def to_toml(self) -> str:
        """The resolved configuration as TOML text (written to the run folder, and to TensorBoard).

        A ``[broker] url`` holding a user name or password is written without them
        (:func:`protocol.broker_url.public_broker_url`), under a :data:`BROKER_LOGIN_LEFT_OUT`
        comment naming the ``--broker`` a ``--resume`` needs; one that is not a broker URL has its
        password, if any, written as ``***``."""
        lines = [f"# resolved fedfleet configuration (from {self.source})"]
        for sec in _SECTIONS:
            lines.append(f"\n[{sec}]")
            for f in dataclasses.fields(getattr(self, sec)):
                v = getattr(getattr(self, sec), f.name)
                if (sec, f.name) == ("broker", "url") and v:
                    v = _broker_url_line(v, lines)
                lines.append(f"{f.name} = {_toml_value(v)}")
        if self.algorithm:
            lines.append("\n[algorithm]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(self.algorithm.items())]
        return "\n".join(lines) + "\n"


#: The comment above a run folder's ``config.toml`` ``[broker] url`` whose URL was given with a
#: user name or password, left out of that copy (:meth:`Config.to_toml`).
BROKER_LOGIN_LEFT_OUT = "# url: the user name and password it was given with are left out of this copy"


def _broker_url_line(url: str, lines: list[str]) -> str:
    """``[broker] url`` as :meth:`Config.to_toml` writes it: without its login, the
    :data:`BROKER_LOGIN_LEFT_OUT` comment appended to ``lines`` where it had one."""
    try:
        login = has_login(url)
    except ValueError:  # not a broker URL: the transport refuses it; its password is not written
        return shown_broker_url(url)
    if login:
        lines.append(f"{BROKER_LOGIN_LEFT_OUT}; a --resume needs --broker {login_placeholder_url(url)}")
    return public_broker_url(url)


_SECTIONS = ("run", "data", "train", "server", "broker", "protocol", "agents", "security", "model", "tracking")

# allowed (min, max) for numbers, or a tuple of choices for strings
_RANGES: dict[tuple[str, str], Any] = {
    ("run", "rounds"): (1, 100_000),
    ("run", "seed"): (0, 2**63 - 1),
    ("data", "alpha"): (1e-6, float("inf")),
    ("data", "clients"): (1, 100_000),
    ("data", "min_samples"): (1, 10**9),
    ("data", "train_samples"): (0, 10**9),
    ("data", "partition"): ("iid", "dirichlet", "domain-silo", "classes"),
    ("data", "classes_per_client"): (1, 100_000),
    ("data", "client_test"): ("shared", "local"),
    ("data", "client_test_fraction"): CLIENT_TEST_FRACTION_RANGE,
    ("data", "domain_train_cap"): (0, 10**9),
    ("data", "domain_test_cap"): (0, 10**9),
    ("train", "local_epochs"): (1, 1000),
    ("train", "batch_size"): (1, 1 << 20),
    ("train", "lr"): (0.0, 100.0),
    ("train", "momentum"): (0.0, 1.0),
    ("train", "weight_decay"): (0.0, 1.0),
    ("server", "participation_rate"): (1e-9, 1.0),
    ("server", "quorum"): (1, 100_000),
    ("server", "round_deadline_s"): (0.1, 7 * 86400.0),
    ("server", "join_timeout_s"): (0.1, 7 * 86400.0),
    ("server", "offline_grace_s"): (0.0, 7 * 86400.0),
    ("server", "global_delivery"): ("auto", "broadcast", "per_device"),
    ("server", "global_confirm_s"): (0.1, 7 * 86400.0),
    ("server", "overlap_evaluation"): ("auto", "off"),
    ("server", "eval_batch_size"): (1, 1 << 20),
    ("server", "client_eval_max"): (0, 1 << 30),
    ("server", "client_eval_every"): (1, 1 << 30),
    ("server", "eval_every"): (1, 1 << 30),
    ("broker", "kind"): ("auto", "mosquitto", "amqtt"),
    ("broker", "mqtt_version"): ("auto", "5", "3.1.1"),
    ("broker", "keepalive_s"): (5, 65535),
    ("protocol", "qos"): (0, 1),
    ("protocol", "chunk_bytes"): (64, 256 * 1024 * 1024),
    ("protocol", "max_packet_bytes"): (0, 268_435_460),
    ("agents", "train_slots"): (0, 1024),
    ("agents", "torch_threads"): (0, 1024),
    ("security", "replay_window"): (64, 1 << 20),
    ("security", "clock_skew_s"): (0.0, 7 * 86400.0),
    ("model", "feature_dim"): (1, 1 << 16),
}


def _toml_value(v: Any) -> str:
    if isinstance(v, tuple) and v and isinstance(v[0], tuple):  # [model] group by profile: an inline table
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v) + "}"
    if isinstance(v, tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, float) and v == float("inf"):
        return "inf"
    return repr(v)


def _coerce(value: Any, ftype: type, where: str) -> Any:
    if ftype is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if ftype is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if ftype is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if ftype is float and not isinstance(value, float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if ftype is str and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def validate(cfg: Config, source: str | None = None) -> None:
    """Check every ranged value of ``cfg``.

    Raises:
        ConfigError: naming the source, section, key, the value and the allowed range.
    """
    src = source or cfg.source
    for (sec, key), rng in _RANGES.items():
        v = getattr(getattr(cfg, sec), key)
        where = f"{src}: [{sec}] {key}"
        if isinstance(rng, tuple) and rng and isinstance(rng[0], str):
            if v not in rng:
                raise ConfigError(f"{where} = {v!r} is not one of {', '.join(rng)}")
        elif not rng[0] <= v <= rng[1]:
            raise ConfigError(f"{where} = {v!r} is outside the allowed range [{rng[0]}, {rng[1]}]")
    from protocol.messages import parse_extras_codec
    from protocol.tensors import Codec

    text = cfg.protocol.extras_codec
    try:
        parse_extras_codec(text)  # the agents' grammar: what passes here, every agent can read
    except ValueError as exc:
        raise ConfigError(f"{src}: [protocol] extras_codec = {text!r}: {exc}") from None
    for key in ("codec", "update_codec", "global_codec"):
        text = getattr(cfg.protocol, key)
        if text or key == "codec":
            try:
                Codec.parse(text)
            except ValueError as exc:
                raise ConfigError(f"{src}: [protocol] {key} = {text!r}: {exc}") from None
    try:
        mix = cfg.agents.profile_mix()
    except ValueError as exc:
        raise ConfigError(f"{src}: [agents] profile = {cfg.agents.profile!r}: {exc}") from None
    from edge_agent.profiles import ProfileError, get_profile

    for name, _ in mix:
        try:
            get_profile(name)
        except ProfileError as exc:
            raise ConfigError(f"{src}: [agents] profile: {exc}") from None
    if 0 < cfg.protocol.max_packet_bytes < 1024:
        raise ConfigError(f"{src}: [protocol] max_packet_bytes = {cfg.protocol.max_packet_bytes}: "
                          "use 0 (no limit) or at least 1024 bytes")
    if cfg.server.quorum > cfg.data.clients:
        raise ConfigError(f"{src}: [server] quorum = {cfg.server.quorum} exceeds [data] clients = {cfg.data.clients}")
    _validate_domains(cfg.data, src)
    _validate_client_test(cfg, src)
    if cfg.security.encrypt and not cfg.security.sign:
        raise ConfigError(f"{src}: [security] encrypt = true needs sign = true (bodies are encrypted, then signed)")
    if bool(cfg.broker.cert_file) != bool(cfg.broker.key_file):
        raise ConfigError(f"{src}: [broker] cert_file and key_file go together (a client certificate and its key)")
    _validate_model(cfg, src)


def _validate_domains(d: DataSection, src: str) -> None:
    """[data] domain keys: ``domain-silo`` needs a multi-domain set, known domain names and
    clients per domain summing to ``clients``; ``domain_clients`` and the caps need a
    multi-domain set (an unknown data-set name is left to the loader, which lists the names)."""
    from edge_agent.data import dataset_info, list_datasets
    from edge_agent.errors import DataError, PartitionError
    from edge_agent.partition import DEFAULT_DOMAIN_CLIENTS, allocate_domain_clients
    from edge_agent.plugins import is_reference

    try:
        info = dataset_info(d.dataset)
    except DataError as exc:
        if is_reference(d.dataset, "dataset"):  # a user's factory that cannot be used: say so now
            raise ConfigError(f"{src}: [data] dataset: {exc}") from None
        info = None
    known = info.known_domain_names if info is not None else ()
    primary = [s.name for s in info.domains] if info is not None else []
    multi = ", ".join(n for n in list_datasets() if dataset_info(n).domains)
    if d.partition == "domain-silo" and not known:
        raise ConfigError(f"{src}: [data] partition = 'domain-silo' needs a multi-domain dataset "
                          f"({multi}), not {d.dataset!r}")
    if d.domain_clients and d.partition != "domain-silo":
        raise ConfigError(f"{src}: [data] domain_clients is for partition = 'domain-silo' "
                          f"(partition is {d.partition!r})")
    if (d.domain_train_cap or d.domain_test_cap) and not known:
        raise ConfigError(f"{src}: [data] domain_train_cap / domain_test_cap apply to the "
                          f"multi-domain datasets ({multi}), not to {d.dataset!r}")
    if d.partition != "domain-silo":
        return
    if not d.domain_clients:
        if sum(DEFAULT_DOMAIN_CLIENTS) != d.clients:
            raise ConfigError(
                f"{src}: [data] domain_clients is empty, so the default {'/'.join(map(str, DEFAULT_DOMAIN_CLIENTS))} "
                f"clients per domain apply, which sum to {sum(DEFAULT_DOMAIN_CLIENTS)}, not [data] clients = "
                f"{d.clients}; set domain_clients, e.g. "
                f"{','.join(f'{n}={k}' for n, k in zip(primary, DEFAULT_DOMAIN_CLIENTS, strict=False))!r}")
        return
    try:
        alloc = allocate_domain_clients(known, d.domain_clients)
    except PartitionError as exc:
        raise ConfigError(f"{src}: [data] domain_clients = {d.domain_clients!r}: {exc}") from None
    if sum(alloc.values()) != d.clients:
        raise ConfigError(f"{src}: [data] domain_clients = {d.domain_clients!r} sums to "
                          f"{sum(alloc.values())} clients, but [data] clients = {d.clients}")


def _validate_client_test(cfg: Config, src: str) -> None:
    """``[data] client_test = "local"``: ``client_eval_max`` must be 0 (it caps the shared split,
    which a local protocol does not use), and somebody must evaluate on the held-out sets:
    ``[server] client_eval`` on, or an algorithm that shares less than the whole model (the
    server turns client evaluation on for it). An unknown algorithm is left to the registry."""
    if cfg.data.client_test != "local":
        return
    if cfg.server.client_eval_max:
        raise ConfigError(f"{src}: [server] client_eval_max = {cfg.server.client_eval_max} caps the shared test "
                          "split, but [data] client_test = 'local' evaluates each device on its own held-out "
                          "split: set client_eval_max = 0 (or client_test = 'shared')")
    if cfg.server.client_eval:
        return
    from .strategies import get_strategy_class

    try:
        share = get_strategy_class(cfg.train.algorithm).share
    except ConfigError:
        return
    if share == "all":
        raise ConfigError(f"{src}: [data] client_test = 'local' holds out a test set from every device's shard "
                          f"for client-side evaluation, but it is off ([server] client_eval = false and "
                          f"{cfg.train.algorithm!r} shares the whole model): set [server] client_eval = true, "
                          "or client_test = 'shared'")


def _model_group(value: Any, where: str) -> tuple:
    """``[model] group`` from TOML: a list of names -> a tuple of names; a table profile -> name
    -> a tuple of ``(profile, name)`` pairs; a string names a group of
    :data:`edge_agent.models.MODEL_GROUPS` and becomes what that group is.

    Raises:
        ConfigError: another type, a non-string or empty entry.
    """
    if isinstance(value, str):  # a named group (edge_agent.models.MODEL_GROUPS)
        from edge_agent.errors import ModelError
        from edge_agent.models import get_group

        try:
            value = get_group(value)
        except ModelError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        value = list(value) if isinstance(value, tuple) else value
    if isinstance(value, list):
        if not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{where} = {value!r}: expected a list of model names (strings)")
        return tuple(value)
    if isinstance(value, dict):
        if not all(isinstance(v, str) and v for v in value.values()):
            raise ConfigError(f"{where} = {value!r}: expected a table of profile = model name (strings)")
        return tuple((str(k), v) for k, v in value.items())
    raise ConfigError(f"{where} = {value!r}: expected a list of model names (round-robin by shard index), a "
                      "table of firmware profile = model name, or a group name")


def _validate_model(cfg: Config, src: str) -> None:
    """[model]: every architecture is a zoo name or an importable factory; profile names are
    known; several architectures only with an algorithm whose ``model_requirement`` is
    ``"prototype"`` (an unknown algorithm is left to the strategy registry, which lists them)."""
    from edge_agent.errors import ModelError
    from edge_agent.models import resolve_model
    from edge_agent.profiles import ProfileError, get_profile

    m = cfg.model
    for name in m.architectures():
        try:
            resolve_model(name)
        except ModelError as exc:
            raise ConfigError(f"{src}: [model]: {exc}") from None
    if m.group and isinstance(m.group[0], tuple):
        for profile, _ in m.group:
            try:
                get_profile(profile)
            except ProfileError as exc:
                raise ConfigError(f"{src}: [model] group by profile: {exc}") from None
    archs = m.architectures()
    if len(archs) < 2:
        return
    from .admission import model_requirement
    from .strategies import get_strategy_class, list_strategies

    try:
        cls = get_strategy_class(cfg.train.algorithm)
    except ConfigError:
        return
    if model_requirement(cls) == "manifest":
        prototype_only = [n for n in list_strategies() if model_requirement(get_strategy_class(n)) == "prototype"]
        raise ConfigError(
            f"{src}: [model] assigns several architectures ({', '.join(archs)}) but [train] algorithm = "
            f"{cfg.train.algorithm!r} averages parameters, which needs one architecture on every device: give one "
            f"[model] name (no group), or use a prototype-only algorithm ({', '.join(prototype_only)})")


def section_hint(key: str, section: str, *, algorithm: str | None = None) -> str:
    """``"; did you mean [data] client_test?"`` when ``key``, unknown in ``[section]``, is a key of
    other sections (all of them named: ``[run] name or [model] name``) or, with ``algorithm``
    (``[train] algorithm``), one of that algorithm's ``[algorithm]`` hyperparameters; ``""``
    when it is neither (an algorithm that cannot be loaded gives no hint)."""
    defaults = Config()
    places = [f"[{sec}] {key}" for sec in _SECTIONS
              if sec != section and key in {f.name for f in dataclasses.fields(getattr(defaults, sec))}]
    if not places and algorithm is not None and section != "algorithm":
        try:
            from .runtime import algorithm_keys
            from .strategies import get_strategy_class

            if key in algorithm_keys(get_strategy_class(algorithm)):
                places = [f"[algorithm] {key} (a hyperparameter of {algorithm!r})"]
        except Exception:  # noqa: BLE001 - only a hint: an algorithm that cannot be loaded is reported elsewhere
            pass
    return f"; did you mean {' or '.join(places)}?" if places else ""


def from_dict(raw: dict, source: str = "<dict>") -> Config:
    """Build a :class:`Config` from parsed TOML.

    Raises:
        ConfigError: unknown section or key, wrong type, value out of range.
    """
    sections: dict[str, Any] = {}
    for sec, table in raw.items():
        if sec not in _SECTIONS and sec != "algorithm":
            raise ConfigError(f"{source}: unknown section [{sec}]; allowed: {', '.join(_SECTIONS + ('algorithm',))}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{sec}] must be a table")
        if sec == "algorithm":  # the algorithm's hyperparameters: checked by its strategy's constructor
            for key, value in table.items():
                if not isinstance(value, (bool, int, float, str)):
                    raise ConfigError(f"{source}: [algorithm] {key} = {value!r}: expected a number, string or "
                                      "true/false")
            sections[sec] = dict(table)
            continue
        factory = Config.__dataclass_fields__[sec].default_factory
        assert factory is not dataclasses.MISSING, f"Config.{sec} has no default_factory"
        cls = cast(type[Any], factory)  # every section field's default_factory is the section's dataclass
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kw = {}
        for key, value in table.items():
            if key not in types:
                train = raw.get("train")
                algorithm = train.get("algorithm", TrainSection.algorithm) if isinstance(train, dict) else \
                    TrainSection.algorithm
                hint = section_hint(key, sec, algorithm=algorithm if isinstance(algorithm, str) else None)
                raise ConfigError(f"{source}: unknown key [{sec}] {key}; allowed: {', '.join(types)}{hint}")
            if (sec, key) == ("model", "group"):
                kw[key] = _model_group(value, f"{source}: [model] group")
                continue
            declared = types[key]  # text under ``from __future__ import annotations``
            ftype = {"int": int, "float": float, "str": str, "bool": bool}[declared] \
                if isinstance(declared, str) else declared
            kw[key] = _coerce(value, ftype, f"{source}: [{sec}] {key}")
        sections[sec] = cls(**kw)
    cfg = Config(**sections, source=source)
    validate(cfg, source)
    return cfg


def load(path: str | os.PathLike, overrides: dict[tuple[str, str], Any] | None = None) -> Config:
    """Read and validate a TOML configuration file.

    Args:
        path: the file.
        overrides: ``{(section, key): value}`` applied before validation (command-line options),
            so that an override can make a file consistent (``--clients 12`` with ``quorum = 9``).
            The value the file gives for an overridden key is still checked on its own (type,
            range or choices): ``rounds = "3"`` is refused with ``--rounds 1`` too.

    Raises:
        ConfigError: the file is missing, not TOML, or has an unknown key or a bad value.
    """
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"configuration file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {p}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from exc
    for (sec, key), value in (overrides or {}).items():
        if not isinstance(raw.get(sec, {}), dict):
            break  # from_dict reports the malformed section
        if key in raw.get(sec, {}):  # the file's own value, which the override hides: checked all the same
            _check_overridden(sec, key, raw[sec][key], str(p))
        raw.setdefault(sec, {})[key] = value
    return from_dict(raw, str(p))


def _check_overridden(sec: str, key: str, value: Any, source: str) -> None:
    """The type and the allowed range or choices of ``[sec] key = value`` in the file ``source``,
    a value an override replaces (:func:`load`): a file is valid on its own, whatever the command
    line says. Consistency between keys (``quorum`` ≤ ``clients``) is left to the whole
    configuration, which an override may make consistent.

    Raises:
        ConfigError: as :func:`from_dict` says it of the file's value, with a note that it is the
            file's own value that is wrong.
    """
    if sec not in _SECTIONS or (sec, key) == ("model", "group"):
        return  # [algorithm] is the strategy's to check; [model] group is checked as a whole
    factory = Config.__dataclass_fields__[sec].default_factory
    types = {f.name: f.type for f in dataclasses.fields(cast(type[Any], factory))}
    if key not in types:
        return  # from_dict names an unknown key
    declared = types[key]
    ftype = {"int": int, "float": float, "str": str, "bool": bool}[declared] if isinstance(declared, str) else declared
    note = " (the file's own value, checked although the command line overrides it)"
    where = f"{source}: [{sec}] {key}"
    try:
        value = _coerce(value, ftype, where)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{note}") from None
    rng = _RANGES.get((sec, key))
    if rng is None:
        return
    if isinstance(rng[0], str):
        if value not in rng:
            raise ConfigError(f"{where} = {value!r} is not one of {', '.join(rng)}{note}")
    elif not rng[0] <= value <= rng[1]:
        raise ConfigError(f"{where} = {value!r} is outside the allowed range [{rng[0]}, {rng[1]}]{note}")
