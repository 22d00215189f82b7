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

On GPUs, :func:`enable_symmetric_all_reduce` gives ``tp_all_reduce`` torch's symmetric-memory
all-reduce (``torch.ops.symm_mem``: each rank's input is copied into a buffer every rank of the
machine can read over NVLink): one-shot (each rank reads every peer's whole buffer) up to
``ONE_SHOT_BYTES``, two-shot (reduce-scatter, then all-gather) up to the buffer's size, NCCL above.
Measured on two H200s inside CUDA graphs (bench/gpu/allreduce.py): 8 KiB 6.6 us one-shot vs 10.9 us
NCCL, 1 MiB 14.7 vs 18.0, 4 MiB 22.0 two-shot vs 36.5; at 128 MiB both ~470 us.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from kiln.ops.common.op import kiln_op

_GROUP: Any = None  # the tensor-parallel process group, or None: one rank
_SYMM: Any = None  # (bf16 symmetric buffer, group name) of enable_symmetric_all_reduce, or None

ONE_SHOT_BYTES = 256 << 10  # one-shot to here, two-shot above (they cross at 128-512 KiB on two H200s)
SYMM_BUFFER_BYTES = 32 << 20  # the symmetric buffer: larger all-reduces (prefill chunks) take NCCL


def set_tp_group(group: Any) -> None:
    """The process group the collectives of this process's graphs run over (None: one rank)."""
    global _GROUP, _SYMM
    _GROUP, _SYMM = group, None


def enable_symmetric_all_reduce(device: torch.device) -> None:
    """Give the group's bf16 all-reduces on ``device`` the symmetric-memory path (module docstring).
    A collective: every rank of the group calls it at the same point, after :func:`set_tp_group`."""
    global _SYMM
    import torch.distributed._symmetric_memory as symm_mem

    name = _GROUP.group_name
    buf = symm_mem.empty(SYMM_BUFFER_BYTES // 2, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, name)
    _SYMM = (buf, name)


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
    if _SYMM is not None and x.dtype == torch.bfloat16 and x.is_cuda:
        buf, name = _SYMM
        n = x.numel()
        if 2 * n <= ONE_SHOT_BYTES:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:n], x.reshape(-1), "sum", name).view(
                x.shape
            )
        if n <= buf.numel() and n % (8 * dist.get_world_size(_GROUP)) == 0:
            staged = buf[:n]
            staged.copy_(x.reshape(-1))
            y = torch.empty_like(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", name, y.view(-1))
            return y
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

__all__ = [
    "enable_symmetric_all_reduce",
    "set_tp_group",
    "tp_all_reduce",
    "tp_embedding",
    "tp_gather_cols",
    "tp_world",
    "without_tp_group",
]
