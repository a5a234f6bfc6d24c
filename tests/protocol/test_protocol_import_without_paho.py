"""``protocol`` is a codec that needs neither paho-mqtt nor torch.

Each check runs in a fresh interpreter (a subprocess) in which the forbidden package cannot be
imported, the way it would be on a device that lacks it: either a meta-path finder that refuses
it (as if it were not installed) or ``sys.modules[name] = None`` (Python's own way of blocking an
import). The expected bytes are the spec's hex test vectors (``protocol/PROTOCOL.md`` §10, kept
in :mod:`protocol.test_vectors` and checked against the spec by ``test_protocol_spec.py``); the
expected decoded values are the record the vector was written from, restated here by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Makes ``import <blocked>`` fail in the child, before any other import. ``{names}`` and
#: ``{how}`` are filled in per case.
_BLOCK = """
import importlib.abc, sys
BLOCKED = {names!r}
class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test)", name=name)
        return None
def _loaded(top):  # modules of package `top` really imported (a None entry is the block itself)
    return sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == top)
if {how!r} == "finder":
    sys.meta_path.insert(0, _Refuse())
else:
    for n in BLOCKED:
        sys.modules[n] = None
"""

_CODEC_WITHOUT_PAHO = """
import json
import numpy as np
import protocol, protocol.messages, protocol.tensors, protocol.chunking, protocol.ledger, protocol.channel
import protocol.security
from protocol.messages import Envelope, Update, decode, encode
from protocol.tensors import Codec
from protocol.test_vectors import MESSAGE_VECTORS, SECURITY_VECTORS
out = {"protocol_file": protocol.__file__}

# the spec's "update" vector: round 3, client-007, seq 4, one float32 tensor, 600 samples
x = [[0.5, -1.25, 3.0], [0.0, 2.0, -0.125]]
env = Envelope(round=3, sender="client-007", seq=4, timestamp_ms=1764420000000,
               body=Update((np.array(x, np.float32),), 600, 0.25, {"train_seconds": 1.5}))
payload = encode(env).payload
out["update_hex"] = payload.hex()
d = decode(payload).envelope
out["decoded"] = [d.kind.label, d.round, d.sender, d.seq, d.body.num_samples, d.body.train_loss,
                  dict(d.body.metrics), [t.tolist() for t in d.body.tensors], [str(t.dtype) for t in d.body.tensors]]
# fp16: every value of x is a binary16 number, so the round trip is exact
d16 = decode(encode(env, Codec.parse("fp16")).payload).envelope
out["fp16"] = [t.tolist() for t in d16.body.tensors]

# sealing works too: Ed25519 is deterministic (RFC 8032), so the signed vector is reproduced
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
sealed = protocol.security.seal(payload, "fedfleet/v1/fed-1/up/client-007/update",
                                signing_key=Ed25519PrivateKey.from_private_bytes(bytes(range(32))), epoch=2)
out["sealed_hex"] = sealed.payload.hex()

# a channel over a transport that is a list: what the agent publishes, the server accepts
from protocol import topics
from protocol.channel import Channel, Received
from protocol.messages import Kind
from protocol.transport_base import Incoming
class ListTransport:
    client_id = "t"
    def __init__(self): self.sent = []
    def subscribe(self, filters, qos=1): pass
    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None): self.sent.append((topic, payload))
    def get(self, timeout_s): return None
    def close(self): pass
t = ListTransport()
agent = Channel(t, node_id="client-007", side="agent", federation="fed-1", ledger=None)
server = Channel(ListTransport(), node_id="server", side="server", federation="fed-1", ledger=None)
agent.send(topics.up("fed-1", "client-007", Kind.UPDATE), env.body, round=3)
(topic, wire), = t.sent
got = server.accept(Incoming(topic, wire, 1, False, 0.0))
out["channel"] = [type(got).__name__, topic, got.envelope.body.num_samples,
                  [a.tolist() for a in got.envelope.body.tensors]]

out["paho_loaded"] = _loaded("paho")
errors = []
for attempt in ("protocol.MqttTransport", "from protocol.transport import MqttTransport", "protocol.transport"):
    try:
        exec(attempt if attempt.startswith("from") else f"_ = {attempt}")
        errors.append([attempt, None, ""])
    except ImportError as exc:
        errors.append([attempt, type(exc).__name__, str(exc)])
