"""Optimizer-state offloading and its dual (issue 42; ZeRO-Offload's placement of the state,
with the update kept on the device).

With AdamW the optimizer state is twice the weights and, as a placeholder, resident for the
whole step: a floor no re-ordering, fission or swap of activations goes below. Offloading a
state tensor `s` models it living in host memory between steps:

- a Load of `s` right before its update (the scheduler's Store/Load timing moves it back just
  far enough for compute to hide the copy, `schedule/swaps.py`), whose device copy the update
  reads instead of `s`;
- the update's in-place write into `s` becomes an ordinary op on the device, and a Store
  writes its result back into `s` (a Store with `writes_into`: the host copy is the state of
  the next step).

So the device holds the state only from its Load to the last reader of the new value, and the
simulator counts `s` in host memory for the whole step, not in the resident bytes
(`magis.sim.tables.host_resident`: a placeholder read only by Loads and written only by a
Store). The copies are Store/Load nodes as swapping's are: priced on the copy stream, run by
the runtime's host pool. Restoring undoes it: the update writes into `s` again and every
reader of the Load reads `s`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from magis.ir import DerivedKey, Graph, PlaceholderKind, Ref
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind
from magis.rules.repeated import MIN_GROUP, with_halves

_WRITERS: DerivedKey[dict[int, int]] = DerivedKey("rules.offload.writers")


def state_writers(graph: Graph) -> dict[int, int]:
    """Placeholder -> the node writing its new value into it (`writes_into`), per graph
    version (one scan, shared by every candidate of a state)."""

    def build() -> dict[int, int]:
        nodes = graph.nodes.values()
        return {n.writes_into.node: n.id for n in nodes if n.writes_into is not None}

    return graph.derived(_WRITERS, build)


def offloadable(graph: Graph, state: int) -> bool:
    """An optimizer-state placeholder that is still on the device, updated by an op writing
    into it (not an in-place `copy_`, which reads the old value as its destination), and not
    itself an output."""
    node = graph.node(state)
    if node.placeholder_kind is not PlaceholderKind.OPT_STATE or not node.outputs[0].numel:
        return False
    writer = state_writers(graph).get(state)
    if writer is None or graph.node(writer).op == STORE_OP:
        return False
    readers = graph.users(state)
    copies = [r for r in readers if graph.node(r).op in (LOAD_OP, STORE_OP)]
    return bool(readers) and not copies and Ref(state) not in graph.outputs


def offloadable_bytes(graph: Graph) -> int:
    """The bytes of optimizer state `offload_state` can move off the device."""
    states = graph.placeholders(PlaceholderKind.OPT_STATE)
    return sum(graph.node(p).outputs[0].nbytes for p in states if offloadable(graph, p))


def offload_state(graph: Graph, state: int) -> Rewritten:
    """`graph` with `state` kept on the host: Load before its readers, the update on the
    device copy, Store back into `state` (see the module docstring)."""
    return offload_states(graph, [state])


def offload_states(graph: Graph, states: Sequence[int]) -> Rewritten:
    """`graph` with each of `states` kept on the host, in one copy of the graph."""
    g = graph.copy()
    writers = state_writers(graph)
    added: set[int] = set()
    changed: set[int] = set()
    for state in states:
        added |= _offload_in_place(g, state, writers[state], changed)
    removed = frozenset(writers[s] for s in states)
    return Rewritten(g, frozenset(added), frozenset(changed - added - removed), removed)


def _offload_in_place(g: Graph, state: int, writer: int, changed: set[int]) -> set[int]:
    """Offload `state` (updated by `writer`) in `g`; the nodes it added, `changed` grown."""
    node = g.node(state)
    load = g.add_op(f"{node.name}_load", LOAD_OP, (Ref(state),), outputs=node.outputs)
    changed |= set(g.replace_uses(Ref(state), Ref(load), [u for u in g.users(state) if u != load]))
    w = g.node(writer)
    update = g.add_op(
        w.name, w.op, w.args, dict(w.kwargs), outputs=w.outputs, module=w.module
    )  # on the device: no longer writing into the state
    changed |= set(g.replace_uses(Ref(writer), Ref(update)))
    g.remove_node(writer)
    store = g.add_op(
        f"{node.name}_store",
        STORE_OP,
        (Ref(update),),
        outputs=node.outputs,
        writes_into=Ref(state),
        module=w.module,
    )
    g.order_before_writers([load])
    return {load, update, store}


def offloaded_stores(graph: Graph, stores: list[int]) -> list[int]:
    """Of `stores`, those writing offloaded state back into a placeholder."""
    return [s for s in stores if graph.node(s).writes_into is not None]


def restore_state(graph: Graph, store: int) -> Rewritten:
    """`offload_state` undone: the update writes into the state again, its readers read it."""
    return restore_states(graph, [store])


def restore_states(graph: Graph, stores: Sequence[int]) -> Rewritten:
    """`offload_state` undone for each of `stores`, in one copy of the graph."""
    g = graph.copy()
    added: set[int] = set()
    changed: set[int] = set()
    removed: set[int] = set()
    for store in stores:
        added.add(_restore_in_place(g, store, changed, removed))
    changed -= removed | added
    g.order_before_writers(sorted(changed))  # the old value's readers before the update
    return Rewritten(g, frozenset(added), frozenset(changed), frozenset(removed))


def _restore_in_place(g: Graph, store: int, changed: set[int], removed: set[int]) -> int:
    """Restore the state `store` writes back, in `g`; the new writer (`changed`, `removed`
    grown)."""
    state = g.node(store).writes_into.node
    update = g.node(store).inputs[0].node
    loads = [u for u in g.users(state) if g.node(u).op == LOAD_OP]
    g.remove_node(store)
    for load in loads:
        changed |= set(g.replace_uses(Ref(load), Ref(state)))
        g.remove_node(load)
    w = g.node(update)
    writer = g.add_op(
        w.name, w.op, w.args, dict(w.kwargs), w.outputs, writes_into=Ref(state), module=w.module
    )
    changed |= set(g.replace_uses(Ref(update), Ref(writer)))
    g.remove_node(update)
    removed |= {store, update, *loads}
    return writer


def _describe(graph: Graph, state: int) -> str:
    return f"keep {graph.node(state).name} on the host, loaded for its update"


def _match_offload(ctx: RuleContext) -> Iterator[Rewrite]:
    """Every offloadable state at once and its larger half (`repeated.with_halves`: a step's
    state is hundreds of tensors, one per weight, and one per search state would spend the
    search on them), then the largest state tensors one by one, at most `max_candidates`."""
    graph = ctx.graph
    states = [
        p
        for p in graph.placeholders(PlaceholderKind.OPT_STATE)
        if offloadable(graph, p) and p not in ctx.frozen
    ]
    states.sort(key=lambda p: (-graph.node(p).outputs[0].nbytes, p))
    for group in _groups(states):
        yield Rewrite(
            "offload_state",
            RuleKind.SWAP,
            f"keep {len(group)} optimizer state tensors on the host, each loaded for its update",
            lambda ps=group: offload_states(graph, ps),
        )
    for p in states[: ctx.max_candidates]:
        yield Rewrite(
            "offload_state", RuleKind.SWAP, _describe(graph, p), lambda n=p: offload_state(graph, n)
        )


def _match_restore(ctx: RuleContext) -> Iterator[Rewrite]:
    """Every offloaded state back at once and half of them (as they were taken), then one by
    one, at most `max_candidates`."""
    graph = ctx.graph
    stores = [s for s in offloaded_stores(graph, ctx.nodes_of(STORE_OP)) if s not in ctx.frozen]
    for group in _groups(stores):
        yield Rewrite(
            "restore_state",
            RuleKind.DESWAP,
            f"keep {len(group)} offloaded optimizer state tensors on the device again",
            lambda ss=group: restore_states(graph, ss),
        )
    for s in stores[: ctx.max_candidates]:
        name = graph.node(graph.node(s).writes_into.node).name
        yield Rewrite(
            "restore_state",
            RuleKind.DESWAP,
            f"keep {name} on the device again",
            lambda n=s: restore_state(graph, n),
        )


def _groups(items: list[int]) -> Iterator[list[int]]:
    """`items` whole and its first half, when there are `MIN_GROUP` of them or more."""
    if len(items) >= MIN_GROUP:
        yield from with_halves([items])


OFFLOAD_STATE = Rule("offload_state", RuleKind.SWAP, _match_offload)
RESTORE_STATE = Rule("restore_state", RuleKind.DESWAP, _match_restore)
