"""The HTML audit as a browser lays it out: three signed runs in long folders (their names longer
than a table column), rendered by a real headless Chromium (Debian's ``chromium``). A small
script added to a copy of the page measures, after layout, the page and table widths against the
viewport and the lines each run label takes; ``--dump-dom`` brings the figures back. A
screenshot is taken too (left in the test's folder to look at). The per-client plot's legend is
checked against its bars in matplotlib's own display coordinates, and the signatures/encryption
table against the hand-made rows' byte counts.

Skipped with the reason where Chromium is not installed; required when ``CI=true`` (``.ci/run``
installs it)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from broker_server.audit import audit_report, write_html  # noqa: E402
from broker_server.audit._plots import clients_figure  # noqa: E402
from protocol.ledger import Ledger, LedgerRow  # noqa: E402

FED = "fleet-trial-with-a-long-federation-name-20261201-s0"
CLIENTS = [f"raspberry-pi-{i:02d}" for i in range(12)]
SIG, ENC = 72, 17  # per signed message / per encrypted upload, as the ledger prices them
VIEWPORT = (1280, 1000)

MEASURE = """
<script>
window.addEventListener("load", () => {
  const vw = document.documentElement.clientWidth;
  const lines = (el) => Math.round(el.getBoundingClientRect().height / parseFloat(getComputedStyle(el).lineHeight));
  const out = {
    viewport: vw,
    scroll_width: document.documentElement.scrollWidth,
    table_rights: [...document.querySelectorAll("table")].map(t => Math.ceil(t.getBoundingClientRect().right)),
    table_boxes_scroll: [...document.querySelectorAll("div.table")].map(d => d.scrollWidth - d.clientWidth),
    label_lines: [...document.querySelectorAll("td.label")].map(lines),
    text_lines: [...document.querySelectorAll("td.text")].map(lines),
    images: [...document.querySelectorAll("img")].map(i => [Math.round(i.getBoundingClientRect().right),
                                                            i.naturalWidth > 0]),
  };
  const pre = document.createElement("pre");
  pre.id = "layout";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def _chromium() -> str:
    found = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but no chromium: .ci/run installs Debian's chromium")
        pytest.skip(reason="no headless browser: apt-get install chromium (Debian) to check the HTML audit's layout")
    return found


def _run(folder: Path, seed: int) -> Path:
    """A signed, encrypted run of 12 clients over 3 rounds (each row priced by hand)."""
    folder.mkdir(parents=True)
    with Ledger(folder / "ledger.sqlite") as ledger:
        ledger.set_meta("federation", FED)
        for rnd in (1, 2, 3):
            for i, c in enumerate(CLIENTS):
                body = 40_000 + 1_000 * i + seed
                for side, node, event in (("agent", c, "sent"), ("server", "server", "received")):
                    topic = f"fedfleet/v1/{FED}/up/{c}/update"
                    ledger.record(LedgerRow(
                        federation=FED, side=side, node=node, event=event, direction="up", kind="update", round=rnd,
                        client=c, sender=c, seq=rnd, topic=topic, topic_bytes=len(topic), mqtt_header_bytes=5,
                        envelope_bytes=30, body_bytes=body, payload_bytes=30 + body + SIG + ENC, qos=1,
                        sig_bytes=SIG, enc_bytes=ENC))
                topic = f"fedfleet/v1/{FED}/down/global"
                ledger.record(LedgerRow(
                    federation=FED, side="agent", node=c, event="received", direction="down", kind="global",
                    round=rnd, client=c, sender="server", seq=rnd, topic=topic, topic_bytes=len(topic),
                    mqtt_header_bytes=5, envelope_bytes=30, body_bytes=60_000, payload_bytes=30 + 60_000 + SIG, qos=1,
                    sig_bytes=SIG))
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"round": r, "accuracy": 0.5 + 0.1 * r, "loss": 1.0 / r}) + "\n" for r in (1, 2, 3)))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("audit-page") / "experiments-on-the-field-trial-machine" / "series-a"
    return [_run(root / f"mnist-fedavg-int8-zstd-delta-20261201-2323{i:02d}-s{i}", i) for i in range(3)]


