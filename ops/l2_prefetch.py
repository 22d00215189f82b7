"""L2 prefetch of weights a later kernel of the step reads (sm_90 bulk prefetch).

A batch-1 decode layer alternates weight streams (the GEMVs, at 66-82% of read bandwidth) with
small kernels that read kilobytes (QK-norm + RoPE, decode attention and its merge, the router and
the top-k): about 14 us per layer in which DRAM idles (docs/decode_budget.md). The weights of the
next GEMVs are known before their inputs are, so a kernel that runs early in such a window can
start pulling them into L2: ``cp.async.bulk.prefetch.L2.global [addr], size`` asks the copy
engine of the issuing SM for ``size`` bytes at once, without registers, shared memory or a wait,
so a few programs can put megabytes in flight and then go on with their own work.

* ``tl_prefetch_l2(ptr, n, pid, nprog, ...)``: a ``@triton.jit`` helper any kernel can call (before
  its PDL wait: weights are never written by an earlier kernel); program ``pid`` of ``nprog``
  issues every ``nprog``-th chunk of ``CHUNK`` elements of ``ptr[0:n]``.
* ``prefetch_l2(tensors, programs)``: a kernel of its own that only prefetches (benchmarks).
* ``prefetchable(t)``: whether ``t`` can be prefetched (CUDA, sm_90+, not the interpreter,
  contiguous, 16-byte aligned), so call sites pass the tensors and the op decides.

Switch: ``KILN_L2_PREFETCH=1`` (read when tracing; off by default until measured end to end)
makes the residual-stream decode layers (compiler/models/base.py) hand the o projection's and the
router's weights to ``kiln::qkv_rope_kvwrite``, whose extra programs prefetch them while the
attention runs. ``KILN_L2_PREFETCH_PROGRAMS`` (default 16) sets how many extra programs do it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.ops.common import capability, interpreting

CHUNK_BYTES = 1 << 15  # bytes per bulk prefetch instruction
DEFAULT_PROGRAMS = 16

# p: the instruction runs only for chunks with bytes (the masked lanes carry size 0); $0: a dummy
# result, since inline asm must produce one (is_pure=False keeps it from being removed)
_ASM = tl.constexpr(
    "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.b32 $0, 0;\n}"
)


def prefetch_requested() -> bool:
    """``KILN_L2_PREFETCH=1`` (read when tracing the decode graphs)."""
    value = os.environ.get("KILN_L2_PREFETCH", "0")
    if value not in ("0", "1"):
        raise ValueError(f"KILN_L2_PREFETCH must be 0 or 1, got {value!r}")
    return value == "1"


def prefetch_programs() -> int:
    """``KILN_L2_PREFETCH_PROGRAMS`` (read at launch, so at capture for CUDA graphs)."""
    raw = os.environ.get("KILN_L2_PREFETCH_PROGRAMS", str(DEFAULT_PROGRAMS))
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ValueError(f"KILN_L2_PREFETCH_PROGRAMS must be an integer in [1, 1024], got {raw!r}")
    return int(raw)


def prefetchable(t: torch.Tensor) -> bool:
    """Whether the bulk prefetch can read ``t``: CUDA sm_90+, not interpreting, one contiguous
    16-byte-aligned span (a weight view at an odd offset of a pack is skipped, not refused)."""
    return (
        t.is_cuda
        and not interpreting()
        and capability(t.device)[0] >= 9
        and t.is_contiguous()
        and t.data_ptr() % 16 == 0
        and t.numel() * t.element_size() >= 16
    )


@triton.jit
def tl_prefetch_l2(ptr, n, pid, nprog, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid`` of ``nprog`` asks L2 for chunks ``pid, pid + nprog, ...`` of ``ptr[0:n]``
    (``CHUNK`` elements each, ``BLOCK`` chunks per step; a tail under 16 bytes is skipped)."""
    esize = ptr.dtype.element_ty.primitive_bitwidth // 8
    nchunks = tl.cdiv(n, CHUNK)
    for c0 in range(pid * BLOCK, nchunks, nprog * BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        start = c.to(tl.int64) * CHUNK
        nbytes = (tl.minimum(n - start, CHUNK) * esize) // 16 * 16
        nbytes = tl.where(c < nchunks, nbytes, 0).to(tl.int32)
        tl.inline_asm_elementwise(_ASM, "=r,l,r", [ptr + start, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(P0, N0, P1, N1, HAS_P1: tl.constexpr, CHUNK0: tl.constexpr, CHUNK1: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    tl_prefetch_l2(P0, N0, pid, nprog, CHUNK0, 128)
    if HAS_P1:
        tl_prefetch_l2(P1, N1, pid, nprog, CHUNK1, 128)


def chunk_elems(t: torch.Tensor) -> int:
    """``CHUNK_BYTES`` in elements of ``t``."""
    return CHUNK_BYTES // t.element_size()


def prefetch_l2(tensors: list[torch.Tensor], programs: int = DEFAULT_PROGRAMS) -> int:
    """Launch a kernel of ``programs`` programs that prefetches up to two tensors into L2 and
    returns at once (the copies go on after it ends). Returns how many tensors it prefetches
    (those ``prefetchable``): 0 launches nothing."""
    ok = [t for t in tensors if prefetchable(t)]
    if len(tensors) > 2:
        raise ValueError(f"prefetch_l2 takes at most 2 tensors, got {len(tensors)}")
    if not ok:
        return 0
    p0, p1 = ok[0], ok[-1]
    _prefetch_kernel[(programs,)](
        p0, p0.numel(), p1, p1.numel(), HAS_P1=len(ok) == 2, CHUNK0=chunk_elems(p0), CHUNK1=chunk_elems(p1),
        num_warps=4,
    )  # fmt: skip
    return len(ok)


__all__ = [
    "CHUNK_BYTES",
    "chunk_elems",
    "prefetch_l2",
    "prefetch_programs",
    "prefetch_requested",
    "prefetchable",
    "tl_prefetch_l2",
]
