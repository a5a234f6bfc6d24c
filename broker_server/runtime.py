"""Building blocks shared by ``fedfleet simulate`` and ``fedfleet server``: transports, the
global model, the strategy and the server, all from one :class:`~broker_server.config.Config`."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from edge_agent.agent import data_announcement
from edge_agent.algorithms import algorithm_setup, build_client_algorithm, evaluation_split
from edge_agent.assembly import AgentSpec
from edge_agent.data import Dataset
from edge_agent.errors import ModelError
from edge_agent.models import make_model
from protocol.broker_url import parse_broker_url, public_broker_url
from protocol.channel import Channel
from protocol.errors import ConnectError, SecurityConfigError
from protocol.ledger import Ledger
from protocol.messages import SERVER_ID
from protocol.security import AllowList, ChannelSecurity, Identity, PublicIdentity, load_identity
from protocol.topics import mqtt_client_id
from protocol.transport import MqttTransport, Will

from .config import Config, section_hint
from .errors import ConfigError
from .server import AggregationServer, ServerSettings, server_will
from .strategies import Strategy, get_strategy_class


def open_transport(client_id: str, cfg: Config, url: str, will: Will | None = None, *,
                   receive_max_packet_bytes: int = 0) -> MqttTransport:
    """An unconnected MQTT transport for ``url`` with the config's credentials and TLS settings
    (``mqtts://``: ``[broker] ca_file``, else the system's CAs; ``cert_file`` + ``key_file``) and
    ``[broker] mqtt_version``; under MQTT 5 it advertises ``receive_max_packet_bytes`` (a device's
    own limit, bytes; 0 = none) in its CONNECT.

    Raises:
        ConfigError: a malformed URL, a password file that cannot be read, TLS files that are
            missing, mismatched or expired, or TLS files given for a plain ``mqtt://`` URL.
    """
    try:
        addr = parse_broker_url(url)
    except ValueError as exc:
        raise ConfigError(f"broker URL: {exc}") from None
    password = addr.password
    if cfg.broker.password_file:
        try:
            password = Path(cfg.broker.password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"[broker] password_file {cfg.broker.password_file}: {exc}") from exc
    username = addr.username or (cfg.broker.username or None)
    b = cfg.broker
    if not addr.tls and (b.cert_file or b.ca_file) and url.lower().startswith("mqtt://"):
        raise ConfigError(f"[broker] ca_file/cert_file are set but the broker URL {public_broker_url(addr)} is plain "
                          f"mqtt://: use mqtts:// for TLS")
    try:
        return MqttTransport(client_id, addr.host, addr.port, username=username, password=password, tls=addr.tls,
                             tls_ca=(b.ca_file or None) if addr.tls else None,
                             tls_cert=(b.cert_file or None) if addr.tls else None,
                             tls_key=(b.key_file or None) if addr.tls else None,
                             clock_skew_s=cfg.security.clock_skew_s, keepalive_s=b.keepalive_s, will=will,
                             mqtt_version=b.mqtt_version, receive_max_packet_bytes=receive_max_packet_bytes)
    except SecurityConfigError as exc:
        raise ConfigError(f"[broker] TLS: {exc}") from None


def _needs_key_dir(cfg: Config) -> str:
    return (f"{cfg.source}: [security] sign = true needs key_dir, the server's key folder (create it with "
            f"`fedfleet keys gen --out DIR --id server`, then enrol each device with `fedfleet keys enroll "
            f"DEVICE.pub --server-dir DIR`)")


def check_server_keys(cfg: Config, *, simulated: bool) -> None:
    """``[security] key_dir`` checked before a run writes anything: with ``sign`` on, the folder
    must hold the server's keys (read only: no session counter is advanced). Without a
    ``key_dir`` a simulation makes fresh keys (``simulated``); a server for a real fleet needs one.

    Raises:
        ConfigError: naming the configuration file and the key folder: no ``key_dir`` for a real
            fleet, a missing folder, unusable keys (readable by others, of another id).
    """
    s = cfg.security
    if not s.sign:
        return
    if not s.key_dir:
        if simulated:
            return
        raise ConfigError(_needs_key_dir(cfg))
    try:
        load_identity(s.key_dir, expected_id=SERVER_ID)
    except SecurityConfigError as exc:
        raise ConfigError(f"{cfg.source}: [security] key_dir = {s.key_dir!r}: {exc}") from None


def server_security(cfg: Config, *, identity: Identity | None = None,
                    extra_peers: dict[str, PublicIdentity] | None = None) -> ChannelSecurity | None:
    """The server channel's signing/verification state from ``[security]`` (``None`` when
    signing is off): its keys from ``key_dir`` (or ``identity``), the allow-list from
    ``key_dir/enrolled/`` (re-read when it changes) plus ``extra_peers``, encrypted uploads
    required when ``encrypt`` is on. Advances the key folder's session counter.

    Raises:
        ConfigError: signing on without a key folder, or keys that cannot be used (missing,
            readable by others, of another id); the message names the configuration file.
    """
    s = cfg.security
    if not s.sign:
        return None
    try:
        if identity is None:
            if not s.key_dir:
                raise ConfigError(_needs_key_dir(cfg))
            identity = load_identity(s.key_dir, expected_id=SERVER_ID)
        allow = AllowList(s.key_dir or identity.key_dir, extra_peers)
        return ChannelSecurity(identity, side="server", peers=allow, require_encrypted=s.encrypt,
                               replay_window=s.replay_window)
    except SecurityConfigError as exc:
        raise ConfigError(f"{cfg.source}: [security]: {exc}") from None


def device_model(ds: Dataset, seed: int, name: str = "lightcnn", feature_dim: int = 64) -> torch.nn.Module:
    """The model ``name`` (zoo name or ``package.module:function``) for ``ds``'s image shape and
    class count with prototype width ``feature_dim``, initialised from ``seed``
    (:func:`edge_agent.models.make_model`, the one place models are made).

    Raises:
        ConfigError: the model is unknown or does not fit (the message names what).
    """
    try:
        return make_model(name, in_channels=ds.channels, image_size=ds.image_size, num_classes=ds.num_classes,
                          feature_dim=feature_dim, seed=seed)
    except ModelError as exc:
        raise ConfigError(f"[model]: {exc}") from None


def server_model(cfg: Config, ds: Dataset) -> torch.nn.Module:
    """The server's model: ``[model] name`` with ``feature_dim``, initialised from ``[run] seed``.

    Raises:
        ConfigError: as :func:`device_model`.
    """
    return device_model(ds, cfg.run.seed, cfg.model.name, cfg.model.feature_dim)


def expected_data(cfg: Config) -> dict[str, str]:
    """The data and algorithm announcement every agent of ``cfg``'s federation must make in its
    join (:func:`edge_agent.agent.data_announcement`): data set, partition and its settings,
    seed, shard count, ``[train] algorithm``, the ``[algorithm]`` table and the client test
    protocol (``client_test``, ``client_test_fraction``)."""
    d = cfg.data
    return data_announcement(dataset=d.dataset, partition=d.partition, alpha=d.alpha, seed=cfg.run.seed,
                             shards=d.clients, min_samples=d.min_samples, train_samples=d.train_samples,
                             domain_clients=d.domain_clients, domain_train_cap=d.domain_train_cap,
                             domain_test_cap=d.domain_test_cap, algorithm=cfg.train.algorithm,
                             algorithm_params=dict(cfg.algorithm), client_test=d.client_test,
                             client_test_fraction=d.client_test_fraction)


def agent_spec(cfg: Config, *, client_id: str, shard: int, profile: str, idle_timeout_s: float = 3600.0,
               info: dict | None = None) -> AgentSpec:
    """The :class:`~edge_agent.assembly.AgentSpec` of device ``shard`` of ``cfg``'s fleet: the
    ``[data]`` settings, ``[run] seed``, ``[train] algorithm`` with ``[algorithm]``, and the
    architecture ``[model]`` assigns to that shard and firmware ``profile``."""
    d = cfg.data
    return AgentSpec(client_id=client_id, shard=shard, shards=d.clients, dataset=d.dataset, partition=d.partition,
                     alpha=d.alpha, min_samples=d.min_samples, train_samples=d.train_samples,
                     domain_clients=d.domain_clients, domain_train_cap=d.domain_train_cap,
                     domain_test_cap=d.domain_test_cap, client_test=d.client_test,
                     client_test_fraction=d.client_test_fraction, seed=cfg.run.seed, algorithm=cfg.train.algorithm,
                     algorithm_params=dict(cfg.algorithm), model=cfg.model.architecture(shard, profile),
                     feature_dim=cfg.model.feature_dim, idle_timeout_s=idle_timeout_s, info=dict(info or {}))


def train_config(cfg: Config) -> dict:
    """The [train] settings and the update encoding sent in every ``round_start``."""
    t = cfg.train
    return {"local_epochs": t.local_epochs, "batch_size": t.batch_size, "lr": t.lr, "momentum": t.momentum,
            "weight_decay": t.weight_decay, "update_codec": cfg.protocol.codec_for("update"),
            "extras_codec": cfg.protocol.extras_codec,
            "delta": cfg.protocol.delta, "error_feedback": cfg.protocol.error_feedback}


def channel_options(cfg: Config) -> dict:
    """Keyword arguments of :class:`~protocol.channel.Channel` from [protocol]."""
    return {"qos": cfg.protocol.qos, "chunk_bytes": cfg.protocol.chunk_bytes,
            "max_packet_bytes": cfg.protocol.max_packet_bytes}


#: the keywords the runtime gives every strategy constructor that takes them (from ``[server]``
#: and ``[train]``); ``[algorithm]`` may not set them.
DRIVER_KWARGS = ("participation_rate", "min_clients", "train_config", "resuming")


_SCALAR_TYPES = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}


def param_type_problem(cls: type, key: str, value: object) -> str | None:
    """Why ``value`` cannot be ``[algorithm] key`` of strategy ``cls``, judged by the annotation
    of the constructor parameter ``key`` (the first ``__init__`` along the MRO that names it):
    ``int`` takes an integer, ``float`` a finite number (an integer too), ``bool`` true/false,
    ``str`` a string (a bool is none of the others). Other annotations, and keys no signature
    names (``extra_keys``), are left to the constructor. ``None`` when it fits."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            param = inspect.signature(init).parameters.get(key)
        except (TypeError, ValueError):
            return None
        if param is None or param.kind is param.VAR_KEYWORD:
            continue
        ann = param.annotation
        ann = ann.__name__ if isinstance(ann, type) else str(ann)
        if ann not in _SCALAR_TYPES:
            return None
        ok = (isinstance(value, bool) if ann == "bool" else isinstance(value, str) if ann == "str"
              else not isinstance(value, bool) and (isinstance(value, int) if ann == "int" else
                                                    isinstance(value, (int, float)) and math.isfinite(value)))
        return None if ok else f"{key} = {value!r} must be {_SCALAR_TYPES[ann]}"
    return None