def test_the_page_fits_a_browser_window(runs: list[Path], tmp_path: Path) -> None:
    browser = _chromium()
    page = write_html([audit_report(r) for r in runs], tmp_path / "report.html")
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}"]
    dom = subprocess.run([*flags, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stdout[-2000:] + dom.stderr[-2000:]
    m = json.loads(html.unescape(found.group(1)))
    assert m["viewport"] == VIEWPORT[0]
    assert m["scroll_width"] <= m["viewport"], m  # nothing runs past the page
    assert max(m["table_rights"]) <= m["viewport"], m
    assert m["table_boxes_scroll"] and max(m["table_boxes_scroll"]) == 0, m  # no table needs its scroll box
    assert m["label_lines"] and set(m["label_lines"]) == {1}, m  # run labels: one line each, never cut
    assert max(m["text_lines"]) <= 2, m
    assert all(right <= m["viewport"] and loaded for right, loaded in m["images"]), m

    shot = tmp_path / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    head = shot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == VIEWPORT


def test_signatures_and_encryption_have_their_own_table(runs: list[Path], tmp_path: Path) -> None:
    text = write_html([audit_report(runs[0])], tmp_path / "one.html").read_text(encoding="utf-8")
    section = text.split("<h3>Security: signatures and encryption</h3>")[1].split("</table>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", section, re.S)[1:]
    cells = [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r)] for r in rows]
    n = len(CLIENTS) * 3  # uploads (each signed and encrypted) = globals received (signed)
    device_up, device_down = cells[0], cells[1]
    assert device_up[:6] == ["device links", "up", f"{n:,}", f"{n * SIG:,}", f"{n:,}", f"{n * ENC:,}"]
    assert device_down[:6] == ["device links", "down", f"{n:,}", f"{n * SIG:,}", "0", "0"]
    assert cells[3][:6] == ["server link", "up", f"{n:,}", f"{n * SIG:,}", f"{n:,}", f"{n * ENC:,}"]


def test_several_folders_of_one_federation_get_a_fleet_total(runs: list[Path], tmp_path: Path) -> None:
    reports = [audit_report(r) for r in runs]
    text = write_html(reports, tmp_path / "fleet.html").read_text(encoding="utf-8")
    row = re.search(r'<td class="label">fleet total</td>(.*?)</tr>', text, re.S)
    assert row
    up = sum(rep["totals"]["device"]["up"]["wire_bytes"] for rep in reports)
    down = sum(rep["totals"]["device"]["down"]["wire_bytes"] for rep in reports)
    # by hand: per upload 5 + topic + 30 + body + SIG + ENC; per global 5 + topic + 30 + 60,000 + SIG
    topic_up = [len(f"fedfleet/v1/{FED}/up/{c}/update") for c in CLIENTS]
    hand_up = sum(3 * (5 + topic_up[i] + 30 + 40_000 + 1_000 * i + seed + SIG + ENC)
                  for seed in range(3) for i in range(len(CLIENTS)))
    hand_down = 3 * 3 * len(CLIENTS) * (5 + len(f"fedfleet/v1/{FED}/down/global") + 30 + 60_000 + SIG)
    assert (up, down) == (hand_up, hand_down)
    nums = re.findall(r'<td class="num">([^<]*)</td>', row.group(1))
    assert f"{up:,}" in nums and f"{down:,}" in nums


def test_the_client_legend_covers_no_bar(runs: list[Path]) -> None:
    fig = clients_figure(audit_report(runs[0]))
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for ax in fig.axes for p in ax.patches]
    assert len(bars) == 2 * len(CLIENTS)
    assert not [b for b in bars if b.overlaps(box)]
    assert box.x0 >= max(b.x1 for b in bars)  # right of the last client's bars
