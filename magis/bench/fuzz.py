"""`magis bench fuzz`: random testing of every rewrite rule, TASO's way (issue 14, item 3).

TASO verifies each graph substitution by running it on random inputs (Jia's thesis §3.4): a
rule that is wrong for some graph is found by drawing many graphs. Here a case is one random
training step (`fuzz_models`: the op mix of real ones, float64) and one random chain of rule
applications on it (`fuzz_chains`: every rule kind and its dual, F-Tree moves at n = 2, 3, 4,
as MAGIS's search applies them, strides derived on fake tensors after each). Each result is
compiled, run on real inputs and compared with eager PyTorch — the loss, the outputs and every
input the step updates in place — to the tolerance `verify` uses; and run through the meta
check (fake tensors: every op must make the shapes, dtypes and strides the graph records),
whose mismatches are counted apart. A mismatch carries its reproducer:
`replay(seed, model, case)`.

Capture and the eager reference are the expensive parts, so each captured model serves
CHAINS_PER_MODEL cases. A model whose *unmodified* program already differs from eager tests no
rule: it is reported apart (`baseline_failures`) and skipped.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from magis.backend import MetaChecker, compile_program, nodes_to_check
from magis.backend.executor import clone_all, relative_error
from magis.bench.fuzz_chains import ChainError, ChainState, Start, all_kinds, all_rules, draw_chain
from magis.bench.fuzz_models import random_step
from magis.capture import Step
from magis.commands.shared import default_tolerance, narrowest_float_dtype
from magis.cost import CostModel, get_cost_model
from magis.errors import MagisError
from magis.ir import Graph, PlaceholderKind
from magis.rules import Rule

CHAINS_PER_MODEL = 40  # cases per captured model: a capture costs about as much as 10 cases
# verify's: float64 programs that compute the same thing agree to rounding; a step with a
# float32 part (an LSTM block) is held to float32's (`magis.commands.shared.default_tolerance`)
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Mismatch:
    """One failing case and what reproduces it: `replay(seed, model, case)`."""

    seed: int
    model: int
    case: int  # -1: the model's unmodified program
    spec: str
    chain: tuple[str, ...]  # "rule: what it did [how it was placed]", in order
    error: str
    max_rel_err: float = math.inf
    worst: str = ""  # the output or updated input that differs most

    @property
    def reproducer(self) -> str:
        return f"magis.bench.fuzz.replay({self.seed}, {self.model}, {self.case})"

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "model": self.model,
            "case": self.case,
            "spec": self.spec,
            "chain": list(self.chain),
            "error": self.error,
            "max_rel_err": self.max_rel_err if math.isfinite(self.max_rel_err) else None,
            "worst": self.worst,
            "reproducer": self.reproducer,
        }


@dataclass
class FuzzReport:
    seed: int
    cases: int = 0  # chains run and compared with eager
    models: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    meta_mismatches: list[Mismatch] = field(default_factory=list)  # ran right, metas wrong
    baseline_failures: list[Mismatch] = field(default_factory=list)
    rules_covered: Counter = field(default_factory=Counter)  # rule name -> times applied
    kinds_covered: Counter = field(default_factory=Counter)  # rule kind -> times applied
    placements: Counter = field(default_factory=Counter)  # how results were scheduled
    meta_rejected: Counter = field(default_factory=Counter)  # rewrites dropped as the search does
    empty_chains: int = 0  # draws where no rule applied (not cases)
    seconds: float = 0.0
    breakdown: Counter = field(default_factory=Counter)  # seconds: capture, chains, run, meta

    @property
    def cases_per_second(self) -> float:
        return self.cases / self.seconds if self.seconds > 0 else 0.0

    @property
    def kinds_missing(self) -> list[str]:
        return sorted(all_kinds() - set(self.kinds_covered))

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "cases": self.cases,
            "models": self.models,
            "mismatches": [m.to_json() for m in self.mismatches],
            "meta_mismatches": [m.to_json() for m in self.meta_mismatches],
            "baseline_failures": [m.to_json() for m in self.baseline_failures],
            "rules_covered": dict(sorted(self.rules_covered.items())),
            "kinds_covered": dict(sorted(self.kinds_covered.items())),
            "kinds_missing": self.kinds_missing,
            "placements": dict(sorted(self.placements.items())),
            "meta_rejected": dict(sorted(self.meta_rejected.items())),
            "empty_chains": self.empty_chains,
            "seconds": self.seconds,
            "cases_per_second": self.cases_per_second,
            "breakdown": {k: round(v, 3) for k, v in sorted(self.breakdown.items())},
        }


# --- a captured model and its eager reference ---------------------------------------------------


@dataclass
class Subject:
    """A random training step, its inputs, eager PyTorch's results on them (run once), and
    where its chains start."""

    index: int
    spec: str
    step: Step
    inputs: list[torch.Tensor]
    expected: list[tuple[str, torch.Tensor]]  # outputs, then inputs as the step left them
    rng_seed: int  # torch's RNG seed for both runs: dropout draws the same masks
    start: Start
    tolerance: float = TOLERANCE  # the relative error allowed: its least precise dtype's


def fuzz_inputs(step: Step, seed: int) -> list[torch.Tensor]:
    """`step.make_inputs(seed=)`, with Adam's second moments made non-negative, as they are in
    training: a negative one is a NaN under the square root, in eager and program alike."""
    inputs = step.make_inputs(seed=seed)
    for i, (name, kind) in enumerate(zip(step.input_names, step.input_kinds, strict=True)):
        if kind is PlaceholderKind.OPT_STATE and name.endswith("exp_avg_sq"):
            inputs[i] = inputs[i].abs()
    return inputs


def make_subject(
    seed: int, index: int, cost: CostModel | None = None, checker: MetaChecker | None = None
) -> Subject:
    """Model `index` of `seed`, captured, with its eager reference run (as `verify` runs it)."""
    spec, step = random_step(seed, index)
    inputs = fuzz_inputs(step, seed + index)
    ref_in = clone_all(inputs)
    torch.manual_seed(seed + index)
    ref_out = step.fn(*ref_in)
    expected = [
        *zip(step.output_names, ref_out, strict=True),
        *zip(step.input_names, ref_in, strict=True),
    ]
    cost = cost if cost is not None else get_cost_model("rtx3090")
    start = Start(step.graph, cost, checker if checker is not None else MetaChecker())
    tolerance = default_tolerance(narrowest_float_dtype(step))  # TOLERANCE in float64
    return Subject(index, spec.describe(), step, inputs, expected, seed + index, start, tolerance)


def compare(subject: Subject, graph: Graph, order: Sequence[int]) -> tuple[float, str]:
    """(largest relative error, its value's name) of the program for (graph, order) against
    eager: `verify`'s comparison, against the subject's stored reference, where a NaN counts as
    a difference (verify passes a NaN that is not in the first value it compares)."""
    program = compile_program(graph, list(order))
    run_in = clone_all(subject.inputs)
    torch.manual_seed(subject.rng_seed)
    run_out = program(*subject.step.program_inputs(run_in))
    worst, worst_err = "", 0.0
    for (name, expected), got in zip(subject.expected, [*run_out, *run_in], strict=True):
        err = relative_error(got, expected)
        err = math.inf if math.isnan(err) else err
        if err > worst_err or not worst:
            worst, worst_err = name, err
    return worst_err, worst


# --- running cases -------------------------------------------------------------------------------


@dataclass
class Fuzzer:
    """One fuzzing run: its seed, rules, the cost model the rules see, and its report."""

    seed: int
    rules: tuple[Rule, ...]
    cost: CostModel
    report: FuzzReport
    checker: MetaChecker = field(default_factory=MetaChecker)

    def subject(self, model: int) -> Subject | None:
        """Model `model`, or None when its unmodified program differs from eager already."""
        start = time.perf_counter()
        subject = make_subject(self.seed, model, self.cost, self.checker)
        self.report.models += 1
        failure = self.baseline_failure(subject)
        self.report.breakdown["capture"] += time.perf_counter() - start
        if failure is not None:
            self.report.baseline_failures.append(failure)
            return None
        return subject

    def baseline_failure(self, subject: Subject) -> Mismatch | None:
        """The unmodified program against eager and the meta check (the capture's bugs)."""
        graph = subject.step.graph
        try:
            err, worst = compare(subject, graph, graph.program_order())
        except Exception as exc:  # noqa: BLE001 - the capture's bug, reported
            return self._mismatch(subject, -1, (), f"{type(exc).__name__}: {exc}")
        if not err <= subject.tolerance:
            return self._mismatch(subject, -1, (), f"{worst} differs by {err:.2e}", err, worst)
        found = self.checker.check_graph(graph)
        if not found.ok:
            return self._mismatch(subject, -1, (), f"meta check: {found.mismatches[0]}")
        return None

    def _mismatch(self, subject, case, chain, error, err=math.inf, worst="") -> Mismatch:
        return Mismatch(self.seed, subject.index, case, subject.spec, chain, error, err, worst)

    def run_case(self, subject: Subject, case: int) -> None:
        """Draw case `case`'s chain on `subject`, run it, check it, and record the outcome."""
        report, start = self.report, time.perf_counter()
        try:
            state = draw_chain(
                subject.start, random.Random(f"chain {self.seed} {case}"), self.rules
            )
        except ChainError as exc:
            report.cases += 1
            report.mismatches.append(self._mismatch(subject, case, exc.chain, str(exc)))
            return
        finally:
            report.breakdown["chains"] += time.perf_counter() - start
        report.meta_rejected.update(state.meta_rejected)
        if not state.chain:
            report.empty_chains += 1
            return
        report.cases += 1
        report.rules_covered.update(c.split(": ")[0] for c in state.chain)
        report.kinds_covered.update(state.kinds)
        report.placements.update(state.placements)
        self._run(subject, case, state)
        self.check_metas(subject, case, state)

    def _run(self, subject: Subject, case: int, state: ChainState) -> None:
        start = time.perf_counter()
        try:
            err, worst = compare(subject, state.graph, state.order)
        except Exception as exc:  # noqa: BLE001 - a program that does not run is a mismatch
            err, worst, error = math.inf, "", f"{type(exc).__name__}: {exc}"
        else:
            error = f"{worst} differs by {err:.2e}"
        finally:
            self.report.breakdown["run"] += time.perf_counter() - start
        if not err <= subject.tolerance:
            mismatch = self._mismatch(subject, case, state.chain, error, err, worst)
            self.report.mismatches.append(mismatch)

    def check_metas(self, subject: Subject, case: int, state: ChainState) -> None:
        """The meta check on the nodes the chain touched (all of them after an F-Tree move)."""
        start = time.perf_counter()
        graph = state.graph
        nodes = graph.ops() if state.touched is None else nodes_to_check(graph, state.touched)
        found = self.checker.check_nodes(graph, nodes)
        self.report.breakdown["meta"] += time.perf_counter() - start
        if not found.ok:
            error = "; ".join(str(m) for m in found.mismatches[:3])
            self.report.meta_mismatches.append(self._mismatch(subject, case, state.chain, error))


def run_fuzz(
    cases: int,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    max_seconds: float | None = None,
    rules: Sequence[Rule] | None = None,
) -> FuzzReport:
    """Run `cases` random cases: a random model, a random chain of rewrites, the result run
    against eager PyTorch and through the meta check. Deterministic for a seed.

    `progress(done, cases)` is called after each case; `max_seconds` stops early (the report
    says how many ran); `rules` replaces the rule set (a test injects a wrong rule)."""
    if cases < 0:
        raise MagisError(f"the number of cases must be >= 0, got {cases}")
    rules = tuple(rules) if rules is not None else all_rules()
    fuzzer = Fuzzer(seed, rules, get_cost_model("rtx3090"), FuzzReport(seed))
    threads = torch.get_num_threads()
    # One intra-op thread: the tensors are tiny, and on a busy machine an OpenMP region waiting
    # for a descheduled worker took 0.5 s of a 2 ms program (measured on 2 shared cores).
    torch.set_num_threads(1)
    try:
        _run_models(fuzzer, cases, progress, max_seconds)
    finally:
        torch.set_num_threads(threads)
    return fuzzer.report


def _run_models(fuzzer: Fuzzer, cases: int, progress, max_seconds: float | None) -> None:
    report, start, case = fuzzer.report, time.perf_counter(), 0

    def done() -> bool:
        late = max_seconds is not None and time.perf_counter() - start >= max_seconds
        return report.cases >= cases or late

    model = 0
    while not done():
        subject = fuzzer.subject(model)
        model += 1
        for _ in range(CHAINS_PER_MODEL if subject is not None else 0):
            if done():
                break
            fuzzer.run_case(subject, case)
            case += 1
            if progress is not None:
                progress(report.cases, cases)
    report.seconds = time.perf_counter() - start


def replay(seed: int, model: int, case: int, rules: Sequence[Rule] | None = None) -> FuzzReport:
    """Run one case of a report again: a mismatch's reproducer."""
    rules = tuple(rules) if rules is not None else all_rules()
    fuzzer = Fuzzer(seed, rules, get_cost_model("rtx3090"), FuzzReport(seed, models=1))
    start = time.perf_counter()
    subject = make_subject(seed, model, fuzzer.cost, fuzzer.checker)
    if case < 0:
        failure = fuzzer.baseline_failure(subject)
        fuzzer.report.baseline_failures.extend([failure] if failure is not None else [])
    else:
        fuzzer.run_case(subject, case)
    fuzzer.report.seconds = time.perf_counter() - start
    return fuzzer.report
