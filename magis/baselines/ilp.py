"""An exact keep / recompute / offload baseline for the captured order: Checkmate's integer
program (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020, §4) with offloading added, as torchtitan's GraphTrainer decides
keep / recompute / CPU-offload per tensor; solved by OR-Tools CP-SAT within a time limit.

What it decides: for each candidate tensor (storage), over the program order as captured (no
re-ordering, no fission), whether it stays on the device, is freed after its early reads and
recomputed (its producer chain, as the re-materialization rule defines one) before its late
reads, or is stored to the host after its producer and loaded back before them
(`magis.baselines.ilp_problem`: candidates, options, stages). The model
(`magis.baselines.ilp_model`) prices time as the simulator does, on the cost model's op times
and the copy stream beside the compute stream, and bounds the memory at every stage; it finds
the least latency under a byte budget, or the least memory under a latency limit.

What is reported is never the model's figure: the chosen decisions are built into a real
program (`magis.baselines.ilp_build`) and simulated. When the simulated peak (budget mode) or
latency (latency mode) misses its limit (the model's stages and its copy-stream estimate are
approximations), the model is solved again with the overshoot taken off its limit (doubled at
each try, `retries` times), as POFO's DP is. A point's params hold the solver's `status`
(optimal, feasible), the `objective` and the `bound` it proved (seconds, or bytes) and their
relative `gap`: how far the plan may be from the best plan *of the model*, within its
candidates, stages and one freeing gap per tensor. A sweep is monotone by construction: the
plan found for a tighter limit also meets a looser one, and a point is the better of the two.

Limits: the order is the captured one; a tensor is freed over one gap of its reads (the
widest) and recomputed or loaded once; at most `max_candidates` tensors are candidates and the
order is cut into at most `max_stages` stages, so the optimum is that of a restricted model
(`ilp_problem`'s docstring says which restriction loses what). Within the time limit the
solver may stop with a gap; it is reported, never hidden.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from magis.baselines.base import (
    Baseline,
    BaselinePoint,
    Failure,
    Outcome,
    Target,
    point,
    size_text,
)
from magis.baselines.ilp_build import build
from magis.baselines.ilp_model import Choice, Model, Status
from magis.baselines.ilp_problem import (
    Candidate,
    ProblemOptions,
    Program,
    Stages,
    candidates,
    make_stages,
)
from magis.cost import CostModel
from magis.ir import Graph
from magis.sim import SimResult, simulate

METHOD = "ilp"
UNBOUNDED_LATENCY = 100.0  # a latency limit no plan reaches (x the program order's)


@dataclass(frozen=True)
class ILPOptions:
    """The sweep (`budgets`: fractions of the program-order peak, least latency within each;
    `latency_limits`: fractions of its latency, least memory within each) and the solver's
    knobs. `time_limit` is seconds per solve."""

    budgets: tuple[float, ...] = (0.25, 0.4, 0.6, 0.8)
    latency_limits: tuple[float, ...] = (1.02, 1.05, 1.10, 1.25)
    time_limit: float = 20.0
    workers: int = 2  # CP-SAT's search workers; 0: one, on deterministic time (reproducible)
    retries: int = 3
    problem: ProblemOptions = field(default_factory=ProblemOptions)


@dataclass
class Planner:
    """One graph's candidates and stages, solved for any number of limits."""

    graph: Graph
    cost: CostModel
    options: ILPOptions

    @cached_property
    def base(self) -> SimResult:
        return simulate(self.graph, self.graph.program_order(), self.cost)

    @cached_property
    def program(self) -> Program:
        return Program.build(self.graph, self.cost, self.base)

    @cached_property
    def candidates(self) -> list[Candidate]:
        return candidates(self.program, self.cost, self.options.problem)

    @cached_property
    def stages(self) -> Stages:
        return make_stages(self.program, self.candidates, self.options.problem.max_stages)

    def model(self) -> Model:
        return Model(self.candidates, self.stages, self.program.peak)

    def plan(self, choice: Choice, **params: Any) -> BaselinePoint:
        g, order = build(self.program, self.candidates, choice, self.cost)
        return point(METHOD, g, order, self.cost, **self._params(choice), **params)

    def _params(self, choice: Choice) -> dict[str, Any]:
        return {
            "status": choice.status.value,
            "objective": choice.objective,
            "bound": choice.bound,
            "gap": round(choice.gap, 6),
            "solve_s": round(choice.seconds, 3),
            "recomputed": len(choice.recompute),
            "offloaded": len(choice.offload),
            "candidates": len(self.candidates),
            "stages": self.stages.n,
        }

    def for_memory(
        self, limit: int, seconds: float, hint: Choice | None = None, **params: Any
    ) -> tuple[Outcome, Choice | None]:
        """The least-latency plan whose simulated peak fits `limit` bytes (module docstring)."""
        return self._tries(limit, seconds, hint, params, memory=True)

    def for_latency(
        self, limit_s: float, seconds: float, hint: Choice | None = None, **params: Any
    ) -> tuple[Outcome, Choice | None]:
        """The least-memory plan whose simulated latency fits `limit_s` seconds."""
        return self._tries(limit_s, seconds, hint, params, memory=False)

    def _tries(self, limit, seconds, hint, params, memory: bool) -> tuple[Outcome, Choice | None]:
        target, deadline = limit, time.perf_counter() + seconds
        found = choice = None
        for attempt in range(self.options.retries + 1):
            # deterministic time is not wall time: each try gets all of it
            left = seconds if self.options.workers <= 0 else deadline - time.perf_counter()
            if memory:
                choice = self.model().least_time(int(target), left, self.options.workers, hint)
            else:
                choice = self.model().least_memory(target, left, self.options.workers, hint)
            if choice.status not in (Status.OPTIMAL, Status.FEASIBLE):
                return self._failure(choice, limit, memory, found, params), None
            found = self.plan(choice, attempts=attempt + 1, **params)
            figure = found.memory if memory else found.latency
            if figure <= limit:
                return found, choice
            over = figure - limit
            target -= max(over, limit * 1e-3) * 2**attempt
            hint = choice
        return self._failure(choice, limit, memory, found, params), None

    def _failure(self, choice, limit, memory: bool, found, params) -> Failure:
        what = size_text(limit) if memory else f"{limit * 1e3:.2f} ms"
        if found is None:
            why = f"the model has no plan within {what} (solver: {choice.status.value})"
        else:
            got = size_text(found.memory) if memory else f"{found.latency * 1e3:.2f} ms"
            why = f"its plan simulates at {got}, over {what} (then solver: {choice.status.value})"
        return Failure(METHOD, why, {**params, "status": choice.status.value})


