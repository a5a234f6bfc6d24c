"""The audit's plots (matplotlib, Agg canvas), each returned as an ``<img>`` with the figure
embedded as a base64 PNG, for the self-contained HTML report."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

from ._format import human, overhead_parts, pct
from ._queries import round_key, round_label


def _png(fig: Any) -> str:
    """An ``<img>`` with the figure embedded as a base64 PNG (rendered with the Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="">'


def _figure(width: float = 9.0, height: float = 4.0) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _mpl_text(text: str) -> str:
    """Text safe for a matplotlib label: no mathtext, no leading underscore (hidden in legends)."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _unit(max_bytes: float) -> tuple[float, str]:
    """Divisor and unit name for a byte axis."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if max_bytes >= scale:
            return float(scale), unit
    return 1.0, "B"


def plot_by_round(report: Mapping[str, Any]) -> str:
    """Stacked bars: wire bytes per round by kind, one panel per direction; control packets grouped."""
    entries = report.get("by_round_kind") or []
    rounds = sorted({e["round"] for e in entries}, key=round_key)
    kinds = sorted({("control packets" if e["control"] else e["kind"]) for e in entries},
                   key=lambda k: (k == "control packets", k))
    fig = _figure(10, 5.5)
    axes = fig.subplots(2, 1, sharex=True)
    peak = max([sum(e["wire_bytes"] for e in entries if e["round"] == r and e["direction"] == d)
                for r in rounds for d in ("up", "down")] or [0])
    scale, unit = _unit(peak)
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    colors = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    xs = list(range(len(rounds)))
    for ax, direction, title in ((axes[0], "up", "uplink (agents → server)"),
                                 (axes[1], "down", "downlink (server → agents)")):
        bottom = [0.0] * len(rounds)
        for kind in kinds:
            heights = [sum(e["wire_bytes"] for e in entries
                           if e["round"] == r and e["direction"] == direction
                           and ("control packets" if e["control"] else e["kind"]) == kind) / scale
                       for r in rounds]
            if any(heights):
                ax.bar(xs, heights, bottom=bottom, color=colors[kind], label=_mpl_text(kind), width=0.7)
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, r, top in zip(xs, rounds, bottom, strict=True):
            total = sum(e["wire_bytes"] for e in entries if e["round"] == r and e["direction"] == direction)
            if total:
                ax.annotate(human(total), (x, top), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7)
        ax.set_ylim(0, max(bottom + [0.0]) * 1.15 or 1)
        ax.set_ylabel(f"wire {unit}")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if not rounds:
        axes[0].text(0.5, 0.5, "no traffic in the ledger", ha="center", va="center", transform=axes[0].transAxes)
    axes[1].set_xticks(xs, [round_label(r) for r in rounds])
    axes[1].set_xlabel("round (session = traffic without a round: control packets …)")
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    if labels:
        fig.legend([handles[lab] for lab in labels], labels, loc="outside right upper", fontsize=8)
    fig.suptitle("Device-link bytes per round, by kind and direction", fontsize=11)
    return _png(fig)


def plot_curves(curves: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], target: float | None,
                title: str) -> str:
    """Accuracy (y) against cumulative device-link MiB (x), one line per curve."""
    fig = _figure(9, 4.5)
    ax = fig.subplots()
    plotted = False
    for label, curve in curves:
        if not curve:
            continue
        xs = [p["cumulative_bytes"] / 1024**2 for p in curve]
        ys = [p["accuracy"] for p in curve]
        (line,) = ax.plot(xs, ys, marker="o", markersize=4, label=_mpl_text(label))
        reached = next((i for i, y in enumerate(ys) if target is not None and y >= target), None)
        if reached is not None:
            ax.plot([xs[reached]], [ys[reached]], marker="*", markersize=13, color=line.get_color())
            ax.annotate(f"round {curve[reached]['round']}: {human(curve[reached]['cumulative_bytes'])}",
                        (xs[reached], ys[reached]), xytext=(6, -14), textcoords="offset points", fontsize=8)
        plotted = True
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {100 * target:g} %")
    if not plotted:
        ax.text(0.5, 0.5, "no accuracy in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("cumulative device-link wire bytes (MiB)")
    ax.set_ylabel("test accuracy (fraction)")
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    if plotted or target is not None:
        ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def plot_clients(report: Mapping[str, Any]) -> str:
    """Grouped bars: device-link wire bytes up and down per client (:func:`clients_figure`)."""
    return _png(clients_figure(report))


def clients_figure(report: Mapping[str, Any]) -> Any:
    """The figure of :func:`plot_clients`; its legend sits outside the axes, right of them, so
    that it never covers a bar (the last client's included)."""
    clients = report.get("by_client") or []
    fig = _figure(max(6.0, min(16.0, 1.0 + 0.6 * len(clients))), 4)
    ax = fig.subplots()
    scale, unit = _unit(max([max(c["up_bytes"], c["down_bytes"]) for c in clients] or [0]))
    xs = list(range(len(clients)))
    ax.bar([x - 0.2 for x in xs], [c["up_bytes"] / scale for c in clients], width=0.4, label="up")
    ax.bar([x + 0.2 for x in xs], [c["down_bytes"] / scale for c in clients], width=0.4, label="down")
    ax.set_xticks(xs, [_mpl_text(c["client"]) for c in clients], rotation=45 if len(clients) > 8 else 0,
                  ha="right" if len(clients) > 8 else "center")
    ax.set_ylabel(f"wire {unit}")
    ax.set_title("Device-link bytes per client", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    if clients:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no clients in the ledger", ha="center", va="center", transform=ax.transAxes)
    return fig


def plot_overhead(report: Mapping[str, Any]) -> str:
    """Horizontal bars of body / envelope / MQTT header+topic / control bytes, numbers printed;
    right panel: the overhead parts alone."""
    tot = report["totals"]["device"]["all"]
    parts = overhead_parts(tot)
    wire = tot["wire_bytes"]
    fig = _figure(11, 3.2)
    axes = fig.subplots(1, 2)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    for ax, shown, title in ((axes[0], parts, "all device-link bytes"),
                             (axes[1], parts[1:], "overhead only (everything but the body)")):
        values = [v for _, v in shown]
        names = [n for n, _ in shown]
        ys = list(range(len(shown)))[::-1]
        ax.barh(ys, values, color=colors[len(parts) - len(shown):])
        ax.set_yticks(ys, names)
        top = max(values or [0]) or 1
        ax.set_xlim(0, top * 1.6)
        for y, v in zip(ys, values, strict=True):
            share = f"{100 * v / wire:.2f} %" if wire else "—"
            ax.text(v + top * 0.02, y, f"{v:,} B ({share})", va="center", fontsize=8)
        ax.set_xlabel("bytes")
        ax.set_title(title, fontsize=10)
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 4))
    fig.suptitle(f"Protocol overhead share: {pct(tot['overhead_share'])} of {wire:,} wire bytes", fontsize=11)
    return _png(fig)

