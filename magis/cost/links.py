"""Links between ranks, and the time of one collective over them (data parallelism, issue 44).

A collective's time is the ring algorithm's (Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005, §4; NCCL's "bus bandwidth" in
nccl-tests' PERFORMANCE.md uses the same factors): with n ranks, a buffer of B bytes and a link of
bandwidth bw and per-hop latency a,

- all-reduce (reduce-scatter then all-gather): 2 (n-1)/n * B / bw + 2 (n-1) a
- all-gather or reduce-scatter of a B-byte full buffer: (n-1)/n * B / bw + (n-1) a

A rank alone (n = 1) sends nothing: 0 s.
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.errors import MagisError
from magis.ir.ops import ALL_GATHER_OP, ALL_REDUCE_OP, REDUCE_SCATTER_OP


class UnknownLinkError(MagisError):
    """A link preset that does not exist."""


@dataclass(frozen=True)
class Link:
    """A link between ranks: achievable bytes/s one way per rank, and seconds per hop."""

    name: str
    bandwidth: float
    latency: float


# Achievable, not peak: NVLink 4 on an H100 SXM node is 450 GB/s per direction, nccl-tests
# all-reduce bus bandwidth ~360 GB/s (NVIDIA, "NCCL tests on DGX H100"); PCIe 4.0 x16 moves ~25
# of its 31.5 GB/s; InfiniBand NDR is 400 Gb/s = 50 GB/s per port, ~45 achievable, with ~5 us
# per hop through a switch. On one host, gloo over loopback TCP moves a few GB/s.
LINK_PRESETS: dict[str, Link] = {
    "nvlink": Link("nvlink", 360e9, 3e-6),
    "pcie": Link("pcie", 25e9, 5e-6),
    "infiniband": Link("infiniband", 45e9, 5e-6),
    "loopback": Link("loopback", 3e9, 30e-6),
}


def get_link(name: str | Link) -> Link:
    """The preset called `name` (a `Link` is returned as it is)."""
    if isinstance(name, Link):
        return name
    link = LINK_PRESETS.get(name.strip().lower())
    if link is None:
        raise UnknownLinkError(f"unknown link '{name}'; choose one of {', '.join(LINK_PRESETS)}")
    return link


@dataclass(frozen=True)
class Interconnect:
    """The ranks of one job and the link between them: what prices a graph's collectives."""

    link: Link
    world_size: int

    def seconds(self, op: str, nbytes: int) -> float:
        """One collective `op` whose full (unsharded) buffer is `nbytes` (module docstring)."""
        n = self.world_size
        if n <= 1 or nbytes <= 0:
            return 0.0
        if op == ALL_REDUCE_OP:
            hops = 2 * (n - 1)
            return hops / n * nbytes / self.link.bandwidth + hops * self.link.latency
        if op in (ALL_GATHER_OP, REDUCE_SCATTER_OP):
            return (n - 1) / n * nbytes / self.link.bandwidth + (n - 1) * self.link.latency
        raise UnknownLinkError(f"no ring cost for the collective {op}")


# What a cost model without an `Interconnect` assumes: 8 ranks on NVLink, one H100 node.
DEFAULT_INTERCONNECT = Interconnect(LINK_PRESETS["nvlink"], 8)
