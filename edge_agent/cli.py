"""``fedfleet-agent``: one edge agent on a real device.

Example::

    fedfleet-agent --broker mqtt://192.0.2.10:1883 --federation myfed --client-id pi-07 \\
        --dataset mnist --data /data --shard 7/10

The agent loads its data set, takes shard ``i`` of ``n`` (the same seeded partition as the
server's configuration), joins the federation and trains whenever it is selected.
With signing: ``--key-dir DIR --server-pubkey server.pub [--encrypt]`` (keys from ``fedfleet keys
gen``; the device must be enrolled with the server). TLS: ``mqtts://`` with ``--ca``, optionally
``--cert``/``--key``; ``--username``/``--password-file``.

Exit codes: 0 finished; 1 failed; 2 bad arguments, or unusable keys/certificates (said at
start-up); 3 data not found; 4 broker unreachable (TLS handshake and login refusals included).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import torch


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fedfleet-agent``."""
    p = argparse.ArgumentParser(prog="fedfleet-agent", description="Run one fedfleet edge agent.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--broker", required=True, help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--federation", required=True, help="federation id printed by `fedfleet server`")
    p.add_argument("--client-id", required=True, help="unique id of this device (A-Za-z0-9_.-, ≤ 64)")
    p.add_argument("--dataset", default="mnist", help="data set name (see edge_agent.data.list_datasets)")
    p.add_argument("--data-dir", "--data", dest="data", help="folder holding the data set files")
    p.add_argument("--shard", default="0/1",
                   help="i/n: take shard i of the n-way partition; n must equal the server's [data] clients")
    p.add_argument("--partition", default="iid", choices=["iid", "dirichlet"],
                   help="must match the server's [data] partition (the server refuses a mismatch)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet α; must match the server's [data] alpha")
    p.add_argument("--seed", type=int, default=0, help="partition seed; must match the server's [run] seed")
    p.add_argument("--out", help="folder for this device's byte ledger (ledger.sqlite; read it with "
                                 "`fedfleet audit`); default fedfleet-agent-<client-id>")
    p.add_argument("--algorithm", default="fedavg")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="an [algorithm] setting that shapes this device's data (e.g. proxy_size=1000 for "
                        "fedmcp); must match the server's configuration; repeatable")
    p.add_argument("--profile", default="x86-cpu",
                   help="firmware profile (fedfleet profiles lists them; a path to a .toml file works too): "
                        "device, precision, threads, batch size, codec and MQTT limits, fitted to this hardware")
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
    p.add_argument("--idle-timeout-s", type=float, default=3600.0)
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fedfleet-agent``; returns the exit code."""
    from broker_server.embedded_broker import parse_broker_url  # URL parsing only
    from protocol import topics
    from protocol.channel import Channel
    from protocol.errors import ConnectError, FieldError
    from protocol.messages import Envelope, Status, encode, valid_id
    from protocol.transport import MqttTransport, Will

    from protocol.ledger import Ledger

    from .agent import EdgeAgent, data_announcement
    from .algorithms import TrainConfig, algorithm_setup, evaluation_split, get_client_algorithm
    from .data import load_dataset
    from .errors import DataError, EdgeAgentError
    from .device import apply
    from .models import build_model
    from .partition import partition
    from .profiles import ProfileError, get_profile, load_profile
    from .runtime import agent_runtime

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if not args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if not valid_id(args.client_id) or not valid_id(args.federation):
            raise ValueError("--client-id and --federation must be 1-64 chars of A-Za-z0-9_.-")
        i, n = (int(v) for v in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError(f"--shard {args.shard}: need 0 ≤ i < n")
        addr = parse_broker_url(args.broker)
        password = Path(args.password_file).read_text().strip() if args.password_file else addr.password
    except (ValueError, OSError) as exc:
        print(f"fedfleet-agent: {exc}", file=sys.stderr)
        return 2
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
        return 2
    try:
        prof = load_profile(args.profile) if args.profile.endswith(".toml") else get_profile(args.profile)
        rt = agent_runtime(prof)
    except ProfileError as exc:
        print(f"fedfleet-agent: profile error: {exc}", file=sys.stderr)
        return 2
    apply(rt.plan)
    for reason in rt.plan.fallbacks:
        print(f"fallback: {reason}", flush=True)
    try:
        ds = load_dataset(args.dataset, data_dir=args.data)
        parts = partition(ds.train.y, n, scheme=args.partition, seed=args.seed,
                          alpha=args.alpha if args.partition == "dirichlet" else None)
        idx = parts[i]
    except DataError as exc:
        print(f"fedfleet-agent: data error: {exc}", file=sys.stderr)
        return 3
    except EdgeAgentError as exc:
        print(f"fedfleet-agent: {exc}", file=sys.stderr)
        return 2
    will_topic = topics.status(args.federation, args.client_id)
    will_payload = encode(Envelope(round=0, sender=args.client_id, seq=0, body=Status("offline", "connection lost"))).payload
    if security is not None:
        will_payload = security.seal(will_topic, will_payload).payload
    will = Will(will_topic, will_payload)
    tr = MqttTransport(args.client_id, addr.host, addr.port, username=args.username or addr.username,
                       password=password, tls=addr.tls, tls_ca=args.ca, tls_cert=args.cert, tls_key=args.key,
                       tls_check_time=not args.tls_no_time_check, clock_skew_s=args.clock_skew_s,
                       keepalive_s=args.keepalive_s, will=will)
    try:
        tr.connect()
    except ConnectError as exc:
        print(f"fedfleet-agent: broker error: {exc}", file=sys.stderr)
        return 4
    torch.manual_seed(args.seed + 1 + i)
    model = build_model("lightcnn", in_channels=ds.channels, image_size=ds.image_size, num_classes=ds.num_classes)
    out = Path(args.out or f"fedfleet-agent-{args.client_id}")
    out.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(out / "ledger.sqlite")
    ledger.set_meta("federation", args.federation)
    ch = Channel(tr, node_id=args.client_id, side="agent", federation=args.federation, ledger=ledger,
                 chunk_bytes=rt.chunk_bytes, max_packet_bytes=rt.max_packet_bytes, security=security)
    info = data_announcement(dataset=args.dataset, partition=args.partition, alpha=args.alpha, seed=args.seed,
                             shards=n)
    print(f"{args.client_id}: {len(idx)} samples (shard {i}/{n} of {ds.name}); joining federation "
          f"{args.federation!r} on {args.broker} (idle timeout {args.idle_timeout_s:g} s)", flush=True)
    params = {}
    for item in args.param:
        key, eq, value = item.partition("=")
        if not eq or not key:
            print(f"error: --param {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        params[key.strip()] = _scalar(value.strip())
    try:
        setup = algorithm_setup(args.algorithm, ds, params, args.seed)
        evals = evaluation_split(args.algorithm, ds, params, args.seed)
        agent = EdgeAgent(channel=ch, model=model,
                          algorithm=get_client_algorithm(args.algorithm, precision=rt.plan.precision, **setup),
                          eval_x=evals.x, eval_y=evals.y,
                          x=ds.train.x[idx], y=ds.train.y[idx], num_classes=ds.num_classes,
                          train_defaults=TrainConfig(seed=args.seed, batch_size=rt.plan.batch_size), client_index=i,
                          profile=prof.name, device=rt.plan.device, runtime=rt,
                          idle_timeout_s=args.idle_timeout_s, info=info,
                          on_trained=lambda rnd, res, nbytes: print(
                              f"round {rnd}: trained {res.num_samples} samples in "
                              f"{res.metrics.get('train_seconds', 0):.1f} s, loss {res.train_loss:.4f}, "
                              f"sent {nbytes:,} bytes", flush=True))
        summary = agent.run()
    except (EdgeAgentError, FieldError) as exc:
        print(f"fedfleet-agent: {exc}", file=sys.stderr)
        return 1
    finally:
        ch.close()
        ledger.close()
    if args.onnx_eval:
        from .onnx_runtime import OnnxModel, export_onnx

        model.to("cpu")
        path = export_onnx(model, out / "model.onnx", input_shape=tuple(ds.train.x.shape[1:]))
        om = OnnxModel(path, providers=rt.plan.onnx_providers or ("CPUExecutionProvider",))
        acc, _ = om.evaluate(np.asarray(ds.train.x[idx], np.float32), np.asarray(ds.train.y[idx]))
        print(f"onnx: local accuracy {acc:.4f} on {len(idx)} samples via {', '.join(om.providers_used)}"
              + (f" (fallbacks: {'; '.join(om.fallbacks)})" if om.fallbacks else ""))
    print(f"{summary.client_id}: trained {summary.rounds_trained} rounds, "
          f"{summary.receipts_accepted} updates acknowledged, finished={summary.finished}; "
          f"byte ledger in {out}/ledger.sqlite (fedfleet audit {out})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def _scalar(text: str) -> bool | int | float | str:
    """``true``/``false``, an int, a float, or the text itself (for ``--param`` values)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
