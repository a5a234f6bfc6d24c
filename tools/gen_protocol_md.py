"""Write protocol/PROTOCOL.md: the normative spec of wire protocol version 1, complete enough for a
second implementation (tests/interop/ holds one, in Node.js, written from it alone).

Every number, table and limit is taken from the code's own constants (kinds, body fields, dtypes,
codecs, limits, reason codes, security constants, test vectors); the codec table is the tensor
module's docstring. The prose names no Python identifier: an implementer in C or JavaScript reads
this file, not the Python. Sections run in order, 1 to 12.

Usage: ``python tools/gen_protocol_md.py`` (rewrites the file); ``--check`` exits 1 when the file
is stale (tests/test_protocol_spec.py runs it).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from protocol import chunking, membership, messages, security, tensors, topics  # noqa: E402
from protocol.channel import MAX_RESEND, MIN_CHUNK_DATA  # noqa: E402
from protocol.security import sealing  # noqa: E402
from protocol.test_vectors import (  # noqa: E402
    DECODE_ONLY,
    MESSAGE_VECTORS,
    SECURITY_VECTOR_UPLOAD_KEY,
    SECURITY_VECTORS,
    TEST_VECTORS,
    message_vector_records,
)

#: the manifest of the canonical-JSON example (§7); its hash is computed below, and checked
#: against the agent's implementation by tests/protocol/test_protocol_spec_rules.py
MANIFEST_EXAMPLE = [["conv.weight", [4, 1, 3, 3], "float32"], ["bn.weight", [4], "float32"],
                    ["bn.num_batches_tracked", [], "int64"], ["fc.bias", [10], "float32"]]

#: the seven codec settings of a configuration and the wire codec each produces (§4)
CODEC_SETTINGS = [("fp32", "raw (0)"), ("fp16", "fp16 (1)"), ("bf16", "bf16 (2)"),
                  ("int8", "int8 (3), axis -1"), ("int8-channel", "int8 (3), axis 0 (-1 for a 0-d or 1-d tensor)"),
                  ("topk:K[:fp16]", "topk (4), K a count or a fraction in (0, 1]"),
                  ("<any>+zstd", "the same number OR 0x80 (128)")]

#: what a float dtype is (lossy codecs apply to these only)
_FLOAT_DTYPES = frozenset(code for code, dt in tensors.DTYPES.items() if dt.kind == "f")

#: torch spelling (manifest) of each wire dtype
_TORCH_NAME = {"float32": "float32", "float16": "float16", "float64": "float64", "int64": "int64",
               "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool"}


def _canonical(manifest: list) -> str:
    return json.dumps(manifest, separators=(",", ":"), ensure_ascii=True)


def manifest_example_hash() -> str:
    """The first 16 hex characters of SHA-256 of the canonical JSON of :data:`MANIFEST_EXAMPLE`."""
    return hashlib.sha256(_canonical(MANIFEST_EXAMPLE).encode("utf-8")).hexdigest()[:16]


def rst_to_md(text: str) -> str:
    """Docstring reST → Markdown: roles and ``literals`` to `code`, simple tables and ``::`` blocks fenced."""
    text = re.sub(r":(?:data|func|class|meth|mod):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("====="):
            j, rules = i, 0
            while j < len(lines):
                if lines[j].startswith("====="):
                    rules += 1
                if rules == 3:
                    break
                j += 1
            out.append("```text")
            out.extend(lines[i:j + 1])
            out.append("```")
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _between(text: str, start: str, end: str | None) -> str:
    a = text.index(start)
    b = text.index(end, a) if end is not None else len(text)
    return text[a:b]


def _sub(text: str, old: str, new: str) -> str:
    """Replace ``old`` (which must be there: a docstring change that drops it fails loudly)."""
    if old not in text:
        raise SystemExit(f"gen_protocol_md: expected text {old!r} not found in a docstring; update the generator")
    return text.replace(old, new)


def codec_text() -> str:
    """The tensor module's normative codec table and zstd paragraph, with code names replaced."""
    doc = tensors.__doc__
    part = _between(doc, "All multi-byte values are little-endian.", "Decoding\n--------")
    part = _sub(part, "(python-zstandard does by default)", "")
    return rst_to_md(part.strip()).replace("  ;", ";").replace("size ;", "size;")


def _json_value(v: object) -> object:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"bin": bytes(v).hex()}
    if isinstance(v, np.ndarray):
        values = v.astype(np.float64).ravel().tolist() if v.dtype.kind == "f" else v.ravel().tolist()
        return {"dtype": tensors.dtype_code(v.dtype), "shape": list(v.shape), "values": values}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_value(x) for k, x in v.items()}
    return v


def message_expectations() -> dict[str, dict]:
    """name -> the decoded fields of each message vector (the decoder's view; tensors decoded)."""
    out = {}
    records = message_vector_records()
    for name, (_, hx) in MESSAGE_VECTORS.items():
        dec = messages.decode(bytes.fromhex(hx))
        env, rec = dec.envelope, records[name]
        body = {f: _json_value(getattr(env.body, f)) for f in type(env.body).__dataclass_fields__}
        # absent optional fields (extras, instructions, a status's holdings) are shown absent, as on the wire
        for f in ("extras", "instructions", "members", "member_index", "global_round", "start_round", "update_round"):
            if f in body and body[f] in ({}, None, {"bin": ""}):
                del body[f]
        out[name] = {"version": env.version, "kind": int(env.kind), "round": env.round, "sender": env.sender,
                     "seq": env.seq, "timestamp_ms": env.timestamp_ms, "body": body}
        assert (env.round, env.sender, env.seq) == (rec.round, rec.sender, rec.seq), name
    return out


def chunk_budget_reference(topic: str, max_packet: int, sender: str, round: int, qos: int = 1,
                           mqtt5: bool = False) -> int:
    """§5's formula for the chunk data budget, written out (the test compares it with the code)."""
    def uint(v: int) -> int:
        return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 1 << 32 else 9

    def strlen(s: str) -> int:
        n = len(s.encode("utf-8"))
        return n + (1 if n < 32 else 2 if n < 256 else 3)

    def binlen(n: int) -> int:
        return n + (2 if n < 256 else 3 if n < 65536 else 5)

    def varint(v: int) -> int:
        return 1 if v < 128 else 2 if v < 16384 else 3 if v < 2097152 else 4

    def remaining(d: int) -> int:
        body = binlen(1 + 18 + 5 + 5 + 5 + 5 + 34 + binlen(d))  # the body's bin header + the body
        payload = 1 + 1 + 1 + uint(round) + strlen(sender) + 9 + 9 + body
        return 2 + len(topic.encode("utf-8")) + (2 if qos else 0) + (1 if mqtt5 else 0) + payload

    def fits(d: int) -> bool:
        r = remaining(d)
        return r <= 268_435_455 and 1 + varint(r) + r <= max_packet

    lo, hi = -1, max_packet
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    if lo < 0:
        raise ValueError(f"max packet size {max_packet} is too small for a chunk on {topic!r}")
    return lo


def mqtt_client_id_rule() -> str:
    """§1's rule for MQTT client ids, from :func:`protocol.topics.mqtt_client_id`'s constants
    (an example computed by it)."""
    n = topics.MQTT_FEDERATION_CHARS
    long_fed = "field-trial-" + "x" * 50
    return (f"* MQTT client ids are unique per connection (two clients with one id evict each other forever):\n"
            f"  a node's is `{{federation}}:{{client_id}}` (the server's `{{federation}}:{messages.SERVER_ID}`), a\n"
            f"  federation id longer than {n} characters cut to its first {n - 9}, `.` and the first 8 hex digits\n"
            f"  of the SHA-256 of its UTF-8 bytes (`{long_fed[:12]}…` of {len(long_fed)} characters:\n"
            f"  `{topics.mqtt_client_id(long_fed, 'pi-07')}`). No id holds `:`, so one device id in two\n"
            f"  federations on one broker makes two clients; no device has the id `{messages.SERVER_ID}`.")