def ilp_points(
    graph: Graph, cost: CostModel, options: ILPOptions | None = None
) -> Iterator[Outcome]:
    """One point (or Failure) per budget, then one per latency limit (module docstring)."""
    planner = Planner(graph, cost, options or ILPOptions())
    opts = planner.options
    base = planner.base
    yield from _sweep(
        sorted(opts.budgets),
        lambda r, hint: planner.for_memory(
            int(r * base.peak_bytes), opts.time_limit, hint, mode="memory", budget=r
        ),
        lambda p: (p.latency, p.memory),
    )
    yield from _sweep(
        sorted(opts.latency_limits),
        lambda r, hint: planner.for_latency(
            r * base.latency_s, opts.time_limit, hint, mode="latency", latency_limit=r
        ),
        lambda p: (p.memory, p.latency),
    )


def _sweep(ratios: Sequence[float], solve, better) -> Iterator[Outcome]:
    """Each ratio's point, tightest first; a tighter one's plan stands in where it is better
    (it meets the looser limit too), and hints the next solve."""
    prior: BaselinePoint | None = None
    hint: Choice | None = None
    for r in ratios:
        found, choice = solve(r, hint)
        hint = choice or hint
        if prior is not None and (isinstance(found, Failure) or better(prior) < better(found)):
            keep = {
                k: v for k, v in found.params.items() if k in ("mode", "budget", "latency_limit")
            }
            found = dataclasses.replace(
                prior, params={**prior.params, **keep, "plan_of": prior_ratio(prior)}
            )
        if isinstance(found, BaselinePoint):
            prior = found
        yield found


def prior_ratio(p: BaselinePoint) -> float:
    """The limit whose solve built `p`'s plan."""
    return p.params.get("plan_of", p.params.get("budget", p.params.get("latency_limit")))


def ilp_solve(graph: Graph, cost: CostModel, target: Target, seconds: float | None) -> Outcome:
    """The plan for one constraint (the search's warm start), within `seconds` in all; None:
    the default time limit, on CP-SAT's deterministic clock (the same plan on every run)."""
    if seconds is None:
        planner = Planner(graph, cost, ILPOptions(workers=0))
        left = planner.options.time_limit
    else:
        start = time.perf_counter()
        planner = Planner(graph, cost, ILPOptions(time_limit=seconds))
        _ = planner.stages  # the candidates and stages count against the time too
        left = max(seconds - (time.perf_counter() - start), 0.5)
    if target.memory_bytes is None:
        return planner.for_latency(target.latency_s, left, mode="latency")[0]
    found = planner.for_memory(target.memory_bytes, left, mode="memory")[0]
    if isinstance(found, Failure):  # no plan fits: the nearest is the least memory
        unbounded = UNBOUNDED_LATENCY * planner.base.latency_s
        return planner.for_latency(unbounded, left, mode="latency")[0]
    return found


ILP = Baseline(
    METHOD,
    "exact keep / recompute / offload per tensor for the captured order (Checkmate-style CP-SAT)",
    ilp_points,
    ilp_solve,
)
