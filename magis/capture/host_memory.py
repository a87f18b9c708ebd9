"""How much host memory a new allocation can have: the kernel's MemAvailable (RAM that can be
had without swapping), read where capture must decide whether a real build fits
(`magis.capture.user_model`) and where a command decides whether a step runs on the CPU
(`magis.commands.device`)."""

from __future__ import annotations

import os
from pathlib import Path


def host_available_memory() -> int:
    """MemAvailable in bytes (the free pages where /proc/meminfo cannot be read)."""
    try:
        return meminfo_available(Path("/proc/meminfo").read_text())
    except (OSError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def meminfo_available(text: str) -> int:
    """MemAvailable of a /proc/meminfo text, in bytes (a ValueError if it has none)."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    raise ValueError("no MemAvailable line")