def device_training_pool(cfg: Config, ds: Dataset) -> np.ndarray:
    """The indices into ``ds.train`` that the devices' shards are cut from (int64, sorted): the
    seeded, class-stratified subset of ``[data] train_samples`` that
    :func:`edge_agent.partition.split_dataset` partitions, or every index when it is 0 or not
    below the split's size. What is outside it no device trains on."""
    from edge_agent.data import stratified_subsample

    y = np.asarray(ds.train.y)
    n = cfg.data.train_samples
    if 0 < n < len(y):
        return np.sort(np.asarray(stratified_subsample(y, n, seed=cfg.run.seed), np.int64))
    return np.arange(len(y), dtype=np.int64)


def data_settings(cfg: Config) -> dict[str, object]:
    """The ``[data]`` settings a server-side policy is learnt for (what ``fedfleet feddo pretrain``
    records in its policy and FedDO compares with a deployed run): data set, partition, Dirichlet α
    (only for ``partition = "dirichlet"``: ``None`` otherwise) and client count."""
    return {"dataset": cfg.data.dataset, "partition": cfg.data.partition,
            "alpha": cfg.data.alpha if cfg.data.partition == "dirichlet" else None, "clients": cfg.data.clients}


def algorithm_keys(cls: type[Strategy]) -> set[str]:
    """The ``[algorithm]`` keys strategy class ``cls`` takes: its constructor's named keywords
    and ``extra_keys``, less its ``setup_keys`` (:meth:`~broker_server.strategies.Strategy.setup_kwargs`
    supplies them) and :data:`DRIVER_KWARGS` (the runtime sets them). A constructor with
    ``**kwargs`` may take more (:func:`make_strategy` then passes every key on)."""
    from edge_agent.plugins import accepted_keywords

    names, _ = accepted_keywords(cls)
    return (names | set(cls.extra_keys)) - set(cls.setup_keys) - set(DRIVER_KWARGS)


