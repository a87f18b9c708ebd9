"""`magis bench coverage`'s results: the counts per outcome, the failures grouped by cause,
the JSON and the markdown table."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COUNTS = ("captured_verified", "specialized", "plan_verified", "peak_equal", "limit_met")


@dataclass(frozen=True)
class Failure:
    """Where one architecture stopped: the stage, a category (the cause), the first line."""

    architecture: str
    stage: str
    category: str
    message: str


@dataclass
class CoverageReport:
    """Every architecture's result (`coverage.ArchResult`), as they finish."""

    time_budget: float
    max_states: int | None
    mem_limit: float
    peak_tolerance: float
    results: list[Any] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0

    def count(self, outcome: str) -> int:
        return sum(bool(getattr(r, outcome)) for r in self.results)

    def counted(self) -> list[Any]:
        """The results of the architectures counted: all but those `excluded`."""
        return [r for r in self.results if not getattr(r, "excluded", "")]

    def excluded(self) -> list[tuple[str, Failure]]:
        """(why, the build's failure) of the architectures counted apart: those that need an
        optional library not installed here, and heads that compute no loss."""
        return [(r.excluded, r.failure) for r in self.results if getattr(r, "excluded", "")]

    def failures(self) -> list[Failure]:
        """Where the counted architectures stopped."""
        return [r.failure for r in self.counted() if r.failure is not None]

    def categories(self) -> list[tuple[str, str, int, Failure]]:
        """(stage, category, how many, the first failure) per cause, most frequent first."""
        failures = self.failures()
        counts = Counter((f.stage, f.category) for f in failures)
        first: dict[tuple[str, str], Failure] = {}
        for f in failures:
            first.setdefault((f.stage, f.category), f)
        return [(s, c, n, first[(s, c)]) for (s, c), n in counts.most_common()]

    def to_json(self) -> dict[str, Any]:
        return {
            "architectures": len(self.results),
            "counted": len(self.counted()),
            **{
                reason.replace(" ", "_"): n
                for reason, n in Counter(why for why, _ in self.excluded()).items()
            },
            **{name: self.count(name) for name in COUNTS},
            "time_budget_s": self.time_budget,
            "max_states": self.max_states,
            "mem_limit": self.mem_limit,
            "peak_tolerance": self.peak_tolerance,
            "interrupted": self.interrupted,
            "seconds": round(self.seconds, 1),
            "failures": [asdict(f) for f in self.failures()],
            "excluded": [{"reason": why, **asdict(f)} for why, f in self.excluded()],
            "categories": [
                {
                    "stage": s,
                    "category": c,
                    "count": n,
                    "first": f.architecture,
                    "message": f.message,
                }
                for s, c, n, f in self.categories()
            ],
            "results": [_result_json(r) for r in self.results],
        }


def _result_json(result: Any) -> dict[str, Any]:
    data = asdict(result)
    data["failure"] = asdict(result.failure) if result.failure is not None else None
    return data


def _share(n: int, total: int) -> str:
    # one decimal: 579 of 610 is 94.9%, which a whole percent showed as the 95% asked
    return f"{n} ({n / total:.1%})" if total else "0"


def table_markdown(report: CoverageReport) -> str:
    """Counts per outcome (shares of the architectures counted: those not excluded), then one
    row per failure category with its first message, then the excluded ones by name."""
    total = len(report.results)
    excluded = report.excluded()
    base = total - len(excluded)
    budget = f"{report.time_budget:g} s" + (
        f", {report.max_states} states" if report.max_states else ""
    )
    lines = [
        f"magis bench coverage: {total} architectures, mem_limit={report.mem_limit:g}, "
        f"search {budget}, {report.seconds / 60:.0f} min"
        + (" (interrupted)" if report.interrupted else ""),
        "",
        "| outcome | architectures |",
        "| --- | --- |",
        f"| tried | {total} |",
        *(
            f"| excluded: {why} | {n} |"
            for why, n in sorted(Counter(why for why, _ in excluded).items())
        ),
        f"| counted | {base} |",
        f"| captured and verified (float64; float32 where a kernel refuses it) | {_share(report.count('captured_verified'), base)} |",
        f"| of which captured for the values the step reads (guarded) | "
        f"{_share(report.count('specialized'), base)} |",
        f"| plan verified | {_share(report.count('plan_verified'), base)} |",
        f"| simulated = measured peak (within {report.peak_tolerance:.0%}) | "
        f"{_share(report.count('peak_equal'), base)} |",
        f"| memory limit met | {_share(report.count('limit_met'), base)} |",
    ]
    categories = report.categories()
    if categories:
        lines += [
            "",
            "| stage | category | count | first (architecture: message) |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {s} | {_cell(c)} | {n} | {f.architecture}: {_cell(f.message)} |"
            for s, c, n, f in categories
        ]
    if excluded:
        lines += ["", "Excluded: " + ", ".join(f"{f.architecture} ({why})" for why, f in excluded)]
    return "\n".join(lines) + "\n"


def _cell(text: str, width: int = 160) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def write_outputs(report: CoverageReport, json_path: Path | None, md_path: Path | None) -> None:
    """The JSON and the markdown table, each rewritten whole (atomically)."""
    if json_path is not None:
        _atomic(json_path, json.dumps(report.to_json(), indent=2, default=str) + "\n")
    if md_path is not None:
        _atomic(md_path, table_markdown(report))


def _atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
