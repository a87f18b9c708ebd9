"""`magis bench fuzz`: random testing of every rewrite rule, TASO's way (issue 14, item 3).

TASO verifies each graph substitution by running it on random inputs (Jia's thesis §3.4); a
rule that is wrong for some graph is found by drawing many graphs. Here a case is one random
training step (`fuzz_models`: the op mix of real ones, float64) and one random chain of rule
applications on it, drawn from every rule kind and its dual as MAGIS's search applies them
(Alg. 3): TASO rules, re-materialization, swapping and compaction and their duals, and F-Tree
mutations (§5.1) materialized at n in {2, 3, 4}. Each result is scheduled (the rewrite's own
placement hint, incremental scheduling of Alg. 2, or the cheap after-inputs placement), checked
to be a valid schedule, compiled, run on real inputs and compared with eager PyTorch: the loss,
the outputs and every input the step updates in place, to the tolerance `verify` uses. A
mismatch carries what reproduces it: the seed, the model and case indices, the chain.

Capture and the eager reference run are the expensive parts, so each captured model serves
`CHAINS_PER_MODEL` cases. Models whose *unmodified* program already differs from eager are
not cases of any rule: they are reported apart (`baseline_failures`).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from magis.backend import compile_program
from magis.backend.executor import clone_all, relative_error
from magis.bench.fuzz_models import random_step
from magis.capture import Step
from magis.cost import CostModel, get_cost_model
from magis.errors import MagisError
from magis.ir import Graph, PlaceholderKind
from magis.rules.base import Rewritten, Rule, RuleContext, RuleKind, place_after_inputs
from magis.rules.compact import COMPACT, DECOMPACT
from magis.rules.remat import DEREMAT, REMAT
from magis.rules.swap import DESWAP, SWAP
from magis.rules.taso import TASO_RULES
from magis.schedule import incremental_schedule, schedule
from magis.schedule.swaps import time_swaps
from magis.search import fission_moves
from magis.sim import SimResult, simulate

CHAINS_PER_MODEL = 40  # cases per captured model: a capture costs about as much as 10 cases
MAX_CHAIN = 4  # rule applications per case
TOLERANCE = 1e-9  # verify's: float64 programs that compute the same thing agree to rounding
FISSION = "fission"  # the kind of F-Tree mutations (their rules are not `Rule`s)
FISSION_N = (2, 3, 4)
# How a rewrite's result is scheduled, and how often: Alg. 2 costs ~0.1 s on these graphs (five
# cases' worth), so it is drawn rarely; its own tests are in tests/test_schedule.py.
PLACEMENTS = {"hint": 0.6, "after_inputs": 0.35, "incremental": 0.05}
FISSION_SHARE = 0.3  # steps that try an F-Tree move
REANALYSIS_SHARE = 0.25  # of those after other rules: analysing again costs ~50 ms


def all_rules() -> tuple[Rule, ...]:
    """Every rewrite rule the search applies, each with its dual."""
    return (*TASO_RULES, REMAT, DEREMAT, SWAP, DESWAP, COMPACT, DECOMPACT)


def all_kinds() -> frozenset[str]:
    """What "every rule kind covered" means: each kind of `Rule`, and F-Tree fission."""
    return frozenset({k.value for k in RuleKind} | {FISSION})


# --- the report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """One failing case and what reproduces it: `replay(seed, model, case)`."""

    seed: int
    model: int
    case: int
    spec: str
    chain: tuple[str, ...]  # "rule: what it did", in order
    error: str
    max_rel_err: float = math.inf
    worst: str = ""  # the output or updated input that differs most

    def to_json(self) -> dict[str, Any]:
        err = self.max_rel_err if math.isfinite(self.max_rel_err) else None
        return {
            "seed": self.seed,
            "model": self.model,
            "case": self.case,
            "spec": self.spec,
            "chain": list(self.chain),
            "error": self.error,
            "max_rel_err": err,
            "worst": self.worst,
            "reproducer": f"magis.bench.fuzz.replay({self.seed}, {self.model}, {self.case})",
        }


@dataclass
class FuzzReport:
    seed: int
    cases: int = 0  # chains executed and compared with eager
    models: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    baseline_failures: list[Mismatch] = field(default_factory=list)  # empty chain, still wrong
    rules_covered: Counter = field(default_factory=Counter)  # rule name -> times applied
    kinds_covered: Counter = field(default_factory=Counter)  # rule kind -> times applied
    placements: Counter = field(default_factory=Counter)  # how results were scheduled
    empty_chains: int = 0  # draws where no rule applied (not counted as cases)
    seconds: float = 0.0
    breakdown: Counter = field(default_factory=Counter)  # seconds: capture, chains, execute

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
            "baseline_failures": [m.to_json() for m in self.baseline_failures],
            "rules_covered": dict(sorted(self.rules_covered.items())),
            "kinds_covered": dict(sorted(self.kinds_covered.items())),
            "kinds_missing": self.kinds_missing,
            "placements": dict(sorted(self.placements.items())),
            "empty_chains": self.empty_chains,
            "seconds": self.seconds,
            "cases_per_second": self.cases_per_second,
            "breakdown": {k: round(v, 3) for k, v in sorted(self.breakdown.items())},
        }


# --- a captured model and its eager reference ---------------------------------------------------


@dataclass
class Subject:
    """A random training step, its inputs, and eager PyTorch's results on them (run once)."""

    index: int
    spec: str
    step: Step
    inputs: list[torch.Tensor]
    expected: list[tuple[str, torch.Tensor]]  # outputs, then inputs as the step left them
    rng_seed: int
    _initial: dict = field(default_factory=dict, repr=False)
    _lineages: dict = field(default_factory=dict, repr=False)

    def initial_state(self, kind: str, cost: CostModel) -> ChainState:
        """The graph in its program (capture) order or in the DP schedule the search starts
        from, simulated: every chain starts from one of these two."""
        if kind not in self._initial:
            g = self.step.graph
            order = tuple(g.program_order() if kind == "program" else schedule(g, "dp").order)
            self._initial[kind] = ChainState(g, order, sim=simulate(g, order, cost, False))
        return self._initial[kind]

    def initial_lineage(self, kind: str) -> fission_moves.Lineage | None:
        """The F-Tree of the initial state (Alg. 1), built once."""
        if kind not in self._lineages:
            order = self._initial[kind].order
            self._lineages[kind] = _lineage(self.step.graph, order, False)
        return self._lineages[kind]


