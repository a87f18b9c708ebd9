"""A `Plan`: what `magis optimize` hands the user (MAGIS §6.2's best M-State).

A plan is a graph, a schedule of it and a `PlanSummary` of what the search found and how, saved
as versioned JSON (never pickle: a plan file may come from someone else). It can show its
generated code, report its figures, and run.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from magis.backend import compile_program, generate
from magis.backend.meta_check import check_graph
from magis.capture import Step
from magis.errors import PlanError
from magis.ir import Graph
from magis.ir.serialize import graph_from_json, graph_to_json
from magis.ir.trail import Decision, decisions_from_json

if TYPE_CHECKING:
    from magis.explain import Explanation

PLAN_FORMAT = "magis.plan"
# 2: the search's figures are the typed `summary` (version 1 had a free-form `info` dict).
# 3: the summary holds the best state's decision trail (`magis explain`); a version-2 plan
# still loads, with an empty trail.
PLAN_VERSION = 3
READABLE_VERSIONS = (2, 3)


@dataclass(frozen=True)
class PlanSummary:
    """The figures of a plan and where they come from. Ratios are against the captured program
    order, measured by the same cost model and memory figure; bytes in bytes, times in seconds."""

    workload: str | None  # the zoo name, or None for a step captured by the user
    hardware: str  # the cost model's name
    mode: str  # Mode.value: "mem-limit" or "lat-limit"
    limit: float  # bytes or seconds
    limit_ratio: float  # the limit over the program order's figure
    satisfied: bool
    peak_bytes: int
    latency_s: float
    host_peak_bytes: int  # swapped-out bytes at their peak, in the host pool
    memory_ratio: float
    latency_ratio: float
    program_order_peak_bytes: int
    program_order_latency_s: float
    states_explored: int
    rules_applied: dict[str, int]
    history: tuple[str, ...]  # rules of the best state, oldest first
    seconds: float  # the search's own clock
    breakdown: dict[str, float]  # seconds per search phase
    improvements: tuple[tuple[float, int, float], ...]  # (seconds, peak bytes, latency s)
    peak_tensors: tuple[str, ...]  # the largest tensors live at the best plan's peak
    interrupted: bool  # Ctrl-C stopped the search
    memory_figure: str  # MemoryFigure.value: how peak_bytes was counted
    wall_seconds: float  # the search call, end to end
    # The best state's moves from the program order, each with its figures before and after
    # (`magis.search.decisions.full_trail`); empty in a plan older than version 3.
    decisions: tuple[Decision, ...] = ()
    # The kind of training step the plan was made for (`magis.capture.StepKind`: the commands
    # that run a saved plan capture that step again), and the program order's resident bytes
    # (weights, optimizer state, inputs: the floor of every plan that keeps them on the device).
    # Plans from before issue 42 lack both: theirs was the sgd step, its floor not recorded.
    step: str = "sgd"
    resident_bytes: int = 0

    @property
    def above_floor_ratio(self) -> float | None:
        """The plan's peak above the resident floor over the program order's (below 0: the
        plan's peak is under the floor, optimizer state offloaded); None if not recorded."""
        above = self.program_order_peak_bytes - self.resident_bytes
        if not self.resident_bytes or above <= 0:
            return None
        return (self.peak_bytes - self.resident_bytes) / above

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "history": list(self.history),
            "improvements": [list(i) for i in self.improvements],
            "peak_tensors": list(self.peak_tensors),
            "decisions": [d.to_json() for d in self.decisions],
        }

    @staticmethod
    def from_json(data: Any, version: int = PLAN_VERSION) -> PlanSummary:
        """The summary of a plan file; a missing or mistyped field is a one-line PlanError.
        A version-2 summary has no decisions."""
        if not isinstance(data, dict):
            raise PlanError("the plan's 'summary' field is not an object: re-run magis optimize")
        hints = typing.get_type_hints(PlanSummary)
        values: dict[str, Any] = {"decisions": ()}
        optional = {
            f.name: f.default for f in dataclasses.fields(PlanSummary) if f.name in _OPTIONAL_FIELDS
        }
        if version >= 3:
            if "decisions" not in data:
                raise PlanError(
                    "the plan's summary has no 'decisions' field: re-run magis optimize"
                )
            values["decisions"] = decisions_from_json(data["decisions"], "summary.decisions")
        for f in dataclasses.fields(PlanSummary):
            if f.name == "decisions":
                continue
            if f.name in optional and f.name not in data:
                values[f.name] = optional[f.name]
                continue
            if f.name not in data:
                raise PlanError(
                    f"the plan's summary has no {f.name!r} field: re-run magis optimize"
                )
            values[f.name] = _checked(f.name, data[f.name], hints[f.name])
        return PlanSummary(
            **{
                **values,
                "history": tuple(values["history"]),
                "improvements": tuple(tuple(i) for i in values["improvements"]),
                "peak_tensors": tuple(values["peak_tensors"]),
            }
        )


# Summary fields added within a plan version: a plan written before them loads with the default.
_OPTIONAL_FIELDS = ("step", "resident_bytes")