HEAD = """# fedfleet wire protocol, version 1

Normative. A conforming implementation in any language must produce and accept the bytes below.
Everything an implementation needs is in this file: transport and topics (§1), the envelope and
how every number is encoded (§2), the bodies (§3), tensors and codecs (§4), chunked transfers
(§5), signing and encryption (§6), the model manifest (§7), the message flow of a federation
(§8), receivers and evolution (§9), limits (§10), byte accounting (§11) and test vectors with the
field values they decode to (§12). The reference implementation checks every vector byte for
byte, and a second, independent decoder (Node.js) decodes the vectors and a live federation of
every message kind and codec from this text alone. This file is generated from the reference
implementation's constants and documentation; it is not edited by hand.

## 1. Transport and topics

* MQTT 3.1.1 (protocol level 4) by default; MQTT 5 works where the broker speaks it. Clean
  sessions: correctness never rests on broker sessions.
* QoS 1 for every message (QoS 1 *delivers duplicates*: receivers de-duplicate, §8).
@MQTT_CLIENT_ID@
* Each agent publishes a retained `status` message (`online`, saying what it holds of the
  rounds, §8) and registers the same topic as its MQTT last will with an `offline` status whose
  envelope `seq` is 0 and `round` 0, so the server marks it offline when it vanishes. With
  signing on, the will is sealed like any other message of the device (§6), encrypted too when
  the device encrypts.
* The server says its own presence the same way, on `down/status`: a retained `status`
  `online` once its subscriptions are made (before it waits for joins) and again after each of
  its reconnects, its MQTT last will a retained `status` `offline` (`seq` 0, `round` 0, detail
  `connection lost`; sealed when it signs), and a retained `offline` when it stops. Its
  `online` says where its rounds are (§3, `status`). Agents receive it on their `down/+`
  subscription; how an agent holds its re-sends on it is §8 (*Server presence*). An agent that
  does not read it ignores a `status` on `down/status`.
* A client that reconnects renews its subscriptions and publishes what answers the reconnect
  (an agent's `online`) only once the broker acknowledged them (SUBACK): a broker may route a
  client's PUBLISH before it put in place the SUBSCRIBE that client sent just before it, and the
  server's answer to that `online` would then miss the agent.
* The broker's maximum packet size is enforced by the sender: a payload whose PUBLISH would
  exceed it, or that is longer than the sender's chunk size, goes as a chunked transfer (§5).

### Topics

```text
fedfleet/v1/{federation}/down/{kind}                server → all agents   round_start, global, finish, status
fedfleet/v1/{federation}/down/{client_id}/{kind}    server → one agent    receipt, resend, round_start, global
fedfleet/v1/{federation}/up/{client_id}/{kind}      agent → server        join, update, receipt, resend
fedfleet/v1/{federation}/status/{client_id}         agent presence        status (retained; last will)
```

| message | topic | from → to |
| --- | --- | --- |
| `join` | `up/{client_id}/join` | agent → server |
| `round_start` | `down/round_start`; or `down/{client_id}/round_start` when the round has per-device instructions \
(§8) | server → agents |
| `global` | `down/global`; or `down/{client_id}/global`: a copy for one selected device (per-device delivery, \
or a device that came back during the round; §8) | server → agents |
| `update` | `up/{client_id}/update` | agent → server |
| `finish` | `down/finish` | server → all agents |
| `status` | `status/{client_id}` (retained when `online`; the last will) | agent → server |
| `status` | `down/status` (retained; the last will): the server's presence, `online` / `offline` | server → agents |
| `receipt` | `down/{client_id}/receipt` (answers a `join` or an `update`); `up/{client_id}/receipt` (answers a \
`global`) | both |
| `chunk` | the topic of the message it carries; a broadcast `global`'s chunks asked for again: the asking \
agent's `down/{client_id}/global` (§5) | both |
| `resend` | `down/{client_id}/resend` (server asks an agent); `up/{client_id}/resend` (agent asks the server) | both |

(Topic prefixes `fedfleet/v1/{federation}/` omitted in the table.) `federation` and `client_id`
are one topic level each: 1–64 characters of `[A-Za-z0-9_.-]`, the first one a letter or digit.
`{kind}` is the kind's label (§3). The server's own id is `"server"`. A message whose topic
`client_id` differs from its envelope `sender` is rejected on `up` and `status` topics; on `down`
topics the sender must be `"server"` (checked always when signing is on). A message whose kind
differs from the topic's `{kind}` is rejected, except `chunk`, which travels on the topic of the
message it carries. The server subscribes to `fedfleet/v1/{federation}/up/+/+` and
`fedfleet/v1/{federation}/status/+`; an agent to `fedfleet/v1/{federation}/down/+` and
`fedfleet/v1/{federation}/down/{client_id}/+`.
"""


def envelope_section() -> str:
    v = messages.PROTOCOL_VERSION
    return f"""
## 2. Envelope and number encoding

A payload is one msgpack value (msgpack spec, 2017 revision with `bin` and `str8`), an array, the
**envelope**:

```text
[version, kind, round, sender, seq, timestamp_ms, body]          7 elements: unsigned
[version, kind, round, sender, seq, timestamp_ms, body, sec]     8 elements: sealed (§6)
```

| # | field | msgpack | meaning |
| --- | --- | --- | --- |
| 1 | version | uint | protocol major version, `{v}` (checked first) |
| 2 | kind | uint | message kind number (§3; checked second) |
| 3 | round | uint | federated round the message belongs to (0 outside rounds: join, presence, resend) |
| 4 | sender | str | id of the sender (`"server"` for the server), a valid topic level (§1) |
| 5 | seq | uint | per-sender sequence number (below) |
| 6 | timestamp_ms | uint | sender's wall clock, ms since the Unix epoch (informational only) |
| 7 | body | bin | the kind's body, itself one msgpack array (§3), nested as `bin` |
| 8 | sec | array | only when sealed: the security trailer (§6) |

The body is nested as `bin` so that its size is known exactly (the ledger's body bytes) and so
that a signature over the envelope can be checked before the body is parsed.

**The envelope is closed.** In version {v} element 8, when present, is always `sec`, and
senders never put more than 8 elements (a sealed envelope's signature is its last 66 bytes, so
nothing can follow `sec`; a receiver may ignore elements after the 8th of an unsigned envelope or
refuse the message). New data is added inside a body, or inside `sec` (§6), never as a new
envelope element (§9).

**Sequence numbers.** Each sender numbers its messages 1, 2, 3, … per connection session; the
last will carries 0. A chunked message (§5) takes a number for its own (inner) envelope, and each
of its chunks then takes the next numbers: the inner number travels only inside the reassembled
payload, never as a packet of its own, so a receiver watching packets sees a gap of one per
chunked message (e.g. inner message 7, chunks 8, 9, 10). Receivers must not expect consecutive
numbers; with signing on the numbers must never repeat within an epoch (§6).

### Number and container encoding

An encoder that reproduces the vectors byte for byte follows these rules (a decoder accepts any
valid msgpack form of the declared type):

* **Integers**: the smallest msgpack form for the value: positive fixint (0–127), `uint8` (`cc`),
  `uint16` (`cd`), `uint32` (`ce`), `uint64` (`cf`); negative values (only `int8`'s `axis = -1`
  and negative integers inside scalar maps) negative fixint (−32…−1), then `int8`/`16`/`32`/`64`
  (`d0`–`d3`). `timestamp_ms` is therefore `uint64` (`cf` + 8 bytes) for any date after 1970 + 49
  days.
* **Floats** (deadline, train loss, float values in scalar maps): always `float64` (`cb` + 8
  bytes, big-endian), never `float32`, even when the value fits.
* **Booleans**: `c2` false, `c3` true. A bool is never accepted for an integer nor the reverse.
* **Strings**: UTF-8, smallest form (fixstr up to 31 bytes, then `str8` `d9`, `str16`, `str32`).
* **Binary**: smallest form (`bin8` `c4`, `bin16` `c5`, `bin32` `c6`); never a string.
* **Arrays and maps**: smallest form (fixarray/fixmap up to 15 entries, then 16- and 32-bit
  forms). Map entries keep the sender's order (the vectors give it); keys are strings.
* `nil` is never sent. Multi-byte data *inside* `bin` values (tensor data, scales) is
  little-endian (§4); msgpack's own integer and float encodings are big-endian.

**Scalar maps** (`M` below): a map from `str` to a scalar: an integer in −2⁶³…2⁶⁴−1, a `float64`,
a `str` (≤ {messages.MAX_STR} characters) or a bool; no arrays, maps, nil or bin.
"""


