"""The communication audit of run folders: what every link carried, from the byte ledger.

``fedfleet audit RUN_DIR [RUN_DIR ...] [--json] [--html OUT.html] [--csv DIR] [--target 0.95]
[--uplink-kbps K] [--downlink-kbps K]`` reads ``RUN_DIR/ledger.sqlite`` (see :mod:`protocol.ledger`)
and ``RUN_DIR/metrics.jsonl`` and reports, in bytes, what the federation cost on the wire: as text
tables (default), JSON, a self-contained HTML report with plots, and CSV files. Given several run
folders it also compares them (final accuracy, bytes, overhead, bytes to reach a target accuracy,
estimated transfer time on a given link).

The package, one job per module:

================  ==========================================================================
``_load``         the run folder: ledger rows (:func:`load_run`), the ledger as an SQLite
                  relation for the queries, ``meta``, ``metrics.jsonl``
``_queries``      totals per link, round, client, kind and direction; rejected messages;
                  bytes paid up to a round; what a resume added; what the devices sent or
                  received again — ``GROUP BY`` and window queries in SQLite
``_fields``       what ``global``/``update`` bodies are made of (``fields`` column, ``json_each``)
``_cost``         bytes to reach a target accuracy, accuracy against bytes, transfer time
``_report``       the report model: :func:`audit_report` (a plain dict) and :func:`comparison_row`
``_format``       table cells shared by the renderers
``_text``         text tables (rich);  ``_html``: the HTML page;  ``_plots``: its matplotlib
                  figures;  ``_csv``: CSV files
``_cli``          ``fedfleet audit`` (a thin layer over the above)
================  ==========================================================================

Each message appears in the ledger up to twice: once written by the server (``side='server'``)
and once by each agent that sent or received it (``side='agent'``). The audit therefore looks at
the ledger through one of two **views**:

``"device"`` (the default: *device links*)
    ``side='agent' AND event IN ('sent', 'received', 'rejected')``: uploads as sent by the agents and
    downloads as received by each agent, so a broadcast counts once **per agent that received
    it**. This is what the fleet pays on its (often metered, slow) links.
``"server"`` (the *server link*)
    ``side='server' AND event IN ('sent', 'received', 'rejected')``: what crossed the server's own
    connection to the broker, so a broadcast counts **once**.

**Directions.** ``up`` is towards the server, whichever side wrote the row (the ledger's
``direction``: an application message's from its topic, ``/down/`` or not; a control packet's
from who sent it, :meth:`protocol.channel.Channel._on_packet`). On the device links, up = what a
device sends the broker (its uploads; CONNECT, SUBSCRIBE, PUBACK for a download, PINGREQ,
DISCONNECT) and down = what the broker sends it (its downloads; CONNACK, SUBACK, PUBACK for an
upload, PINGRESP). On the server link, up = what the broker sends the **server** (the devices'
uploads, statuses and last wills as delivered to it; CONNACK, SUBACK, PUBACK for the server's own
PUBLISH, PINGRESP) and down = what the server sends the broker (its downloads; CONNECT,
SUBSCRIBE, PUBACK for an upload it received, PINGREQ, DISCONNECT). The text and HTML say so
under each link's totals (``_format.DIRECTION_MEANING``).

Rows with ``event='rejected'`` count in their side's view (the bytes crossed that link, even
though the receiver refused them); :func:`rejected` also lists them with their reasons. Rows with
``event='message'`` (the logical record of a chunked message, whose bytes the chunk rows already
count) belong to no view.

**Control packets.** The ledger also holds one row per MQTT packet that is not an application
PUBLISH (CONNECT, CONNACK, SUBSCRIBE, SUBACK, PUBACK, PINGREQ, PINGRESP, DISCONNECT, and
PUBLISH-DUP for a retransmission): ``reason='control'``, ``round`` NULL, payload 0 and
``mqtt_header_bytes`` = the whole packet. They are real bytes on the link, so they count in every
view like any other row: as their own kinds in :func:`by_kind`, in :func:`totals` (in
``control_bytes`` and ``wire_bytes``), in the overhead share (they carry no body), and in
:func:`by_round` under the *session* row (``round`` None: traffic not tied to one round).

Byte columns, per row (all in bytes)::

    body_bytes       the message kind's body
    envelope_bytes   payload bytes that are not body, signature or encryption (envelope fields +
                     msgpack framing)
    sig_bytes        the signature trailers of signed messages (``protocol.security``)
    enc_bytes        what encryption added (AES-GCM tags)
    mqtt_bytes       mqtt_header_bytes + topic_bytes of an application PUBLISH (framing and topic)
    control_bytes    what a control-packet row's packet put on the link (0 for application messages)
    unsent_bytes     of an application PUBLISH the socket took only part of (the connection was
                     lost, or the transport closed, with it partly written; ledger schema 6): the
                     bytes it never took, which the columns above count (they size whole packets)
    wire_bytes       what crossed the link: mqtt_header_bytes + topic_bytes + payload_bytes −
                     unsent_bytes (the ledger's column, control packets' included),
                     so wire = body + envelope + sig + enc + mqtt + control − unsent

``signed_messages`` / ``encrypted_messages`` count the rows that carried a signature / an
encrypted body. A chunked transfer's chunks are each signed (and their bodies encrypted on
uploads), so these costs are all on the wire rows.

and the protocol **overhead share** = (wire_bytes − body_bytes) / wire_bytes, a fraction in [0, 1]
(``None`` where nothing was sent: 0 / 0 has no meaning).

**Body fields.** :func:`body_fields` shows what ``global`` and ``update`` bodies are made of:
model ``tensors``, each named ``extras.<name>`` entry, and the rest, with the tensor values'
bytes before the codec (``raw_bytes``). It reads each message once, as its **sender** encoded it
(the sender's ``fields`` column breaks ``extras`` down per entry; the receiver's holds one lump):
the agents' rows for uploads, the server's for downloads, whole-message rows only
(:func:`whole_message`: a chunked transfer's ``event='message'`` row, never its chunk rows).

The summary functions (:func:`by_round`, :func:`by_round_kind`, :func:`by_client`,
:func:`by_kind`, :func:`body_fields`, :func:`totals`, :func:`rejected`, :func:`bytes_to_target`,
:func:`cumulative_bytes`, :func:`cumulative_parts`, :func:`link_time_s`, :func:`comparison_row`) are pure: ledger rows
(mappings with the columns of the ``messages`` table, as :func:`protocol.ledger.read_rows` yields
them, in ledger order) and metrics records in, plain JSON-serialisable lists and dicts out. Rows
are read by column name; columns the audit does not know are ignored, and optional ones that are
missing (``reason``, ``topic``, ``node`` …) read as empty. The sums are SQL ``GROUP BY`` queries:
the rows are loaded into an in-memory SQLite table first (:func:`memory_ledger`). Each of these
functions also takes, instead of rows, an open connection from :func:`open_ledger` (read-only,
on ``RUN_DIR/ledger.sqlite``), which :func:`audit_report` uses: the queries then run on the
ledger file itself, without loading its rows into Python.

**Resumed runs.** A run killed or interrupted and continued with ``--resume`` keeps in its
ledger the rows of every attempt (they crossed the wire: the ledger equals the socket's bytes).
The server notes each resume in the ledger's ``meta`` (``resumes``: the checkpoint round it went
on from and the last row id before it; :mod:`broker_server.resumes`), and :func:`resume_bytes`
tells the bytes an uninterrupted run would not have sent: *re-sent* (the interrupted session's
rows of the rounds after that checkpoint, run again after the resume), *ending* (that session's
control packets and statuses after them, and its ``finish``) and *reconnecting* (the resumed
session's connections, joins and statuses before it sends the first download of a round after
the checkpoint); a refused ``--resume`` attempt (its checkpoint did not load) adds its
session's rows, its connections, and continues nothing. After round 0 the note's ``registry``
(the devices of the checkpoint taken back) tells two resumes apart: with none (no checkpoint
yet) the resumed session is the whole run again, every device joining it, so the *interrupted*
session's connections and joins are the extra ones; from round 0's checkpoint (written once the
devices had joined, with their registry) the devices come back through their ``online`` status
as after any later round, so the interrupted session's joins are the run's own and only what
the resumed session added (its connections, statuses, a join made again) is extra. A note
without ``registry`` (written before it was noted) is read from the resumed session's rows: a
``join`` there, everyone joined again; none, the devices came back. The report's ``resume``
(:func:`resume_report`) holds them per view; the text, HTML and comparison say them in a line
("Resumed after round 2 (1 resume): … bytes belong to it: … re-sent (round 3's first attempt,
sent again after the resume), … ending the interrupted session … and … reconnecting …"; after
round 0, "Resumed before its first checkpoint (1 resume: the run started again from round 1)"
or "Resumed after round 0 (1 resume: its checkpoint held the devices that had joined)") and a
table. A ledger written before resumes were noted, of a run whose ``summary.json`` names a
resume, is said to be resumed with the attribution unknown; a note that is there but unreadable,
or implausible (beyond the ledger's last round or row, negative, repeated), is said to be so,
with the attribution unknown.

**What the devices sent or received again** (a resume's or reconnect's cost on the device links,
as the devices' own ledgers tell it). An agent's ``--out`` folder notes no resume: its server's
ledger does. :func:`repeat_bytes` counts, per device, the rows an uninterrupted session does not
have: *copies after the first* (a round's ``global``, ``round_start`` (per topic), ``update``,
``receipt``, ``finish``, or a ``join``, sent or received again, a message delivered twice, and
every ``resend`` request), MQTT *retransmissions* (``PUBLISH-DUP`` rows) and *reconnections*
(CONNECT, CONNACK, SUBSCRIBE, SUBACK from the first CONNECT after the device's first message).
Exact, row by row; whatever made a message go again counts (the ledger does not say why), and
the rows that no message or outage can be told from (the acknowledgements of those messages,
pings, the ``online`` status published again after a reconnect) do not. The report's ``repeats``
holds them; the text and HTML say them in a line ("Resume/reconnect cost on the device links
(what was sent or received again): …"), the comparison's ``resume B`` gives a device's own
ledger's as "N again" (never "0: never resumed", which only a server's ledger can say), the CSV
and the comparison rows in ``repeat_*``, and the fleet total sums them.

**Fleet total.** Several ledgers of one federation (a fleet's agent folders) have a fleet total
(:func:`fleet_total`): the device-link bytes and messages summed over them, and what they sent
or received again. The text and HTML comparisons print it, and ``fedfleet audit --json`` gives
it as ``fleet_total`` in each report (the same object; None for a single run or runs of other
federations, which the text says in one line). Its ``runs`` counts the device ledgers (those
with device-link rows: a server's folder adds none), ``ledgers`` every ledger summed.

**Unclean close.** A ledger file that its writer did not close (:meth:`protocol.ledger.Ledger.close`
returns it from WAL mode to a rollback journal) is reported: ``ledger_closed`` False in the
report, and one line in the text and HTML.
"""

