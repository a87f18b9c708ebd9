"""The HTML report's figures as inline SVG: text a browser draws without a script, a font or
a network request, and that stays searchable and sharp at any zoom.

Three charts: memory over the schedule's steps (one curve per schedule, a limit line, each
peak marked with its holders), stacked bars of the peak by category, and the search's
improvements as points of latency against peak memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

import numpy as np

WIDTH, HEIGHT = 880, 360
LEFT, RIGHT, TOP, BOTTOM = 84, 24, 20, 46
MAX_POINTS = 1200  # a curve keeps each bucket's least and greatest value beyond this

CATEGORY_COLOURS = {
    "weights": "#4e79a7",
    "buffers": "#9c755f",
    "optimizer_state": "#b07aa1",
    "inputs": "#bab0ac",
    "gradients": "#f28e2b",
    "activations": "#e15759",
    "temporaries": "#76b7b2",
}


@dataclass(frozen=True)
class Curve:
    """Bytes at each step of one schedule, and who holds its peak."""

    label: str
    values: np.ndarray
    colour: str
    holders: Sequence[str] = field(default=())


def size_text(n: float, digits: int = 2) -> str:
    """Bytes as people read them (binary units)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def tick_size_text(n: float) -> str:
    """An axis tick's bytes: round values, written without trailing zeros."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def time_text(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def tick_time_text(s: float) -> str:
    """An axis tick's seconds: round values, written without trailing zeros."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if abs(s) >= scale:
            return f"{round(s / scale, 6):g} {unit}"
    return f"{round(s * 1e6, 6):g} µs"


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def _byte_ticks(hi: float) -> list[float]:
    """Ticks in whole binary units (MiB, GiB) from 0 to `hi`."""
    scale = next((s for s in (2**30, 2**20, 2**10) if hi >= 2 * s), 1)
    return [t * scale for t in _ticks(0, hi / scale)]


class _Frame:
    """A plot area mapping data coordinates to pixels."""

    def __init__(self, x: tuple[float, float], y: tuple[float, float], w=WIDTH, h=HEIGHT):
        self.x0, self.x1 = x
        self.y0, self.y1 = y
        self.w, self.h = w, h

    def px(self, x: float) -> float:
        span = (self.x1 - self.x0) or 1
        return LEFT + (x - self.x0) / span * (self.w - LEFT - RIGHT)

    def py(self, y: float) -> float:
        span = (self.y1 - self.y0) or 1
        return self.h - BOTTOM - (y - self.y0) / span * (self.h - TOP - BOTTOM)

    def axes(self, xticks, yticks, xfmt, yfmt, xlabel: str, ylabel: str) -> list[str]:
        out = [
            f'<rect x="{LEFT}" y="{TOP}" width="{self.w - LEFT - RIGHT}" '
            f'height="{self.h - TOP - BOTTOM}" fill="#fbfbfb" stroke="#999"/>'
        ]
        for t in yticks:
            y = self.py(t)
            out.append(
                f'<line x1="{LEFT}" x2="{self.w - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            )
            out.append(
                f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(yfmt(t))}</text>'
            )
        for t in xticks:
            x = self.px(t)
            out.append(
                f'<text x="{x:.1f}" y="{self.h - BOTTOM + 16}" text-anchor="middle">'
                f"{escape(xfmt(t))}</text>"
            )
        out.append(
            f'<text x="{(LEFT + self.w - RIGHT) / 2}" y="{self.h - 8}" text-anchor="middle" '
            f'class="label">{escape(xlabel)}</text>'
        )
        out.append(
            f'<text transform="translate(14 {(TOP + self.h - BOTTOM) / 2}) rotate(-90)" '
            f'text-anchor="middle" class="label">{escape(ylabel)}</text>'
        )
        return out


def _svg(body: list[str], w: int = WIDTH, h: int = HEIGHT, title: str = "") -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" '
        f'height="{h}" role="img" aria-label="{escape(title)}">' + "".join(body) + "</svg>"
    )


def _thinned(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a curve, at most ~2 * MAX_POINTS of them, keeping every bucket's
    least and greatest value (so the peak is drawn where it is)."""
    n = len(values)
    steps = np.arange(n)
    if n <= 2 * MAX_POINTS:
        return steps, values
    edges = np.linspace(0, n, MAX_POINTS + 1).astype(int)
    xs, ys = [], []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        chunk = values[a:b]
        lo, hi = int(np.argmin(chunk)), int(np.argmax(chunk))
        for k in sorted({lo, hi}):
            xs.append(a + k)
            ys.append(chunk[k])
    return np.array(xs), np.array(ys)


def memory_timeline_svg(curves: Sequence[Curve], limit: float | None) -> str:
    """Bytes on the device at each step of each schedule (a plan's schedule may be longer than
    the program order: re-computations and copies add steps), with the memory limit and each
    curve's peak."""
    top = max([float(c.values.max()) for c in curves] + [limit or 0.0]) * 1.08
    longest = max(len(c.values) for c in curves)
    frame = _Frame((0, max(longest - 1, 1)), (0, top))
    body = frame.axes(
        _ticks(0, longest - 1),
        _byte_ticks(top),
        lambda t: f"{t:.0f}",
        tick_size_text,
        "step of the schedule",
        "device memory",
    )
    if limit is not None:
        y = frame.py(limit)
        body.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="limit"/>'
        )
        body.append(
            f'<text x="{WIDTH - RIGHT - 4}" y="{y - 5:.1f}" text-anchor="end" class="limit-text">'
            f"limit {escape(size_text(limit))}</text>"
        )
    for k, c in enumerate(curves):
        xs, ys = _thinned(c.values)
        pts = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in zip(xs, ys, strict=True))
        body.append(
            f'<polyline points="{pts}" fill="none" stroke="{c.colour}" stroke-width="1.6">'
            f"<title>{escape(c.label)}</title></polyline>"
        )
        body += _peak_marker(frame, c, k)
    body += _legend([(c.label, c.colour) for c in curves])
    return _svg(body, title="device memory over the schedule")