def bodies_section() -> str:
    rows = "".join(f"| {int(k)} | `{k.label}` | {', '.join(f'`{f}`' for f in messages.BODY_FIELDS[k])} |\n"
                   for k in messages.Kind)
    states = ", ".join(f"`{s}`" for s in messages.STATUS_STATES)
    return f"""
## 3. Kinds and bodies

| number | label | body fields, in wire order |
| --- | --- | --- |
{rows}
Kind numbers are never reused. Each body is a msgpack array of its fields in this order. A field
in parentheses below is optional: absent (the array is shorter), never `nil`. `T` = a tensor (§4).

| kind | field | type | meaning |
| --- | --- | --- | --- |
| join | profile | str ≤ 64 | hardware profile name of the device (`rpi4`, `jetson-nano` …) |
| join | manifest_hash | str ≤ 128 | 16 lower-case hex characters: the hash of the device's model manifest (§7) |
| join | num_samples | uint | training examples on the device |
| join | class_histogram | array of uint | examples per class, class 0 first (≤ {messages.MAX_LIST:,} entries) |
| join | info | M | what the device announces about itself: hardware (`cores`, `ram_mb` …), its data settings \
(`dataset`, `partition` …), its algorithm and software versions; informational, except that a server may refuse a \
join whose data settings differ from its own (receipt `accepted` = false), and two optional uint entries: \
`max_packet_bytes` (1,024 … 268,435,460), the largest whole MQTT PUBLISH packet the device takes, and `chunk_bytes` \
(64 … 268,435,456), its chunk size: a server sends every message to the device (each broadcast: to the smallest \
limit among the joined devices) as a chunked transfer whose packets fit, sized for MQTT 5 framing; a value outside \
those ranges is refused; and `state_round` (uint), sent by a device whose algorithm keeps state between rounds: the \
newest round its kept state is as of (0: its initial state). A server that has counted updates of that device and \
reads `state_round` = 0 says that the device restarted without its state (informational: the join is accepted) |
| round_start | selected | array of str | ids of the agents asked to train this round |
| round_start | deadline_s | float64 > 0 | seconds after this message within which updates are accepted |
| round_start | config | M | training settings for every selected agent: `lr`, `local_epochs`, `batch_size`, \
`update_codec` (codec setting text, §4), `delta` (bool), `error_feedback` (bool), `client_eval` (bool) and algorithm \
parameters |
| round_start | (instructions) | M | per-device settings (a data ratio, a number of epochs …) for the one agent this \
`round_start` is addressed to (§8), so `selected` then names exactly that one agent (else the message is \
refused); sent only when not empty, so a `round_start` without it is byte-identical to the \
three-field form |
| round_start | (members) | bin | the selected agents by member index (a member set, below), beside the ones \
named in `selected`: an agent is selected when its id is in `selected` or its member index is in `members`. Sent only \
when not empty, and then after an `instructions` field that is an empty map; never beside non-empty `instructions` \
(the message is refused); an empty `bin` is the same as none (a placeholder when a later field follows) |
| global | tensors | array of T | the shared model tensors for this round, in manifest order (§7) |
| global | meta | M | `manifest_hash` (str, the server's manifest hash) and `share` (str: `all` = every manifest \
entry, `backbone` = the entries whose name starts with `backbone.`, `none` = no entry: `tensors` is empty) |
| global | (extras) | X | non-model state of the algorithm (below) |
| update | tensors | array of T | the agent's tensors, same positions, shapes and dtypes as the round's `global` (or \
their deltas, §8) |
| update | num_samples | uint ≥ 1 | examples the update stands for (the aggregation weight) |
| update | train_loss | float64, finite | mean training loss of the round |
| update | metrics | M | numbers the agent measured (`train_seconds`, `eval_accuracy` in [0, 1] …) |
| update | (delta) | bool | `tensors` are `w_local − w_global` (§8); false when absent |
| update | (extras) | X | as in `global`; present only after `delta` |
| finish | reason | str | why the run ended (`completed` …) |
| finish | rounds_completed | uint | rounds aggregated |
| status | state | str | one of {states} |
| status | detail | str | free text (why offline; for `idle`, `round r: why`) |
| status | (global_round) | uint | with `online` only: the newest round whose `global` the agent holds or trained \
(0: none) |
| status | (start_round) | uint | with `online` only: the newest round whose `round_start` selecting the agent it \
holds, trains or trained (0: none) |
| status | (update_round) | uint | with `online` only: the round of the agent's last `update` whose receipt it has not \
read (0: none). The three are sent together or not at all (an `online` without them says nothing of what the agent \
holds, as one from an older agent); receivers ignore them beside another state. In the server's `online` \
(`down/status`) they say where its rounds are: `global_round` the last round it completed, `start_round` the round \
it collects updates for (0: none), `update_round` 0 |
| receipt | ref_kind | uint ≤ 255 | kind number of the acknowledged message |
| receipt | ref_seq | uint | envelope `seq` of the acknowledged message; for a chunked message, the inner message's \
`seq` (§2), never a chunk's |
| receipt | accepted | bool | taken (true) or refused (false) |
| receipt | reason | str | why refused; on an accepted duplicate `duplicate: already counted`; else empty |
| receipt | sha256 | bin (32 or 0 bytes) | SHA-256 of the acknowledged payload as the receiver got it: the whole \
PUBLISH payload (the sealed bytes, `sec` included, when signed) for a message sent whole; for a chunked message the \
reassembled (unsealed) inner payload |
| receipt | (member_index) | uint ≤ {membership.MAX_MEMBER_INDEX:,} | on an accepted `join` receipt (`ref_kind` 1) \
to an agent whose `join.info` has `{membership.JOIN_INFO_KEY}` = true: the agent's member index, which broadcast \
`round_start.members` use to name it (§8). Senders put it on no other receipt; on another receipt (a placeholder \
when a later field follows) it means nothing and receivers ignore it |
| chunk | transfer_id | bin 16 | random id of the transfer (§5) |
| chunk | index | uint | 0 … count − 1 |
| chunk | count | uint | chunks in the transfer, 1 … {messages.MAX_CHUNKS:,} |
| chunk | offset | uint | byte offset of `data` in the whole payload |
| chunk | total_bytes | uint | length of the whole payload (≤ {messages.MAX_PAYLOAD_BYTES:,}) |
| chunk | sha256 | bin 32 | SHA-256 of the whole payload |
| chunk | data | bin | the slice |
| resend | transfer_id | bin 16 | the stalled transfer |
| resend | indices | array of uint | the chunk indices asked for again |

`X` = a map from a name (1–64 characters of `[A-Za-z0-9_.-]`, at most {messages.MAX_EXTRAS} entries)
to a tensor: the non-model state an algorithm exchanges (`prototypes` [C, d] float with
`proto_classes` [C] int64 and `proto_counts` [C] int64, `soft_predictions` [P, C] on a proxy set,
control variates …). It is present only when not empty, so a model-only message is
byte-identical with or without it; each entry may use its own codec. `tensors` may be empty (no
parameters shared). The tensors and the extras share one decoded-byte budget.

**Member sets** (`round_start.members`). The server gives every agent a *member index* when it
first joins: 0, 1, 2, … in the order of first admission, kept for good (an agent joining again,
and a server resumed from its checkpoint, keep it; an agent joining mid-run takes the next one),
and tells it in the accepted join receipt (`member_index`). A member set is one `bin` value whose
first byte is its form, followed by the set in that form; it is never empty:

| form byte | form | bytes after the form byte |
| --- | --- | --- |
| {membership.BITMAP} | bitmap | bit `i mod 8` (least significant bit first) of byte `i div 8` is 1 when index `i` \
is in the set; at most {membership.MAX_MEMBER_INDEX // 8 + 1:,} bytes; at least one bit set; encoders write no \
trailing zero byte (`max index div 8 + 1` bytes) |
| {membership.DELTAS} | deltas | the indices in strictly increasing order, delta-encoded (the first delta is the first \
index, each next one `index[j] − index[j−1]` ≥ 1), each an unsigned LEB128 varint as in `topk` (§4; minimal, at most \
4 bytes here), nothing after the last; at most {membership.MAX_MEMBERS:,} indices |

Indices are at most {membership.MAX_MEMBER_INDEX:,}. Encoders send the shorter form (the bitmap on a
tie). Example: indices `[0, 1, 2, 9]` → bitmap `00 07 02` (3 bytes), deltas `01 00 01 01 07`
(5 bytes): the bitmap is sent. Indices `[300]` → bitmap 1 + 38 bytes, deltas `01 ac 02`: the deltas.
A decoder refuses an unknown form byte, a set without any index (a form byte alone, an all-zero
bitmap), a truncated, over-long or non-minimal varint, a zero delta after the first and an index
above the maximum; an empty `bin` (no form byte) is no set at all, as if the field were absent.
"""


