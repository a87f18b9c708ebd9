"""The keep / recompute / offload baseline's decisions, built into a program (Checkmate, Jain et
al. MLSys 2020, §4.5: a solution's schedule generation; here with the rules' own edits).

Recomputations first: the program order with each recomputed chain run right before its first
late read (chains due before the same node merged, each op once, in program order) is an
execution trace, and `magis.rules.recompute_trace.trace_graph` makes it a program in which every
read reads the latest run of what it reads, exactly as DTR's and XLA's traces are built.
Offloads then, on that program, as the swap rule makes them (`magis.rules.swap.swap_into`: a
Store, a Load, the late readers reading the Load through re-created views), the late readers
being those from the first late read's chain on; `magis.schedule.swaps.time_swaps` places
each Store right after its producer and each Load as late as its transfer is still hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

from magis.baselines.ilp_model import Choice
from magis.baselines.ilp_problem import Candidate, Program
from magis.cost import CostModel
from magis.ir import Graph, positions
from magis.rules.recompute_trace import trace_graph
from magis.rules.remat import reads_from
from magis.rules.swap import swap_into
from magis.schedule.swaps import time_swaps


def build(
    program: Program, cands: Sequence[Candidate], choice: Choice, cost: CostModel
) -> tuple[Graph, list[int]]:
    """The program of `choice` and its order (module docstring)."""
    events, starts = _trace(program, [cands[i] for i in choice.recompute])
    g, order = trace_graph(program.graph, events)
    offloads = [cands[i] for i in choice.offload]
    if not offloads:
        return g, order
    pos = positions(order)
    reads = [reads_from(g, pos, c.storage, starts[c.late]) for c in offloads]
    placed: dict[int, list[int]] = {}  # node -> copies (and re-created views) right before it
    after: dict[int, list[int]] = {}  # producer -> Stores right after it
    for r in reads:
        if r is None:
            continue
        first = g.next_id
        swap_into(g, r)
        new = list(range(first, g.next_id))
        after.setdefault(r.storage.node, []).append(new[0])
        placed.setdefault(r.readers[0], []).extend(new[1:])
    order = _with_copies(order, placed, after)
    return g, time_swaps(g, order, cost)


def _trace(program: Program, recomputed: Sequence[Candidate]) -> tuple[list[int], dict[int, int]]:
    """The execution trace, and for each position of the program order the index in it where
    what runs before that position's node starts."""
    due: dict[int, set[int]] = {}
    for c in recomputed:
        due.setdefault(c.late, set()).update(c.recompute.nodes)
    events: list[int] = []
    starts: dict[int, int] = {}
    for x, nid in enumerate(program.order):
        starts[x] = len(events)
        events.extend(sorted(due.get(x, ()), key=program.pos.__getitem__))
        events.append(nid)
    return events, starts


def _with_copies(
    order: Sequence[int], placed: dict[int, list[int]], after: dict[int, list[int]]
) -> list[int]:
    out: list[int] = []
    for nid in order:
        out.extend(placed.get(nid, ()))
        out.append(nid)
        out.extend(after.get(nid, ()))
    return out
