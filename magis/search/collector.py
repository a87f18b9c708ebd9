"""The garbage collector's pace while a search runs.

Evaluating one state allocates some 10^5 short-lived containers (the scheduler's problem, the
simulator's tables, storage maps, hashes), alive for the few milliseconds of that state. At
CPython's default pace (a young collection every 700 allocations) many of them outlive a young
collection, and the promotions they cause trigger full collections that walk every graph the
queue holds — work that frees nothing, since these containers die by reference count anyway.
Measured on corpus:t5 (7,048 nodes) under memory limit 0.4, one process, 60 s: 536 states at
the default pace, 822 with the young threshold at 100,000, 844 with the collector off; peak
memory 1.74 -> 2.00 GB. Cycles are still collected, only less often.

The main process restores the caller's pace afterwards (`search_pace`); a worker process is the
search's own, so it also freezes the heap it starts with (torch, the cost model), which no
collection then walks (`worker_pace`).

What survives a child's evaluation (the child, if kept, and the caches) is frozen too
(`settle`): a young collection walks every reference of what is young, and a fresh 42,000-node
graph's dicts made each one take some 200 ms. A frozen object is still freed when its last
reference goes; only reference cycles among frozen objects stay, and there are few: 120
children of Phi-1.5's split best left 1,248 cyclic objects, the same peak RSS (1,488 MB),
and took 12.3 -> 11.7 s (young collections 1.0 -> 0.3 s).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SEARCH_YOUNG_THRESHOLD = 100_000


@contextmanager
def search_pace() -> Iterator[Callable[[], None]]:
    """Collect young objects every `SEARCH_YOUNG_THRESHOLD` allocations inside the block; yields
    the search's `settle`, called after each child: it freezes what is alive, and the block
    unfreezes it all as it ends. Where the caller froze objects of its own (the process had
    a freeze count), nothing is frozen: unfreezing would undo the caller's."""
    before = gc.get_threshold()
    freezing = gc.get_freeze_count() == 0
    gc.set_threshold(max(before[0], SEARCH_YOUNG_THRESHOLD), *before[1:])
    try:
        yield gc.freeze if freezing else _keep
    finally:
        gc.set_threshold(*before)
        if freezing:
            gc.unfreeze()


def _keep() -> None:
    """`settle` where nothing may be frozen."""


def worker_pace() -> Callable[[], None]:
    """A worker process's pace for the rest of its life: the search's, its start-up heap
    frozen; returns its `settle`."""
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, SEARCH_YOUNG_THRESHOLD), *older)
    return gc.freeze


@contextmanager
def collector_paused() -> Iterator[None]:
    """No collection inside the block: pickling or unpickling a state makes hundreds of
    thousands of objects, none of them garbage, and the collections they triggered doubled the
    unpickling of a 42,000-node state (0.6 -> 1.2-1.5 s)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
