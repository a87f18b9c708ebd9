"""A data-parallel job's ranks as Ray actors (issue 44): what `torchrun` does, on a Ray cluster.

`torchrun` starts a job's ranks as processes of the machines it is started on; on a Ray cluster
the machines are Ray's, and Ray places the ranks. `run_ranks(fn, world_size)` starts
`world_size` actors (each holding `gpus_per_rank` GPUs and one CPU), makes a free TCP port on
rank 0's node the rendezvous of a c10d process group (`env://`-style, as torchrun's static
rendezvous: rank 0's address and port, each rank's number and the world size), runs
`fn(*args)` on every rank inside that group, and returns the ranks' results in rank order.
Inside `fn`, `torch.distributed` is initialized: `magis.compile(..., parallel="ddp",
process_group=dist.group.WORLD)` works as under torchrun. An error on any rank is raised here,
with the rank that raised it, after every actor is gone.

The backend is NCCL when ranks hold GPUs and gloo otherwise. Ray itself is the optional extra
(`pip install 'magis[ray]'`); a local Ray of `world_size` CPUs is started when this process is
not connected to one, and shut down afterwards.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from magis.errors import MagisError
from magis.search.transport import import_ray, start_ray


class RankFailedError(MagisError):
    """A rank's function raised: which rank, and its one-line error."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    address: str | None = None,
    gpus_per_rank: float = 0,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> list[Any]:
    """`fn(*args)` on `world_size` Ray actors joined in one process group; their results in
    rank order. `address`: the Ray cluster to join (None: this process's Ray, or a local one)."""
    if world_size < 1:
        raise MagisError(f"run_ranks: world_size must be at least 1, not {world_size}")
    ray = import_ray()
    started = start_ray(ray, address, None if address else world_size)
    backend = backend or ("nccl" if gpus_per_rank else "gloo")
    rank_actor = ray.remote(num_cpus=1, num_gpus=gpus_per_rank)(_Rank)
    actors = [rank_actor.remote() for _ in range(world_size)]
    try:
        host, port = ray.get(actors[0].rendezvous.remote(), timeout=timeout_s)
        init = f"tcp://{host}:{port}"
        calls = [
            a.run.remote(fn, args, backend, init, rank, world_size) for rank, a in enumerate(actors)
        ]
        results = ray.get(calls, timeout=timeout_s)
    finally:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()
    failed = [(rank, r) for rank, r in enumerate(results) if isinstance(r, _Failure)]
    if failed:
        rank, failure = failed[0]
        raise RankFailedError(f"rank {rank} of {world_size} failed: {failure.line}")
    return results


class _Failure:
    """What a rank's function raised, as one line (a rank's exception may not unpickle here)."""

    def __init__(self, exc: BaseException) -> None:
        self.line = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class _Rank:
    """One rank: a Ray actor that joins the process group and runs the job's function."""

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a TCP port free on it (rank 0's: the group's rendezvous)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def run(
        self, fn: Callable, args: Sequence, backend: str, init: str, rank: int, world: int
    ) -> Any:
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - returned, raised by the caller with its rank
            return _Failure(exc)
        finally:
            dist.destroy_process_group()
