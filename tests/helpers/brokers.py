"""Broker availability for the tests that need a real one."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from broker_server.embedded_broker import mosquitto_available

#: Broker implementations the integration tests run against.
BROKER_KINDS = ("mosquitto", "amqtt")


def require_mosquitto() -> None:
    """Skip the calling test when no ``mosquitto`` binary is installed; fail it when CI == "true"
    (Mosquitto is required in CI, DESIGN.md §8)."""
    if mosquitto_available():
        return
    reason = "mosquitto binary not found on PATH or in /usr/sbin (apt-get install mosquitto)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; Mosquitto is required when CI=true", pytrace=False)
    pytest.skip(reason=reason)


def password_file(path: Path, user: str, password: str) -> Path:
    """A Mosquitto password file (``password_file`` in mosquitto.conf) holding ``user`` with
    ``password``: made by mosquitto_passwd when installed, else written in its PBKDF2-SHA512 format
    (``user:$7$101$salt$hash``, base64)."""
    tool = shutil.which("mosquitto_passwd")
    if tool:
        subprocess.run([tool, "-c", "-b", str(path), user, password], check=True, capture_output=True)
    else:
        salt = os.urandom(12)
        digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, 101)
        path.write_text(f"{user}:$7$101${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}\n")
    os.chmod(path, 0o600)
    return path