def make_strategy(cfg: Config, ds: Dataset, *, resuming: bool = False) -> Strategy:
    """The server half of ``[train] algorithm`` built with the ``[algorithm]`` hyperparameters.

    The constructor gets ``participation_rate`` (``[server]``), ``min_clients`` (``[server]
    quorum``) and ``train_config`` (:func:`train_config`) when it takes them, ``resuming`` when
    it names it (the run goes on from its checkpoint, whose ``load_state_dict`` follows: FedDO
    then reads its policy file only where no checkpoint holds the agent), every
    ``[algorithm]`` key, and what the class's ``setup_kwargs`` returns. Its
    :meth:`~broker_server.strategies.Strategy.config_for_round` is then checked for every round
    of the run (:func:`~broker_server.strategies.round_config`).

    Raises:
        ConfigError: unknown algorithm (or a user's that does not fit); an ``[algorithm]`` key
            the constructor does not take, or one its ``setup_kwargs`` supplies (the message names
            it and lists the ``[algorithm]`` keys it takes); a value it refuses; a per-round
            setting no device can use.
    """
    from edge_agent.plugins import accepted_keywords

    from .strategies import round_config

    declared: type[Strategy] = get_strategy_class(cfg.train.algorithm)
    cls: Callable[..., Strategy] = declared  # a Strategy subclass; its constructor takes the keywords below
    where = f"{cfg.source}: [algorithm] for {cfg.train.algorithm!r}"
    names, any_keyword = accepted_keywords(declared)
    own = algorithm_keys(declared)
    params = dict(cfg.algorithm)
    taken = sorted(set(params) & set(DRIVER_KWARGS))
    if taken:
        raise ConfigError(f"{where}: {', '.join(taken)} is set by the runtime ([server] participation_rate and "
                          "quorum, [train], --resume), not in [algorithm]")

    def refuse_supplied(keys: set[str]) -> None:  # set in [algorithm], but setup_kwargs supplies them
        if keys:
            raise ConfigError(f"{where}: {', '.join(sorted(keys))} is supplied by {declared.__qualname__}."
                              "setup_kwargs from the data set and the run, not an [algorithm] key")

    refuse_supplied(set(params) & set(declared.setup_keys))
    unknown = sorted(set(params) - own) if not any_keyword else []
    if unknown:
        hints = "".join(section_hint(key, "algorithm") for key in unknown)
        listed = ", ".join(sorted(own)) if own else "no [algorithm] keys"
        raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
                          f"{declared.__qualname__} takes {listed}{hints}")
    wrong = [problem for k, v in sorted(params.items()) if (problem := param_type_problem(declared, k, v))]
    if wrong:
        raise ConfigError(f"{where}: {'; '.join(wrong)}")
    base_config = train_config(cfg)
    driver = {"participation_rate": cfg.server.participation_rate, "min_clients": cfg.server.quorum,
              "train_config": base_config}
    kwargs = {k: v for k, v in driver.items() if any_keyword or k in names}
    if "resuming" in names:  # named only: a constructor taking **kwargs need not know it
        kwargs["resuming"] = resuming
    try:
        # the data setup reads [algorithm] keys too (FedMCP's proxy_size, proxy_seed)
        setup: dict = {}
        wanted = inspect.signature(declared.setup_kwargs).parameters
        if "device_samples" in wanted:
            setup["device_samples"] = device_training_pool(cfg, ds)
        if "data_settings" in wanted:
            setup["data_settings"] = data_settings(cfg)
        extra = dict(declared.setup_kwargs(ds, params, cfg.run.seed, **setup))
        refuse_supplied(set(extra) & set(params))  # a user's strategy that does not declare its setup_keys
        strategy = cls(**kwargs, **params, **extra)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for r in range(1, cfg.run.rounds + 1):
        try:
            round_config(strategy, r, base_config)
        except ValueError as exc:
            raise ConfigError(f"{cfg.source}: [train] algorithm {cfg.train.algorithm!r}: {exc}") from None
    return strategy