def _peak_marker(frame: _Frame, c: Curve, k: int) -> list[str]:
    step = int(np.argmax(c.values))
    peak = float(c.values[step])
    x, y = frame.px(step), frame.py(peak)
    anchor = "end" if x > WIDTH * 0.6 else "start"
    dx = -8 if anchor == "end" else 8
    lines = [f"{c.label} peak {size_text(peak)} at step {step}", *c.holders[:3]]
    out = [
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{c.colour}" stroke="#222">'
        f"<title>{escape(chr(10).join([lines[0], *c.holders]))}</title></circle>"
    ]
    ty = y + 14 + 44 * k
    for j, line in enumerate(lines):
        cls = "peak-head" if j == 0 else "peak-holder"
        out.append(
            f'<text x="{x + dx:.1f}" y="{ty + 13 * j:.1f}" text-anchor="{anchor}" class="{cls}">'
            f"{escape(line)}</text>"
        )
    return out


def _legend(
    items: Sequence[tuple[str, str]], x: float = LEFT + 10, y: float = TOP + 14
) -> list[str]:
    out = []
    for j, (label, colour) in enumerate(items):
        yy = y + 16 * j
        out.append(f'<rect x="{x}" y="{yy - 9}" width="12" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 17}" y="{yy}">{escape(label)}</text>')
    return out


def breakdown_svg(rows: Sequence[tuple[str, dict[str, int]]]) -> str:
    """One horizontal bar per schedule, its peak split by category."""
    h = 46 * len(rows) + 84
    top = max(sum(b.values()) for _, b in rows) * 1.05 or 1
    left, right = 160, WIDTH - RIGHT

    def px(v: float) -> float:
        return left + v / top * (right - left)

    body = []
    for t in _byte_ticks(top):
        x = px(t)
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="16" y2="{h - 64}" class="grid"/>')
        body.append(
            f'<text x="{x:.1f}" y="{h - 50}" text-anchor="middle">{escape(tick_size_text(t))}</text>'
        )
    for j, (label, parts) in enumerate(rows):
        y = 20 + 46 * j
        body.append(f'<text x="{left - 8}" y="{y + 20}" text-anchor="end">{escape(label)}</text>')
        at = 0.0
        for cat, nbytes in parts.items():
            if nbytes <= 0:
                continue
            x0, x1 = px(at), px(at + nbytes)
            body.append(
                f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 0.5):.1f}" height="30" '
                f'fill="{CATEGORY_COLOURS.get(cat, "#888")}"><title>{escape(cat)}: '
                f"{escape(size_text(nbytes))}</title></rect>"
            )
            at += nbytes
    cats = [c for c in CATEGORY_COLOURS if any(p.get(c, 0) > 0 for _, p in rows)]
    for j, c in enumerate(cats):
        x = left + 118 * j
        body.append(
            f'<rect x="{x}" y="{h - 30}" width="12" height="10" fill="{CATEGORY_COLOURS[c]}"/>'
        )
        body.append(f'<text x="{x + 16}" y="{h - 21}">{escape(c.replace("_", " "))}</text>')
    return _svg(body, h=h, title="peak by category")


@dataclass(frozen=True)
class Point:
    latency_s: float
    peak_bytes: int
    label: str
    kind: str  # "program", "found", "front" (not dominated) or "plan"


POINT_STYLE = {
    "program": ('fill="#222"', 6),
    "found": ('fill="#bbb" stroke="#777"', 4),
    "front": ('fill="#59a14f" stroke="#2d5a27"', 5),
    "plan": ('fill="#e15759" stroke="#222"', 7),
}


def pareto_svg(points: Sequence[Point], mem_limit: float | None, lat_limit: float | None) -> str:
    """Latency against peak memory of the program order, of each improvement the search
    recorded (the ones no other beats in both figures highlighted) and of the plan."""
    lats = [p.latency_s for p in points] + [v for v in (lat_limit,) if v]
    peaks = [p.peak_bytes for p in points] + [v for v in (mem_limit,) if v]
    lo, hi = min(lats), max(lats)
    pad = (hi - lo) * 0.08 or hi * 0.05 or 1e-6
    frame = _Frame((lo - pad, hi + pad), (0, max(peaks) * 1.1))
    body = frame.axes(
        _ticks(lo - pad, hi + pad),
        _byte_ticks(max(peaks) * 1.1),
        tick_time_text,
        tick_size_text,
        "simulated latency",
        "simulated peak memory",
    )
    if mem_limit:
        y = frame.py(mem_limit)
        body.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="limit"/>'
        )
    if lat_limit:
        x = frame.px(lat_limit)
        body.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" class="limit"/>'
        )
    for kind in ("found", "front", "program", "plan"):
        style, r = POINT_STYLE[kind]
        for p in points:
            if p.kind == kind:
                body.append(
                    f'<circle cx="{frame.px(p.latency_s):.1f}" cy="{frame.py(p.peak_bytes):.1f}" '
                    f'r="{r}" {style}><title>{escape(p.label)}</title></circle>'
                )
    legend = [("program order", "#222"), ("improvement", "#bbb"), ("Pareto front", "#59a14f")]
    body += _legend([*legend, ("the plan", "#e15759")], x=WIDTH - RIGHT - 150)
    return _svg(body, title="the search's improvements")
