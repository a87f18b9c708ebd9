"""A plan as one self-contained HTML page (`magis report PLAN --html OUT`, issue #17).

The page needs nothing but itself: inline CSS and inline SVG figures (`figures.py`), no script,
no font, no image or request of any kind, so it opens offline, from a mail attachment, or in a
CI artifact viewer. Its sections:

1. the plan's figures against the captured program order (MAGIS §7's memory and latency ratios);
2. device memory over the schedule, before (program order) and after (the plan), with the
   memory limit and each peak's largest holders (MAGIS §2.1's hot-spots);
3. the peak by category (weights, activations, ...), before and after;
4. the explain table: the search's decisions, one row each (`magis.explain`);
5. the Pareto points: each improvement the search recorded (MAGIS Alg. 3), latency against
   peak, and those no other point beats in both;
6. predicted against measured figures, when the plan was run (`magis run W --plan PLAN
   --json RUN.json`: a `RunReport`'s JSON).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import TYPE_CHECKING, Any

from magis.explain import explain
from magis.ir import Graph
from magis.plan import Plan
from magis.report.figures import (
    CATEGORY_COLOURS,
    Curve,
    Point,
    breakdown_svg,
    memory_timeline_svg,
    pareto_svg,
    size_text,
    time_text,
)
from magis.sim import SimResult, simulate

if TYPE_CHECKING:
    from magis.cost import CostModel

BEFORE_COLOUR, AFTER_COLOUR = "#4e79a7", "#e15759"
HOLDERS = 8

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
margin:0 auto;max-width:960px;padding:16px 24px 40px;background:#fff}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#555;margin:0 0 12px}.met{color:#2d7d2d;font-weight:600}.unmet{color:#b3261e;font-weight:600}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
svg{display:block;max-width:100%;height:auto;font:12px system-ui,sans-serif}
svg .grid{stroke:#e4e4e4}svg .label{fill:#444}svg .limit{stroke:#b3261e;stroke-dasharray:6 4}
svg .limit-text{fill:#b3261e}svg .peak-head,svg .peak-holder,svg .limit-text{paint-order:stroke;
stroke:#fbfbfb;stroke-width:3px;stroke-linejoin:round}svg .peak-head{font-weight:600}svg .peak-holder{fill:#444;font-size:11px}
.note{color:#555;font-size:13px}code{background:#f4f4f4;padding:0 3px}
"""


def render_report(
    plan: Plan,
    measured: Mapping[str, Any] | None = None,
    *,
    program: Graph | None = None,
    cost: CostModel | None = None,
) -> str:
    """The HTML page of `plan`. `measured` is a `magis run --json` report of the plan;
    `program` the captured graph the plan was made from (its program order is the "before";
    without it only the plan's summary figures stand for it); `cost` the model the plan was
    searched under (by default the one its summary names)."""
    from magis.cost import get_cost_model

    s = plan.summary
    cost = cost if cost is not None else get_cost_model(s.hardware)
    after = simulate(plan.graph, plan.order, cost)
    before = simulate(program, program.program_order(), cost) if program is not None else None
    title = f"magis plan: {s.workload or 'a captured step'} on {s.hardware}"
    sections = [
        _summary_section(plan, before, after),
        _timeline_section(plan, before, after),
        _breakdown_section(before, after),
        _explain_section(plan),
        _pareto_section(plan),
        _measured_section(plan, after, measured),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<link rel="icon" href="data:,"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n<h1>{escape(title)}</h1>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], numeric=()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="n">{escape(str(v))}</td>' if j in numeric else f"<td>{escape(str(v))}</td>"
            for j, v in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _summary_section(plan: Plan, before: SimResult | None, after: SimResult) -> str:
    s = plan.summary
    limit = size_text(s.limit) if s.mode == "mem-limit" else time_text(s.limit)
    status = '<span class="met">met</span>' if s.satisfied else '<span class="unmet">NOT met</span>'
    rows = [
        (
            "peak memory",
            size_text(s.program_order_peak_bytes),
            size_text(s.peak_bytes),
            f"{s.memory_ratio:.3f}",
        ),
        (
            "latency",
            time_text(s.program_order_latency_s),
            time_text(s.latency_s),
            f"{s.latency_ratio:.3f}",
        ),
        ("host memory (swaps)", "0 B", size_text(s.host_peak_bytes), ""),
        ("schedule steps", str(len(before.order)) if before else "", str(len(plan.order)), ""),
    ]
    search = (
        f"{s.states_explored} states in {s.seconds:.1f} s of search "
        f"({s.wall_seconds:.1f} s end to end){', interrupted' if s.interrupted else ''}; "
        f"memory counted as {escape(s.memory_figure)}"
    )
    return (
        '<section id="summary"><h2>The plan</h2>'
        f'<p class="sub">Limit: {escape(s.mode)} {escape(limit)} ({s.limit_ratio:.3f} of the '
        f"program order): {status}. {search}.</p>"
        + _table(["figure", "program order", "plan", "ratio"], rows, numeric={1, 2, 3})
        + "</section>"
    )


