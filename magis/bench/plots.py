"""The PNG figures of `magis bench compare` (MAGIS Figs. 9-12) and `magis bench ablation` (Fig. 13).

matplotlib's object API with its Agg canvas (no pyplot: no global figure state, no display).
A method keeps one colour in every figure; FAILURE is written where its bar would be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from magis.bench.constraints import (
    LATENCY_CONSTRAINTS,
    MAGIS,
    MEMORY_CONSTRAINTS,
    MICROBATCH,
    PARETO,
    Constraint,
)
from magis.search import Mode

FIG9 = "fig9_memory_under_latency_limit.png"
FIG10 = "fig10_latency_under_memory_limit.png"
FIG11 = "fig11_pareto.png"
FIG12 = "fig12_microbatching.png"
FIG13 = "fig13_ablation.png"


class Row(Protocol):
    """What a figure reads of a result row (`magis.bench.compare.Row`)."""

    workload: str
    method: str
    constraint: str  # a Constraint's label, PARETO or MICROBATCH
    memory_ratio: float | None
    latency_ratio: float | None
    satisfied: bool


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colours(names: Sequence[str]) -> dict[str, tuple]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def compare_figures(
    rows: Sequence[Row], workloads: Sequence[str], methods: Sequence[str], out: Path
) -> list[Path]:
    """Figs. 9-12 of a (possibly partial) comparison of `methods` on `workloads`; those with
    nothing to show are skipped."""
    if not rows:
        return []
    colours = _colours(methods)
    written = [
        _bars(rows, workloads, methods, colours, LATENCY_CONSTRAINTS, out / FIG9),
        _bars(rows, workloads, methods, colours, MEMORY_CONSTRAINTS, out / FIG10),
        _pareto(rows, workloads, methods, colours, out / FIG11),
    ]
    if any(r.constraint == MICROBATCH for r in rows):
        written.append(_microbatch(rows, out / FIG12))
    return written


def constraint_bars(
    rows: Sequence[Row],
    workloads: Sequence[str],
    methods: Sequence[str],
    constraints: Sequence[Constraint],
    path: Path,
) -> Path:
    """Figs. 9 and 10's grouped bars for any `constraints` (one panel each): `bench corpus`."""
    return _bars(rows, workloads, methods, _colours(methods), constraints, path)


def _bars(rows, workloads, methods, colours, constraints, path: Path) -> Path:
    """Grouped bars, one group per workload: memory ratio (latency limits, Fig. 9) or latency
    overhead in % (memory limits, Fig. 10)."""
    fig = _figure(max(6.0, 1.6 * len(workloads) + 2), 3.2 * len(constraints))
    axes = fig.subplots(len(constraints), 1, squeeze=False)[:, 0]
    for ax, c in zip(axes, constraints, strict=True):
        found = {(r.workload, r.method): r for r in rows if r.constraint == c.label}
        _bar_panel(ax, found, workloads, methods, colours, c)
    _legend(fig, axes)
    fig.savefig(path, dpi=110)
    return path


def _bar_panel(ax, found: Mapping, workloads, methods, colours, c: Constraint) -> None:
    width = 0.8 / max(len(methods), 1)
    memory = c.mode is Mode.LATENCY_LIMIT
    heights = [_bar_value(r, memory) for r in found.values() if r.satisfied]
    top = max([1.0 if memory else 5.0, *heights])
    for j, m in enumerate(methods):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(workloads))]
        label = m
        for x, w in zip(xs, workloads, strict=True):
            r = found.get((w, m))
            if r is None:
                continue
            height = _bar_value(r, memory) if r.satisfied else 0.0
            ax.bar(x, height, width, color=colours[m], label=label)
            label = "_nolegend_"  # one legend entry per method
            if not r.satisfied:
                ax.text(
                    x,
                    top * 0.02,
                    "FAILURE",
                    rotation=90,
                    fontsize=6,
                    color="red",
                    ha="center",
                    va="bottom",
                )
    ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
    if memory:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("peak memory ratio")
        ax.set_title(f"Fig. 9: memory under latency limit {c.ratio:g} (lower is better)")
    else:
        ax.set_ylabel("latency overhead (%)")
        ax.set_title(f"Fig. 10: latency overhead under memory limit {c.ratio:g} (lower is better)")
    ax.set_ylim(0, top * 1.15)


