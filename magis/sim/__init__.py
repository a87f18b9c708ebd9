"""The simulator: schedule -> latency, memory timeline, peak, hot-spots (MAGIS §2.1, §6.2)."""

from magis.sim.simulator import Category, Hotspot, SimResult, memory_timeline, simulate

__all__ = ["Category", "Hotspot", "SimResult", "memory_timeline", "simulate"]