def _holders(sim: SimResult) -> list[str]:
    return [f"{h.name} {size_text(h.nbytes)}" for h in sim.top_hotspots(HOLDERS)]


def _timeline_section(plan: Plan, before: SimResult | None, after: SimResult) -> str:
    s = plan.summary
    curves = []
    if before is not None:
        curves.append(Curve("program order", before.timeline, BEFORE_COLOUR, _holders(before)))
    curves.append(Curve("plan", after.timeline, AFTER_COLOUR, _holders(after)))
    limit = s.limit if s.mode == "mem-limit" else None
    note = (
        ""
        if before is not None
        else '<p class="note">The program order (peak '
        f"{escape(size_text(s.program_order_peak_bytes))}) is not drawn: its captured graph "
        "was not given (a plan file holds only its own graph; `magis report` captures the "
        "plan's workload again, which a plan of a user's own step does not name).</p>"
    )
    rows = [
        (
            h.name,
            h.op,
            "×".join(map(str, h.shape)),
            size_text(h.nbytes),
            h.category.value if h.category else "",
        )
        for h in after.top_hotspots(HOLDERS)
    ]
    return (
        '<section id="timeline"><h2>Device memory over the schedule</h2>'
        + memory_timeline_svg(curves, limit)
        + note
        + f"<p>The plan's peak, {escape(size_text(after.peak_bytes))} at step {after.peak_step}, "
        "is held by (largest first):</p>"
        + _table(["tensor", "op", "shape", "size", "category"], rows, numeric={3})
        + "</section>"
    )


def _breakdown_section(before: SimResult | None, after: SimResult) -> str:
    runs = ([("program order", before)] if before is not None else []) + [("plan", after)]
    bars = breakdown_svg([(name, dict(r.breakdown)) for name, r in runs])
    cats = [c for c in CATEGORY_COLOURS if any(r.breakdown.get(c, 0) for _, r in runs)]
    rows = [
        (c.replace("_", " "), *(size_text(r.breakdown.get(c, 0)) for _, r in runs)) for c in cats
    ]
    rows.append(("total at the peak", *(size_text(r.peak_bytes) for _, r in runs)))
    return (
        '<section id="breakdown"><h2>The peak by category</h2>'
        + bars
        + _table(
            ["category", *(name for name, _ in runs)], rows, numeric=set(range(1, len(runs) + 1))
        )
        + "</section>"
    )


def _explain_section(plan: Plan) -> str:
    doc = explain(plan).to_json()
    rows = [
        (
            r["step"],
            r["rule"],
            r["description"],
            ", ".join(r.get("modules", [])[:3]),
            size_text(r["bytes_saved"]),
            time_text(r["time_added_s"])
            if r["time_added_s"] >= 0
            else "-" + time_text(-r["time_added_s"]),
        )
        for r in doc["rows"]
    ]
    note = f'<p class="note">{escape(doc["note"])}</p>' if doc.get("note") else ""
    total = (
        f"<p>The rows took {escape(size_text(doc['bytes_saved']))} off the peak "
        f"(program order minus plan: {escape(size_text(doc['peak_reduction_bytes']))}) and "
        f"added {escape(time_text(abs(doc['time_added_s'])))} of latency"
        f"{' (a saving)' if doc['time_added_s'] < 0 else ''}.</p>"
    )
    return (
        '<section id="explain"><h2>Decisions (magis explain)</h2>'
        + note
        + (
            total
            + _table(
                ["step", "rule", "what", "modules", "bytes saved", "time added"], rows, {0, 4, 5}
            )
            if rows
            else ""
        )
        + "</section>"
    )


