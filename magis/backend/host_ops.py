"""Store and Load as operators Inductor can hold in a compiled graph (issue 43).

Inductor compiles ATen-level FX graphs; a Store or a Load there is an opaque custom operator
(`torch.library.custom_op`), which Inductor runs as a fallback kernel at its place in the
graph: it never drops one (its output is read) and, with re-ordering off
(`magis.backend.fx_export.INDUCTOR_CONFIG`), never moves one. Each copy is done by the
program's `HostPool`, as the generated Python's `store(x)` / `load(x)` are.

An operator takes tensors and numbers only, so a graph names its pool by a number: the pools
of live programs are found in `POOLS`, a weak table (a pool leaves it with its program).
"""

from __future__ import annotations

import weakref

import torch

from magis.backend.runtime import HostPool, host_strides

POOLS: weakref.WeakValueDictionary[int, HostPool] = weakref.WeakValueDictionary()


def pool_number(pool: HostPool) -> int:
    """The number `pool` goes by inside compiled graphs."""
    POOLS[id(pool)] = pool
    return id(pool)


@torch.library.custom_op("magis::store", mutates_args=())
def store(x: torch.Tensor, pool: int) -> torch.Tensor:
    """`x` copied to host memory by pool `pool`."""
    return POOLS[pool].store(x)


@store.register_fake
def _store_fake(x: torch.Tensor, pool: int) -> torch.Tensor:
    return torch.empty_strided(x.shape, host_strides(x), dtype=x.dtype, device="cpu")


@torch.library.custom_op("magis::load", mutates_args=())
def load(host: torch.Tensor, pool: int, device: torch.device) -> torch.Tensor:
    """`host` copied back to `device`; the copy has landed when the op returns."""
    out = POOLS[pool].load(host, device)
    POOLS[pool].ready(out)
    return out


@load.register_fake
def _load_fake(host: torch.Tensor, pool: int, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@torch.library.custom_op("magis::store_into", mutates_args=("host",))
def store_into(x: torch.Tensor, host: torch.Tensor, pool: int) -> None:
    """`x` written into `host`, an input kept in host memory (offloaded optimizer state)."""
    POOLS[pool].store_into(x, host)


@store_into.register_fake
def _store_into_fake(x: torch.Tensor, host: torch.Tensor, pool: int) -> None:
    return None