def check_fleet_size(cfg: Config, strategy: Strategy) -> None:
    """Refuse a simulated fleet (``[data] clients`` devices, each on its shard) larger than the
    strategy can serve (:attr:`Strategy.max_devices <broker_server.strategies.Strategy>`): FedDO
    with a pre-trained policy for K devices, where device K+1 would get no slot and never train.
    Called by ``fedfleet simulate`` and ``fedfleet feddo pretrain`` before a broker starts or
    anything is written; a server (``fedfleet server``) meets the same limit when the device
    beyond it joins (its strategy's own error), since its ``[data] clients`` counts shards, not
    the devices that will join.

    Raises:
        ConfigError: ``[data] clients`` above ``strategy.max_devices`` (the message names both
            and what to do).
    """
    cap = strategy.max_devices
    if cap is not None and cfg.data.clients > cap:
        policy = getattr(strategy, "policy_path", "")
        what = f"the policy {policy}" if policy else f"[train] algorithm {cfg.train.algorithm!r}"
        raise ConfigError(
            f"{cfg.source}: {cfg.data.clients} devices ([data] clients, or --clients), but {what} serves at most "
            f"{cap} devices: {cfg.data.clients - cap} of them would never train. Run {cap} devices"
            + (f", or pre-train a policy for {cfg.data.clients} devices (fedfleet feddo pretrain, without "
               "[algorithm] policy)" if policy else ""))


