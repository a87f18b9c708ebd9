"""`magis workloads`: the zoo (MAGIS Table 2's seven models, each at three sizes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from magis.capture import list_workloads


@dataclass(frozen=True)
class WorkloadRow:
    name: str
    batch: int
    dtype: str
    size: str  # paper, tiny or small
    description: str


@dataclass(frozen=True)
class WorkloadsReport:
    rows: tuple[WorkloadRow, ...]

    def to_json(self) -> dict:
        return {"workloads": [asdict(r) for r in self.rows]}


def workloads() -> WorkloadsReport:
    return WorkloadsReport(
        tuple(
            WorkloadRow(
                wl.name, wl.batch, str(wl.dtype).removeprefix("torch."), wl.size, wl.description
            )
            for wl in list_workloads()
        )
    )
