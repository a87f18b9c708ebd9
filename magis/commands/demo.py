"""`magis demo` (`make demo`): bert-base analyzed at paper size, then bert-base:tiny run and
verified against eager PyTorch — the two things a newcomer wants to see work."""

from __future__ import annotations

from dataclasses import dataclass

from magis.commands.analyze import AnalyzeReport, analyze
from magis.commands.run import RunReport, run
from magis.commands.shared import Progress, silent

DEMO_WORKLOAD = "bert-base"


@dataclass(frozen=True)
class DemoReport:
    analyze: AnalyzeReport  # paper size (MAGIS Table 2), fake tensors, on the paper's card
    run: RunReport  # :tiny, executed in float64 on this CPU

    def to_json(self) -> dict:
        return {"analyze": self.analyze.to_json(), "run": self.run.to_json()}


def demo(progress: Progress = silent) -> DemoReport:
    analyzed = analyze(DEMO_WORKLOAD, "rtx3090", progress=lambda s: progress(f"analyze: {s}"))
    ran = run(f"{DEMO_WORKLOAD}:tiny", "cpu", progress=lambda s: progress(f"run: {s}"))
    return DemoReport(analyzed, ran)