from ._cli import add_audit_arguments, main_audit, run_audit
from ._cost import accuracy_curve, bytes_to_target, first_round_reaching, link_time_s
from ._csv import write_csv
from ._fields import body_fields, field_bytes_per_client_round, field_codecs
from ._format import short_run_labels as _short_run_labels  # noqa: F401  (tests import it)
from ._html import render_html, write_html
from ._load import LEDGER_NAME, METRICS_NAME, AuditError, RunAudit, load_run, memory_ledger, open_ledger
from ._queries import (
    CONTROL_KINDS,
    VIEWS,
    by_client,
    by_kind,
    by_round,
    by_round_kind,
    cumulative_bytes,
    cumulative_parts,
    is_control,
    rejected,
    repeat_bytes,
    resume_bytes,
    round_label,
    totals,
    whole_message,
)
from ._report import DEFAULT_TARGET, audit_report, comparison_row, fleet_total, resume_report
from ._text import render_comparison_text, render_text

__all__ = [
    "CONTROL_KINDS",
    "DEFAULT_TARGET",
    "LEDGER_NAME",
    "METRICS_NAME",
    "VIEWS",
    "AuditError",
    "RunAudit",
    "accuracy_curve",
    "add_audit_arguments",
    "audit_report",
    "body_fields",
    "by_client",
    "by_kind",
    "by_round",
    "by_round_kind",
    "bytes_to_target",
    "comparison_row",
    "cumulative_bytes",
    "cumulative_parts",
    "field_bytes_per_client_round",
    "field_codecs",
    "first_round_reaching",
    "fleet_total",
    "is_control",
    "link_time_s",
    "load_run",
    "main_audit",
    "memory_ledger",
    "open_ledger",
    "rejected",
    "render_comparison_text",
    "render_html",
    "render_text",
    "repeat_bytes",
    "resume_bytes",
    "resume_report",
    "round_label",
    "run_audit",
    "totals",
    "whole_message",
    "write_csv",
    "write_html",
]
