"""One rank of a data-parallel job, planned in simulation (`magis optimize --parallel`, issue 44).

`magis optimize corpus:llama --parallel fsdp --world-size 8 --hardware h100` captures rank 0's
step of an 8-rank FSDP job (every rank's has the same shapes: `magis.capture.sharding`), with no
process group, prices its collectives over a link preset (`magis.cost.links`, NVLink by default)
and searches it as any step. Beside the plan it reports what the job costs each rank without
magis, simulated the same way on the same cost model:

- **FSDP2**: the captured step in program order, which is FSDP2's schedule (each block
  gathered at its forward and again at its backward, resharded after its forward);
- **FSDP2 + full AC**: the same job captured with every block's forward checkpointed
  (torch.utils.checkpoint, as torchtitan's full activation checkpointing wraps each block), its
  recomputation all-gathering the block in the backward, as FSDP2 does under checkpointing;
- for DDP, only its step in program order.

Each row: the per-rank peak, the step's time, the communication stream's busy time and how
much of it the compute hides (overlap = (compute + communication - step) / communication).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from magis.capture import StepKind, workload_step
from magis.capture.sharding import PlannedJob
from magis.cost import CostModel
from magis.ir import Graph
from magis.search import WarmStart
from magis.sim import SimResult, simulate


@dataclass(frozen=True)
class RankFigures:
    """One schedule of one rank's step, simulated: what the table of `--parallel` shows."""

    name: str
    peak_bytes: int
    step_s: float
    compute_s: float
    comm_s: float

    @staticmethod
    def of(name: str, sim: SimResult) -> RankFigures:
        return RankFigures(name, sim.peak_bytes, sim.latency_s, sim.compute_s, sim.comm_s)

    @property
    def overlap(self) -> float:
        """The share of the communication stream's time hidden under compute."""
        if self.comm_s <= 0:
            return 1.0
        hidden = self.compute_s + self.comm_s - self.step_s
        return min(max(hidden / self.comm_s, 0.0), 1.0)

    def to_json(self) -> dict:
        return {**asdict(self), "overlap": self.overlap}


def rank_figures(name: str, graph: Graph, order: Sequence[int], cost: CostModel) -> RankFigures:
    return RankFigures.of(name, simulate(graph, order, cost))


CHECKPOINTED = "FSDP2 + full AC"
CHECKPOINTED_WARM_START = "fsdp2-full-ac"


def checkpointed_graph(workload: str, job: PlannedJob, step: StepKind) -> Graph | None:
    """The same job's step with every block's forward checkpointed (FSDP2 + full AC), or None
    for DDP, whose baseline is its step alone."""
    if job.kind != "fsdp":
        return None
    checkpointed = replace(job, checkpoint_blocks=True)
    _, ac = workload_step(workload, step=step, float64_when_tiny=True, job=checkpointed)
    return ac.graph


def job_warm_starts(graph: Graph, checkpointed: Graph | None) -> list[WarmStart]:
    """FSDP2 + full AC's program as a starting state of the search: the plan a user of FSDP
    would run instead, so the search starts at its point and improves from there, as from any
    peer's (`magis.commands.warm_start`). Not where its recomputation draws random numbers the
    step does not: torch.utils.checkpoint replays dropout's masks from a saved RNG state, a
    graph draws them again."""
    if checkpointed is None or _draws(checkpointed) != _draws(graph):
        return []
    return [WarmStart(CHECKPOINTED_WARM_START, checkpointed, checkpointed.program_order())]


def _draws(graph: Graph) -> int:
    return sum(1 for n in graph.nodes if graph.info(n).is_random)


def job_baselines(
    workload: str,
    job: PlannedJob,
    step: StepKind,
    cost: CostModel,
    graph: Graph,
    checkpointed: Graph | None = None,
) -> list[RankFigures]:
    """What each rank runs without magis (module docstring): `graph` is the job's captured
    step; FSDP's checkpointed variant is `checkpointed`, captured here when not given."""
    name = "FSDP2" if job.kind == "fsdp" else "DDP"
    rows = [rank_figures(name, graph, graph.program_order(), cost)]
    if job.kind == "fsdp":
        g = checkpointed if checkpointed is not None else checkpointed_graph(workload, job, step)
        rows.append(rank_figures(CHECKPOINTED, g, g.program_order(), cost))
    return rows