def fuzz_inputs(step: Step, seed: int) -> list[torch.Tensor]:
    """`step.make_inputs(seed=)`, with Adam's second moments made non-negative (as they are in
    training): a random negative one is a NaN under the square root, in eager and program alike,
    and NaN would hide every difference downstream."""
    inputs = step.make_inputs(seed=seed)
    for i, (name, kind) in enumerate(zip(step.input_names, step.input_kinds, strict=True)):
        if kind is PlaceholderKind.OPT_STATE and name.endswith("exp_avg_sq"):
            inputs[i] = inputs[i].abs()
    return inputs


def make_subject(seed: int, index: int) -> Subject:
    spec, step = random_step(seed, index)
    inputs = fuzz_inputs(step, seed + index)
    rng_seed = seed + index
    ref_in = clone_all(inputs)
    torch.manual_seed(rng_seed)  # as verify does: dropout draws the same masks in both runs
    ref_out = step.fn(*ref_in)
    expected = [
        *zip(step.output_names, ref_out, strict=True),
        *zip(step.input_names, ref_in, strict=True),
    ]
    return Subject(index, spec.describe(), step, inputs, expected, rng_seed)


def compare(subject: Subject, graph: Graph, order: Sequence[int]) -> tuple[float, str]:
    """(largest relative error, its value's name) of the program for (graph, order) against
    eager: `verify`'s comparison against the subject's stored reference, where a NaN counts
    as a difference (verify skips a NaN that is not the first value compared)."""
    program = compile_program(graph, list(order))
    run_in = clone_all(subject.inputs)
    torch.manual_seed(subject.rng_seed)
    run_out = program(*subject.step.program_inputs(run_in))
    actual = [*run_out, *run_in]
    worst, worst_err = "", 0.0
    for (name, expected), got in zip(subject.expected, actual, strict=True):
        err = relative_error(got, expected)
        err = math.inf if math.isnan(err) else err
        if err > worst_err or not worst:
            worst, worst_err = name, err
    return worst_err, worst


# --- chains of rule applications --------------------------------------------------------------


@dataclass(frozen=True)
class ChainState:
    """A graph, its schedule, the frozen nodes of enabled F-Tree regions, and the F-Tree
    lineage while only F-Tree moves were applied since its analysis (as `MState`)."""

    graph: Graph
    order: tuple[int, ...]
    frozen: frozenset[int] = frozenset()
    lineage: fission_moves.Lineage | None = None
    chain: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    sim: SimResult | None = None  # of (graph, order), when known


