"""Fully sharded data parallelism inside the captured step: FSDP2's collectives as graph ops
(issue 44).

What FSDP2 (`torch.distributed.fsdp.fully_shard`, torch/distributed/fsdp/_fully_shard) does on
each rank, and how the captured step does the same:

- **Groups.** `fully_shard` is applied to each block and then to the model; each call makes one
  parameter group, all-gathered and reduce-scattered together. The grouping rule here
  (`fsdp_blocks`, the one torchtitan applies to its models): the children of every
  `nn.ModuleList` not inside another block are the blocks (a transformer's layers); a model with
  no ModuleList has its direct children with parameters as its blocks. Every parameter outside
  the blocks belongs to the root group.
- **Shards.** Each parameter is sharded on dim 0 (FSDP2's `Shard(0)`): rank r holds rows
  [r c, (r+1) c) with c = ceil(dim0 / world size), zero-padded to c rows so that every rank's
  piece, and therefore every rank's graph and plan, has the same shape (`local_piece`). These
  pieces are the step's WEIGHT inputs, and the optimizer updates them, its state shaped alike:
  elementwise optimizers (SGD, Adam, AdamW) give every element what they give it unsharded, and
  the padding rows stay zero (zero gradient, zero state).
- **All-gather.** At the start of a block's forward (where FSDP2's pre-forward hook unshards,
  and prefetches the next block's, `_Resharding.for_forward`) the group's pieces are copied into one flat buffer, all-gathered
  (`_c10d_functional.all_gather_into_tensor`) and copied out into full parameters (FSDP2's
  `foreach_all_gather` copy-in and copy-out); the root group is gathered before the forward.
- **Reshard after forward** (FSDP2's default, `reshard_after_forward=True`, which its root
  group skips): what autograd saves of a block's full parameters for the backward is replaced by
  a note of where it lies (`torch.autograd.graph.saved_tensors_hooks`), and the first unpack in
  the backward all-gathers the group again (and prefetches the block before it, as FSDP2's
  backward prefetch does), so the forward's gathered parameters die with the
  block's forward, as FSDP2 frees them.
- **Reduce-scatter.** The all-gather's backward (`_AllGather`) pads each full gradient to c
  rows per rank, lays them out as the all-gather did, scales by 1/world size (FSDP2 divides
  float64 gradients before and after the sum, `_get_gradient_divide_factors`; by powers of two
  both are exact) and reduce-scatters (`reduce_scatter_tensor`, "sum") into the pieces'
  gradients: after the whole block's backward, where FSDP2's post-backward reduce-scatters.

The collectives are graph ops like DDP's all-reduce (`magis.capture.collectives`): on the
communication stream in the simulator, never recomputed, merged or split by a rule, called by the
generated program. Capturing needs no process group: only its name and size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils._named_member_accessor import NamedMemberAccessor
from torch.utils.checkpoint import checkpoint

from magis.capture.collectives import DataParallel, ParallelError

ROOT = ""  # the root group's module path
# The group a planned job's collectives name (`PlannedJob`): torch.distributed's default group
# (`dist.group.WORLD.group_name`), so that a plan made by `magis optimize --parallel` runs under
# `magis.compile(..., process_group=dist.group.WORLD, plan=...)`.
PLANNED_GROUP = "0"
PARALLEL_KINDS = ("ddp", "fsdp")


class ShardingError(ParallelError):
    """A model whose parameters FSDP cannot shard."""


def fsdp_blocks(model: nn.Module) -> list[str]:
    """The module paths `fully_shard` is applied to before the model (module docstring)."""
    lists: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer in lists)
        if name and isinstance(module, nn.ModuleList) and not inside:
            lists.append(name)
    if lists:
        children = [
            (f"{n}.{c}", m) for n in lists for c, m in model.get_submodule(n).named_children()
        ]
    else:
        children = list(model.named_children())
    return [path for path, m in children if next(m.parameters(), None) is not None]


@dataclass(frozen=True)
class ShardedParam:
    """One parameter: its name in the model, its full shape, and the rows of a rank's piece."""

    name: str
    shape: tuple[int, ...]
    rows: int

    def piece_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shape[1:])

    @property
    def piece_numel(self) -> int:
        return math.prod(self.piece_shape())


