"""The keep / recompute / offload decisions as a CP-SAT model over the stages of the captured
order (Checkmate, Jain et al. MLSys 2020, §4.2-4.4, restricted to a fixed order and one
freeing gap per tensor; the candidates and stages are `magis.baselines.ilp_problem`'s).

Variables: per candidate, `rec` and `off` (booleans, at most one: neither is keep). Checkmate's
residency S[t, i] of a tensor at a stage is then a constant of the decision: a candidate is
resident at stage k unless its option frees it over all of k.

Memory (Checkmate's U, Eq. 2-4, as one bound per stage): at stage k,

    mem_k = memory_k - sum(nbytes_c [c frees all of k]) + sum(added bytes touching k)

where memory_k is the most the program order holds in k, and the added bytes are a
recomputation's transient outputs at the stage of its first late read and the inputs it keeps
alive until then. Bytes are counted in units of `byte_unit`, freed bytes rounded down and added
bytes up, so mem_k bounds the simulator's memory at every position of k.

Time (the simulator's two streams, MAGIS §6.2): the compute of the order, plus each
recomputation's compute, plus each offload's stall (its Load's transfer that the compute
before its first late read cannot cover), plus per stage the copy work that does not fit
beside the stage's compute: extra_k >= copies_k - compute_k - recomputed_k, where a copy's
transfer is spread over the stages of the compute that hides it, in proportion to it.

Two objectives: least time with mem_k <= budget at every stage (stages that cannot exceed it
even with every addition are left out), or least peak P >= mem_k under a time limit.

Two decisions conflict (a pair constraint) when a recomputation reads a storage live anyway at
its first late read in the program order and the other candidate frees that storage over that
read: the copy would keep the freed storage alive. The model forbids the pair.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from magis.baselines.ilp_problem import Candidate, Stages
from magis.ir import Ref

TIME_UNITS = 1_000_000  # the program order's compute is this many time units
BYTE_UNITS = 200_000  # the program order's peak is this many byte units


class Status(enum.Enum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Choice:
    """One solve: the option of each candidate, and what the solver proved."""

    recompute: tuple[int, ...]  # indices of the candidates recomputed
    offload: tuple[int, ...]
    status: Status
    objective: float  # seconds (least time) or bytes (least peak), in the model
    bound: float  # the best bound the solver proved, same unit
    seconds: float  # wall time of the solve

    @property
    def gap(self) -> float:
        """(objective - bound) / objective: how far from optimal the solver may still be."""
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


@dataclass(frozen=True)
class Units:
    seconds: float  # per time unit
    nbytes: float  # per byte unit

    def t(self, s: float) -> int:
        return int(np.ceil(s / self.seconds - 1e-9))

    def up(self, b: float) -> int:
        return int(np.ceil(b / self.nbytes - 1e-9))

    def down(self, b: float) -> int:
        return int(np.floor(b / self.nbytes + 1e-9))


class Model:
    """The CP-SAT model of one program's candidates and stages, solved once: for a budget
    (`least_time`) or a time limit (`least_memory`) (module docstring)."""

    def __init__(self, cands: Sequence[Candidate], stages: Stages, peak: int) -> None:
        self.cands = list(cands)
        self.stages = stages
        total = float(stages.compute.sum())
        self.units = Units(max(total, 1e-12) / TIME_UNITS, max(peak, 1) / BYTE_UNITS)
        self.base_time = sum(self.units.t(c) for c in stages.compute)
        self.m = cp_model.CpModel()
        self.rec = {i: self.m.NewBoolVar(f"rec{i}") for i, c in enumerate(cands) if c.recompute}
        self.off = {i: self.m.NewBoolVar(f"off{i}") for i, c in enumerate(cands) if c.offload}
        for i in self.rec.keys() & self.off.keys():
            self.m.Add(self.rec[i] + self.off[i] <= 1)
        self._conflicts()
        self.mem_terms, self.mem_floor = self._memory_terms()
        self.extra_time = self._time_terms()

    # --- building ---------------------------------------------------------------------------

    def _conflicts(self) -> None:
        by_storage: dict[Ref, int] = {c.storage: i for i, c in enumerate(self.cands)}
        for i, c in enumerate(self.cands):
            if c.recompute is None:
                continue
            for s in c.recompute.reads:
                j = by_storage.get(s)
                if j is None or j == i:
                    continue
                other = self.cands[j]
                if other.early_end < c.late < other.late:
                    for var in (self.rec.get(j), self.off.get(j)):
                        if var is not None:
                            self.m.Add(self.rec[i] + var <= 1)

    def _memory_terms(self) -> tuple[list[list[tuple[int, cp_model.IntVar]]], list[int]]:
        """Per stage: (coefficient, variable) terms of the bytes the decisions change there,
        and the bytes the program order holds (units)."""
        u, st = self.units, self.stages
        terms: list[list] = [[] for _ in range(st.n)]
        for i, c in enumerate(self.cands):
            if i in self.rec:
                rec = c.recompute
                for k in st.covered(c.early_end + 1, c.late - 1):
                    terms[k].append((-u.down(c.nbytes), self.rec[i]))
                for k in st.touched(c.late - 1, c.late):
                    terms[k].append((u.up(rec.transient_bytes), self.rec[i]))
                for first, nbytes in rec.extended:
                    for k in st.touched(first, c.late):
                        terms[k].append((u.up(nbytes), self.rec[i]))
            if i in self.off:
                for k in st.covered(c.early_end + 1, c.offload.load_at - 1):
                    terms[k].append((-u.down(c.nbytes), self.off[i]))
        floor = [u.up(m) for m in st.memory]
        return [[t for t in ts if t[0]] for ts in terms], floor

    def _time_terms(self) -> cp_model.LinearExpr:
        """Seconds the decisions add to the program order (units; module docstring)."""
        u, st = self.units, self.stages
        extra = []
        recomputed: list[list] = [[] for _ in range(st.n)]
        copies: list[list] = [[] for _ in range(st.n)]
        for i, c in enumerate(self.cands):
            if i in self.rec:
                t = u.t(c.recompute.seconds)
                extra.append(t * self.rec[i])
                for k in st.touched(c.late, c.late):
                    recomputed[k].append((t, self.rec[i]))
            if i in self.off:
                off = c.offload
                if off.stall_s > 0:
                    extra.append(u.t(off.stall_s) * self.off[i])
                for window in (off.store_window, off.load_window):
                    for k, share in self._spread(window, off.transfer_s):
                        copies[k].append((u.t(share), self.off[i]))
        for k in range(st.n):
            if not copies[k]:
                continue
            slack = self.m.NewIntVar(0, sum(c for c, _ in copies[k]), f"stall{k}")
            busy = sum(c * v for c, v in copies[k]) - sum(c * v for c, v in recomputed[k])
            self.m.Add(slack >= busy - u.t(st.compute[k]))
            extra.append(slack)
        return sum(extra)

    def _spread(self, window: tuple[int, int], seconds: float) -> list[tuple[int, float]]:
        """`seconds` of copy spread over the stages of positions [start, stop), in
        proportion to the compute each holds of them (evenly when they hold none)."""
        start, stop = window
        stages = self.stages.touched(start, stop - 1)
        if not len(stages):
            return []
        weights = np.array(
            [min(self.stages.hi[k], stop - 1) - max(self.stages.lo[k], start) + 1 for k in stages],
            dtype=np.float64,
        )
        share = weights / weights.sum()
        return [(k, seconds * float(w)) for k, w in zip(stages, share, strict=True)]

    def mem_expr(self, k: int) -> cp_model.LinearExpr:
        return self.mem_floor[k] + sum(c * v for c, v in self.mem_terms[k])

    def _mem_max(self, k: int) -> int:
        return self.mem_floor[k] + sum(c for c, _ in self.mem_terms[k] if c > 0)

    # --- solving ----------------------------------------------------------------------------

    def least_time(
        self, budget: int, seconds: float, workers: int, hint: Choice | None = None
    ) -> Choice:
        """The fastest decisions whose memory fits `budget` bytes at every stage, the least
        peak among them. `workers` 0: one worker and `seconds` of CP-SAT's deterministic time
        (the same answer on every run), else that many workers for `seconds` of wall time."""
        limit = self.units.down(budget)
        for k in range(self.stages.n):
            if self._mem_max(k) > limit:
                self.m.Add(self.mem_expr(k) <= limit)
        lexicographic = (self.extra_time, self._peak())
        return self._solve(lexicographic, seconds, workers, hint, self._time_value)

    def least_memory(
        self, limit_s: float, seconds: float, workers: int, hint: Choice | None = None
    ) -> Choice:
        """The decisions of least peak whose time is within `limit_s` seconds, the fastest
        among them (`workers`: as `least_time`'s)."""
        self.m.Add(self.base_time + self.extra_time <= self.units.t(limit_s))
        lexicographic = (self._peak(), self.extra_time)
        return self._solve(lexicographic, seconds, workers, hint, lambda v: v * self.units.nbytes)

    def _peak(self) -> cp_model.IntVar:
        top = max(self._mem_max(k) for k in range(self.stages.n))
        peak = self.m.NewIntVar(0, top, "peak")
        for k in range(self.stages.n):
            self.m.Add(peak >= self.mem_expr(k))
        return peak

    def _time_value(self, v: float) -> float:
        return (self.base_time + v) * self.units.seconds

    def _solve(self, objectives, seconds: float, workers: int, hint, value) -> Choice:
        """Minimize the first objective, then the second with the first held at its value
        (a quarter of the time); the status, value and bound are the first's."""
        if hint is not None:
            self._hint(hint)
        first, second = objectives
        self.m.Minimize(first)
        solver, status = self._run(0.75 * seconds, workers)
        if status not in (Status.OPTIMAL, Status.FEASIBLE):
            return Choice((), (), status, float("nan"), float("nan"), solver.WallTime())
        found = self._decisions(solver)
        spent = solver.WallTime()
        reached = (value(solver.ObjectiveValue()), value(solver.BestObjectiveBound()))
        self.m.Add(first <= round(solver.ObjectiveValue()))
        self.m.Minimize(second)
        self.m.ClearHints()
        self._hint(Choice(*found, status, 0.0, 0.0, 0.0))
        again, tie_status = self._run(0.25 * seconds, workers)
        if tie_status in (Status.OPTIMAL, Status.FEASIBLE):
            found = self._decisions(again)
        return Choice(*found, status, *reached, spent + again.WallTime())

    def _run(self, seconds: float, workers: int) -> tuple[cp_model.CpSolver, Status]:
        solver = cp_model.CpSolver()
        # CP-SAT's own SIGINT handler is left as SIG_DFL after a solve: a later Ctrl-C then
        # kills the process instead of raising KeyboardInterrupt (no plan saved). Ctrl-C
        # during a solve is Python's to handle once the solve returns.
        solver.parameters.catch_sigint_signal = False
        if workers <= 0:
            solver.parameters.max_deterministic_time = max(seconds, 0.1)
            solver.parameters.num_workers = 1
        else:
            solver.parameters.max_time_in_seconds = max(seconds, 0.1)
            solver.parameters.num_workers = workers
        solver.parameters.random_seed = 0
        code = solver.Solve(self.m)
        return solver, {
            cp_model.OPTIMAL: Status.OPTIMAL,
            cp_model.FEASIBLE: Status.FEASIBLE,
            cp_model.INFEASIBLE: Status.INFEASIBLE,
        }.get(code, Status.UNKNOWN)

    def _decisions(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], tuple[int, ...]]:
        rec = tuple(i for i, v in sorted(self.rec.items()) if solver.Value(v))
        off = tuple(i for i, v in sorted(self.off.items()) if solver.Value(v))
        return rec, off

    def _hint(self, hint: Choice) -> None:
        rec, off = set(hint.recompute), set(hint.offload)
        for i, v in self.rec.items():
            self.m.AddHint(v, i in rec)
        for i, v in self.off.items():
            self.m.AddHint(v, i in off)