def _lineage(graph: Graph, order, reanalysis: bool, frozen=frozenset()):
    found = fission_moves.analyze(graph, list(order), reanalysis=reanalysis)
    if found is None:
        return None
    base, base_order, tree = found
    return fission_moves.Lineage(base, base_order, tree, int(reanalysis), frozen)


def _random_n_trees(tree, rng: random.Random):
    """(description, tree) for a few random tree-nodes enabled at random n in FISSION_N where
    n divides what is left of the node's length (and, rarely, where it does not: a split the
    materialization must refuse)."""
    for i in rng.sample(range(len(tree)), min(3, len(tree))):
        node = tree.nodes[i]
        length = node.length
        for a in tree.ancestors(i):
            anc = tree.nodes[a]
            if anc.enabled and anc.component == node.component:
                length //= anc.n
        ns = [n for n in FISSION_N if length % n == 0 and n != node.n]
        if rng.random() < 0.1:
            ns = [n for n in FISSION_N if length % n != 0]
        if ns:
            n = rng.choice(ns)
            yield f"n={n} {i}", tree.with_n(i, n)


def fission_step(state: ChainState, rng: random.Random, cost: CostModel) -> ChainState | None:
    """One F-Tree move as the search makes it (`fission_moves.moves`: Fig. 7's enable, lift,
    disable, mutate, and the direct and level-wide enables) or a node enabled at a random n,
    materialized on the lineage's base; None when no move applies."""
    lineage = state.lineage
    moves = list(itertools.islice(fission_moves.moves(lineage.tree), 24))
    offered = [(d, build) for d, build in moves] + [
        (d, lambda t=t: t) for d, t in _random_n_trees(lineage.tree, rng)
    ]
    rng.shuffle(offered)
    for description, build in offered[:4]:
        tree = build()
        try:
            done = fission_moves.apply(lineage, tree)
        except MagisError:  # the search's "not applicable" (n does not divide, a bad split)
            continue
        order = done.order
        if done.graph.copy_nodes():
            order = time_swaps(done.graph, order, cost)
        name = f"{FISSION}:{description.split()[0]}"
        return ChainState(
            done.graph,
            tuple(order),
            done.frozen,
            replace(lineage, tree=tree, materialized=done.materialized),
            (*state.chain, f"{name}: {description}"),
            (*state.kinds, FISSION),
        )
    return None


def _rules_in_turn(rules: Sequence[Rule], state: ChainState, rng: random.Random) -> list[Rule]:
    """The rules in random order; after a rule, half the time its kind's dual (and, after a
    TASO rule, the other TASO rules) first, so chains undo and compose what they did."""
    order = list(rules)
    rng.shuffle(order)
    if state.kinds and rng.random() < 0.5:
        last = state.kinds[-1]
        duals = {"remat": "deremat", "swap": "deswap", "compact": "decompact"}
        duals |= {v: k for k, v in duals.items()} | {"taso": "taso"}
        order.sort(key=lambda r: r.kind.value != duals.get(last))
    return order


def rule_step(
    state: ChainState, rules: Sequence[Rule], rng: random.Random, cost: CostModel
) -> tuple[ChainState, str, Rewritten] | None:
    """One rewrite of the first rule (in random order) that matches anything, drawn at random
    among its candidates; (new state, placement used, the rewrite) or None."""
    sim = state.sim if state.sim is not None else simulate(state.graph, state.order, cost, False)
    hotspots_only = rng.random() < 0.5
    if not hotspots_only and rng.random() < 0.5:
        # A rule must be right wherever the peak is: the peak only chooses what to rewrite.
        # A peak moved elsewhere makes other reads "late" (re-materialization, swapping and
        # compaction then match where the true peak would not let them).
        sim = replace(sim, peak_step=rng.randrange(len(state.order)))
    ctx = RuleContext(
        state.graph,
        state.order,
        sim,
        state.frozen,
        hotspots_only=hotspots_only,
        max_candidates=rng.choice((4, 16, 64)),
    )
    for rule in _rules_in_turn(rules, state, rng):
        found = list(itertools.islice(rule.match(ctx), 64))
        if not found:
            continue
        rewrite = rng.choice(found)
        label = f"{rewrite.rule}: {rewrite.description}"
        try:
            result = rewrite.build()
            result.graph.verify()
            placement = rng.choices(list(PLACEMENTS), weights=list(PLACEMENTS.values()))[0]
            order = place(state.graph, state.order, result, placement, cost)
        except Exception as exc:  # noqa: BLE001 - any failure of a rule is the rule's bug
            raise ChainError((*state.chain, label), f"{type(exc).__name__}: {exc}") from exc
        if not result.graph.is_valid_schedule(order):
            raise ChainError((*state.chain, label), f"invalid schedule after {placement}")
        new = ChainState(
            result.graph,
            tuple(order),
            state.frozen & frozenset(result.graph.nodes),
            None,  # any rule but an F-Tree move ends the lineage (fission_moves)
            (*state.chain, label),
            (*state.kinds, rule.kind.value),
        )
        return new, placement, result
    return None


