"""Seeded Gumbel-max sampling: ``argmax(x + g)`` with counter-based noise, fused in one kernel.

The noise for token ``v`` of a row is a pure function of that row's two 32-bit keys (derived on
the host from the request's seed and step, ``row_keys``) and ``v``:

    h = lowbias32(lowbias32((v + key_a) mod 2**32) ^ key_b)
    u = (h >> 8 + 0.5) / 2**24                    in (0, 1), 24 bits
    g = -log(-log(u))                             standard Gumbel

so a request's draw depends on nothing else in the batch (same seed, same output, whatever the
batch). ``argmax(x + g)`` over logits ``x`` (masked entries ``-inf``) samples ``softmax(x)``.

``gumbel_argmax(x[B, V] f32, keys[B, 2] i64) -> [B] i64`` launches the Triton kernels on CUDA
(one program per row and 2048-token chunk, then one program per row reducing the chunks) and the
plain-torch reference on CPU (the kernels under the interpreter when ``KILN_TRITON_ON_CPU=1``).
``argmax_rows(x[B, V]) -> [B] i64`` is the same two kernels without the noise: greedy decoding.
(``torch.argmax`` over a 128k vocabulary runs one block per row: 27 us at batch 1 on the H200,
against two short launches here.) Both return the lowest index among equal maxima, as
``torch.argmax`` does. No host sync, fixed grid per shape: fits in a CUDA graph. Both kernels are
launched with PDL (ops/common/launch.py) and wait at their top (logits and keys come from earlier work).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import next_pow2, pdl_args, pdl_trigger, pdl_wait, use_triton

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
C1, C2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (Wellons' hash prospector)
CHUNK = 2048  # tokens per program
_M32 = tl.constexpr(M32)  # kernels may only read constexpr globals
_C1 = tl.constexpr(C1)
_C2 = tl.constexpr(C2)


# ---- host side: per-row keys ----------------------------------------------------------------------


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def row_keys(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit noise keys of a request at generation step ``step`` (Python ints)."""
    z = _splitmix64((seed & M64) ^ _splitmix64(step & M64))
    return z & M32, z >> 32


def derive_seed(seed: int, index: int) -> int:
    """Seed of completion ``index`` of a request with ``n > 1`` (index 0 keeps ``seed``)."""
    return seed if index == 0 else _splitmix64((seed & M64) ^ _splitmix64(index)) >> 1


# ---- torch reference ------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32): the constant as a signed 32-bit value
    keeps the product inside int64."""
    cs = c - (1 << 32) if c >= 1 << 31 else c
    return (x * cs) & M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, C1)
    x = x ^ (x >> 15)
    x = _mul32(x, C2)
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise ``g: [B, V]`` f32 for ``keys: [B, 2]`` int64 (reference; also used by tests)."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)  # [V]
    h = _lowbias32((v[None, :] + keys[:, :1]) & M32)  # [B, V]
    h = _lowbias32(h ^ keys[:, 1:2])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def gumbel_argmax_ref(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax(x + g)`` per row. x: [B, V] f32, keys: [B, 2] int64 -> [B] int64."""
    return (x + gumbel_noise(keys, x.shape[1])).argmax(dim=-1)


# ---- Triton kernel --------------------------------------------------------------------------------


@triton.jit
def _tl_lowbias32(x):
    # x: uint64 holding a 32-bit value; products of two 32-bit values fit in 64 bits.
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


@triton.jit
def _best(v, i, valid):
    """(max, lowest index of it) over the ``valid`` lanes, NaN counting as the maximum (as in
    ``torch.argmax``); NaN never enters ``tl.max``."""
    nan = (v != v) & valid
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan | ~valid, float("-inf"), v), axis=0)
    pick = tl.where(any_nan, nan, (v == top) & valid)
    idx = tl.min(tl.where(pick, i, 2147483647), axis=0)
    return tl.where(any_nan, float("nan"), top), idx


