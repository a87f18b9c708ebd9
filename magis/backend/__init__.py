"""Codegen, execution, memory measurement and verification against eager PyTorch (MAGIS §7.1)."""

from magis.backend.codegen import Program, compile_program, generate
from magis.backend.executor import Measurement, Verification, measure, verify
from magis.backend.memory import LiveBytesTracker

__all__ = [
    "LiveBytesTracker",
    "Measurement",
    "Program",
    "Verification",
    "compile_program",
    "generate",
    "measure",
    "verify",
]
