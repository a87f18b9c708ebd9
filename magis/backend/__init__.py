"""Codegen, execution, memory measurement and verification against eager PyTorch (MAGIS §7.1)."""

from magis.backend.codegen import Program, compile_program, generate
from magis.backend.executor import (
    Measurement,
    Verification,
    measure,
    placed_inputs,
    tracker_for,
    verify,
)
from magis.backend.memory import LiveBytesTracker
from magis.backend.meta_check import (
    MetaChecker,
    MetaCheckError,
    MetaMismatch,
    MetaReport,
    check_graph,
    check_nodes,
    nodes_to_check,
)

__all__ = [
    "placed_inputs",
    "tracker_for",
    "LiveBytesTracker",
    "Measurement",
    "MetaCheckError",
    "MetaChecker",
    "MetaMismatch",
    "MetaReport",
    "Program",
    "Verification",
    "check_graph",
    "check_nodes",
    "compile_program",
    "generate",
    "measure",
    "nodes_to_check",
    "verify",
]