def make_client_algorithm(cfg: Config, ds: Dataset, precision: str = "fp32"):
    """The client half of ``[train] algorithm`` for one device (its data-dependent setup, such
    as a proxy set, from the class's ``setup_kwargs``)."""
    name = cfg.train.algorithm
    setup = algorithm_setup(name, ds, dict(cfg.algorithm), cfg.run.seed)
    return build_client_algorithm(name, precision=precision, setup=setup)


def client_eval_on(cfg: Config) -> bool:
    """Whether the devices evaluate their own models: ``[server] client_eval``, or an algorithm
    that shares less than the whole model (the server switches it on for those)."""
    strategy_cls: type[Strategy] = get_strategy_class(cfg.train.algorithm)
    return cfg.server.client_eval or strategy_cls.share != "all"


def local_eval_split(cfg: Config, ds: Dataset, indices):
    """Under ``[data] client_test = "local"``: device i's evaluation split, ``ds.train`` at its
    held-out indices (``indices``, int64 ``[M]``: :attr:`edge_agent.partition.ClientSplits.test`
    ``[i]``), when client evaluation is on (:func:`client_eval_on`), else ``None``."""
    return ds.train.subset(indices) if client_eval_on(cfg) else None


def client_eval_split(cfg: Config, ds: Dataset):
    """The shared split every virtual device evaluates its own model on when client evaluation
    is on (:func:`client_eval_on`; at most ``client_eval_max`` samples, a seeded choice), else
    ``None``. The split of ``[data] client_test = "shared"``; under ``"local"`` each device has its
    own (:func:`local_eval_split`)."""
    if not client_eval_on(cfg):
        return None
    split = evaluation_split(cfg.train.algorithm, ds, dict(cfg.algorithm), cfg.run.seed)
    cap = cfg.server.client_eval_max
    if cap and len(split.y) > cap:
        import numpy as np

        idx = np.sort(np.random.default_rng(cfg.run.seed).choice(len(split.y), cap, replace=False))
        return type(split)(x=split.x[idx], y=split.y[idx], num_classes=split.num_classes)
    return split