def _legend(fig: Figure, axes) -> None:
    """One legend below the panels, each label once (none when nothing is drawn yet)."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(
            list(entries.values()), list(entries), loc="outside lower center", ncols=5, fontsize=7
        )


def _bar_value(r: Row, memory: bool) -> float:
    return r.memory_ratio if memory else (r.latency_ratio - 1) * 100


def _grid(fig: Figure, n: int, ncols: int = 4):
    ncols = min(ncols, max(n, 1))
    nrows = math.ceil(max(n, 1) / ncols)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return axes


def _pareto(rows, workloads, methods, colours, path: Path) -> Path:
    """Fig. 11: each method's Pareto front, memory ratio against latency ratio, per workload."""
    ncols = min(4, max(len(workloads), 1))
    fig = _figure(max(4.0 * ncols, 8.0), 3.4 * math.ceil(max(len(workloads), 1) / ncols) + 0.8)
    axes = _grid(fig, len(workloads))
    for ax, w in zip(axes, workloads, strict=False):
        for m in methods:
            pts = sorted(
                (r.memory_ratio, r.latency_ratio)
                for r in rows
                if r.workload == w and r.method == m and r.constraint == PARETO
            )
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", ms=3, lw=1.2, color=colours[m], label=m)
        ax.axhline(1.0, color="grey", lw=0.6, ls="--")
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("memory ratio", fontsize=8)
        ax.set_ylabel("latency ratio", fontsize=8)
    _legend(fig, axes)
    fig.suptitle("Fig. 11: latency and memory trade-off (lower-left is better)")
    fig.savefig(path, dpi=110)
    return path


def _microbatch(rows, path: Path) -> Path:
    """Fig. 12: POFO, POFO on micro-batched graphs, and MAGIS's front, per workload."""
    workloads = sorted({r.workload for r in rows if r.constraint == MICROBATCH})
    fig = _figure(max(5.0 * len(workloads), 8.0), 4.0)
    axes = _grid(fig, len(workloads), ncols=len(workloads))
    for ax, w in zip(axes, workloads, strict=False):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r.workload != w or not r.satisfied:
                continue
            if r.constraint == MICROBATCH or (r.constraint == PARETO and r.method == MAGIS):
                series.setdefault(r.method, []).append((r.memory_ratio, r.latency_ratio))
        own = _colours(sorted(series))  # pofo, pofo xN, magis: one colour each
        for name, pts in sorted(series.items()):
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=name, color=own[name])
        failed = sorted(
            {
                r.method
                for r in rows
                if r.workload == w and r.constraint == MICROBATCH and not r.satisfied
            }
        )
        if failed:
            ax.text(
                0.02,
                0.98,
                "FAILURE: " + ", ".join(failed),
                transform=ax.transAxes,
                fontsize=7,
                color="red",
                va="top",
            )
        ax.set_title(f"{w}: micro-batching + POFO vs MAGIS", fontsize=9)
        ax.set_xlabel("memory ratio")
        ax.set_ylabel("latency ratio")
        ax.legend(fontsize=7)
    fig.suptitle("Fig. 12: micro-batching")
    fig.savefig(path, dpi=110)
    return path


def ablation_figure(
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
    ylabels: Mapping[str, str],
    title: str,
    path: Path,
) -> Path:
    """Fig. 13: per constraint, each setting's best-so-far value against search seconds (a step
    line: the value holds until the next improvement)."""
    settings = sorted({s for curves in panels.values() for s in curves})
    colours = _colours(settings)
    fig = _figure(max(4.2 * len(panels), 8.0), 4.0)
    axes = _grid(fig, len(panels), ncols=max(len(panels), 1))
    for ax, (label, curves) in zip(axes, panels.items(), strict=False):
        for s, pts in curves.items():
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.step(xs, ys, where="post", lw=1.3, color=colours[s], label=s)
        if not any(curves.values()):
            ax.text(0.5, 0.5, "no search met this limit", transform=ax.transAxes, ha="center")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("search time (s)")
        ax.set_ylabel(ylabels.get(label, ""))
    _legend(fig, axes)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path