def _checked(name: str, value: Any, hint: Any) -> Any:
    """`value` if its JSON type fits `hint` (a number for float, a list for a tuple...)."""
    if _fits(value, hint):
        return value
    raise PlanError(
        f"the plan's summary field {name!r} holds {type(value).__name__} {value!r:.40}, "
        f"not {_describe(hint)}: re-run magis optimize"
    )


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is dict:
        key, val = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _fits(k, key) and _fits(v, val) for k, v in value.items()
        )
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_fits, value, args))
    return False


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is dict:
        return "an object"
    if origin is tuple:
        return "a list"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[hint]


@dataclass
class Plan:
    """What the optimizer hands the user: graph, schedule, the summary of the search and, when
    made in this process, the step it was made for (to run it against eager PyTorch)."""

    graph: Graph
    order: list[int]
    summary: PlanSummary
    step: Step | None = field(default=None, repr=False)

    @property
    def code(self) -> str:
        """The generated Python source of this plan."""
        return generate(self.graph, self.order)

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        """Run the plan on the step's flat inputs (parameters, buffers, state, data)."""
        program = compile_program(self.graph, self.order, _device_of(inputs))
        extra = self.step.program_inputs(inputs)[len(inputs) :] if self.step is not None else []
        return program(*inputs, *extra)

    def explain(self) -> Explanation:
        """One row per decision the search kept, with the bytes each took off the peak and
        the time it added (`magis explain PLAN` prints it)."""
        from magis.explain import explain  # the explain tables load only when asked

        return explain(self)

    def report(self) -> str:
        s = self.summary
        lines = [
            f"magis plan for {_what(s)} on {s.hardware}",
            f"  memory  {s.memory_ratio:.3f} of the program order ({s.peak_bytes / 2**30:.3f} GiB)"
            + _above_floor(s),
            f"  latency {s.latency_ratio:.3f} of the program order",
            f"  limit   {'met' if s.satisfied else 'NOT met'} ({s.mode} {s.limit_ratio:.3f} "
            "of the program order)",
            f"  rules   {s.rules_applied}",
        ]
        if not s.satisfied and s.peak_tensors:
            lines.append("  the peak is held by: " + ", ".join(s.peak_tensors[:5]))
        return "\n".join(lines)

    def check_matches(self, step: Step) -> None:
        """A plan runs on a step only if their inputs agree (names may differ, shapes may not)."""
        mine = [self.graph.node(p).outputs[0] for p in self.graph.placeholders()]
        theirs = [step.graph.node(p).outputs[0] for p in step.graph.placeholders()]
        if mine != theirs:
            raise PlanError(
                "this plan was made for another step: its inputs' shapes or dtypes differ"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "summary": self.summary.to_json(),
            "order": list(self.order),
            "graph": graph_to_json(self.graph),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)  # a plan file is never half-written
        return path

    @staticmethod
    def load(path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"no plan file at {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read plan {path}: {exc}") from exc
        return Plan.from_json(data)

    @staticmethod
    def from_json(data: Any) -> Plan:
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError("not a magis plan (its 'format' field is missing or different)")
        version = data.get("version")
        if version not in READABLE_VERSIONS or type(version) is not int:
            raise PlanError(
                f"plan format version {version} is not {PLAN_VERSION}: re-run magis optimize"
                " with this magis to make the plan again"
            )
        for key, kind in (("summary", dict), ("order", list), ("graph", dict)):
            if key not in data:
                raise PlanError(f"the plan has no {key!r} field: re-run magis optimize")
            if not isinstance(data[key], kind):
                raise PlanError(
                    f"the plan's {key!r} field is not {'a list' if kind is list else 'an object'}"
                )
        summary = PlanSummary.from_json(data["summary"], version)
        graph = graph_from_json(data["graph"])
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in data["order"]):
            raise PlanError("the plan's 'order' field must list node numbers")
        order = list(data["order"])
        if not graph.is_valid_schedule(order):
            raise PlanError("the plan's schedule is not a valid order of its graph")
        check_plan_graph(graph)
        return Plan(graph, order, summary)


def check_plan_graph(graph: Graph) -> None:
    """The meta check every plan passes before it is returned, loaded or run: each op, run on
    fake tensors from its inputs' recorded shapes, dtypes and strides, makes what the graph
    records (a PlanError naming the first node that does not)."""
    report = check_graph(graph)
    if not report.ok:
        raise PlanError(
            f"the plan does not hold together: {report.mismatches[0]} "
            f"({len(report.mismatches)} mismatches); re-run magis optimize"
        )


def _what(s: PlanSummary) -> str:
    """The workload and its step kind; a user's own step is "a step" (its kind is theirs)."""
    return "a step" if s.workload is None else f"{s.workload} ({s.step} step)"


def _above_floor(s: PlanSummary) -> str:
    """The peak above the resident floor, beside the memory ratio, where the floor is known."""
    ratio = s.above_floor_ratio
    if ratio is None:
        return ""
    return f"; above the resident floor {ratio:.3f} of the program order's"


def _device_of(inputs) -> torch.device:
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