def pareto_points(plan: Plan) -> list[Point]:
    """The program order, every improvement the search recorded (those no other point beats in
    both peak and latency marked "front") and the plan."""
    s = plan.summary
    found = [(lat, peak, sec) for sec, peak, lat in s.improvements]
    points = [
        Point(s.program_order_latency_s, s.program_order_peak_bytes, "program order", "program")
    ]
    for lat, peak, sec in found:
        dominated = any(
            (ol <= lat and op <= peak) and (ol < lat or op < peak) for ol, op, _ in found
        )
        label = f"found at {sec:.1f} s: {size_text(peak)}, {time_text(lat)}"
        points.append(Point(lat, peak, label, "found" if dominated else "front"))
    points.append(
        Point(
            s.latency_s,
            s.peak_bytes,
            f"the plan: {size_text(s.peak_bytes)}, {time_text(s.latency_s)}",
            "plan",
        )
    )
    return points


def _pareto_section(plan: Plan) -> str:
    s = plan.summary
    points = pareto_points(plan)
    mem_limit = s.limit if s.mode == "mem-limit" else None
    lat_limit = s.limit if s.mode == "lat-limit" else None
    rows = [
        (
            f"{sec:.2f}",
            size_text(peak),
            f"{peak / s.program_order_peak_bytes:.3f}",
            time_text(lat),
            f"{lat / s.program_order_latency_s:.3f}",
            "yes" if p.kind == "front" else "",
        )
        for (sec, peak, lat), p in zip(s.improvements, points[1:-1], strict=True)
    ]
    return (
        '<section id="pareto"><h2>What the search found</h2>'
        + pareto_svg(points, mem_limit, lat_limit)
        + f"<p>{len(s.improvements)} improvements recorded; the green ones are the Pareto front "
        "(no other point has both less memory and less latency).</p>"
        + _table(
            ["found at (s)", "peak", "memory ratio", "latency", "latency ratio", "front"],
            rows,
            {0, 1, 2, 3, 4},
        )
        + "</section>"
    )


def _measured_section(plan: Plan, after: SimResult, measured: Mapping[str, Any] | None) -> str:
    if measured is None:
        return (
            '<section id="measured"><h2>Predicted and measured</h2><p class="note">This plan was '
            "not run for this report. <code>magis run WORKLOAD --plan PLAN --json RUN.json</code> "
            "runs it (a :tiny or :small workload on this machine), and <code>magis report PLAN "
            "--html OUT --measured RUN.json</code> puts the figures here.</p></section>"
        )
    m = measured
    rows = [
        (
            "peak memory",
            size_text(after.peak_bytes),
            size_text(m["simulated_peak_bytes"]),
            size_text(m["measured_peak_bytes"]),
            f"{m['peak_error']:.1%}",
        ),
        (
            "latency",
            time_text(after.latency_s),
            time_text(m["simulated_latency_s"]),
            time_text(m["latency_s"]),
            f"{abs(m['simulated_latency_s'] - m['latency_s']) / max(m['latency_s'], 1e-12):.1%}",
        ),
        (
            "host memory (swaps)",
            size_text(after.host_peak_bytes),
            size_text(m.get("simulated_host_peak_bytes", 0)),
            size_text(m.get("measured_host_peak_bytes", 0)),
            "",
        ),
    ]
    verdict = "verified" if m["verified"] else "NOT verified"
    cls = "met" if m["verified"] else "unmet"
    return (
        '<section id="measured"><h2>Predicted and measured</h2>'
        f"<p>Run as {escape(str(m['workload']))} ({escape(str(m['dtype']))}) on "
        f'{escape(str(m.get("device", "cpu")))}: <span class="{cls}">{verdict}</span> against eager '
        f"PyTorch (largest relative error {m['max_rel_err']:.2e}, tolerance {m['tolerance']:.0e}).</p>"
        + _table(
            [
                "figure",
                f"predicted ({plan.summary.hardware})",
                f"simulated ({m['hardware']})",
                "measured",
                "error",
            ],
            rows,
            {1, 2, 3, 4},
        )
        + "</section>"
    )
