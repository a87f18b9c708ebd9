"""The constraints of MAGIS §7.2 and the names of the result series, shared by the comparison
(`magis.bench.compare`), the ablation and their figures (`magis.bench.plots`).

Latency limits 1.05 and 1.10 (§7.2.1: least memory within them, Fig. 9) and memory limits 0.8
and 0.4 (§7.2.2: least latency within them, Fig. 10), as ratios of the program order's figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.search import Mode, Objective
from magis.sim import SimResult


@dataclass(frozen=True)
class Constraint:
    """A latency limit (least memory within it) or a memory limit (least latency within it),
    as a ratio of the program order's figure."""

    mode: Mode
    ratio: float

    @property
    def label(self) -> str:
        return f"{'lat' if self.mode is Mode.LATENCY_LIMIT else 'mem'}<={self.ratio:g}"

    def objective(self, base: SimResult) -> Objective:
        if self.mode is Mode.LATENCY_LIMIT:
            return Objective(self.mode, self.ratio * base.latency_s)
        return Objective(self.mode, int(self.ratio * base.peak_bytes))


LATENCY_CONSTRAINTS = (Constraint(Mode.LATENCY_LIMIT, 1.05), Constraint(Mode.LATENCY_LIMIT, 1.10))
MEMORY_CONSTRAINTS = (Constraint(Mode.MEMORY_LIMIT, 0.8), Constraint(Mode.MEMORY_LIMIT, 0.4))
CONSTRAINTS = LATENCY_CONSTRAINTS + MEMORY_CONSTRAINTS

MAGIS = "magis"  # the method name of our search among the baselines
PARETO = "pareto"  # the constraint column of a Pareto-front point (Fig. 11)
MICROBATCH = "microbatch"  # ... and of a micro-batching point (Fig. 12)
