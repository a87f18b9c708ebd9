"""`magis optimize` and `magis.optimize`: the fastest equivalent program under a memory limit, or
the smallest under a latency limit (MAGIS §6.2), handed to the user as a `Plan`.

Two steps, so that a caller who shows the search live (the CLI) measures its ratios against the
very baseline the plan reports: `setup_search` prepares the cost model once (a profiled one
measures the graph's ops here, outside the search's time budget) and measures the program order
by the chosen memory figure; `find_plan` runs the search (`magis.search.optimize_graph`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from magis.capture import DEFAULT_STEP, Step, StepKind, read_step_kind, training_step, workload_step
from magis.capture.sharding import PlannedJob
from magis.commands.limits import (
    SearchLimit,
    check_latency_reachable,
    check_memory_reachable,
    parse_memory_figure,
    read_search_limit,
)
from magis.commands.parallel import checkpointed_graph, job_warm_starts
from magis.commands.shared import (
    Progress,
    cost_model,
    prepare_cost,
    silent,
)
from magis.commands.warm_start import WARM_START_SHARE, baseline_warm_starts
from magis.cost import CostModel
from magis.cost.links import Interconnect, get_link
from magis.errors import MagisError, deferred_interrupt
from magis.ir import Graph
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.plan import Plan, PlanSummary, check_plan_graph
from magis.rules import Rule
from magis.rules.offload import offloadable_bytes
from magis.rules.swap import SWAP
from magis.search import (
    TIME_BUDGET_S,
    Improvement,
    MemoryFigure,
    Mode,
    Objective,
    SearchOptions,
    SearchResult,
    optimize_graph,
    search_pace,
    simulate_state,
    start_search_workers,
)
from magis.search.decisions import full_trail
from magis.sim import SimResult


@dataclass(frozen=True)
class SearchSetup:
    """A search ready to start: the step, its cost model, the memory figure, the limit, and the
    program order those measure (the denominator of every ratio the search reports)."""

    step: Step
    cost: CostModel
    figure: MemoryFigure
    base: SimResult  # the program order, its peak counted by `figure`
    objective: Objective
    workload: str | None = None
    step_kind: StepKind = DEFAULT_STEP  # what `workload` was captured as
    # a data-parallel job's FSDP2 + full AC step (`magis.commands.parallel`): a warm start
    checkpointed: Graph | None = None

    def memory_ratio(self, memory: int) -> float:
        return memory / self.base.peak_bytes

    def latency_ratio(self, latency: float) -> float:
        return latency / self.base.latency_s


def setup_search(
    step: Step,
    *,
    mem_limit: str | float | None = None,
    lat_limit: str | float | None = None,
    hardware: str | CostModel = "rtx3090",
    memory_figure: str | MemoryFigure = "theoretical",
    workload: str | None = None,
    progress: Progress = silent,
) -> SearchSetup:
    """Prepare a search of `step` under exactly one of `mem_limit` and `lat_limit`.

    A limit that cannot be read, or that no plan can meet (below the resident bytes, or under
    the latency bound of `magis.commands.limits`), is a one-line LimitError before the search."""
    limit = read_search_limit(mem_limit, lat_limit)
    return _setup(step, limit, hardware, parse_memory_figure(memory_figure), workload, progress)


def _setup(
    step: Step,
    limit: SearchLimit,
    hardware: str | CostModel,
    figure: MemoryFigure,
    workload: str | None,
    progress: Progress,
) -> SearchSetup:
    """`setup_search` with its limit and figure already read (each entry point reads them
    once, before any capture)."""
    cost = prepare_cost(hardware, step.graph, progress)
    progress("simulating program order")
    # ratios compare like with like: the program order measured by the same memory figure
    base = simulate_state(step.graph, step.graph.program_order(), cost, figure)
    written = limit.limit
    if limit.mode is Mode.MEMORY_LIMIT:
        limit_bytes = int(written.resolve(base.peak_bytes))
        movable = offloadable_bytes(step.graph)
        check_memory_reachable(limit_bytes, written.text, base, movable)
        objective = Objective(Mode.MEMORY_LIMIT, limit_bytes)
    else:
        limit_s = written.resolve(base.latency_s)
        check_latency_reachable(limit_s, written.text, step.graph, cost, base)
        objective = Objective(Mode.LATENCY_LIMIT, limit_s)
    return SearchSetup(step, cost, figure, base, objective, workload)


def setup_workload_search(
    workload: str,
    *,
    mem_limit: str | float | None = None,
    lat_limit: str | float | None = None,
    hardware: str | CostModel = "rtx3090",
    memory_figure: str | MemoryFigure = "theoretical",
    step: StepKind | str = DEFAULT_STEP,
    progress: Progress = silent,
) -> SearchSetup:
    """Capture `workload`'s `step` (`:tiny` in float64 where the step kind allows it, so that
    its plans verify tightly) and prepare its search; limits that cannot be read, figures,
    step kinds and hardware fail before the capture."""
    limit = read_search_limit(mem_limit, lat_limit)
    return prepare_workload_search(
        workload,
        limit,
        hardware=hardware,
        memory_figure=memory_figure,
        step=step,
        progress=progress,
    )


def prepare_workload_search(
    workload: str,
    limit: SearchLimit,
    *,
    hardware: str | CostModel = "rtx3090",
    memory_figure: str | MemoryFigure = "theoretical",
    step: StepKind | str = DEFAULT_STEP,
    progress: Progress = silent,
    job: PlannedJob | None = None,
    link: str = "nvlink",
) -> SearchSetup:
    """`setup_workload_search` with its limit already read: `magis optimize` reads it once,
    naming its flags in any error (`read_search_limit`), and hands it here. With `job`, the
    step is one rank's of that data-parallel job, its collectives priced over `link`
    (`magis.commands.parallel`)."""
    figure = parse_memory_figure(memory_figure)
    kind = read_step_kind(step)
    cost = cost_model(hardware)
    if job is not None:
        cost = cost.with_interconnect(Interconnect(get_link(link), job.world_size))
    progress("capturing")
    _, captured = workload_step(workload, step=kind, float64_when_tiny=True, job=job)
    checkpointed = None if job is None else checkpointed_graph(workload, job, kind)
    setup = _setup(captured, limit, cost, figure, workload, progress)
    return replace(setup, step_kind=kind, checkpointed=checkpointed)


def find_plan(
    setup: SearchSetup,
    options: SearchOptions | None = None,
    *,
    on_improvement: Callable[[Improvement], None] | None = None,
    before_polish: Callable[[Plan], None] | None = None,
    warm_start: bool = True,
    progress: Progress = silent,
) -> Plan:
    """Run the search of MAGIS Alg. 3 for at most `options.time_budget` seconds (Ctrl-C stops
    it too) and hand over its best state as a Plan. With `warm_start`, the baselines' best
    plans are starting states (`magis.commands.warm_start`); their time counts in the budget.

    `options` (default `SearchOptions()`) is the search's budget and knobs as one object, from
    the caller down to the search loop: `time_budget`, `max_states`, `workers` > 1 building
    each popped state's children in that many processes (Ray actors with `ray`: "local" or a
    cluster's address; the same plan for a seed and `max_states`, `magis.search.parallel`),
    `seed`. Its memory figure is the setup's, which measured the program order.

    `before_polish` gets the best plan before the final re-ordering, which a second Ctrl-C can
    interrupt (the CLI saves it there)."""
    start = time.perf_counter()

    def hand_over(result: SearchResult) -> None:
        with deferred_interrupt():  # a Ctrl-C now waits until the plan is handed over
            before_polish(plan_from_search(result, setup, time.perf_counter() - start))

    options = replace(options or SearchOptions(), memory_figure=setup.figure)
    time_budget = options.time_budget
    with search_pace():  # the peers' warm starts allocate as the search does
        # workers boot (import torch, unpickle the cost model) while the peers run
        started = (
            start_search_workers(setup.cost, options, setup.objective, setup.step.graph)
            if options.workers > 1
            else None
        )
        warm = []
        try:
            if warm_start:
                share = None if options.max_states is not None else time_budget * WARM_START_SHARE
                warm = baseline_warm_starts(
                    setup.step.graph, setup.cost, setup.objective, share, progress=progress
                )
        except BaseException:
            if started is not None:  # from here on, optimize_graph stops them
                started.close()
            raise
        if warm_start:  # the job's own alternative first: the plan the user would otherwise run
            warm = [*job_warm_starts(setup.step.graph, setup.checkpointed), *warm]
        warm = [w for w in warm if _within_rules(w.graph, options.rules)]
        # the search keeps its share even when a peer overran the warm start's
        left = max(
            time_budget - (time.perf_counter() - start), time_budget * (1 - WARM_START_SHARE)
        )
        progress("searching")
        result = optimize_graph(
            setup.step.graph,
            setup.cost,
            setup.objective,
            replace(options, time_budget=left),
            on_improvement,
            hand_over if before_polish is not None else None,
            warm,
            started,
        )
    return plan_from_search(result, setup, wall_seconds=time.perf_counter() - start)


def _within_rules(graph: Graph, rules: Sequence[Rule] | None) -> bool:
    """A peer's plan is a start only if the search's rules could have made it: one with
    Store/Load (a swapping peer's) is not when the rules swap nothing (`rules_without_host_copies`:
    a CPU, whose host copies stay in the memory measured, or `magis.torch_backend`)."""
    if rules is None or any(r.name == SWAP.name for r in rules):
        return True
    return not any(graph.node(n).op in (STORE_OP, LOAD_OP) for n in graph.ops())


def plan_from_search(result: SearchResult, setup: SearchSetup, wall_seconds: float) -> Plan:
    check_plan_graph(result.best.graph)  # no plan leaves the search without its meta check
    best, base = result.best, setup.base
    memory_mode = result.objective.mode is Mode.MEMORY_LIMIT
    summary = PlanSummary(
        workload=setup.workload,
        hardware=setup.cost.name,
        mode=result.objective.mode.value,
        limit=result.objective.limit,
        limit_ratio=result.objective.limit / (base.peak_bytes if memory_mode else base.latency_s),
        satisfied=result.satisfied,
        peak_bytes=best.memory,
        latency_s=best.latency,
        host_peak_bytes=best.sim.host_peak_bytes,
        memory_ratio=setup.memory_ratio(best.memory),
        latency_ratio=setup.latency_ratio(best.latency),
        program_order_peak_bytes=base.peak_bytes,
        program_order_latency_s=base.latency_s,
        states_explored=result.stats.states_explored,
        rules_applied=dict(result.stats.rules_applied),
        history=tuple(best.history),
        seconds=result.seconds,
        breakdown=dict(result.stats.breakdown),
        improvements=tuple((i.seconds, i.memory, i.latency) for i in result.improvements),
        peak_tensors=tuple(
            f"{h.name} ({h.nbytes / 2**20:.1f} MiB)" for h in best.sim.top_hotspots(10)
        ),
        interrupted=result.interrupted,
        memory_figure=setup.figure.value,
        wall_seconds=wall_seconds,
        decisions=full_trail(base, result.initial.sim, best.sim, best.decisions, best.history),
        step=setup.step_kind.value,
        resident_bytes=base.resident_bytes,
    )
    return Plan(best.graph, list(best.order), summary, setup.step)


def optimize(
    step_or_model: Step | torch.nn.Module,
    example_inputs: tuple | None = None,
    *,
    mem_limit: str | float | None = None,
    lat_limit: str | float | None = None,
    time_budget: float = TIME_BUDGET_S,
    hardware: str | CostModel = "rtx3090",
    loss_fn: Callable | None = None,
    optimizer: str | None = "sgd",
    on_improvement: Callable[[Improvement], None] | None = None,
    workload: str | None = None,
    memory_figure: str | MemoryFigure = "theoretical",
    max_states: int | None = None,
    workers: int = 1,
    ray: str | None = None,
    rules: Sequence[Rule] | None = None,
) -> Plan:
    """Optimize a captured step — or a model with example inputs, whose training step is
    captured first — under exactly one of `mem_limit` and `lat_limit` (MAGIS §6.2).
    `workers`/`ray`: the search on several processes, as `find_plan` takes them; `rules`:
    the rewrite rules the search may use (default: the catalog's)."""
    limit = read_search_limit(mem_limit, lat_limit)  # a typo fails before the capture
    options = SearchOptions(
        time_budget=time_budget, max_states=max_states, workers=workers, ray=ray, rules=rules
    )
    step = step_or_model
    if isinstance(step_or_model, torch.nn.Module):
        if example_inputs is None:
            raise MagisError("optimize(model, example_inputs, ...): the example inputs are missing")
        step = training_step(step_or_model, example_inputs, loss_fn=loss_fn, optimizer=optimizer)
    figure = parse_memory_figure(memory_figure)
    setup = _setup(step, limit, hardware, figure, workload, silent)
    return find_plan(setup, options, on_improvement=on_improvement)
