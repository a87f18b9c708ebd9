"""M-Analyzer (MAGIS §4): D-Graph, F-Trans validity, dominator trees, heat and score, F-Tree."""

from magis.analyze.dgraph import DGraph, dgraph, node_dims
from magis.analyze.dominators import DomTree, dominator_tree
from magis.analyze.ftrans import (
    FTrans,
    FTransInfo,
    InputKind,
    OutputKind,
    OutputMerge,
    Rejected,
    check,
)
from magis.analyze.ftree import (
    DEFAULT_MAX_LEVEL,
    FTree,
    FTreeNode,
    Scores,
    build_ftree,
    get_scores,
    memory_hotspots,
)

__all__ = [
    "DEFAULT_MAX_LEVEL",
    "DGraph",
    "DomTree",
    "FTrans",
    "FTransInfo",
    "FTree",
    "FTreeNode",
    "InputKind",
    "OutputKind",
    "OutputMerge",
    "Rejected",
    "Scores",
    "build_ftree",
    "check",
    "dgraph",
    "dominator_tree",
    "get_scores",
    "memory_hotspots",
    "node_dims",
]
