"""``fedfleet keys``: generate key folders, enrol devices with a server, revoke them, show keys.

::

    fedfleet keys gen --out keys/server                    # the server's keys (id "server")
    fedfleet keys gen --out /etc/fedfleet/keys --id pi-07  # on (or for) a device
    fedfleet keys enroll pi-07.pub --server-dir keys/server
    fedfleet keys revoke pi-07 --server-dir keys/server
    fedfleet keys list --server-dir keys/server
    fedfleet keys show keys/server/server.pub

A device pins the server's public key (``fedfleet-agent --key-dir DIR --server-pubkey
server.pub``); the server runs with ``[security] sign = true`` and ``key_dir`` = its folder.
Private keys are written with mode 0600 and are never printed; what is printed is each key's
fingerprint (the first 16 bytes of SHA-256 of the public keys). Exit codes as ``fedfleet``:
0 done, 2 bad usage or unusable key files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from protocol.errors import SecurityConfigError
from protocol.messages import SERVER_ID
from protocol.security import (
    enroll,
    generate_identity,
    list_enrolled,
    load_identity,
    load_public,
    revoke,
    write_key_dir,
)

from .errors import ConfigError

__all__ = ["add_keys_arguments", "run_keys"]

DEFAULT_SERVER_DIR = "keys/server"


def add_keys_arguments(p: argparse.ArgumentParser) -> None:
    """The sub-commands of ``fedfleet keys``."""
    sub = p.add_subparsers(dest="keys_command", required=True)
    g = sub.add_parser("gen", help="generate an Ed25519 signing key and an X25519 key into a folder (0600)")
    g.add_argument("--out", required=True, metavar="DIR", help="the key folder to create")
    g.add_argument("--id", default=SERVER_ID,
                   help="the node id: the device's --client-id, or 'server' (default) for the server")
    g.add_argument("--force", action="store_true", help="replace keys already in DIR (re-enrol afterwards)")
    e = sub.add_parser("enroll", help="add a device's public key (<id>.pub) to the server's allow-list")
    e.add_argument("pubkey", metavar="DEVICE_PUBKEY", help="the device's <id>.pub file")
    e.add_argument("--server-dir", default=DEFAULT_SERVER_DIR, metavar="DIR",
                   help="the server's key folder ([security] key_dir)")
    e.add_argument("--replace", action="store_true", help="replace another key enrolled under the same id")
    r = sub.add_parser("revoke", help="remove a device from the server's allow-list")
    r.add_argument("device_id", metavar="ID")
    r.add_argument("--server-dir", default=DEFAULT_SERVER_DIR, metavar="DIR")
    ls = sub.add_parser("list", help="the enrolled devices with their fingerprints")
    ls.add_argument("--server-dir", default=DEFAULT_SERVER_DIR, metavar="DIR")
    s = sub.add_parser("show", help="id and fingerprint of a key folder or a .pub file")
    s.add_argument("path", metavar="DIR_OR_PUB")


def run_keys(args: argparse.Namespace) -> int:
    """Run one ``fedfleet keys`` sub-command; returns the exit code.

    Raises:
        ConfigError: unusable key files, keys that exist already, an enrolment conflict.
    """
    try:
        return _run(args)
    except SecurityConfigError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:  # a bad --id
        raise ConfigError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    cmd = args.keys_command
    if cmd == "gen":
        ident = generate_identity(args.id)
        pub_file = write_key_dir(ident, args.out, force=args.force)
        print(f"keys of {ident.id!r} in {args.out} (private keys mode 0600: keep them there)")
        print(f"public key: {pub_file}  fingerprint {ident.public.fingerprint}")
        if ident.id == SERVER_ID:
            print(f"next: enrol each device with `fedfleet keys enroll DEVICE.pub --server-dir {args.out}`; copy "
                  f"{pub_file} to the devices (fedfleet-agent --server-pubkey)")
        else:
            print(f"next: on the server, `fedfleet keys enroll {pub_file.name} --server-dir DIR`")
        return 0
    if cmd == "enroll":
        if not Path(args.server_dir).is_dir():
            raise ConfigError(f"server key folder {args.server_dir} does not exist (fedfleet keys gen --out DIR)")
        pub, path = enroll(args.server_dir, args.pubkey, replace=args.replace)
        print(f"enrolled {pub.id!r} (fingerprint {pub.fingerprint}) in {path}")
        return 0
    if cmd == "revoke":
        if revoke(args.server_dir, args.device_id):
            print(f"revoked {args.device_id!r}: a running server refuses it from now on")
            return 0
        print(f"fedfleet: {args.device_id!r} is not enrolled in {args.server_dir}", file=sys.stderr)
        return 2
    if cmd == "list":
        if not Path(args.server_dir).is_dir():
            print(f"fedfleet: server key folder {args.server_dir} does not exist (fedfleet keys gen --out DIR; "
                  "--server-dir DIR names another)", file=sys.stderr)
            return 2
        enrolled = list_enrolled(args.server_dir)
        for pub in enrolled:
            print(f"{pub.id}  {pub.fingerprint}")
        if not enrolled:
            print(f"fedfleet: no device is enrolled in {args.server_dir} (fedfleet keys enroll DEVICE.pub "
                  f"--server-dir {args.server_dir})", file=sys.stderr)
        return 0
    p = Path(args.path)
    pub = load_identity(p).public if p.is_dir() else load_public(p)
    print(f"{pub.id}  {pub.fingerprint}")
    return 0
