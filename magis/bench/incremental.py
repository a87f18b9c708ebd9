"""`magis bench incremental`: incremental (IS) against full (FS) scheduling, MAGIS §7.3 / Fig. 14.

The paper's experiment: 10 random DNNs shaped like NASNet, 10 rounds of rewrites each after an
initial schedule; both IS and FS use the DP. Here each round applies one random valid rewrite
(re-computation inserted or removed, a node split, two parallel mm merged), half the time at a
memory hot-spot of the current schedule (where MAGIS's search applies its rules, §5.2), then

* FS: `schedule(new, DP)` from scratch;
* IS: `incremental_schedule(old, old IS order, new, touched nodes)` (Alg. 2),

each on its own copy of the new graph, so neither reuses the other's per-version caches. The old
schedule of the next round is IS's, as in the search. Speedup = FS time / IS time; quality =
IS peak / FS peak (1 = equal; below 1, IS found the better order).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from magis.cost import UnitCostModel
from magis.schedule import Scheduler, incremental_schedule, schedule
from magis.schedule.memo import DpMemo
from magis.schedule.random_graphs import NasnetShape, nasnet_dag, random_rewrite
from magis.sim import simulate

SPEEDUP_BINS = (0.0, 2.0, 4.0, 10.0, 20.0, 30.0, float("inf"))
CELLS = (14, 20)  # cells per DAG: NASNet-A stacks 3 x N normal cells (N = 4..6) + 2 reduction cells


@dataclass
class IncrementalCase:
    dag: int
    round: int
    rewrite: str
    nodes: int
    fs_seconds: float
    is_seconds: float
    speedup: float
    fs_peak_bytes: int
    is_peak_bytes: int
    quality_ratio: float  # IS peak / FS peak
    rescheduled_units: int
    total_units: int


@dataclass
class IncrementalReport:
    cases: list[IncrementalCase]
    mean_speedup: float
    min_speedup: float
    max_speedup: float
    median_speedup: float
    equal_quality: int  # cases where IS peak == FS peak
    better_quality: int  # cases where IS found a lower peak than FS
    worst_quality_ratio: float
    speedup_histogram: dict[str, int]  # "lo-hi" x -> cases
    quality_histogram: dict[str, int]
    seed: int
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def run_incremental_bench(
    dags: int = 10,
    rounds: int = 10,
    seed: int = 0,
    progress: Callable[[str], None] = lambda stage: None,
    repeats: int = 3,
) -> IncrementalReport:
    """The §7.3 experiment (see the module docstring)."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    cases: list[IncrementalCase] = []
    for d in range(dags):
        shape = NasnetShape(cells=int(rng.integers(CELLS[0], CELLS[1] + 1)))
        graph = nasnet_dag(rng, shape)
        order = schedule(graph, Scheduler.DP).order
        memo = DpMemo()  # IS's memory of solved segments, carried along the chain of rewrites
        for r in range(rounds):
            progress(f"DAG {d + 1}/{dags}, round {r + 1}/{rounds}")
            step = _round(graph, order, rng, d, r, memo, repeats)
            if step is None:
                break
            case, graph, order, memo = step
            cases.append(case)
    return _report(cases, seed, time.perf_counter() - start)


def _round(graph, order, rng: np.random.Generator, d: int, r: int, memo: DpMemo, repeats: int):
    focus = _hotspot_nodes(graph, order) if rng.random() < 0.5 else frozenset()
    rewrite = random_rewrite(graph, rng, focus)
    if rewrite is None:
        return None
    fs_s = is_s = float("inf")
    for _ in range(repeats):  # the least of a few runs: the machine is shared
        fs_graph, is_graph, is_memo = rewrite.graph.copy(), rewrite.graph.copy(), memo.copy()
        t0 = time.perf_counter()
        fs = schedule(fs_graph, Scheduler.DP)
        t1 = time.perf_counter()
        inc = incremental_schedule(graph, order, is_graph, rewrite.changed, memo=is_memo)
        t2 = time.perf_counter()
        fs_s, is_s = min(fs_s, t1 - t0), min(is_s, t2 - t1)
    case = IncrementalCase(
        dag=d,
        round=r,
        rewrite=rewrite.kind.value,
        nodes=len(is_graph),
        fs_seconds=fs_s,
        is_seconds=is_s,
        speedup=fs_s / is_s,
        fs_peak_bytes=fs.peak_bytes,
        is_peak_bytes=inc.peak_bytes,
        quality_ratio=inc.peak_bytes / fs.peak_bytes,
        rescheduled_units=inc.rescheduled,
        total_units=sum(s.units for s in fs.segments),
    )
    return case, is_graph, inc.order, is_memo


def _hotspot_nodes(graph, order) -> frozenset[int]:
    """Producers of the storages live at the peak, and their users."""
    sim = simulate(graph, order, UnitCostModel())
    nodes = {h.storage.node for h in sim.hotspots}
    return frozenset(nodes | {u for n in nodes for u in graph.users(n)})


def _report(cases: list[IncrementalCase], seed: int, seconds: float) -> IncrementalReport:
    speedups = np.array([c.speedup for c in cases]) if cases else np.array([1.0])
    ratios = [c.quality_ratio for c in cases] or [1.0]
    return IncrementalReport(
        cases=cases,
        mean_speedup=float(speedups.mean()),
        min_speedup=float(speedups.min()),
        max_speedup=float(speedups.max()),
        median_speedup=float(np.median(speedups)),
        equal_quality=sum(1 for c in cases if c.is_peak_bytes == c.fs_peak_bytes),
        better_quality=sum(1 for c in cases if c.is_peak_bytes < c.fs_peak_bytes),
        worst_quality_ratio=float(max(ratios)),
        speedup_histogram=_histogram(speedups, SPEEDUP_BINS, "x"),
        quality_histogram=_quality_histogram(ratios),
        seed=seed,
        seconds=seconds,
    )


def _histogram(values, bins, unit: str) -> dict[str, int]:
    out = {}
    for lo, hi in zip(bins[:-1], bins[1:], strict=True):
        label = f">={lo:g}{unit}" if hi == float("inf") else f"{lo:g}-{hi:g}{unit}"
        out[label] = int(sum(1 for v in values if lo <= v < hi))
    return out


def _quality_histogram(ratios: list[float]) -> dict[str, int]:
    return {
        "<1 (IS better)": sum(1 for q in ratios if q < 1),
        "=1": sum(1 for q in ratios if q == 1),
        "1-1.05": sum(1 for q in ratios if 1 < q <= 1.05),
        ">1.05": sum(1 for q in ratios if q > 1.05),
    }