@triton.jit
def _gumbel_argmax_kernel(
    x_ptr,  # [B, V] logits (f32), unit column stride
    stride_x,  # row stride of x (may exceed V)
    keys_ptr,  # [B, 2] int64 noise keys (NOISE), else any pointer
    best_val_ptr,  # [B, num_chunks] f32 out: each chunk's maximum
    best_idx_ptr,  # [B, num_chunks] i32 out: its lowest index
    V,
    num_chunks,
    CHUNK_SIZE: tl.constexpr,  # tokens per program
    BLOCK: tl.constexpr,  # tokens per step through the chunk
    NOISE: tl.constexpr,  # add the Gumbel noise (sampling), or not (greedy)
    PDL: tl.constexpr,  # programmatic dependent launch (ops/common/launch.py)
):
    # grid (B, num_chunks): the best (value, lowest index) of one chunk of one row
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if NOISE:
        key_a = tl.load(keys_ptr + row * 2).to(tl.uint64)
        key_b = tl.load(keys_ptr + row * 2 + 1).to(tl.uint64)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    start = chunk * CHUNK_SIZE
    for off in range(0, CHUNK_SIZE, BLOCK):
        offs = start + off + tl.arange(0, BLOCK)  # [BLOCK]
        mask = offs < V
        s = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if NOISE:
            h = _tl_lowbias32((offs.to(tl.uint64) + key_a) & _M32)
            h = _tl_lowbias32(h ^ key_b)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            s = s - tl.log(-tl.log(u))
        s = tl.where(mask, s, float("-inf"))
        take = (s > best) | ((s != s) & (best == best))  # NaN is the maximum, as in torch.argmax
        best = tl.where(take, s, best)
        best_i = tl.where(take, offs, best_i)
    top, top_i = _best(best, best_i, best_i == best_i)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, top_i)


@triton.jit
def _argmax_finish_kernel(
    best_val_ptr, best_idx_ptr, out_ptr, num_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    # grid (B,): the chunk winners of one row -> its index (int64); chunks hold ascending indices,
    # so the lowest index among equal maxima is the lowest chunk's
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < num_chunks
    v = tl.load(best_val_ptr + row * num_chunks + c, mask=m, other=float("-inf"))
    i = tl.load(best_idx_ptr + row * num_chunks + c, mask=m, other=2147483647)
    # an all -inf row: every chunk reports -inf at index 0 (its best index never moved); index 0
    # then wins, as in torch
    _top, pick = _best(v, i, m)
    tl.store(out_ptr + row, pick.to(tl.int64))


def argmax_launch(
    x: torch.Tensor, keys: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The two kernels: ``argmax(x + g)`` per row with ``keys`` (``[B, 2]`` int64), plain
    ``argmax(x)`` without. ``x``: [B, V] float32 with unit column stride; ``out``: [B] int64 or
    None (allocated). Returns ``out``."""
    B, V = x.shape
    assert x.stride(1) == 1, "argmax: rows must be contiguous"
    chunk = min(CHUNK, next_pow2(V))
    block = min(1024, chunk)
    num_chunks = triton.cdiv(V, chunk)
    best_val = torch.empty(B, num_chunks, dtype=torch.float32, device=x.device)
    best_idx = torch.empty(B, num_chunks, dtype=torch.int32, device=x.device)
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    pdl = pdl_args(x)
    _gumbel_argmax_kernel[(B, num_chunks)](
        x, x.stride(0), keys.contiguous() if keys is not None else x, best_val, best_idx, V, num_chunks,
        CHUNK_SIZE=chunk, BLOCK=block, NOISE=keys is not None, **pdl,
    )  # fmt: skip
    _argmax_finish_kernel[(B,)](
        best_val, best_idx, out, num_chunks, BLOCK=max(16, next_pow2(num_chunks)), **pdl
    )
    return out


# ---- entry points: plain functions, not ops (the sampler calls them outside the graphs) ----------


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: ``argmax(x + g)``.

    x: [B, V] float32 (row stride may exceed V; entries ``-inf`` are never chosen unless the
    whole row is ``-inf``). keys: [B, 2] int64 from ``row_keys``. Returns [B] int64.
    """
    if not use_triton(x):
        return gumbel_argmax_ref(x, keys)
    return argmax_launch(x, keys)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy: ``x.argmax(dim=-1)`` for x [B, V] float32 (rows contiguous, row stride may exceed
    V), the lowest index among equal maxima; the Triton kernels where ``use_triton`` says so.
    ``out``: a ``[B]`` int64 tensor to write the ids into (returned)."""
    if out is not None and (out.shape != (x.shape[0],) or out.dtype != torch.int64):
        raise ValueError(f"argmax_rows: out must be [{x.shape[0]}] int64, got {tuple(out.shape)} {out.dtype}")
    if not use_triton(x) or x.dim() != 2 or x.stride(1) != 1:
        return torch.argmax(x, dim=-1, out=out) if out is not None else x.argmax(dim=-1)
    return argmax_launch(x, None, out)
