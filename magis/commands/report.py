"""`magis report`: a plan as the HTML page a person opens (issue #17).

`report` writes a plan's self-contained HTML page (`magis.report.html`). Its "before" is the
program order of the workload the plan names, captured again (a plan file holds only its own
graph); its measured figures come from a `magis run W --plan PLAN --json RUN.json` file
(`--measured`), or from running the plan now on the CPU (`--run`, :tiny and :small workloads).
A RUN.json is checked against the plan: its simulated peak must be the plan's, which no other
plan's is but by chance.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from magis.capture import workload_step
from magis.commands.shared import Progress, silent
from magis.cost import get_cost_model
from magis.errors import MagisError, PlanError
from magis.ir import Graph
from magis.plan import Plan
from magis.report.html import render_report
from magis.sim import simulate


class MeasuredRunError(MagisError):
    """A `--measured` file that is not a `magis run --json` report of this plan."""


# The fields of a RunReport the page shows, with their JSON types.
MEASURED_FIELDS: dict[str, tuple[type, ...]] = {
    "workload": (str,),
    "dtype": (str,),
    "verified": (bool,),
    "max_rel_err": (int, float),
    "tolerance": (int, float),
    "measured_peak_bytes": (int,),
    "simulated_peak_bytes": (int,),
    "peak_error": (int, float),
    "latency_s": (int, float),
    "simulated_latency_s": (int, float),
    "hardware": (str,),
}


@dataclass(frozen=True)
class ReportSummary:
    plan: str
    html: str
    html_bytes: int
    workload: str | None
    program_order_drawn: bool
    measured: bool
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def report(
    plan_path: str | Path,
    html_path: str | Path,
    measured_path: str | Path | None = None,
    run: bool = False,
    progress: Progress = silent,
) -> ReportSummary:
    """Write the HTML page of the plan at `plan_path` to `html_path` (see the module docstring)."""
    start = time.perf_counter()
    if run and measured_path is not None:
        raise MagisError("--run measures the plan now; --measured reads a measurement: pick one")
    progress("reading the plan")
    plan = Plan.load(plan_path)
    cost = get_cost_model(plan.summary.hardware)
    measured = read_measured(measured_path, plan) if measured_path is not None else None
    if run:
        measured = run_plan_now(plan, plan_path, progress)
    program = program_graph(plan, progress)
    progress("drawing the page")
    page = render_report(plan, measured, program=program, cost=cost)
    html_path = Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(page, encoding="utf-8")
    return ReportSummary(
        plan=str(plan_path),
        html=str(html_path),
        html_bytes=len(page.encode()),
        workload=plan.summary.workload,
        program_order_drawn=program is not None,
        measured=measured is not None,
        seconds=time.perf_counter() - start,
    )


def program_graph(plan: Plan, progress: Progress = silent) -> Graph | None:
    """The captured graph the plan was made from (its workload captured again as `magis
    optimize` does), or None for a plan of a user's step or one the zoo no longer matches."""
    if plan.summary.workload is None:
        return None
    progress("capturing the program order")
    _, step = workload_step(plan.summary.workload, step=plan.summary.step, float64_when_tiny=True)
    try:
        plan.check_matches(step)
    except PlanError:
        return None
    return step.graph


def read_measured(path: str | Path, plan: Plan) -> dict[str, Any]:
    """The `magis run --json` report at `path`, checked to be a run of `plan`."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MeasuredRunError(
            f"no file at {path}: make it with magis run W --plan PLAN --json"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MeasuredRunError(f"cannot read {path} as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise MeasuredRunError(f"{path} is not a magis run --json report (not an object)")
    for name, kinds in MEASURED_FIELDS.items():
        value = data.get(name)
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise MeasuredRunError(
                f"{path} is not a magis run --json report: its {name!r} field is missing or "
                "of the wrong type"
            )
    peak = simulate(plan.graph, plan.order, get_cost_model("unit")).peak_bytes
    if data["simulated_peak_bytes"] != peak:
        raise MeasuredRunError(
            f"{path} measured another program: its simulated peak is "
            f"{data['simulated_peak_bytes']} bytes, this plan's {peak}; run this plan with "
            "magis run W --plan PLAN --json"
        )
    return data


def run_plan_now(plan: Plan, plan_path: str | Path, progress: Progress = silent) -> dict[str, Any]:
    """Run the plan on the CPU against eager PyTorch (`magis run W --plan PLAN`) and measure it."""
    from magis.commands.run import run_plan

    if plan.summary.workload is None:
        raise MagisError(
            "--run needs the plan's workload, and this plan was made for a user's step: "
            "measure it with magis.compile, or drop --run"
        )
    return run_plan(plan.summary.workload, plan_path, "cpu", progress).to_json()