@dataclass(frozen=True)
class ParamGroup:
    """The parameters gathered together: a block's, or the root's (`module` ROOT)."""

    module: str
    params: tuple[ShardedParam, ...]

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees a block's gathered parameters after its forward, not the root's."""
        return self.module != ROOT

    def spans(self) -> list[tuple[int, int]]:
        """Where each parameter's piece lies in the group's flat shard."""
        out, at = [], 0
        for p in self.params:
            out.append((at, at + p.piece_numel))
            at += p.piece_numel
        return out


@dataclass(frozen=True)
class ShardLayout:
    """How a model's parameters are sharded over `ranks`: its groups, in gathering order."""

    groups: tuple[ParamGroup, ...]
    ranks: DataParallel
    # Each block's forward checkpointed (`_gather_around`): FSDP2 with full activation
    # checkpointing, the baseline `magis optimize --parallel fsdp` reports beside FSDP2.
    checkpoint_blocks: bool = False

    @staticmethod
    def of(model: nn.Module, ranks: DataParallel, checkpoint_blocks: bool = False) -> ShardLayout:
        """The groups of `model` (`fsdp_blocks`), or a one-line ShardingError."""
        blocks = fsdp_blocks(model)
        owner = {}
        for name, p in model.named_parameters():
            _check_shardable(name, p)
            owner[name] = next((b for b in blocks if name.startswith(f"{b}.")), ROOT)
        groups = []
        for module in (ROOT, *blocks):
            params = tuple(
                ShardedParam(n, tuple(p.shape), -(-p.shape[0] // ranks.world_size))
                for n, p in model.named_parameters()
                if owner[n] == module
            )
            if params:
                _check_one_dtype(model, module, params)
                groups.append(ParamGroup(module, params))
        return ShardLayout(tuple(groups), ranks, checkpoint_blocks)

    @property
    def params(self) -> list[ShardedParam]:
        return [p for g in self.groups for p in g.params]


def _check_shardable(name: str, p: torch.Tensor) -> None:
    if p.dim() == 0:
        raise ShardingError(
            f"parameter {name!r} is 0-dimensional and FSDP shards parameters on dim 0: give it "
            "shape [1] (torch.nn.Parameter(value.reshape(1)))"
        )


def _check_one_dtype(model: nn.Module, module: str, params: Sequence[ShardedParam]) -> None:
    dtypes = sorted({str(model.get_parameter(p.name).dtype).removeprefix("torch.") for p in params})
    if len(dtypes) > 1:
        where = f"block {module!r}" if module else "the model outside its blocks"
        raise ShardingError(
            f"{where} holds {' and '.join(dtypes)} parameters and one all-gather moves one "
            "dtype: cast the model to one dtype (model.to(dtype))"
        )


def local_piece(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s rows of `full` on dim 0, zero-padded to ceil(dim0 / world_size) rows (a
    new tensor: FSDP2's `_chunk_with_empty`, padded as its `_sharded_param_data`)."""
    rows = -(-full.shape[0] // world_size)
    mine = full.detach()[rank * rows : (rank + 1) * rows]
    pad = mine.new_zeros((rows - mine.shape[0], *full.shape[1:]))
    return torch.cat([mine, pad]) if pad.numel() else mine.clone()


def all_gather_group(
    pieces: Sequence[torch.Tensor], group: ParamGroup, ranks: DataParallel
) -> list[torch.Tensor]:
    """The group's full parameters from every rank's pieces: copy-in, one all-gather, copy-out
    (each full parameter in a storage of its own, which `_Resharding` recognizes)."""
    c10d = torch.ops._c10d_functional
    flat = torch.cat([p.reshape(-1) for p in pieces])
    gathered = c10d.wait_tensor(
        c10d.all_gather_into_tensor(flat, ranks.world_size, ranks.group_name)
    )
    by_rank = gathered.view(ranks.world_size, -1)
    fulls = []
    for param, (lo, hi) in zip(group.params, group.spans(), strict=True):
        mine = by_rank[:, lo:hi].clone(memory_format=torch.contiguous_format)
        full = mine.view(ranks.world_size * param.rows, *param.shape[1:])
        fulls.append(full if full.shape[0] == param.shape[0] else full[: param.shape[0]])
    return fulls


def reduce_scatter_group(
    grads: Sequence[torch.Tensor], group: ParamGroup, ranks: DataParallel
) -> list[torch.Tensor]:
    """The pieces' gradients, averaged over the ranks, from each rank's full gradients."""
    n = ranks.world_size
    columns = []
    for g, param in zip(grads, group.params, strict=True):
        missing = n * param.rows - param.shape[0]
        padded = torch.cat([g, g.new_zeros((missing, *param.shape[1:]))]) if missing else g
        columns.append(padded.reshape(n, -1))
    flat = (torch.cat(columns, dim=1) * (1.0 / n)).reshape(-1)
    c10d = torch.ops._c10d_functional
    mine = c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", n, ranks.group_name))
    return [
        mine[lo:hi].view(param.piece_shape())
        for param, (lo, hi) in zip(group.params, group.spans(), strict=True)
    ]


class _AllGather(torch.autograd.Function):
    """All-gather in the forward, reduce-scatter of the gradients in the backward."""

    @staticmethod
    def forward(ctx, group: ParamGroup, ranks: DataParallel, *pieces: torch.Tensor):
        ctx.group, ctx.ranks = group, ranks
        return tuple(all_gather_group(pieces, group, ranks))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *reduce_scatter_group(grads, ctx.group, ctx.ranks))


@dataclass(frozen=True)
class _Saved:
    """What the forward saved of a block's full parameter: where it lies, not its data."""

    group: int
    param: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Resharding:
    """The gathering of one captured step: full parameters by storage, prefetched and
    regathered groups, the order the blocks ran forward in."""

    def __init__(self, layout: ShardLayout, pieces: Mapping[str, torch.Tensor]) -> None:
        self.layout = layout
        self.pieces = pieces
        # storage -> (group, param, full): the full tensor held so that its storage, and so
        # its key, cannot be reused by another tensor during the capture
        self.owner: dict[StorageWeakRef, tuple[int, int, torch.Tensor]] = {}
        self.prefetched: dict[int, list[torch.Tensor]] = {}
        self.ran: list[int] = []  # blocks in the order of their first forward
        self.regathered: dict[int, list[torch.Tensor]] = {}

    def gather(self, index: int) -> list[torch.Tensor]:
        group = self.layout.groups[index]
        pieces = [self.pieces[p.name] for p in group.params]
        fulls = list(_AllGather.apply(group, self.layout.ranks, *pieces))
        if group.reshard_after_forward:
            for i, full in enumerate(fulls):
                self.owner[StorageWeakRef(full.untyped_storage())] = (index, i, full)
        return fulls

    def for_forward(self, index: int) -> list[torch.Tensor]:
        """Block `index`'s full parameters for its forward, and on its first forward the next
        block's all-gather issued before this block computes: FSDP2's forward prefetch (its
        all-gathers run on their own stream while the CPU runs ahead, so the next block's is
        in flight during this one's compute)."""
        fulls = self.prefetched.pop(index, None)
        if fulls is None:
            fulls = self.gather(index)
        if index not in self.ran:  # not a recomputation (checkpoint_blocks)
            self.ran.append(index)
            after = index + 1
            if after < len(self.layout.groups) and after not in self.prefetched:
                self.prefetched[after] = self.gather(after)
        return fulls

    def pack(self, t: torch.Tensor):
        found = self.owner.get(StorageWeakRef(t.untyped_storage()))
        if found is None:
            return t
        return _Saved(found[0], found[1], tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.group not in self.regathered:  # the group's first use in the backward
            self.regather(saved.group)
            # FSDP2's backward prefetch: the block that ran before it, gathered now
            at = self.ran.index(saved.group) if saved.group in self.ran else 0
            if at > 0 and self.ran[at - 1] not in self.regathered:
                self.regather(self.ran[at - 1])
        fulls = self.regathered[saved.group]
        return fulls[saved.param].as_strided(saved.size, saved.stride, saved.offset)

    def regather(self, index: int) -> None:
        group = self.layout.groups[index]
        pieces = [self.pieces[p.name].detach() for p in group.params]
        self.regathered[index] = all_gather_group(pieces, group, self.layout.ranks)


@contextlib.contextmanager
def unsharded(
    layout: ShardLayout, model: nn.Module, tensors: dict[str, torch.Tensor], prefix: str = ""
) -> Iterator[dict[str, torch.Tensor]]:
    """Inside a captured step: `tensors` (`prefix + name` -> a parameter's piece) with the root
    group's full parameters in place of its pieces, every block's gathered before its forward,
    and the blocks' saved parameters regathered in the backward (module docstring)."""
    state = _Resharding(layout, {p.name: tensors[prefix + p.name] for p in layout.params})
    out = dict(tensors)
    undo = []
    try:
        for index, group in enumerate(layout.groups):
            if group.module == ROOT:
                for p, full in zip(group.params, state.gather(index), strict=True):
                    out[prefix + p.name] = full
            else:
                undo.append(_gather_around(model.get_submodule(group.module), index, state))
        with torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack):
            yield out
    finally:
        for step in undo:
            step()


def _gather_around(block: nn.Module, index: int, state: _Resharding) -> Callable[[], None]:
    """`block.forward` replaced by one that runs it with the group's full parameters (its
    pieces again after), checkpointed when the layout says so; returns what undoes that.

    With checkpointing (torch.utils.checkpoint, non-reentrant, as torchtitan's full AC wraps
    each block) the recomputation in the backward runs this forward again, all-gathering the
    group there: where FSDP2 with activation checkpointing all-gathers it before the block's
    backward, and the checkpoint, not `_Resharding`, holds what the backward reads."""
    group = state.layout.groups[index]
    names = [p.name.removeprefix(f"{group.module}.") for p in group.params]
    accessor = NamedMemberAccessor(block)
    own = vars(block).get("forward")
    forward = block.forward

    def gathered(*args, **kwargs):
        fulls = state.for_forward(index)
        pieces = accessor.swap_tensors_dict(dict(zip(names, fulls, strict=True)))
        try:
            return forward(*args, **kwargs)
        finally:
            accessor.swap_tensors_dict(pieces[0])

    def run(*args, **kwargs):
        if state.layout.checkpoint_blocks:
            return checkpoint(gathered, *args, use_reentrant=False, **kwargs)
        return gathered(*args, **kwargs)

    def undo() -> None:
        if own is None:
            del block.forward
        else:
            block.forward = own

    block.forward = run
    return undo


def full_tensors(
    layout: ShardLayout, pieces: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Eagerly, on a live process group: the full tensors of which `pieces` (name -> this
    rank's piece of a parameter, or of its optimizer state) are every rank's pieces."""
    out = {}
    for group in layout.groups:
        if not all(p.name in pieces for p in group.params):
            continue
        fulls = all_gather_group([pieces[p.name] for p in group.params], group, layout.ranks)
        out.update({p.name: f for p, f in zip(group.params, fulls, strict=True)})
    return out


def shard_parameters(model: nn.Module, layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """Replace each parameter's data by rank `rank`'s piece (the Parameter objects stay, so an
    optimizer built on them holds them); return the full data, for `restore_parameters`."""
    full = {}
    for p in layout.params:
        param = model.get_parameter(p.name)
        full[p.name] = param.data
        param.data = local_piece(param.data, rank, layout.ranks.world_size)
    return full


def restore_parameters(model: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Undo `shard_parameters`."""
    for name, data in full.items():
        model.get_parameter(name).data = data


@dataclass(frozen=True)
class PlannedJob:
    """One rank of a data-parallel job, captured with no process at all (`magis optimize
    --parallel`): DDP's all-reduce or FSDP's sharding over `world_size` ranks of the default
    group; `checkpoint_blocks` captures FSDP2 with full activation checkpointing instead."""

    kind: str
    world_size: int
    checkpoint_blocks: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PARALLEL_KINDS:
            raise ParallelError(
                f"unknown parallel {self.kind!r}; choose one of {', '.join(PARALLEL_KINDS)}"
            )
        DataParallel(PLANNED_GROUP, self.world_size)  # a world size of at least one rank

    @property
    def ranks(self) -> DataParallel:
        return DataParallel(PLANNED_GROUP, self.world_size)

    def shard(self, model: nn.Module) -> ShardLayout | None:
        """For FSDP, `model`'s parameters replaced by rank 0's pieces (every rank's have the
        same shapes, so rank 0's step is every rank's) and their layout; None for DDP."""
        if self.kind != "fsdp":
            return None
        layout = ShardLayout.of(model, self.ranks, self.checkpoint_blocks)
        shard_parameters(model, layout, 0)
        if self.checkpoint_blocks:
            _no_kv_cache(model)
        return layout


def _no_kv_cache(model: nn.Module) -> None:
    """Hugging Face models (anywhere in `model`) without their key/value cache, as their
    gradient checkpointing does (`use_cache=True` is incompatible with it): a recomputed layer
    would append its keys and values to the cache a second time."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
