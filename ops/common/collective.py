"""Collectives inside the graphs: the tensor-parallel group's ops.

A tensor-parallel artifact (``kiln compile --tp N``) is one graph run by N processes, one per rank,
each with its rank's weight pack. The graph calls these ops where the ranks' partial results meet:

* ``kiln::tp_all_reduce(x)``: the sum of ``x`` over the ranks (after the row-parallel linears, the
  attention output projection and the MLP's down projection, whose inputs are split by columns);
* ``kiln::tp_embedding(ids, weight)``: the vocab-parallel embedding, each rank holding rows
  ``[rank * V_r, (rank + 1) * V_r)`` of the table: its rows of ``ids`` looked up, the others zero,
  then summed over the ranks;
* ``kiln::tp_gather_cols(x)``: ``[B, N_r]`` per rank to ``[B, tp * N_r]``, rank-major along the last
  dim (the vocab-parallel LM head's logits).

The graph is the same on every rank: the rank and the group come from the process, not from the
graph. The runtime sets them with :func:`set_tp_group` (a ``torch.distributed`` process group: NCCL
on GPUs, gloo on CPUs) before it runs a graph; without a group (a single process, e.g. the compile's
warm-up) the world is one rank and the ops are copies. Each op returns a new tensor (an op may not
return an alias of its input); the collective runs in place on that copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from kiln.ops.common.op import kiln_op

_GROUP: Any = None  # the tensor-parallel process group, or None: one rank


def set_tp_group(group: Any) -> None:
    """The process group the collectives of this process's graphs run over (None: one rank)."""
    global _GROUP
    _GROUP = group


@contextlib.contextmanager
def without_tp_group() -> Iterator[None]:
    """One rank inside the block (the compile's warm-up, in a process that may serve a
    tensor-parallel engine: its graphs must not join that engine's collectives)."""
    global _GROUP
    saved, _GROUP = _GROUP, None
    try:
        yield
    finally:
        _GROUP = saved


def tp_world() -> tuple[int, int]:
    """``(rank, world size)`` of this process in the tensor-parallel group (``(0, 1)`` without one)."""
    if _GROUP is None:
        return 0, 1
    return dist.get_rank(_GROUP), dist.get_world_size(_GROUP)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the tensor-parallel ranks (a new tensor)."""
    y = x.clone()
    if _GROUP is not None:
        dist.all_reduce(y, group=_GROUP)
    return y


def tp_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows ``ids [T]`` of the vocab-parallel table whose rank holds ``weight [V_r, H]``: ``[T, H]``."""
    rank, _ = tp_world()
    vr = weight.shape[0]
    local = ids - rank * vr
    mine = (local >= 0) & (local < vr)
    rows = torch.nn.functional.embedding(torch.where(mine, local, 0), weight)
    return tp_all_reduce(rows * mine[:, None].to(rows.dtype))


def tp_gather_cols(x: torch.Tensor) -> torch.Tensor:
    """``x [B, N_r]`` of every rank side by side: ``[B, tp * N_r]``, rank 0's columns first."""
    _, world = tp_world()
    if world == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP)
    return torch.cat(parts, dim=-1)


def _gathered_shape(x: torch.Tensor) -> torch.Tensor:
    _, world = tp_world()
    return x.new_empty(*x.shape[:-1], x.shape[-1] * world)


# The same function is launch and reference: a collective is the same call on every device (kiln_op).
tp_all_reduce = kiln_op("tp_all_reduce", ref=tp_all_reduce, fake=lambda x: torch.empty_like(x))(tp_all_reduce)
tp_embedding = kiln_op(
    "tp_embedding",
    ref=tp_embedding,
    fake=lambda ids, weight: weight.new_empty(ids.shape[0], weight.shape[1]),
)(tp_embedding)
tp_gather_cols = kiln_op("tp_gather_cols", ref=tp_gather_cols, fake=_gathered_shape)(tp_gather_cols)

__all__ = ["set_tp_group", "tp_all_reduce", "tp_embedding", "tp_gather_cols", "tp_world", "without_tp_group"]
