"""``fedfleet-agent``: one edge agent on a real device.

Example::

    fedfleet-agent --broker mqtt://192.0.2.10:1883 --federation myfed --client-id pi-07 \\
        --dataset mnist --data /data --shard 7/10 --model lightcnn

The agent loads its data set, takes shard ``i`` of ``n`` (the same seeded partition as the
server's configuration), joins the federation and trains whenever it is selected.
With signing: ``--key-dir DIR --server-pubkey server.pub [--encrypt]`` (keys from ``fedfleet keys
gen``; the device must be enrolled with the server). TLS: ``mqtts://`` with ``--ca``, optionally
``--cert``/``--key``; ``--username``/``--password-file``.

The data and algorithm options must be the server's (``fedfleet server`` prints the whole
command): ``--partition domain-silo --domain-clients photo=3,art_painting=4,...`` (with
``--domain-train-cap``/``--domain-test-cap``) for a multi-domain set, ``--train-samples`` for a
data-scarce run, ``--client-test local --client-test-fraction F`` when each device is evaluated on
a test set held out of its own shard (``[data] client_test``), ``--algorithm NAME`` and one
``--param KEY=VALUE`` per ``[algorithm]`` key. The agent announces them in its join and the
server refuses a join whose settings differ, naming them. ``--model NAME|package.module:function``
and ``--feature-dim D`` choose the device's architecture (the one the server's ``[model]`` table
assigns it); the join carries its manifest hash, name, feature width and class count. The agent is put together by
:mod:`edge_agent.assembly`, as every virtual agent of ``fedfleet simulate`` is.

Exit codes (never reused): 0 finished; 1 failed (join refused, the server's model does not fit
this device's algorithm, nothing heard for ``--idle-timeout-s``); 2 bad arguments, or unusable
keys/certificates (said at start-up); 3 data not found; 4 broker unreachable (TLS handshake and
login refusals included), or the link to it failed during the run: a message the run cannot go on
without that the MQTT client did not take (the transport closed, its offline buffer full, a QoS 0
link down), said in one line, ``broker link error: …`` (a join or status whose wait for the
broker's acknowledgement ends is no such failure: it stays queued, and the join counts as not
answered yet); 5 the server never acknowledged the join and nothing was trained (not
enrolled on a signing server, a wrong ``--server-pubkey``, or another federation): after a warning
at 30 s it gives up after ``--join-timeout-s`` (300 s), or when the federation finishes without
it; 130 stopped by Ctrl-C (SIGINT; 128 + 2, as a shell reports it): one line says so and in which
round, the offline status is published if the link takes it (SIGTERM exits 143 the same way,
without the line).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
from pathlib import Path

import numpy as np

from protocol.version import VersionAction

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DATA = 3
EXIT_BROKER = 4
EXIT_NOT_JOINED = 5
#: stopped by Ctrl-C (SIGINT): 128 + SIGINT, as a shell reports it (``fedfleet server``'s too)
EXIT_INTERRUPTED = 130

JOIN_WARN_S = 30.0
"""Seconds after which an unanswered join is warned about (the run goes on until ``--join-timeout-s``)."""

JOIN_TIMEOUT_S = 300.0
"""Default ``--join-timeout-s``: an agent whose join is unanswered this long exits 5."""

CONNECT_ATTEMPTS = 10
"""Default ``--connect-attempts``: connects tried while the broker is unreachable or does not answer."""

CONNECT_BACKOFF_S = (1.0, 30.0)
"""First and largest bound (seconds) of the jittered delay between connect attempts
(:class:`protocol.transport.ConnectRetry`): about 8 minutes of trying in all at the default attempts."""

RECEIPT_TIMEOUT_S = 10.0
"""Default ``--receipt-timeout-s`` (:class:`~edge_agent.agent.EdgeAgent`'s ``receipt_timeout_s``): seconds
after the broker acknowledged an update's last copy before, without a receipt, it is sent again."""

ROUND_START_WAIT_S = 10.0
"""Default ``--round-start-wait-s`` (:class:`~edge_agent.agent.EdgeAgent`'s ``round_start_wait_s``): seconds
holding a round's global without a round_start of that round before asking the server for it (the broker
dropped it); the server's ``[server] global_confirm_s`` default."""

MAX_RESENDS = 3
"""Default ``--max-resends`` (:class:`~edge_agent.agent.EdgeAgent`'s ``max_resends``): re-sends of an update
without a receipt, each after ``--receipt-timeout-s``, only while its round is open."""

NOT_JOINED_HINT = ("the likely causes: this device is not enrolled on a signing server (fedfleet keys enroll), "
                   "--server-pubkey is not that server's key, --federation / --broker name another "
                   "federation (the server prints its own), or that federation has finished or its server "
                   "is not running (a finish is not kept for devices that start later)")


def client_test_fraction(text: str) -> float:
    """``--client-test-fraction``'s value: a number in
    :data:`edge_agent.partition.CLIENT_TEST_FRACTION_RANGE` (the range ``[data]
    client_test_fraction`` allows).

    Raises:
        argparse.ArgumentTypeError: not a number, or outside that range (argparse exits 2 with it).
    """
    from .partition import CLIENT_TEST_FRACTION_RANGE

    lo, hi = CLIENT_TEST_FRACTION_RANGE
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not lo <= value <= hi:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} is outside [{lo:g}, {hi:g}], the range of the server's "
                                         "[data] client_test_fraction")
    return value


