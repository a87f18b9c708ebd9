"""The one list of the search's graph rewrite rules (MAGIS §5: TASO's substitutions, the
M-Rules of §5.2 and their duals, He & Yu's min cut), with what each reader needs to know of a
rule: its kind, the rule that undoes it (its dual, Fig. 8) and whether the fuzzer draws it.

The search (`magis.search.default_rules`), the fuzzer (`magis.bench.fuzz_chains`) and the
decision records (`magis.search.decisions`) read this catalog; nothing else lists the rules.
The F-Tree mutations of §5.1 change a tree, not a graph: they are not `Rule`s and not here
(`rules/ftree_moves.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.ir.trail import DecisionKind
from magis.rules.base import Rule, RuleKind
from magis.rules.compact import COMPACT, DECOMPACT
from magis.rules.mincut_remat import MINCUT_REMAT
from magis.rules.offload import OFFLOAD_STATE, RESTORE_STATE
from magis.rules.relax import RELAX
from magis.rules.remat import DEREMAT, REMAT
from magis.rules.swap import DESWAP, REMAT_TO_SWAP, SWAP
from magis.rules.taso import LATER_TASO_RULES, TASO_RULES

# The fuzz run that first drew a rule: the reproducers of the first runs
# (`tests/bench/test_fuzz.py`) replay with the rules of round 1 only, in catalog order.
FIRST_FUZZ_ROUND = 1


@dataclass(frozen=True)
class CatalogEntry:
    """One rule as the catalog records it. `dual` names the rule that undoes what this one
    does (MAGIS §5.2: re-materialization and swapping each have one), None where no single
    rule does (a TASO substitution; the rules that themselves give time back). `fuzz_round`
    is the fuzz run that first drew the rule (None: the fuzzer never draws it); the fuzzer
    draws rules by round, then in catalog order, so that an old seed replays its chains."""

    rule: Rule
    dual: str | None = None
    fuzz_round: int | None = FIRST_FUZZ_ROUND

    @property
    def name(self) -> str:
        return self.rule.name

    @property
    def kind(self) -> RuleKind:
        return self.rule.kind


# In the search's order, which its results depend on (`default_rules`, whose docstring says
# why): TASO rules first (cheap latency wins that buy slack), then the schedule-based rules.
RULE_CATALOG: tuple[CatalogEntry, ...] = (
    *(CatalogEntry(rule) for rule in TASO_RULES),
    CatalogEntry(REMAT, dual=DEREMAT.name),
    CatalogEntry(DEREMAT, dual=REMAT.name),
    CatalogEntry(SWAP, dual=DESWAP.name),
    CatalogEntry(DESWAP, dual=SWAP.name),
    # Trades a recomputation for a swap, and relaxation undoes recomputations and swaps in
    # bulk: both give time back themselves, so no one rule undoes them. Fuzzed from round 2.
    CatalogEntry(REMAT_TO_SWAP, fuzz_round=2),
    CatalogEntry(RELAX, fuzz_round=2),
    CatalogEntry(COMPACT, dual=DECOMPACT.name),
    CatalogEntry(DECOMPACT, dual=COMPACT.name),
    # Its recomputed copies are duplicates that re-materialization's dual merges back.
    CatalogEntry(MINCUT_REMAT, dual=DEREMAT.name),
    # Optimizer state kept on the host between steps (issue 42): last, so that the search's
    # order of the rules before it, and its results on steps without state, are unchanged.
    CatalogEntry(OFFLOAD_STATE, dual=RESTORE_STATE.name, fuzz_round=3),
    CatalogEntry(RESTORE_STATE, dual=OFFLOAD_STATE.name, fuzz_round=3),
    # A zero pad folded, an activation's backward reading its output (issue 42, CNNs): last,
    # for the reason above; fuzzed from round 4, where the fuzzer's depthwise block has both.
    *(CatalogEntry(rule, fuzz_round=4) for rule in LATER_TASO_RULES),
)

# What undoes a kind of rewrite: the fuzzer tries it right after that kind, so that chains also
# undo and compose what they did. TASO substitutions are followed by other substitutions.
KIND_DUALS: dict[RuleKind, RuleKind] = {
    RuleKind.TASO: RuleKind.TASO,
    RuleKind.REMAT: RuleKind.DEREMAT,
    RuleKind.DEREMAT: RuleKind.REMAT,
    RuleKind.SWAP: RuleKind.DESWAP,
    RuleKind.DESWAP: RuleKind.SWAP,
    RuleKind.COMPACT: RuleKind.DECOMPACT,
    RuleKind.DECOMPACT: RuleKind.COMPACT,
}

# The kind of decision a plan records for a rewrite of each kind (`magis.ir.trail`); a
# rewrite of the dual kind that made or dropped only swaps is refined by what it did
# (`magis.search.decisions`).
DECISION_KINDS: dict[RuleKind, DecisionKind] = {
    RuleKind.TASO: DecisionKind.TASO,
    RuleKind.REMAT: DecisionKind.RECOMPUTE,
    RuleKind.DEREMAT: DecisionKind.UNDO_RECOMPUTE,
    RuleKind.SWAP: DecisionKind.SWAP,
    RuleKind.DESWAP: DecisionKind.UNDO_SWAP,
    RuleKind.COMPACT: DecisionKind.COMPACTION,
    RuleKind.DECOMPACT: DecisionKind.UNDO_COMPACTION,
}


def rules_in_search_order() -> tuple[Rule, ...]:
    """Every rule of the catalog, in the search's order (Alg. 3 tries them in turn)."""
    return tuple(entry.rule for entry in RULE_CATALOG)


def fuzzed_rules(up_to_round: int | None = None) -> tuple[Rule, ...]:
    """The rules the fuzzer draws (those of rounds up to `up_to_round`; all when None), by
    round and then in the catalog's order: a seed of an earlier run draws the same chains."""
    fuzzed = [
        e
        for e in RULE_CATALOG
        if e.fuzz_round is not None and (up_to_round is None or e.fuzz_round <= up_to_round)
    ]
    return tuple(e.rule for e in sorted(fuzzed, key=lambda e: e.fuzz_round))


def catalog_entry(name: str) -> CatalogEntry:
    """The entry of the rule called `name`; a name the catalog lacks is an error."""
    for entry in RULE_CATALOG:
        if entry.name == name:
            return entry
    raise KeyError(f"no rule {name!r} in the catalog (magis.rules.catalog.RULE_CATALOG)")


def dual_kind(kind: RuleKind) -> RuleKind:
    """The kind of rewrite that undoes one of `kind` (TASO: another substitution)."""
    return KIND_DUALS[kind]


def decision_kind(kind: RuleKind) -> DecisionKind:
    """The kind of decision a plan records for a rewrite of `kind`, before refinement."""
    return DECISION_KINDS[kind]
