"""The cost-model contract: how long one node takes on the compute stream, one copy on the copy stream.

MAGIS simulates a schedule instead of running it, with "an operator performance cache" that keeps
the latency of every distinct operator (MAGIS §6.2); TASO measures "the execution time of a DNN
operator once for each configuration" and sums them (Jia, thesis §2.6). Both rest on the same
observation: the time of an op depends only on the op, its input and output shapes and dtypes and
its constant arguments. `op_key` is that configuration, and `CostModel` memoizes on it, so the
twelve identical layers of a transformer are estimated (or measured) once, and a search that asks
about thousands of mutated graphs pays a dictionary lookup per node.
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from magis.cost.links import DEFAULT_INTERCONNECT, Interconnect
from magis.ir import Graph, Node, OpInfo, Ref, TensorMeta


class OpKey(NamedTuple):
    """The configuration of one op call: everything its time depends on, hashable.

    Tensor arguments appear as their `TensorMeta`, lists as tuples, keyword arguments as sorted
    pairs. Which node it is, what it writes into and who consumes it are not part of it.
    """

    op: str
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]
    outputs: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class OpCall:
    """An `OpKey` with its registry entry: what an estimator or a profiler needs."""

    key: OpKey
    info: OpInfo

    @property
    def op(self) -> str:
        return self.key.op

    @property
    def args(self) -> tuple:
        return self.key.args

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.key.kwargs)

    @property
    def outputs(self) -> tuple[TensorMeta, ...]:
        return self.key.outputs


def _freeze(value: Any, nodes: dict[int, Node]) -> Any:
    """`value` with Refs replaced by their TensorMeta and lists by tuples (hashable).

    `type(...) is` rather than isinstance: this runs for every argument of every node, and
    node_times must stay in the tens of milliseconds on 10,000-node graphs (DESIGN principle 4).
    """
    kind = type(value)
    if kind is Ref:
        return nodes[value.node].outputs[value.index]
    if kind is tuple or kind is list:
        return tuple([_freeze(v, nodes) for v in value])
    return value


def _key_of(node: Node, nodes: dict[int, Node]) -> OpKey:
    args = _freeze(node.args, nodes)
    kwargs = tuple([(k, _freeze(v, nodes)) for k, v in node.kwargs]) if node.kwargs else ()
    return OpKey(node.op, args, kwargs, node.outputs)


def key_text(key: OpKey) -> str:
    """A key as text: its repr (TensorMeta, dtype, device and float reprs are stable)."""
    return repr(tuple(key))


def op_key(graph: Graph, nid: int) -> OpKey:
    """The memo key of node `nid` (the facts of `graph.meta_args`, made hashable)."""
    return _key_of(graph.node(nid), graph.nodes)


@dataclass(frozen=True)
class CacheInfo:
    """Memo statistics, in the spirit of `functools.lru_cache().cache_info()`."""

    entries: int  # distinct op keys known
    computed: int  # keys estimated or measured by this instance (memo misses)


@dataclass
class _Memo:
    times: dict[OpKey | str, float] = field(default_factory=dict)
    computed: int = 0
    # node id -> (the Node object timed, seconds). Nodes are immutable and a rewrite replaces
    # the node objects it changes, so an identical object means an identical time: the search's
    # thousands of graph versions share almost all of theirs.
    by_node: dict[int, tuple[object, float]] = field(default_factory=dict)
    scratch_by_node: dict[int, tuple[object, int]] = field(default_factory=dict)  # the same


class CostModel(abc.ABC):
    """Seconds per node on the compute stream, seconds per host<->device copy on the copy stream.

    Subclasses implement `estimate` (one op configuration, uncached) and `transfer_time`;
    placeholders and views cost nothing, everything else is memoized by `OpKey`. A node that
    writes its result into a placeholder (`writes_into`) carries its functional op and costs as
    that op: writing into an existing buffer takes as long as writing into a fresh one.
    """

    name: str
    # A view launches no kernel on a GPU; on the host every op, views included, is a dispatch
    # through Python (a quarter of bert-base:tiny's wall time), so a profiled CPU model times them.
    views_cost_time: bool = False
    # Whether a Store/Load runs beside compute. A GPU has copy engines for it. On the host, a
    # Store or Load is a memcpy into the host pool, done by the threads that compute, so it
    # adds its whole time (measured: unet:small's plan ran 1.195x where overlap said 1.009x).
    copies_overlap: bool = True
    # Whether `scratch_bytes` knows anything (a model that ran the ops): the simulator adds
    # each op's scratch to the memory of its step only then.
    measures_scratch: bool = False
    # The ranks and link that price collectives (`magis.cost.links`); set by whoever plans a
    # data-parallel step (`with_interconnect`). Collectives are never measured here: running one
    # on a single rank would wait for the others forever.
    interconnect: Interconnect = DEFAULT_INTERCONNECT

    def __init__(self) -> None:
        self._memo = _Memo()

    def with_interconnect(self, interconnect: Interconnect) -> CostModel:
        """A copy of this model pricing collectives over `interconnect`; this one is unchanged
        (a caller's model keeps its link). The op times it knew are shared (no op's time
        depends on the link), its node times are not (a collective's does)."""
        other = copy.copy(self)
        other.interconnect = interconnect
        other._memo = _Memo(times=self._memo.times)
        return other

    def comm_time(self, graph: Graph, nid: int) -> float:
        """Seconds collective `nid` takes on the communication stream: its full buffer (the
        larger of its input and output) over `interconnect` (`Interconnect.seconds`)."""
        node = graph.node(nid)
        ins = [graph.meta(r).nbytes for r in node.inputs]
        return self.interconnect.seconds(node.op, max([node.outputs[0].nbytes, *ins]))

    @abc.abstractmethod
    def estimate(self, call: OpCall) -> float:
        """Seconds one call of this op configuration takes (not memoized; use `op_time`)."""

    @abc.abstractmethod
    def transfer_time(self, nbytes: int) -> float:
        """Seconds one host<->device copy of `nbytes` takes on the copy stream (Store/Load)."""

    def op_time(self, graph: Graph, nid: int) -> float:
        """Seconds node `nid` takes on the compute stream; 0 for placeholders (and views, unless
        `views_cost_time`)."""
        node = graph.node(nid)
        if node.is_placeholder:
            return 0.0
        info = graph.info(nid)
        if info.copy_stream:
            return self.transfer_time(node.outputs[0].nbytes)
        if info.comm_stream:
            return self.comm_time(graph, nid)
        if info.is_view and not self.views_cost_time:
            return 0.0
        return self.time_of(op_key(graph, nid), info)

    def scratch_bytes(self, graph: Graph, nid: int) -> int:
        """Bytes node `nid` allocates and frees inside itself (a cuDNN convolution's workspace,
        a CPU convolution's padded copies), which no tensor of the graph holds. Only a model
        that ran the op knows (`measures_scratch`): 0 here."""
        return 0

    def node_scratch(self, graph: Graph) -> np.ndarray | None:
        """Every node's `scratch_bytes` as an int64 array indexed by node id (as `node_times`),
        or None for a model that does not measure scratch: the simulator then adds nothing."""
        if not self.measures_scratch:
            return None
        out = np.zeros(max(graph.nodes, default=-1) + 1, dtype=np.int64)
        by_node = self._memo.scratch_by_node
        for nid, node in graph.nodes.items():
            seen = by_node.get(nid)
            if seen is not None and seen[0] is node:
                out[nid] = seen[1]
                continue
            out[nid] = scratch = self.scratch_bytes(graph, nid)
            by_node[nid] = (node, scratch)
        return out

    def time_of(self, key: OpKey, info: OpInfo) -> float:
        """The memoized time of one op configuration."""
        memo = self._memo.times
        memo_key: OpKey | str = key
        try:
            return memo[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable constant argument: memoize by the key's text
            memo_key = key_text(key)
            if memo_key in memo:
                return memo[memo_key]
        seconds = float(self.estimate(OpCall(key, info)))
        memo[memo_key] = seconds
        self._memo.computed += 1
        return seconds

    def node_times(self, graph: Graph) -> np.ndarray:
        """Every node's `op_time`, as a float64 array indexed by node id.

        Ids of removed nodes (gaps) hold 0; the array is as long as the largest id plus one.
        This is the hot path of the search (MAGIS §6.2), so it inlines `op_time`.
        """
        nodes = graph.nodes
        lookup = graph.registry.lookup
        infos: dict[str, OpInfo] = {}
        times = np.zeros(max(nodes, default=-1) + 1)
        by_node = self._memo.by_node
        for nid, node in nodes.items():
            if node.is_placeholder:
                continue
            seen = by_node.get(nid)
            if seen is not None and seen[0] is node:
                times[nid] = seen[1]
                continue
            info = infos.get(node.op)
            if info is None:
                info = infos[node.op] = lookup(node.op)
            if info.copy_stream:
                times[nid] = self.transfer_time(node.outputs[0].nbytes)
            elif info.comm_stream:
                times[nid] = self.comm_time(graph, nid)
            elif not info.is_view or self.views_cost_time:
                times[nid] = self.time_of(_key_of(node, nodes), info)
            by_node[nid] = (node, float(times[nid]))
        return times

    def total_time(self, graph: Graph) -> float:
        """Sum of all nodes' times: the latency of running them one after another (thesis §2.6)."""
        return float(self.node_times(graph).sum())

    def forget(self, key: OpKey, text: str) -> None:
        """Drop one op configuration's memoized time (by `key` and by its `text`, whichever
        memoized it) and every node's: a subclass that re-measured the op recomputes them on
        next use (`ProfiledModel`'s second pass)."""
        self._memo.times.pop(key, None)
        self._memo.times.pop(text, None)
        self._memo.by_node.clear()

    def cache_info(self) -> CacheInfo:
        return CacheInfo(len(self._memo.times), self._memo.computed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class UnitCostModel(CostModel):
    """The test mode (STYLE habit 8): every op that is not a view costs 1 s, a copy nbytes / 1e9 s.

    Hand-checkable in scheduler and search tests, as the AOTAutograd partitioner's
    `estimate_runtime(..., "testing")` is.
    """

    name = "unit"

    def estimate(self, call: OpCall) -> float:
        return 1.0

    def transfer_time(self, nbytes: int) -> float:
        return nbytes / 1e9