class ChainError(Exception):
    """A rule or the scheduling of its result failed: the chain so far and what happened."""

    def __init__(self, chain: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.chain = chain


def place(
    old: Graph, old_order: Sequence[int], result: Rewritten, how: str, cost: CostModel
) -> list[int]:
    """A schedule of `result.graph` from the old one: `how` is "hint" (where the rewrite says
    its nodes belong: before `anchor`, or where the nodes they replace ran; after their inputs
    when that is not valid), "incremental" (Alg. 2 around the touched nodes) or
    "after_inputs". Store/Load are then timed, as the search does."""
    graph = result.graph
    if how == "incremental":
        touched = set(result.changed) | set(result.removed)
        for n in result.added:
            touched.update(graph.predecessors(n))
            touched.update(graph.successors(n))
        touched = {n for n in touched if n in old}
        order = list(incremental_schedule(old, old_order, graph, touched).order)
    else:
        order = hinted_order(old_order, result) if how == "hint" else None
        if order is None or not graph.is_valid_schedule(order):
            order = place_after_inputs(graph, list(old_order), result.added)
    if graph.copy_nodes():
        order = time_swaps(graph, order, cost)
    return order


def hinted_order(old_order: Sequence[int], result: Rewritten) -> list[int] | None:
    """The old order with the rewrite's nodes where its hints put them (`Rewritten.anchor`:
    right before that node, in id order; `in_place_of`: where the first replaced node ran),
    removed nodes dropped; None when the rewrite gives no hint and adds nodes."""
    kept = [n for n in old_order if n not in result.removed]
    if result.anchor is not None:
        at = kept.index(result.anchor)
        return [*kept[:at], *sorted(result.added), *kept[at:]]
    if result.in_place_of:
        pos = {n: i for i, n in enumerate(old_order)}
        spots = {min(olds, key=pos.__getitem__): news for olds, news in result.in_place_of}
        order = []
        for n in old_order:
            order.extend(spots.get(n, ()))
            if n not in result.removed:
                order.append(n)
        return order
    return None if result.added else kept


# --- running cases ---------------------------------------------------------------------------------


def draw_chain(
    subject: Subject, rng: random.Random, rules: Sequence[Rule], cost: CostModel
) -> tuple[ChainState, list[str]]:
    """A random chain of 1..MAX_CHAIN applications on `subject` (fewer when nothing applies),
    and how each result was placed."""
    kind = rng.choice(("program", "dp"))
    state = subject.initial_state(kind, cost)
    placements = []
    for _ in range(rng.randint(1, MAX_CHAIN)):
        if rng.random() < FISSION_SHARE:
            moved = _try_fission(subject, kind, state, rng, cost)
            if moved is not None:
                state = moved
                placements.append(FISSION)
                continue
        stepped = rule_step(state, rules, rng, cost)
        if stepped is None:
            break
        state, placement, _ = stepped
        placements.append(placement)
    return state, placements


def _try_fission(
    subject: Subject, kind: str, state: ChainState, rng: random.Random, cost: CostModel
) -> ChainState | None:
    """An F-Tree move on `state`: from its lineage, or (as the search's re-analysis does) from
    a new analysis of a state other rules made."""
    try:
        if state.lineage is None:
            if not state.chain:
                lineage = subject.initial_lineage(kind)
            elif rng.random() < REANALYSIS_SHARE:
                lineage = _lineage(state.graph, state.order, True, state.frozen)
            else:
                return None
            state = replace(state, lineage=lineage)
        return fission_step(state, rng, cost) if state.lineage is not None else None
    except Exception as exc:  # noqa: BLE001 - analysis or materialization failed
        raise ChainError((*state.chain, FISSION), f"{type(exc).__name__}: {exc}") from exc


def run_case(
    subject: Subject, seed: int, case: int, rules: Sequence[Rule], cost: CostModel, report
) -> None:
    """Draw case `case`'s chain on `subject`, run it, and record the outcome in `report`."""
    rng = random.Random(f"chain {seed} {case}")

    def mismatch(chain, error, err=math.inf, worst=""):
        return Mismatch(seed, subject.index, case, subject.spec, chain, error, err, worst)

    start = time.perf_counter()
    try:
        state, placements = draw_chain(subject, rng, rules, cost)
    except ChainError as exc:
        report.cases += 1
        report.mismatches.append(mismatch(exc.chain, str(exc)))
        return
    if not state.chain:
        report.empty_chains += 1
        return
    report.cases += 1
    report.rules_covered.update(c.split(": ")[0] for c in state.chain)
    report.kinds_covered.update(state.kinds)
    report.placements.update(placements)
    report.breakdown["chains"] += time.perf_counter() - start
    start = time.perf_counter()
    try:
        err, worst = compare(subject, state.graph, state.order)
    except Exception as exc:  # noqa: BLE001 - a program that does not run is a mismatch
        report.mismatches.append(mismatch(state.chain, f"{type(exc).__name__}: {exc}"))
        return
    finally:
        report.breakdown["execute"] += time.perf_counter() - start
    if not err <= TOLERANCE:
        report.mismatches.append(mismatch(state.chain, f"{worst} differs by {err:.2e}", err, worst))


def baseline_failure(subject: Subject, seed: int) -> Mismatch | None:
    """The unmodified program against eager: a model that fails here tests no rule."""
    graph = subject.step.graph
    try:
        err, worst = compare(subject, graph, graph.program_order())
    except Exception as exc:  # noqa: BLE001
        return Mismatch(seed, subject.index, -1, subject.spec, (), f"{type(exc).__name__}: {exc}")
    if err <= TOLERANCE:
        return None
    return Mismatch(seed, subject.index, -1, subject.spec, (), f"{worst} differs", err, worst)


def run_fuzz(
    cases: int,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    max_seconds: float | None = None,
    rules: Sequence[Rule] | None = None,
    cost: CostModel | None = None,
) -> FuzzReport:
    """Run `cases` random cases (random model, random rule chain, compared with eager).

    Deterministic for a seed. `progress(done, cases)` is called after each case; `max_seconds`
    stops early (the report says how many ran); `rules` replaces the rule set (a test injects a
    wrong rule); `cost` is the cost model the rules see (default: the rtx3090 roofline)."""
    if cases < 0:
        raise MagisError(f"--cases must be >= 0, got {cases}")
    rules = tuple(rules) if rules is not None else all_rules()
    cost = cost if cost is not None else get_cost_model("rtx3090")
    report = FuzzReport(seed)
    threads = torch.get_num_threads()
    # One intra-op thread: the tensors are tiny, and on a shared machine an OpenMP region
    # waiting for a descheduled worker took 0.5 s of a 2 ms program (measured, 2 busy cores).
    torch.set_num_threads(1)
    try:
        _run_models(report, cases, seed, progress, max_seconds, rules, cost)
    finally:
        torch.set_num_threads(threads)
    return report


def _run_models(report: FuzzReport, cases, seed, progress, max_seconds, rules, cost) -> None:
    start = time.perf_counter()
    next_case = 0
    for model in itertools.count():
        if report.cases >= cases or _past(start, max_seconds):
            break
        captured = time.perf_counter()
        subject = make_subject(seed, model)
        report.models += 1
        failure = baseline_failure(subject, seed)
        report.breakdown["capture"] += time.perf_counter() - captured
        if failure is not None:
            report.baseline_failures.append(failure)
            continue
        for _ in range(CHAINS_PER_MODEL):
            if report.cases >= cases or _past(start, max_seconds):
                break
            run_case(subject, seed, next_case, rules, cost, report)
            next_case += 1
            if progress is not None:
                progress(report.cases, cases)
    report.seconds = time.perf_counter() - start


def _past(start: float, max_seconds: float | None) -> bool:
    return max_seconds is not None and time.perf_counter() - start >= max_seconds


def replay(seed: int, model: int, case: int, rules: Sequence[Rule] | None = None) -> FuzzReport:
    """Run exactly one case of a report again (a mismatch's reproducer)."""
    rules = tuple(rules) if rules is not None else all_rules()
    report = FuzzReport(seed, models=1)
    start = time.perf_counter()
    run_case(make_subject(seed, model), seed, case, rules, get_cost_model("rtx3090"), report)
    report.seconds = time.perf_counter() - start
    return report
