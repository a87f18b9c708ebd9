"""The simulator: schedule -> latency, memory timeline, peak, hot-spots (MAGIS §2.1, §6.2)."""

from magis.sim.simulator import (
    Category,
    Hotspot,
    SimResult,
    memory_timeline,
    near_peak_storages,
    simulate,
    tensor_peak_bytes,
)
from magis.sim.tables import (
    Tables,
    derive_facts,
    derive_node_times,
    node_scratch,
    node_times,
    tables,
)

__all__ = [
    "Category",
    "Hotspot",
    "SimResult",
    "Tables",
    "derive_facts",
    "derive_node_times",
    "memory_timeline",
    "near_peak_storages",
    "node_scratch",
    "node_times",
    "simulate",
    "tables",
    "tensor_peak_bytes",
]