def positive_seconds(text: str) -> float:
    """A value of seconds that must be above 0 (``--receipt-timeout-s``).

    Raises:
        argparse.ArgumentTypeError: not a number, or not above 0 (argparse exits 2 with it).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text}: need a positive number of seconds")
    return value


def non_negative_count(text: str) -> int:
    """A whole number that must be 0 or more (``--max-resends``).

    Raises:
        argparse.ArgumentTypeError: not a whole number, or below 0 (argparse exits 2 with it).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: need 0 or more (0: never sent again)")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fedfleet-agent``."""
    from .partition import (
        AGENT_SCHEMES,
        CLIENT_TEST_FRACTION_RANGE,
        DEFAULT_CLIENT_TEST_FRACTION,
        SIMULATION_ONLY_SCHEMES,
    )

    p = argparse.ArgumentParser(prog="fedfleet-agent", description="Run one fedfleet edge agent.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--broker", required=True, help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--federation", required=True, help="federation id printed by `fedfleet server`")
    p.add_argument("--client-id", required=True, help="unique id of this device (A-Za-z0-9_.-, ≤ 64)")
    p.add_argument("--dataset", default="mnist", help="data set name (see edge_agent.data.list_datasets)")
    p.add_argument("--data-dir", "--data", dest="data", help="folder holding the data set files")
    p.add_argument("--shard", default="0/1",
                   help="i/n: take shard i of the n-way partition; n must equal the server's [data] clients")
    p.add_argument("--partition", default="iid", choices=AGENT_SCHEMES,
                   help="must match the server's [data] partition (the server refuses a mismatch); "
                        f"{', '.join(repr(s) for s in SIMULATION_ONLY_SCHEMES)} is simulation-only (its "
                        "classes_per_client is not announced)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet α; must match the server's [data] alpha")
    p.add_argument("--min-samples", type=int, default=10,
                   help="smallest shard; drives Dirichlet's redraws: must match the server's [data] min_samples")
    p.add_argument("--domain-clients", default="", metavar="TEXT",
                   help="domain-silo: clients per domain, e.g. photo=3,art_painting=4,cartoon=2,sketch=1 "
                        "('' = 3/4/2/1 by domain position); must match the server's [data] domain_clients")
    p.add_argument("--domain-train-cap", type=int, default=0, metavar="N",
                   help="multi-domain sets: at most N training samples per domain (0 = all); [data] domain_train_cap")
    p.add_argument("--domain-test-cap", type=int, default=0, metavar="N",
                   help="multi-domain sets: at most N test samples per domain (0 = all); [data] domain_test_cap")
    p.add_argument("--train-samples", type=int, default=0, metavar="N",
                   help="partition a seeded class-stratified subset of N training samples (0 = all); "
                        "[data] train_samples")
    p.add_argument("--client-test", default="shared", choices=("shared", "local"),
                   help="what this device's own-model evaluation uses: the test split ('shared') or a test set "
                        "held out of its own shard, per class ('local'); must match the server's [data] client_test")
    lo, hi = CLIENT_TEST_FRACTION_RANGE
    p.add_argument("--client-test-fraction", type=client_test_fraction, default=DEFAULT_CLIENT_TEST_FRACTION,
                   metavar="F", help=f"with --client-test local: the share of the shard held out ({lo:g} <= F <= "
                                     f"{hi:g}); the server's [data] client_test_fraction")
    p.add_argument("--seed", type=int, default=0, help="partition seed; must match the server's [run] seed")
    p.add_argument("--out", help="folder for this device's byte ledger (ledger.sqlite; read it with "
                                 "`fedfleet audit`) and the state it keeps between rounds "
                                 "(device_state-<federation>.sqlite: a restarted agent carries on from it); "
                                 "default fedfleet-agent-<client-id>")
    p.add_argument("--algorithm", default="fedavg",
                   help="the server's [train] algorithm (the server refuses another one at join)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="one [algorithm] setting of the server's configuration (e.g. proxy_size=1000 for "
                        "fedmcp), repeated for each key: the server refuses a join whose settings differ")
    p.add_argument("--model", default="lightcnn", metavar="NAME|pkg.mod:fn",
                   help="this device's architecture: a zoo name (lightcnn, resnet18, resnet8, mobilenet_v2, "
                        "inception_small) or your own factory package.module:function; the one the server assigned "
                        "to this device (its [model] table; `fedfleet server` prints it)")
    p.add_argument("--feature-dim", type=int, default=64, metavar="D",
                   help="prototype width d of the model (features(x) is [N, d]); the server's [model] feature_dim")
    p.add_argument("--profile", default="x86-cpu",
                   help="firmware profile (fedfleet profiles lists them; a path to a .toml file works too): "
                        "device, precision, threads, batch size, codec and MQTT limits, fitted to this hardware")
    p.add_argument("--torch-threads", type=int, default=0, metavar="N",
                   help="torch intra-op threads for training (default 0: the firmware profile's torch_threads; "
                        "at most the usable cores). Several agents on one machine: 1 each")
    p.add_argument("--onnx-eval", action="store_true",
                   help="at the end, export the local model to ONNX and evaluate it with ONNX Runtime on the "
                        "local data, with the profile's execution providers")
    p.add_argument("--ca", help="CA file of the broker's certificate for mqtts:// (default: the system's CAs)")
    p.add_argument("--cert", help="client certificate (PEM) for brokers that require one (with --key)")
    p.add_argument("--key", help="the client certificate's private key (PEM)")
    p.add_argument("--tls-no-time-check", action="store_true",
                   help="for devices without a real-time clock: do not check certificate validity periods "
                        "(the chain and host name still are)")
    p.add_argument("--clock-skew-s", type=float, default=300.0,
                   help="seconds of clock skew allowed when certificate dates are checked at start-up")
    p.add_argument("--username")
    p.add_argument("--password-file", help="file holding the MQTT password")
    p.add_argument("--key-dir", help="this device's key folder (fedfleet keys gen --out DIR --id CLIENT_ID): "
                                     "signs every message; needs --server-pubkey")
    p.add_argument("--server-pubkey", help="the server's public key file (server.pub), pinned: only messages "
                                           "it signed are accepted")
    p.add_argument("--encrypt", action="store_true",
                   help="encrypt the body of every upload (AES-256-GCM; needs --key-dir)")
    p.add_argument("--keepalive-s", type=int, default=30)
    p.add_argument("--connect-attempts", type=int, default=CONNECT_ATTEMPTS, metavar="N",
                   help="connects tried while the broker is unreachable, does not answer in 30 s or says it is "
                        "busy (a fleet rebooting together, a broker still starting), with a jittered delay growing "
                        f"from {CONNECT_BACKOFF_S[0]:g} s to at most {CONNECT_BACKOFF_S[1]:g} s; each retry is "
                        "logged; a refused login fails at once (exit 4)")
    p.add_argument("--mqtt-version", default="auto", choices=("auto", "5", "3.1.1"),
                   help="MQTT protocol: auto (MQTT 5 where the broker speaks it, else 3.1.1), 5 or 3.1.1; under "
                        "MQTT 5 the profile's max_packet_bytes is advertised to the broker")
    p.add_argument("--idle-timeout-s", type=float, default=3600.0,
                   help="give up when nothing arrives from the server for this many seconds (exit 1; 5 when "
                        "the join was never answered)")
    p.add_argument("--join-timeout-s", type=float, default=JOIN_TIMEOUT_S,
                   help="exit 5 when no join was answered this many seconds after the first (a warning comes "
                        f"after {JOIN_WARN_S:g} s; the agent re-sends its join meanwhile, so a server started "
                        "later still finds it)")
    p.add_argument("--receipt-timeout-s", type=positive_seconds, default=RECEIPT_TIMEOUT_S, metavar="S",
                   help="an update without the server's receipt this many seconds after the broker acknowledged its "
                        "last copy is sent again (> 0)")
    p.add_argument("--max-resends", type=non_negative_count, default=MAX_RESENDS, metavar="N",
                   help="at most this many re-sends of an update without a receipt, only while its round is open "
                        "(>= 0; after the last, it is sent again only when the server starts its round again)")
    p.add_argument("--round-start-wait-s", type=positive_seconds, default=ROUND_START_WAIT_S, metavar="S",
                   help="holding a round's global without its round_start (dropped by the broker) this many "
                        "seconds, ask the server for it (> 0; at most 3 asks a round, after S, 3·S and 7·S)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def agent_spec(args: argparse.Namespace, params: dict[str, object]):
    """The :class:`~edge_agent.assembly.AgentSpec` of parsed ``fedfleet-agent`` arguments (``params``:
    the ``--param`` values, parsed).

    Raises:
        ValueError: a malformed ``--shard``, or ``i`` outside ``0 <= i < n``.
    """
    from .assembly import AgentSpec

    i, n = (int(v) for v in args.shard.split("/"))
    return AgentSpec(client_id=args.client_id, shard=i, shards=n, dataset=args.dataset, partition=args.partition,
                     alpha=args.alpha, min_samples=args.min_samples, train_samples=args.train_samples,
                     domain_clients=args.domain_clients, domain_train_cap=args.domain_train_cap,
                     domain_test_cap=args.domain_test_cap, client_test=args.client_test,
                     client_test_fraction=args.client_test_fraction, seed=args.seed, algorithm=args.algorithm,
                     algorithm_params=params, model=args.model, feature_dim=args.feature_dim,
                     idle_timeout_s=args.idle_timeout_s)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fedfleet-agent``; returns the exit code. Standard output is guarded
    (:func:`protocol.lifecycle.guard_stdout`): a reader that goes away (``| head -1``) ends the
    output, not the run."""
    from protocol.lifecycle import guard_stdout

    with guard_stdout("fedfleet-agent"):
        try:
            return _main(argv)
        except KeyboardInterrupt:  # Ctrl-C before the run (data, connect) or while it ends
            print(interrupted_line(None), file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED


def interrupted_line(agent) -> str:
    """The one line ``fedfleet-agent`` ends with when Ctrl-C stops it: where the run was, from
    ``agent`` (an :class:`~edge_agent.agent.EdgeAgent`; ``None``: stopped before it joined):
    whether its join was answered, the newest round it took up (:meth:`~edge_agent.agent.EdgeAgent.holdings`'
    start round) and whether that round's update awaits its receipt, the rounds trained and the
    updates acknowledged."""
    if agent is None:
        return "fedfleet-agent: stopped by Ctrl-C before it joined"
    _, started, awaiting = agent.holdings()
    if not agent.joined:
        where = "before the server answered its join"
    elif started == 0:
        where = "before its first round"
    else:
        where = f"in round {started}" + (" (its update awaits its receipt)" if awaiting == started else "")
    trained, acked = agent.rounds_trained, agent.receipts_accepted
    return (f"fedfleet-agent: {agent.client_id} stopped by Ctrl-C {where}; "
            f"{trained} round{'s' if trained != 1 else ''} trained, "
            f"{acked} update{'s' if acked != 1 else ''} acknowledged")


def _main(argv: list[str] | None) -> int:
    """:func:`main` inside its stdout guard."""
    from protocol.broker_url import parse_broker_url, public_broker_url
    from protocol.channel import Channel
    from protocol.errors import ConnectError, FieldError, TransportError
    from protocol.ledger import Ledger
    from protocol.messages import valid_id
    from protocol.topics import check_device_id, mqtt_client_id
    from protocol.transport import ConnectRetry, MqttTransport

    from .agent import param_value
    from .assembly import build_agent, channel_limits, offline_will, prepare_agent
    from .device import apply, apply_threads, detect, plan_threads, usable_cores
    from .errors import DataError, EdgeAgentError
    from .optional_runtime import unavailable
    from .profiles import ProfileError, get_profile, load_profile
    from .runtime import agent_runtime
    from .state_store import DeviceStateStore, StateStoreError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if not args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from protocol.lifecycle import install_signal_handlers
    install_signal_handlers()  # SIGTERM/SIGINT: ledger committed, channel and ledger closed in order
    try:
        if not valid_id(args.client_id) or not valid_id(args.federation):
            raise ValueError("--client-id and --federation must be 1-64 chars of A-Za-z0-9_.-")
        check_device_id(args.client_id)
        i, n = (int(v) for v in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError(f"--shard {args.shard}: need 0 ≤ i < n")
        if args.feature_dim < 1:
            raise ValueError(f"--feature-dim {args.feature_dim}: need d >= 1")
        if not args.join_timeout_s > 0:
            raise ValueError(f"--join-timeout-s {args.join_timeout_s:g}: need a positive number of seconds")
        addr = parse_broker_url(args.broker)
        password = Path(args.password_file).read_text().strip() if args.password_file else addr.password
    except (ValueError, OSError, FieldError) as exc:
        print(f"fedfleet-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from protocol.errors import SecurityConfigError
    from protocol.messages import SERVER_ID
    from protocol.security import ChannelSecurity, load_identity, load_public
    from protocol.transport import tls_context

    security = None
    try:  # keys and certificates are checked now: a wrong file stops the agent here, not mid-round
        if (args.ca or args.cert) and not addr.tls:
            raise SecurityConfigError("--ca/--cert are for TLS but --broker is mqtt://: use mqtts://")
        if addr.tls:
            tls_context(ca_file=args.ca, cert_file=args.cert, key_file=args.key,
                        check_time=not args.tls_no_time_check, clock_skew_s=args.clock_skew_s)
        if args.key_dir or args.server_pubkey or args.encrypt:
            if not args.key_dir:
                raise SecurityConfigError("--server-pubkey/--encrypt need --key-dir (fedfleet keys gen --out DIR "
                                          f"--id {args.client_id})")
            if not args.server_pubkey:
                raise SecurityConfigError("the server's public key is not pinned: pass --server-pubkey FILE (the "
                                          "server.pub of the server's key folder)")
            server_pub = load_public(args.server_pubkey)
            if server_pub.id != SERVER_ID:
                raise SecurityConfigError(f"{args.server_pubkey} holds the key of {server_pub.id!r}, not the "
                                          f"server's", path=args.server_pubkey)
            security = ChannelSecurity(load_identity(args.key_dir, expected_id=args.client_id), side="agent",
                                       peers={SERVER_ID: server_pub}, encrypt=args.encrypt)
    except SecurityConfigError as exc:
        print(f"fedfleet-agent: security configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        prof = load_profile(args.profile) if args.profile.endswith(".toml") else get_profile(args.profile)
        if args.torch_threads < 0:
            raise ProfileError(f"--torch-threads must be >= 0 (0: the profile's), got {args.torch_threads}")
        if args.torch_threads:
            prof = dataclasses.replace(prof, torch_threads=args.torch_threads)
        hw = detect()
        rt = agent_runtime(prof, info=hw)
    except ProfileError as exc:
        print(f"fedfleet-agent: profile error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    apply(rt.plan, log_fallbacks=False)  # printed here, once
    for reason in rt.plan.fallbacks:
        print(f"fallback: {reason}", flush=True)
    # a real device: --torch-threads, else the profile's torch_threads (capped at the usable cores);
    # the start-up line names which of the two it was
    threads = apply_threads(plan_threads(usable_cores(hw), role="device", profile_threads=rt.plan.torch_threads,
                                         torch_threads=max(args.torch_threads, 0)))
    print(threads.describe(), flush=True)
    params: dict[str, object] = {}
    for item in args.param:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            print(f"fedfleet-agent: --param {item!r}: expected KEY=VALUE", file=sys.stderr)
            return EXIT_USAGE
        params[key.strip()] = param_value(value.strip())
    spec = agent_spec(args, params)
    try:
        ds = spec.load_dataset(args.data)
        prepared = prepare_agent(spec, ds, precision=rt.plan.precision)
    except DataError as exc:
        print(f"fedfleet-agent: data error: {exc}", file=sys.stderr)
        return EXIT_DATA
    except (EdgeAgentError, TypeError, ValueError) as exc:  # a partition, model, algorithm or --param refused
        print(f"fedfleet-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    info, idx, model = prepared.info, prepared.indices, prepared.model
    tr = MqttTransport(mqtt_client_id(args.federation, args.client_id), addr.host, addr.port,
                       username=args.username or addr.username,
                       password=password, tls=addr.tls, tls_ca=args.ca, tls_cert=args.cert, tls_key=args.key,
                       tls_check_time=not args.tls_no_time_check, clock_skew_s=args.clock_skew_s,
                       keepalive_s=args.keepalive_s, will=offline_will(args.federation, args.client_id, security),
                       mqtt_version=args.mqtt_version, receive_max_packet_bytes=rt.max_packet_bytes)
    if args.connect_attempts < 1:
        print(f"fedfleet-agent: --connect-attempts must be >= 1, got {args.connect_attempts}", file=sys.stderr)
        return EXIT_USAGE
    try:
        tr.connect(retry=ConnectRetry(attempts=args.connect_attempts, base_s=CONNECT_BACKOFF_S[0],
                                      cap_s=CONNECT_BACKOFF_S[1]),
                   on_retry=lambda n, exc, delay: print(f"broker not ready (attempt {n}/{args.connect_attempts}): "
                                                        f"{exc}; trying again in {delay:.1f} s", flush=True))
    except ConnectError as exc:
        print(f"fedfleet-agent: broker error: {exc}", file=sys.stderr)
        return EXIT_BROKER
    out = Path(args.out or f"fedfleet-agent-{args.client_id}")
    out.mkdir(parents=True, exist_ok=True)
    try:  # what the device keeps between rounds (SCAFFOLD's c_i, a personal head …) survives a restart
        state = DeviceStateStore(out / f"device_state-{args.federation}.sqlite")
    except StateStoreError as exc:
        print(f"fedfleet-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    ledger = Ledger(out / "ledger.sqlite")
    ledger.set_meta("federation", args.federation)
    ch = Channel(tr, node_id=args.client_id, side="agent", federation=args.federation, ledger=ledger,
                 security=security, **channel_limits(rt))
    held = len(prepared.eval_split.y) if spec.client_test == "local" and prepared.eval_split is not None else 0
    print(f"{args.client_id}: {len(idx)} samples (shard {i}/{n} of {ds.name}"
          + (f", domain {info['domain']}" if "domain" in info else "")
          + (f"; {held} more held out as its local test set" if held else "")
          + f"), model {args.model} (d = {args.feature_dim}), algorithm {args.algorithm}; joining federation "
          f"{args.federation!r} on {public_broker_url(addr)} (idle timeout {args.idle_timeout_s:g} s)", flush=True)
    agent = None
    warn = None
    try:
        agent = build_agent(prepared, ch, runtime=rt, device=rt.plan.device, state_store=state,
                            receipt_timeout_s=args.receipt_timeout_s, max_resends=args.max_resends,
                            round_start_wait_s=args.round_start_wait_s,
                            on_trained=lambda rnd, res, nbytes: print(
                                f"round {rnd}: trained {res.num_samples} samples in "
                                f"{res.metrics.get('train_seconds', 0):.1f} s, loss {res.train_loss:.4f}, "
                                f"sent {nbytes:,} bytes", flush=True))
        agent.join_timeout_s = args.join_timeout_s
        if agent.restored_round is not None:
            print(f"{args.client_id}: carries on from the state it kept after round {agent.restored_round} "
                  f"({state.path})", flush=True)
        elif agent.state_store is not None:
            print(f"{args.client_id}: no state kept for federation {args.federation} in {out}: starts from its "
                  "initial state (an agent restarted with another --out loses what it kept)", flush=True)
        warn = threading.Timer(min(JOIN_WARN_S, args.join_timeout_s / 2), _warn_unanswered, args=(agent,))
        warn.daemon = True
        warn.start()
        summary = agent.run()
    except (EdgeAgentError, FieldError) as exc:
        print(f"fedfleet-agent: {exc}", file=sys.stderr)
        if agent is not None and not agent.joined and agent.join_refused is None:
            print(f"fedfleet-agent: the server never acknowledged the join; {NOT_JOINED_HINT}", file=sys.stderr)
            return EXIT_NOT_JOINED if agent.rounds_trained == 0 else EXIT_FAILED
        return EXIT_FAILED
    except TransportError as exc:  # the link failed under a message the run cannot go on without
        print(f"fedfleet-agent: broker link error: {exc}", file=sys.stderr)
        if agent is not None:  # said offline if the link still takes it (a clean close fires no last will)
            agent.leave(f"broker link error: {exc}")
        return EXIT_BROKER
    except KeyboardInterrupt:  # Ctrl-C, SIGINT (protocol.lifecycle): a clean DISCONNECT fires no last
        if agent is not None:   # will, so say offline before it (as a run's end does)
            agent.leave("stopped by a signal")
        print(interrupted_line(agent), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except SystemExit:  # SIGTERM (exit 143), the same way, without the line
        if agent is not None:
            agent.leave("stopped by a signal")
        raise
    finally:
        if warn is not None:
            warn.cancel()
        ch.close()
        ledger.close()
        state.close()
    if args.onnx_eval and (why := unavailable("onnx", "onnxruntime")):  # probed in a child: cannot crash us
        print(f"onnx: --onnx-eval skipped: {why}", file=sys.stderr)
    elif args.onnx_eval:
        from .onnx_runtime import OnnxModel, export_onnx

        model.to("cpu")
        path = export_onnx(model, out / "model.onnx", input_shape=tuple(ds.train.x.shape[1:]))
        om = OnnxModel(path, providers=rt.plan.onnx_providers or ("CPUExecutionProvider",))
        acc, _ = om.evaluate(np.asarray(ds.train.x[idx], np.float32), np.asarray(ds.train.y[idx]))
        print(f"onnx: local accuracy {acc:.4f} on {len(idx)} samples via {', '.join(om.providers_used)}"
              + (f" (fallbacks: {'; '.join(om.fallbacks)})" if om.fallbacks else ""))
    if not agent.joined:  # e.g. the federation finished without it: not a run this device took part in
        print(f"fedfleet-agent: the server never acknowledged the join of {args.client_id} "
              f"(trained {summary.rounds_trained} rounds{'; the federation finished' if summary.finished else ''}); "
              f"{NOT_JOINED_HINT}", file=sys.stderr)
        if summary.rounds_trained == 0:
            return EXIT_NOT_JOINED
    print(f"{summary.client_id}: trained {summary.rounds_trained} round{'s' if summary.rounds_trained != 1 else ''}, "
          f"{summary.receipts_accepted} updates acknowledged, finished={summary.finished}; "
          f"byte ledger in {out}/ledger.sqlite (fedfleet audit {out})")
    return EXIT_OK


def _warn_unanswered(agent) -> None:
    """Timer callback: warn (once, the run goes on) when the join is still unanswered."""
    if not agent.joined and agent.join_refused is None:
        print(f"fedfleet-agent: warning: no answer to the join of {agent.client_id} yet (still waiting, "
              f"until --join-timeout-s {agent.join_timeout_s:g} s); {NOT_JOINED_HINT}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

