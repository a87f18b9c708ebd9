"""Graph rewrite rules (MAGIS §5): TASO's substitutions, the M-Rules of §5.2
(re-materialization, swapping, compaction and their duals), the fusion-aware min cut of He & Yu
(MLSys 2023) as one re-materialization rewrite, F-Trans as a rewrite and the F-Tree mutations
of §5.1.

Every graph rewrite rule follows one contract (base.py): a `Rule` whose `match` yields lazy
`Rewrite`s, each building a `Rewritten` only when asked. The rules the search and the fuzzer
apply, with their kinds and duals, are listed once, in `catalog.py` (`RULE_CATALOG`).
"""

from magis.rules.base import (
    OrderIndex,
    Rewrite,
    Rewritten,
    Rule,
    RuleContext,
    RuleKind,
    after_local_move,
    candidates,
    group_rule,
    node_rewrites,
    node_rule,
    ordered_for,
)
from magis.rules.catalog import (
    RULE_CATALOG,
    CatalogEntry,
    catalog_entry,
    decision_kind,
    dual_kind,
    fuzzed_rules,
    rules_in_search_order,
)
from magis.rules.compact import COMPACT, DECOMPACT
from magis.rules.duplicates import recompute_call
from magis.rules.fission import FissionError, Materialized, check_shapes, materialize
from magis.rules.fission_prepare import prepare
from magis.rules.ftree_moves import (
    FTREE_MUTATIONS,
    FTreeMutation,
    Mutation,
    MutationKind,
    direct_fission_numbers,
    directly_enableable,
    enable_directly,
    enclosing_enableable,
    mutations,
    nested_enableable,
)
from magis.rules.mincut_remat import MINCUT_REMAT
from magis.rules.offload import OFFLOAD_STATE, RESTORE_STATE
from magis.rules.relax import RELAX
from magis.rules.remat import DEREMAT, REMAT
from magis.rules.swap import DESWAP, REMAT_TO_SWAP, SWAP
from magis.rules.taso import TASO_RULES

__all__ = [
    "COMPACT",
    "DECOMPACT",
    "DEREMAT",
    "DESWAP",
    "FTREE_MUTATIONS",
    "MINCUT_REMAT",
    "OFFLOAD_STATE",
    "RELAX",
    "REMAT",
    "REMAT_TO_SWAP",
    "RESTORE_STATE",
    "RULE_CATALOG",
    "SWAP",
    "TASO_RULES",
    "CatalogEntry",
    "FTreeMutation",
    "FissionError",
    "Materialized",
    "Mutation",
    "OrderIndex",
    "MutationKind",
    "Rewrite",
    "Rewritten",
    "Rule",
    "RuleContext",
    "RuleKind",
    "candidates",
    "catalog_entry",
    "decision_kind",
    "dual_kind",
    "fuzzed_rules",
    "rules_in_search_order",
    "check_shapes",
    "directly_enableable",
    "direct_fission_numbers",
    "enable_directly",
    "enclosing_enableable",
    "nested_enableable",
    "group_rule",
    "materialize",
    "mutations",
    "node_rewrites",
    "node_rule",
    "after_local_move",
    "ordered_for",
    "prepare",
    "recompute_call",
]