out["mqtt_errors"] = errors
out["paho_loaded_after"] = _loaded("paho")
print(json.dumps(out))
"""

_EVERY_MODULE = """
import json, pkgutil, importlib
import protocol
names = sorted(m.name for m in pkgutil.walk_packages(protocol.__path__, "protocol."))
for n in names:
    importlib.import_module(n)
print(json.dumps({"modules": names, "torch_loaded": _loaded("torch"),
                  "protocol_file": protocol.__file__}))
"""


def _run(blocked: list[str], how: str, body: str) -> dict:
    code = _BLOCK.format(names=blocked, how=how) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(out["protocol_file"]).resolve().parent == ROOT / "protocol"  # this checkout's protocol
    return out


@pytest.mark.parametrize("how", ["finder", "sys.modules"])
def test_the_codec_the_security_and_the_channel_work_without_paho(how: str) -> None:
    from protocol.test_vectors import MESSAGE_VECTORS, SECURITY_VECTORS

    out = _run(["paho"], how, _CODEC_WITHOUT_PAHO)
    x = [[0.5, -1.25, 3.0], [0.0, 2.0, -0.125]]
    assert out["update_hex"] == MESSAGE_VECTORS["update"][1]
    assert out["decoded"] == ["update", 3, "client-007", 4, 600, 0.25, {"train_seconds": 1.5}, [x], ["float32"]]
    assert out["fp16"] == [x]
    assert out["sealed_hex"] == SECURITY_VECTORS["update-signed"][4]
    assert out["channel"] == ["Received", "fedfleet/v1/fed-1/up/client-007/update", 600, [x]]
    assert out["paho_loaded"] == [] and out["paho_loaded_after"] == []
    for attempt, error, message in out["mqtt_errors"]:
        assert error is not None, f"{attempt} did not raise without paho"
        assert "paho-mqtt" in message and "pip install" in message, (attempt, message)


@pytest.mark.parametrize("how", ["finder", "sys.modules"])
def test_no_protocol_module_imports_torch(how: str) -> None:
    out = _run(["torch"], how, _EVERY_MODULE)
    assert out["torch_loaded"] == []
    # the walk reached the leaves, the transport (with paho) and the security package included
    assert {"protocol.messages", "protocol.transport", "protocol.transport_base",
            "protocol.security.sealing", "protocol.security.replay"} <= set(out["modules"])


_MEMORY_BROKER_WITHOUT_PAHO = """
import json, pkgutil, importlib
import numpy as np
import protocol
from protocol import topics
from protocol.channel import Channel, Received
from protocol.memory_transport import MemoryBroker
from protocol.messages import Kind, Update
failed = []
for m in pkgutil.walk_packages(protocol.__path__, "protocol."):
    if m.name != "protocol.transport":  # the MQTT client itself: needs paho by design
        try:
            importlib.import_module(m.name)
        except ImportError as exc:
            failed.append([m.name, str(exc)[:120]])
hub = MemoryBroker()
server = Channel(hub.connect("server"), node_id="server", side="server", federation="fed-1", ledger=None)
agent = Channel(hub.connect("client-007"), node_id="client-007", side="agent", federation="fed-1", ledger=None)
server.transport.subscribe(topics.server_filters("fed-1"), qos=1)
agent.send(topics.up("fed-1", "client-007", Kind.UPDATE),
           Update(tensors=(np.ones(3, np.float32),), num_samples=4, train_loss=0.5), round=1)
got = server.receive(5.0)
print(json.dumps({"failed": failed, "got": type(got).__name__, "paho_loaded": _loaded("paho"),
                  "protocol_file": protocol.__file__}))
"""


@pytest.mark.parametrize("how", ["finder", "sys.modules"])
def test_every_protocol_module_but_the_mqtt_client_and_the_memory_broker_work_without_paho(how: str) -> None:
    """The in-memory transport double lives beside the seam, not the MQTT client: a federation in
    one process runs over it on a machine without paho-mqtt."""
    out = _run(["paho"], how, _MEMORY_BROKER_WITHOUT_PAHO)
    assert out["failed"] == []
    assert out["got"] == "Received" and out["paho_loaded"] == []
