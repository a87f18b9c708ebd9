"""What a person opens: a simulated schedule as a Chrome/Perfetto trace or a PyTorch memory
snapshot (`timeline`), and a plan as one self-contained HTML page (`html`)."""

from magis.report.replay import Replay, Storage, replay
from magis.report.timeline import memory_snapshot, write_chrome_trace, write_memory_snapshot

__all__ = [
    "Replay",
    "Storage",
    "memory_snapshot",
    "replay",
    "write_chrome_trace",
    "write_memory_snapshot",
]