def tensors_section() -> str:
    rows = []
    for code, dt in tensors.DTYPES.items():
        kind = "float" if code in _FLOAT_DTYPES else "bool (0 = false, 1 = true)" if dt.kind == "b" else \
            "signed int" if dt.kind == "i" else "unsigned int"
        rows.append(f"| {code} | `{dt.name}` | {dt.itemsize} | {kind} | "
                    f"{'all codecs' if code in _FLOAT_DTYPES else '`raw` (0) only'} |\n")
    codecs = ", ".join(f"{n} = `{name}`" for n, name in tensors.CODECS.items())
    settings = "".join(f"| `{a}` | {b} |\n" for a, b in CODEC_SETTINGS)
    return f"""
## 4. Tensors and codecs

A tensor is a msgpack array `[codec, dtype, shape, data, *params]`:

* `codec` (uint): how `data` (and `params`) were produced: {codecs}; optionally OR-ed with the
  zstd flag `0x{tensors.ZSTD_FLAG:02x}`. Numbers are never reused.
* `dtype` (uint): element type of the **decoded** tensor, from the table below (whatever the
  codec carries inside `data`).
* `shape` (array of uint): at most {tensors.MAX_DIMS} dimensions; `[]` is a 0-d tensor (one element).
  `n = prod(shape)` (`1` for `[]`).
* `data` (bin): the values, in C (row-major) order, as the codec says.
* `params`: the codec's parameters, appended in the order listed. A decoder ignores elements
  after the ones its codec defines (forward compatibility); a raw tensor has none.

| dtype | name | bytes per element | kind | codecs |
| --- | --- | --- | --- | --- |
{''.join(rows)}
{codec_text()}

A receiver checks every field of a tensor from a peer: types; the dtype and codec numbers known;
`k <= n` and strictly increasing, in-range `topk` indices with minimal varints of at most
{tensors.MAX_VARINT_BYTES} bytes; the number of int8 scales and their finiteness; byte lengths exact; at most
{tensors.MAX_DIMS} dimensions and {tensors.MAX_ELEMENTS:,} elements; and no NaN/±Inf in the *decoded*
values of `global` and `update` tensors (extras included).

Codec settings (the text of `update_codec` in `round_start.config`) and what they put on the wire:

| setting | wire codec |
| --- | --- |
{settings}
A lossy codec on a non-float tensor is replaced by `raw`, as above. An agent with error feedback
on keeps what its lossy codec lost and adds it to the next round's tensor before encoding (its own
business: nothing of it travels).
"""


