"""The rule catalog (rules/catalog.py): every rule once, each with a kind; the duals it names
exist and undo each other where a pair does; the search's, the fuzzer's and the decision
records' rules and kinds all come from it."""

import pytest

from magis.bench.fuzz_chains import FIRST_RULES, all_rules, dual_kind_name
from magis.ir.trail import DecisionKind
from magis.rules import (
    COMPACT,
    DECOMPACT,
    DEREMAT,
    DESWAP,
    MINCUT_REMAT,
    OFFLOAD_STATE,
    RELAX,
    REMAT,
    REMAT_TO_SWAP,
    RESTORE_STATE,
    RULE_CATALOG,
    SWAP,
    TASO_RULES,
    Rule,
    RuleKind,
    catalog_entry,
    decision_kind,
    dual_kind,
    fuzzed_rules,
    rules_in_search_order,
)
from magis.rules.taso import LATER_TASO_RULES
from magis.search import default_rules

# Pairs whose rules each undo the other (MAGIS §5.2, Fig. 8).
MUTUAL = {
    ("remat", "deremat"),
    ("swap", "deswap"),
    ("compact", "decompact"),
    ("offload_state", "restore_state"),  # issue 42
}


def test_every_rule_is_listed_once_with_a_kind():
    names = [e.name for e in RULE_CATALOG]
    assert len(names) == len(set(names))
    for entry in RULE_CATALOG:
        assert isinstance(entry.rule, Rule)
        assert isinstance(entry.kind, RuleKind)
        assert entry.kind is entry.rule.kind


def test_every_dual_named_exists_and_pairs_are_mutual():
    for entry in RULE_CATALOG:
        if entry.dual is None:
            continue
        dual = catalog_entry(entry.dual)
        assert dual.kind is dual_kind(entry.kind), entry.name
        if (entry.name, dual.name) in MUTUAL or (dual.name, entry.name) in MUTUAL:
            assert dual.dual == entry.name
    for a, b in MUTUAL:
        assert catalog_entry(a).dual == b and catalog_entry(b).dual == a


def test_kind_duals_and_decision_kinds_cover_every_kind():
    for kind in RuleKind:
        assert dual_kind(dual_kind(kind)) is kind
        assert isinstance(decision_kind(kind), DecisionKind)
    assert dual_kind_name("fission") is None
    assert dual_kind_name("swap") == "deswap"


def test_an_unknown_rule_name_is_an_error():
    with pytest.raises(KeyError, match="no rule"):
        catalog_entry("no-such-rule")


def test_the_search_applies_the_catalog_in_its_order():
    assert default_rules() == rules_in_search_order()
    assert default_rules() == (
        *TASO_RULES,
        REMAT,
        DEREMAT,
        SWAP,
        DESWAP,
        REMAT_TO_SWAP,
        RELAX,
        COMPACT,
        DECOMPACT,
        MINCUT_REMAT,
        OFFLOAD_STATE,  # last: steps without optimizer state keep their fingerprints
        RESTORE_STATE,
        *LATER_TASO_RULES,  # after them, for the same reason
    )  # the order the search's fingerprints were recorded with


def test_the_fuzzer_draws_the_catalog_by_round():
    assert all_rules() == fuzzed_rules()
    assert set(all_rules()) == {e.rule for e in RULE_CATALOG if e.fuzz_round is not None}
    # The first runs' reproducers replay with the rules of those runs, in their order.
    first_runs = (
        *TASO_RULES,
        REMAT,
        DEREMAT,
        SWAP,
        DESWAP,
        COMPACT,
        DECOMPACT,
        MINCUT_REMAT,
    )
    assert first_runs == FIRST_RULES
    assert all_rules() == (
        *FIRST_RULES,
        REMAT_TO_SWAP,
        RELAX,
        OFFLOAD_STATE,
        RESTORE_STATE,
        *LATER_TASO_RULES,
    )
