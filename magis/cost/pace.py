"""The machine's pace: how long a fixed reference workload takes on the profiled device now.

A measured op time is only as good as the moment it was taken. On a shared machine another
process can hold the cores through a whole profile: each op's lower quartile of eight samples,
and the second pass `profile_graph` makes seconds later, are then all slow, and the persistent
cache (`magis.cost.store`) used to keep them for good. (Seen on this project's 2-core machine:
a float64 layer-norm backward of 2x16x32 cached at 21 ms, and `make demo` simulating 388 ms for
a step measured at 3.4 ms; a fresh cache simulated 1.8 ms.)

So every measured row is stored with the pace at which it was measured, and a cost model that
opens the cache on a machine running more than `STALE_PACE` times faster takes those rows
again. A row measured on a quiet machine is kept on a busy one: it is the better measurement.
The reference is the kind of work a program's small ops do: the profiler's own disturbance
calls (`profiled.Disturbance`, eight small ATen ops, dispatch included); its lower quartile over
`SAMPLES` samples is one reading, a few milliseconds, taken again when the last one is older
than `TTL_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# A row measured this many times slower than the machine's pace now is retaken. Two readings
# on one busy machine differ by up to about 2x (seen beside a test run on this 2-core machine);
# rows taken under a burst of load were 100-400x slow.
STALE_PACE = 3.0
SAMPLES = 16
TTL_S = 2.0  # a reading is reused this long: a profile stores thousands of rows


class Pace:
    """Readings of a `reference` workload, each reused for `TTL_S` seconds.

    `timer(fn, samples)` times `fn` (seconds per call, lower quartile); the profiled model
    passes its own, which synchronizes a GPU."""

    def __init__(
        self,
        reference: Callable[[], object],
        timer: Callable[[Callable[[], object], int], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reference = reference
        self._timer = timer
        self._clock = clock
        self._last: tuple[float, float] | None = None  # (clock at reading, seconds)

    def read(self) -> float:
        """Seconds of the reference workload now (a reading at most `TTL_S` old)."""
        now = self._clock()
        if self._last is None or now - self._last[0] > TTL_S:
            self._last = (now, self._timer(self._reference, SAMPLES))
        return self._last[1]


def is_stale(measured_at: float, now: float) -> bool:
    """Whether a row measured at pace `measured_at` should be taken again at pace `now`
    (0 is an unknown pace: a row estimated rather than measured, or a model given no pace,
    never retaken for it)."""
    return measured_at > 0 and now > 0 and measured_at > STALE_PACE * now