def chunking_section() -> str:
    seal = sealing.MAX_SEAL_BYTES
    return f"""
## 5. Chunked transfers

**When.** A sender has a *chunk size* (`chunk_bytes`, {chunking.DEFAULT_CHUNK_BYTES:,} bytes by default) and
may know the broker's maximum packet size (`max_packet`, whole PUBLISH packet). With `P` = the
length of the encoded unsigned payload and `S` = {seal} when signing is on (the most bytes sealing
adds: the `sec` trailer, the GCM tag and the growth of the body's `bin` header), else 0, the
message is sent whole when `P + S <= chunk_bytes` and its PUBLISH packet of `P + S` payload
bytes fits `max_packet` (a packet exactly at the maximum is sent whole); otherwise it is sent as
a **transfer** of `chunk` messages (kind 8).

**Layout.** A transfer has a 16-byte random `transfer_id`, the `total_bytes` and the
SHA-256 digest of the whole (unsealed) payload, and `count` ≥ 1 chunks. With a slice length
`L` ≥ 1 (the same for the whole transfer), chunk `index` = *i* carries `data` = payload[*i*·L :
min((*i*+1)·L, total_bytes)] at `offset` = *i*·L, and `count` = ⌈total_bytes / L⌉. So every
chunk but the last carries exactly L bytes, the last carries 1..L bytes, and the slices cover
[0, total_bytes) without gap or overlap. An empty payload is one chunk (`count` = 1) of 0 bytes.
`count` ≤ 2²⁰ and `total_bytes` ≤ 256 MiB. A receiver refuses any other layout (every chunk is
checked on its own and against the first chunk of its transfer).

**Slice length.** `chunk_bytes` bounds the *data slice* of a chunk, not its packet: `L =
chunk_bytes` when no `max_packet` is known, else `L = min(chunk_bytes, B − S)` where `B` (the
chunk data budget) is the largest data length `D ≥ 0` for which the PUBLISH packet of a probe
chunk fits `max_packet` (and MQTT's own bound: remaining length `R` ≤ 268,435,455); when not
even `D = 0` fits, the message cannot be sent:

```text
body(D)    = 1 + 18 + 5 + 5 + 5 + 5 + 34 + bin(D)          fixarray(7), transfer_id, index, count,
                                                           offset, total_bytes (each as uint32), sha256, data
payload(D) = 1 + 1 + 1 + uint(round) + str(sender) + 9 + 9 + bin(body(D))
                                                           fixarray(7), version, kind, round, sender,
                                                           seq and timestamp_ms (each as uint64), body
packet(D)  = 1 + vbi(R) + R,  R = 2 + len(topic) + (2 if qos > 0) + (1 for MQTT 5) + payload(D)
bin(n)     = n + 2 if n < 256, n + 3 if n < 65,536, else n + 5
uint(v)    = 1 if v < 128, 2 if v < 256, 3 if v < 65,536, 5 if v < 2³², else 9
str(s)     = len(s) + 1 if len(s) < 32, + 2 if < 256, else + 3   (UTF-8 bytes)
vbi(R)     = 1 if R < 128, 2 if R < 16,384, 3 if R < 2,097,152, else 4   (MQTT variable byte integer)
```

The probe puts every field the sender does not fix at its widest form (`seq` and
`timestamp_ms` as `uint64`; `index`, `count`, `offset`, `total_bytes` as `uint32`), so a real
chunk is never longer. A sender with `L < 1` cannot send the message (an error, not a transfer).
`topic` is the message's topic, except for a broadcast `global`: the server computes `B` on the
longest own topic of its joined devices, `down/{{client_id}}/global` (when that leaves at least
{MIN_CHUNK_DATA} bytes of data), so that a chunk asked for again fits there too (see *Resend*).

**Envelopes.** Each chunk is a message of its own: envelope `sender` and `round` of the chunked
message, a fresh `seq` per chunk (§2), published on the chunked message's topic (chunks of a
broadcast `global` asked for again: see *Resend*) with the same QoS, never retained. With signing
on, each chunk is sealed on its own (§6), for the topic it is published on. The inner payload is
the unsealed encoding of the whole message (7-element envelope).

**Reassembly.** The receiver keys a transfer by (envelope `sender`, `transfer_id`). It checks
the first chunk's bounds (total buffered bytes, concurrent transfers per sender, bytes per
transfer), preallocates `total_bytes` and copies each chunk to its offset. A chunk index that
arrives again is a **duplicate** (MQTT QoS 1 delivers at least once) and is ignored if its bytes
are identical; a chunk of a transfer completed recently is ignored too. When every index has
arrived, the SHA-256 of the buffer must equal `sha256`; the buffer is then decoded as an ordinary
unsigned payload, whose envelope `sender`, `round` and kind must equal the chunks' sender, round
and topic kind. The chunks of one transfer may arrive on more than one topic of its kind (a
broadcast's chunks asked for again come on the device's own topic): the message is taken as
arrived on its first chunk's topic, and a chunk on a topic of another kind (or direction) than
its transfer's first chunk is refused (the transfer keeps the chunks it has). A chunk that
disagrees with its transfer (`count`, `total_bytes`, `sha256`, slice length, different bytes at a
seen index) or a digest mismatch drops the whole transfer. A
transfer that got no chunk for 120 s (default) is dropped and reported, never waited on forever.
The server admits chunks only from joined agents; an agent only from the server.

**Superseded transfers.** A sender whose transfer the broker refused sends the same payload again
as a new transfer in smaller chunks. A transfer whose first chunk carries the `sha256` and
`total_bytes` of a transfer of the same sender still in progress supersedes it: the older one is
dropped without a report (the newer one carries the same bytes) and its late chunks are ignored;
a transfer of a payload that arrived whole by another transfer lately is ignored as a duplicate.

**Resend.** While a transfer stalls (no chunk for 5 s by default), the receiver may send
`resend` (kind 9, round 0) with the `transfer_id` and up to {MAX_RESEND:,} missing indices to the transfer's
sender. The sender answers from a bounded cache of its recent transfers by publishing those chunk
records again (same bodies, new envelopes with fresh `seq`). It honours a request only from a
peer it knows (the server: a joined agent, verified when signing is on; an agent: the server),
only for a transfer that peer was sent (a broadcast, or one addressed to it), only for indices
the transfer has, and at most once per chunk per second and within a per-peer budget of resent
bytes; a refused request is logged as `rejected` with its reason, and nothing is resent. A
sender that no longer holds the transfer refuses the request; the receiver's transfer then
expires. A request for a transfer the sender replaced (sent the message again as a new transfer
after a refusal) is not answered and not a refusal: it is ledgered as received. The once-a-second
limit and the budget are each requester's own. The chunks go again on the transfer's topic, except
a broadcast `global`'s (`down/global`): the server publishes those to the device that asked alone,
on its own `down/{{client_id}}/global` (which every agent subscribes to, §1; sealed for that topic
when signing is on), so that no other device downloads them again. The transfer was cut for the
longest such topic of the devices joined when it went out (*Slice length*); a chunk whose PUBLISH
on the requester's topic would still exceed the packet limit its transfer was cut for (a device
that joined later with a longer id) goes on the broadcast topic, as does every chunk of a
`round_start` or `finish` broadcast. Resent chunks are ordinary chunks to the receiver (duplicates
included). A receiver that keys transfers by (`sender`, `transfer_id`) as above, whatever the
topic, completes a transfer from chunks on both topics; so did every earlier fedfleet agent, which
subscribes to its own topics.

Units: bytes for every size, seconds for every duration.
"""