def make_server(cfg: Config, ds: Dataset, url: str, *, federation: str, run_dir: Path, ledger: Ledger,
                expected_clients: int, on_round: Callable[[dict], None] | None = None,
                security: ChannelSecurity | None = None, strategy: Strategy | None = None,
                resuming: bool = False) -> AggregationServer:
    """Connect the server's transport and build the :class:`AggregationServer`.

    Args:
        strategy: the run's strategy when the caller already built it (``simulate`` checks the
            configuration with it first); ``None``: :func:`make_strategy` of ``cfg`` (``resuming``:
            the run goes on from its checkpoint).
        security: the server channel's security state; ``None``: :func:`server_security` of
            ``cfg`` (``None`` again when signing is off).

    Raises:
        ConfigError: unknown algorithm; unusable keys or TLS files.
        ConnectError: the server could not connect to the broker (nothing listening, no answer, a
            refused login or certificate): the message names the broker's URL without its user
            name and password (:func:`protocol.broker_url.public_broker_url`), then the
            transport's reason.
    """
    if strategy is None:
        strategy = make_strategy(cfg, ds, resuming=resuming)
    if security is None:
        security = server_security(cfg)
    # its last will: the retained offline status agents hold their re-sends on (server_will)
    tr = open_transport(mqtt_client_id(federation, SERVER_ID), cfg, url, will=server_will(federation, security))
    try:
        tr.connect()
    except ConnectError as exc:
        raise ConnectError(f"the server could not connect to the broker at {public_broker_url(url)}: {exc}",
                           client_id=exc.client_id, transient=exc.transient, attempts=exc.attempts) from exc
    ch = Channel(tr, node_id=SERVER_ID, side="server", federation=federation, ledger=ledger, **channel_options(cfg),
                 security=security)
    return AggregationServer(
        channel=ch, strategy=strategy, model=server_model(cfg, ds), test=ds.test,
        settings=ServerSettings(rounds=cfg.run.rounds, quorum=cfg.server.quorum,
                                round_deadline_s=cfg.server.round_deadline_s, join_timeout_s=cfg.server.join_timeout_s,
                                expected_clients=expected_clients, seed=cfg.run.seed,
                                eval_batch_size=cfg.server.eval_batch_size, client_eval=cfg.server.client_eval,
                                client_eval_every=cfg.server.client_eval_every, client_test=cfg.data.client_test,
                                global_codec=cfg.protocol.codec_for("global"), extras_codec=cfg.protocol.extras_codec,
                                expected_data=tuple(expected_data(cfg).items()),
                                offline_grace_s=cfg.server.offline_grace_s,
                                global_delivery=cfg.server.global_delivery,
                                global_confirm_s=cfg.server.global_confirm_s,
                                overlap_evaluation=cfg.server.overlap_evaluation,
                                eval_every=cfg.server.eval_every),
        run_dir=run_dir, on_round=on_round, test_domains=getattr(ds, "test_domains", None) or None)
