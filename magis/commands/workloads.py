"""`magis workloads`: the zoo (MAGIS Table 2's seven models, each at three sizes), or with
`corpus=True` the public corpus (`magis.capture.corpus`: `corpus:NAME`, `corpus:NAME:tiny`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from magis.capture import Workload, get_workload, list_workloads


@dataclass(frozen=True)
class WorkloadRow:
    name: str
    batch: int
    dtype: str
    size: str  # paper, tiny or small (a corpus entry's full size is "paper")
    description: str


@dataclass(frozen=True)
class WorkloadsReport:
    rows: tuple[WorkloadRow, ...]

    def to_json(self) -> dict:
        return {"workloads": [asdict(r) for r in self.rows]}


def workloads(corpus: bool = False) -> WorkloadsReport:
    """Every zoo workload, or every corpus entry at full and tiny size when `corpus`."""
    if corpus:
        from magis.capture.corpus import workload_names

        listed = [get_workload(name) for name in workload_names()]
    else:
        listed = list_workloads()
    return WorkloadsReport(tuple(_row(wl) for wl in listed))


def _row(wl: Workload) -> WorkloadRow:
    return WorkloadRow(
        wl.name, wl.batch, str(wl.dtype).removeprefix("torch."), wl.size, wl.description
    )