def security_section() -> str:
    reasons = "".join(f"| `{code}` | {text} |\n" for code, text in security.REASONS.items())
    return f"""
## 6. Signed and encrypted messages

When a federation runs with signing on, every payload is a **sealed envelope**: the envelope of
§2 with one more element, `sec`, as its 8th (and last) element:

```text
[version, kind, round, sender, seq, timestamp_ms, body, sec]
sec = [epoch, flags, body_bytes, check, signature]
```

| field | msgpack | meaning |
| --- | --- | --- |
| epoch | uint | the sender's session number, ≥ 1; strictly increasing across the sender's restarts (a counter the \
node keeps on disk) |
| flags | uint | bit 0 (`0x{sealing.FLAG_ENCRYPTED:02x}`): `body` is encrypted (AES-256-GCM); other bits are 0 |
| body_bytes | uint | length of `body` as sent (the ciphertext when encrypted) |
| check | bin8 ({sealing.CHECK_BYTES}) | SHA-256(topic)[0:4] ‖ SHA-256(body)[0:4]; lets a receiver say *what* \
changed when a signature fails (diagnostic only; it is signed) |
| signature | bin8 ({sealing.SIGNATURE_BYTES}) | Ed25519 signature (RFC 8032), always the last 66 bytes of the \
payload (`c4 40` + 64 bytes) |

**Evolution of `sec`.** Elements a later version adds to `sec` go between `check` and
`signature` (so `signature` stays last); receivers ignore them (they are signed). An unsigned
envelope keeps its 7 elements and its exact bytes. Because the envelope is closed (§2), an 8th
envelope element is always `sec`.

**What is signed.** With `P0` = the payload bytes before the body's content (array header,
header fields and the body's `bin` header), `B` = the body's content and `P1` = the bytes
between the body and the signature's `bin` header (the `sec` array header, `epoch`, `flags`,
`body_bytes`, `check`):

```text
TBS = "fedfleet/v1 signature" 00 ‖ u16be(len(topic)) ‖ topic (UTF-8) ‖ P0 ‖ SHA-256(B) ‖ P1
signature = Ed25519-Sign(sender's signing key, TBS)
```

so the topic, every header field (round and seq included), the epoch, the flags and the body are
bound by one signature, and the receiver verifies it **before it parses the body**. The body
enters through its SHA-256 (FIPS 180-4). The array header of a sealed envelope is `98` (fixarray
of 8); `P0` starts with it.

**Encryption** (optional; device → server only): `body` is AES-256-GCM (NIST SP 800-38D) of the
plaintext body with the {sealing.TAG_BYTES}-byte tag appended; the key is per (device, epoch):

```text
shared = X25519(device x25519 key, server x25519 key)                       (RFC 7748)
key    = HKDF-SHA256(salt = "fedfleet/v1 hkdf salt", ikm = shared,          (RFC 5869)
                     info = "fedfleet/v1 upload key" 00 ‖ sender 00 ‖ u64be(epoch)
                            ‖ device x25519 public ‖ server x25519 public, L = 32)
nonce  = 00 00 00 00 ‖ u64be(seq)          (unique: seq never repeats within an epoch)
aad    = "fedfleet/v1 aead" 00 ‖ u16be(len(topic)) ‖ topic ‖ P0
```

(`P0` here is that of the sealed payload: its `bin` header gives the ciphertext's length.)
Encryption comes first, then the signature covers the ciphertext (encrypt-then-sign), so a
receiver rejects a forged or altered message before it decrypts anything. Only the body is
encrypted: the broker and other subscribers see the topic, the header fields and the sizes.

**Which messages are encrypted.** A device with encryption on encrypts *every* message it
sends: `join`, `update`, `status` (`online`, `idle`, `offline`, and its last will), `receipt`,
`resend` and every `chunk` of its transfers. The server never encrypts: its messages are signed
only (`flags` = 0), and a receiver refuses an encrypted message from the server. A server may
require encryption of every device message (reason `unencrypted` otherwise).

**Chunked transfers.** A message that must be chunked is cut into `chunk` messages as in §5
from its *unsealed* payload; each chunk is then sealed (signed, and its body encrypted when the
device encrypts) like any other message. The whole is authenticated by its chunks (each carries
the SHA-256 of the whole and comes from the same verified sender).

**Receivers** check, in this order, and reject with the reason code in brackets: a sealed
envelope where one is required [`unsigned`]; the sender against the topic (`up`/`status`: the
topic's client id; `down`: `server`) [`sender_mismatch`]; a key for the sender (the server: its
allow-list of enrolled devices; a device: the pinned server key) [`unenrolled`]; the `sec`
layout and flags [`bad_sec`]; `check` against the topic [`tampered_topic`]; `body_bytes` against
the body [`truncated_ciphertext` / `truncated_body` / `tampered_body`]; `check` against the body
[`tampered_body`]; the signature [`bad_signature`]; encryption where the server requires it
[`unencrypted`]; then replay protection: an epoch older than the newest seen from that sender
[`stale_epoch`]; a round-bound message (round > 0) more than one round behind the receiver's
current round, or (at the server) ahead of the round it opened [`wrong_round`]; a `seq` already
seen in this epoch, or older than the replay window ({security.DEFAULT_REPLAY_WINDOW:,} below the highest seen)
[`replayed`]; finally the AEAD tag [`decrypt_failed`]. Only then is the body decoded. `seq` 0 is
the last will's, which the broker may deliver once per lost connection: a `status` message with
`seq` 0 is exempt from the replay window, but is accepted only from the sender's newest session
and once until the sender sends another message [`replayed`]. A `status` delivered retained
(the broker hands its retained message to a renewed subscription) that is byte for byte the last
message the receiver accepted on that topic is that message again: taken as it was verified
then, not refused as [`replayed`]. No check uses a clock: `timestamp_ms` stays informational.

**Replay state survives restarts.** A receiver keeps each sender's newest epoch, the sequence
numbers seen in it and whether its will was taken on disk, so a restarted server still refuses a
device's messages from before its restart.

**Keys.** A node holds an Ed25519 signing key and an X25519 key. The server knows each enrolled
device's two public keys (its allow-list); a device knows the server's (pinned). A public
identity is exchanged as a text file:

```text
# fedfleet public identity v1
id = "pi-07"
ed25519 = "<base64 of the 32-byte Ed25519 public key>"
x25519 = "<base64 of the 32-byte X25519 public key>"
fingerprint = "<first 16 bytes of SHA-256(ed25519 ‖ x25519), hex>"
```

Reason codes (never reused):

| code | meaning |
| --- | --- |
{reasons}"""


def manifest_section() -> str:
    dtypes = ", ".join(f"`{_TORCH_NAME[dt.name]}` ({code})" for code, dt in tensors.DTYPES.items())
    return f"""
## 7. Model manifest

Model tensors travel positionally, without names: the list `tensors` of `global` and `update`
follows the model's manifest order (the order of the model's parameters and buffers), restricted
to the shared entries (`global.meta.share`, §3). The manifest is the list of `[name, shape,
dtype]` of every entry, buffers included (a BatchNorm's `num_batches_tracked` is an `int64` of
shape `[]`). Its **hash** is the first 16 lower-case hex characters of the SHA-256 of its
**canonical JSON**, encoded as UTF-8:

* a JSON array with one element per entry, in manifest order: `[name, shape, dtype]`, where
  `name` is a JSON string, `shape` a JSON array of decimal integers (`[]` for a 0-d entry) and
  `dtype` a JSON string spelling the element type: {dtypes};
* no whitespace at all: separators `,` and `:` only;
* ASCII only: every character outside ASCII written as `\\uXXXX` (UTF-16 code units, lower-case
  hex), `"` and `\\` escaped as `\\"` and `\\\\`, control characters as `\\n`, `\\t` … or `\\u00XX`.

Example:

```text
manifest  = {_canonical(MANIFEST_EXAMPLE)}
hash      = {manifest_example_hash()}
```

The agent announces its hash in `join.manifest_hash`; the server sends its own in
`global.meta.manifest_hash`. The server refuses a join whose hash differs from its own with a
receipt (`accepted` = false, `reason` names both hashes); the agent stops. An `update` whose
tensors do not match the shared entries' shapes and dtypes is refused with a receipt.
"""


SEMANTICS = """
## 8. Rounds, receipts and the flow of a federation

A federation, message by message (agent `c`; topics without the `fedfleet/v1/{federation}/` prefix):

```text
server → all     down/status            status online (retained)            round 0
agent → server   status/c               status online (retained)            round 0
agent → server   up/c/join              join                                round 0
server → agent   down/c/receipt         receipt (ref_kind 1, accepted or not) round 0
   for each round r = 1, 2, …:
server → all     down/global            global (model of round r)           round r
   (or, delivered per device, one down/c/global per selected agent)
server → all     down/round_start       round_start (selected, deadline, members) round r
   (or, when the round has per-device instructions, one down/c/round_start per selected agent)
agent → server   up/c/receipt           receipt (ref_kind 3) for the global round r
agent → server   up/c/update            update                              round r   (selected agents)
server → agent   down/c/receipt         receipt (ref_kind 4)                round r
server → all     down/finish            finish                              round of the last one
agent → server   status/c               status offline                      round 0
(broker)         status/c               the last will (status offline, seq 0) if c vanished
server → all     down/status            status offline (retained)           round 0
(broker)         down/status            the server's last will (status offline, seq 0) if it vanished
```

* `seq` is per sender (§2), so duplicates and replays can be recognised.
* The server opens round *r* with `global` (the model for round *r*) then `round_start`. An agent
  trains once it holds both for the same round and it is selected. After the server reconnects
  (not after a close it took for the broker's refusal of a message, which it sends again
  smaller) it sends the open round's `round_start` again to each selected agent whose update it
  has not counted (that has not withdrawn or been dropped), on `down/{client_id}/round_start`
  naming only that agent, with the time left in the round as `deadline_s`, and the round's
  `global` again, on `down/{client_id}/global`, only to those of them whose `online` never said
  what they hold (an agent whose link broke too says what it lacks once it is back, below).
  An agent that already trained that round sends its update again, once however many copies of
  that `round_start` it finds queued, not while its last copy is still being delivered
  (awaiting the broker's acknowledgement, or being sent again smaller after a refusal), not
  for a copy that arrived before its last copy of the update was sent (the server sent it
  before it could have that copy), and not for a copy on its own topic when that update, still
  without a receipt, went out on the connection it made since its own link came back. An
  update without a receipt is sent again after a timeout that counts from the broker's
  acknowledgement of its last copy, never while that copy is still being delivered.
* **Per-device delivery.** The server may send a round's `global` to each selected agent on
  `down/{client_id}/global` instead of broadcasting it (the unselected agents then download no
  model for that round); each copy may carry that agent's own tensors and extras (same shapes
  as the round's; an agent's delta update is taken against the copy it got). An agent treats a
  `global` on its own topic exactly like the broadcast one and confirms it the same way. When
  the round's `round_start` goes per device (per-device instructions) and some online agent
  was not selected, the server broadcasts a `round_start` whose `selected` and `members` are
  empty as well, which selects nobody (whether the `global` went per device or broadcast):
  every agent hears from the server each round, and every agent that gets a round's `global`
  gets a `round_start` of that round (see *A lost round_start*).
* **Devices that come back.** An agent whose link came back publishes `status` `online`
  (retained) with `global_round`, `start_round` and `update_round` (§3), once its subscriptions
  are acknowledged (§1). The server takes it up when it arrives live, or retained when it
  differs from the last `status` the server handled from that agent (it was published while
  the server's own link was down: after a broker restart the agent may be back first); any
  other retained copy is one it handled already. When `update_round` names a round whose update
  from that agent the server counted, the server sends that update's receipt again (its
  `ref_seq` and `sha256` those of the copy it counted), and nothing asks for the update. When
  the agent is selected in the open round *r*, has not reported or withdrawn, the server sends
  that agent alone what it lacks of round *r*: with `global_round` < *r* (or an `online`
  without them, from an older agent, or a live one), the round's `global` on
  `down/{client_id}/global` and a `round_start` on `down/{client_id}/round_start`; with the
  global held but `start_round` < *r*, or with `update_round` = *r* (its update not counted),
  the `round_start` alone; else nothing (it holds both and trains). When the round's `global`
  (the broadcast, or the agent's copy) went out after the server's own reconnect, an agent that
  subscribed before it reached the broker still gets it, which its `online` cannot say: the
  server then sends its copy only if the agent has not confirmed that `global` (its receipt)
  within the server's confirmation timeout. That `round_start` names
  only the agent and its `deadline_s` is the time left in the round; the agent treats both
  like the broadcast ones (a copy of a round it already trained is not trained again: it sends
  its update again, unless that update still awaits its receipt and went out on the connection
  made since the device's link came back, or the copy arrived before its last copy of the
  update was sent). A selected device whose `status` `offline` (its last will) arrives and that
  does not say `online` within the server's grace period is no longer waited for.
* **A lost round_start.** A broker may drop a message for one subscriber without telling anyone
  (Mosquitto does when that client's queue is full). An agent that holds round *r*'s `global`
  (the newest it took; a round it has not trained) and has received no `round_start` of round
  *r* at all (broadcast or on its own topic, selecting it or not) for a wait *W* after it took
  that global (10 s by default, the server's default confirmation timeout; configurable on the
  agent) asks for it: it publishes `status` `online` again (retained, as after a reconnect;
  `detail` free text) with `global_round` = *r* and `start_round` < *r*. It asks at most 3 times
  a round, the *k*-th after (2^*k* − 1) × *W* (10, 30, 70 s by default), not before its `join`
  is answered, not while the server is known offline (*Server presence*: the server's
  `round_start` copies come after its reconnect), and never once any `round_start` of round *r*
  or a newer `global` came; an agent whose `round_start` arrives sends nothing more. The server
  takes such an `online` from an agent it holds online (no `offline` of it since) as an ask and
  answers as for a device that comes back: a selected agent gets the `round_start` alone on
  `down/{client_id}/round_start` (naming only it, `deadline_s` the time left in the round), an
  agent it did not select gets a `round_start` there whose `selected` and `members` are empty,
  so that it stops asking; at most 3 answers per agent and round, none after the round's
  deadline.
* **Per-device instructions.** When a round's plan gives devices their own settings, the server
  sends no broadcast `round_start` for that round: each selected device gets its own on
  `down/{client_id}/round_start`, whose `selected` names only it and whose fourth body field
  `instructions` carries what concerns it; the agent merges it over `config` (a key in both
  takes the instruction's value, for that device alone).
* Every `global` an agent takes is confirmed with a `receipt` on `up/{client_id}/receipt`
  (`ref_kind` 3, `ref_seq` = the global's `seq`, `accepted` = true, `sha256` as in §3), round =
  the global's round.
* Every `join` is answered with a `receipt` on `down/{client_id}/receipt` (`ref_kind` 1),
  round 0: accepted, or refused with the reason (manifest or data settings differ). An agent that
  reads member sets says so in its join (`join.info.members` = true); its accepted join receipt
  then carries its `member_index`, and it keeps the index of the latest such receipt. A broadcast
  `round_start` with `members` that arrives before that receipt (a resumed server opens a round
  for the devices it knows as soon as they are online) is kept, the newest one, and decided when
  the receipt brings the index: the agent trains that round when its index is in `members`.
* **Who is selected.** A broadcast `round_start` names the selected agents that read member sets
  in `members` (§3) and the other selected agents by id in `selected`; an agent is selected
  when either names it. So a device downloads the round's settings and about one bit per joined
  device (bitmap) or about one byte per selected device (deltas), not every selected id; an
  agent that does not read `members` (it never said so at join) is still named by id and works
  as before. The server names all of them by id when that is no longer than the member set (one
  or two agents). A per-device `round_start` (instructions, a device that came back) names its
  one agent in `selected` and has no `members`. An `update` from an agent the round did not
  select is refused (`accepted` = false), whichever way it came to train. The set is exact (no
  filter with false positives: each would be a device training a round for nothing) and explicit
  (not a selection rule a device evaluates: the server's strategy chooses the devices).
* Every `update` is answered with a `receipt` (`ref_kind` 4): `accepted` = true, or false with
  the reason (round not started, closed, after the deadline, not selected, manifest mismatch
  naming the tensor and both shapes, a metric out of range). An `update` whose envelope header
  decodes but whose body does not is answered the same way (`accepted` = false, `ref_seq` its
  header's `seq`) when it passed the security checks (§6) and its sender is the topic's client;
  one that failed them is not answered (its sender cannot be trusted). A second update from the
  same client for the same round is answered as accepted with reason `duplicate: already
  counted` and is **not** aggregated again.
* `status` `idle` with round *r* (not retained) tells the server the device will not contribute
  to round *r*, so the round need not wait for its deadline. An agent whose own update (a `seq`
  it sent) is answered `accepted` = false sends one. Only a signed server (§6) stops waiting for
  a device on the refusal alone: unsigned, a refused update on a device's topic may be anyone's,
  so the round waits for the device's own word; an agent ignores a receipt for a `seq` it never
  sent.
* **Delta updates.** `update.delta` = true: each float tensor is `w_local − w_global`, where
  `w_global` is the round's global model **as decoded from the wire** (after the server's lossy
  codec, when it uses one: the server itself continues from the decoded values, so both sides
  hold the same base); non-float tensors are sent whole. The server adds the deltas to that
  same decoded global model.
* The round closes when every selected client reported or the deadline passed. With fewer
  updates than the quorum it is closed without aggregation (global model unchanged); an
  aggregate containing NaN/Inf is discarded. Updates for a closed round are refused.
* `finish` ends the run; agents publish `status` `offline` and disconnect.
* **Server presence.** An agent holds (does not publish) its `update` re-sends (the receipt
  timeout's) and its `join` re-sends while the server is known offline, and the server is known
  offline only from a `status` `offline` on `down/status` delivered **live** (MQTT retain flag 0
  on delivery) on the agent's connection: the server's last will or its `offline` at its stop,
  as they happen. A **retained** `offline` (delivered on subscribing, or again after a
  reconnect) never holds anything: it may be left by the server of an earlier run under the
  same federation id, and a new agent that held on it would wait for a server that may never
  say `online`. The first `join` is never held. The hold ends on any `online` on `down/status`,
  live or retained, and on any other message from the server delivered live (the server's
  messages reach the broker before its last will, so one after it comes from a server that is
  back). On the `online` that ends a hold the agent sends at once what is pending: its `join`
  when none was answered, and its last `update` still without a receipt (one re-send, within
  its re-send limit and its round's deadline), instead of waiting out its timeout, unless the
  `online` says the server neither collects nor completed that update's round (a resumed server
  that runs it again: its `round_start` asks for the update, and a copy before it would go
  unanswered; the receipt timeout then counts from the `online`); a live `online` while its
  `join` is unanswered (a server started after that join) sends the `join` again at once too.
  A held copy does not use up the re-send limit. After its own reconnect the
  server sends the open round's `round_start` copies (above) before its `online`, so an agent
  answers those and finds nothing pending when the `online` comes.

## 9. Receivers, errors and evolution

* Decoders check, in this order: payload size, msgpack validity (exactly one value, nothing
  trailing), envelope shape (an array of at least 7 elements), **version** (an unknown major
  version is rejected before anything else is parsed), **kind** (an unknown kind number is
  rejected), header field types, then the body. A violation is reported with the offending
  field's path (`envelope.kind`, `body.tensors[2].shape`, …); the receiver logs it, records a
  `rejected` row in its byte ledger and carries on. Nothing a peer sends can stop the receiver.
* Types are exact: a bool is never accepted for an integer or the reverse; map keys are strings;
  map values are scalars. Integers are non-negative where the field is a count or an index.
* **Evolution.** The envelope is closed (§2): its 8th element, when present, is `sec`. New
  fields are appended at the end of a *body* or of a *tensor array* (after the codec's params),
  or inside `sec` between `check` and `signature`, each optional with a default, so that old
  messages keep their bytes; decoders ignore trailing body, tensor and `sec` elements they do
  not know (`round_start.instructions`, `round_start.members`, `receipt.member_index` and
  `status.global_round`, `start_round`, `update_round` were added this way). A field's type never changes; kind,
  codec and dtype numbers are never reused. An incompatible change increments the version.
"""


def limits_section() -> str:
    return f"""
## 10. Limits

| what | limit |
| --- | --- |
| payload | {messages.MAX_PAYLOAD_BYTES:,} bytes (256 MiB) |
| tensors in one message (`tensors` + extras) | {messages.MAX_TENSORS:,} |
| elements of one tensor | {tensors.MAX_ELEMENTS:,} |
| dimensions | {tensors.MAX_DIMS} |
| string fields | {messages.MAX_STR:,} characters (ids 64, profile 64, manifest hash 128, status state 32) |
| scalar map entries | {messages.MAX_MAP_ENTRIES} |
| extras entries | {messages.MAX_EXTRAS} |
| `selected`, `class_histogram`, `resend.indices` | {messages.MAX_LIST:,} |
| member index; indices in one member set | {membership.MAX_MEMBER_INDEX:,}; {membership.MAX_MEMBERS:,} |
| chunks per transfer | {messages.MAX_CHUNKS:,} |
| integers | 0 … 2⁶³ − 1 for header fields and counts |
"""


ACCOUNTING = """
## 11. Byte accounting

Every message is written to a byte ledger on the side that sends it and on the side that
receives it: topic bytes, MQTT header bytes (PUBLISH framing without topic and payload: fixed
header + 2-byte topic length + 2-byte packet id at QoS 1; MQTT 3.1.1 §3.3), envelope bytes, body
bytes (and per body field), raw tensor bytes before the codec, the codec, chunk index, QoS,
signature and encryption bytes. MQTT control packets (CONNECT, CONNACK, SUBSCRIBE, SUBACK,
PUBACK, PINGREQ, PINGRESP, DISCONNECT) and PUBLISH retransmissions are rows of their own. On a
healthy connection the ledger's sum per connection equals the bytes on the TCP stream, both
directions. Refused messages are `rejected` rows with their reason.
"""


def vectors_section() -> str:
    parts = ["\n## 12. Test vectors\n\n### Messages\n\n"]
    parts.append("Each is a whole MQTT payload (unsigned), lower-case hex, followed by the fields it decodes to "
                 "(JSON: `bin` values as `{\"bin\": hex}`; tensors as `{\"dtype\", \"shape\", \"values\"}` with the "
                 "decoded values in C order; optional body fields that are absent on the wire are absent here). "
                 "The tensor of `global` and `update` is `[[0.5, -1.25, 3.0], [0.0, 2.0, -0.125]]` (float32); "
                 "`update-int8-delta` carries it as int8 (the values are what int8 decodes to).\n")
    exp = message_expectations()
    for name, (codec, hx) in MESSAGE_VECTORS.items():
        parts.append(f"\n#### `{name}` ({codec or 'fp32'}, {len(hx) // 2} bytes)\n\n```hex\n{hx}\n```\n\n"
                     f"```json\n{json.dumps(exp[name], separators=(', ', ': '))}\n```\n")
    parts.append("\n### Sealed messages\n\nThe unsigned vector named, sealed for the topic given with test keys "
                 "(raw private keys: bytes 0, 1, …, 31 = the device's Ed25519 seed, 32 … 63 = the device's X25519 "
                 "key, 64 … 95 = the server's Ed25519 seed, 96 … 127 = the server's X25519 key). The upload key of "
                 f"`update-encrypted` (client-007, epoch 2) is `{SECURITY_VECTOR_UPLOAD_KEY}`. Decrypting and "
                 "unsealing each gives back its unsigned vector (7-element envelope, plaintext body).\n\n")
    parts.append("| name | unsigned vector | topic | epoch | encrypted | payload (hex) |\n"
                 "| --- | --- | --- | --- | --- | --- |\n")
    for name, (base, topic, epoch, encrypted, hx) in SECURITY_VECTORS.items():
        parts.append(f"| `{name}` | `{base}` | `{topic}` | {epoch} | {'yes' if encrypted else 'no'} | `{hx}` |\n")
    parts.append("\n### Tensors\n\nEach is the msgpack encoding of one tensor array "
                 "`[codec, dtype, shape, data, *params]` of a float32 tensor (dtype 1); `input` is the tensor "
                 "given to the encoder, `decoded` what a decoder returns (float32 values written exactly); both "
                 "directions hold except where marked decode-only (zstd frames differ between zstd versions).\n\n")
    parts.append("| name | codec | input | hex | decoded |\n| --- | --- | --- | --- | --- |\n")
    for name, (inp, codec, hx, dec) in TEST_VECTORS.items():
        mark = " (decode-only)" if name in DECODE_ONLY else ""
        parts.append(f"| `{name}`{mark} | `{codec}` | `{inp}` | `{hx}` | `{dec}` |\n")
    parts.append("\n### Chunk data budget\n\n`B` of §5 for topic `fedfleet/v1/fed-1/up/client-007/update`, sender "
                 "`client-007`, round 3, QoS 1, MQTT 3.1.1:\n\n| max_packet | B |\n| --- | --- |\n")
    for mp in (256, 1024, 65_536, 1_048_576):
        b = chunking.chunk_data_budget("fedfleet/v1/fed-1/up/client-007/update", mp, qos=1, sender="client-007",
                                       round=3)
        parts.append(f"| {mp:,} | {b:,} |\n")
    return "".join(parts)


def render() -> str:
    """The whole text of PROTOCOL.md."""
    head = HEAD.replace("@MQTT_CLIENT_ID@", mqtt_client_id_rule())
    text = "".join([head, envelope_section(), bodies_section(), tensors_section(), chunking_section(),
                    security_section(), manifest_section(), SEMANTICS, limits_section(), ACCOUNTING,
                    vectors_section()])
    return text


def main() -> int:
    text = render()
    out = ROOT / "protocol" / "PROTOCOL.md"
    if "--check" in sys.argv:
        return 0 if out.read_text(encoding="utf-8") == text else 1
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text):,} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
