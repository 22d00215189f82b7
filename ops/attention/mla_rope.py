"""MLA's latent write fused with its norm and RoPE: ``kiln::mla_rope_kvwrite`` (DeepSeek-V2/V3).

Inputs (``T`` new tokens, ``H`` heads, ``r = kv_lora_rank``, ``dr = qk_rope_head_dim``, ``dn =
qk_nope_head_dim``; ops/attention/mla.py has the layer and the cache layout):

* ``kv_a``      ``[T, r + dr]`` bf16/f16/f32: ``kv_a_proj_with_mqa(x) = [c | k_pe]`` (unit column
  stride; the row stride is free);
* ``q``         ``[T, H, dn + dr]``, same dtype: the query heads ``[q_nope | q_pe]`` (unit stride on
  the last dim; a view of the q projection's output);
* ``positions`` ``[T]`` int64 and ``cos_sin`` ``[P, dr]`` float32: ops/attention/rope.py's table
  (YaRN's attention factor folded in);
* ``norm_w``    ``[r]``: ``kv_a_layernorm``'s weight; ``eps`` its epsilon;
* ``cache``     ``[N, C, r + dr]``, ``kv_a``'s dtype: one layer's latent cache, in pages (``C`` the
  page size) or flat (``C = 1``: the pool's ``k_cache[layer]``); mutated in place;
* ``out_slots`` ``[T]`` int64: the slot each token writes, at ``cache[s // C, s % C]`` (padding
  rows carry 0, the reserved sink);
* ``is_neox``: RoPE pairs ``(i, i + dr/2)`` (DeepSeek-V3 with ``rope_interleave: false``), else
  ``(2i, 2i + 1)`` (DeepSeek-V2, and V3 by default).

Per token: ``c_kv = kv_a_layernorm(c)`` as transformers' ``DeepseekV2RMSNorm`` computes it
(float32 statistics, the normalized value cast to the input dtype, then times the weight), ``k_pe``
rotated (float32 math), the row ``[c_kv | k_pe]`` written to the cache (cast to its dtype), and
``q_pe = rope(q[..., dn:])`` returned, ``[T, H, dr]`` contiguous in ``q``'s dtype. The norm and
RoPE of the latent therefore cost no pass of their own, and ``q_nope`` is not copied (the layer
absorbs it from ``q`` in place).

Kernel: grid ``(T, 1 + cdiv(H, BLOCK_H))``; program ``(t, 0)`` normalizes, rotates and writes
token ``t``'s latent row, program ``(t, 1 + j)`` rotates the ``q_pe`` of heads ``j * BLOCK_H ..``.
The grid depends on shapes only and nothing is read back to the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.attention.qkv_rope import _rne_bf16, head_rmsnorm_ref
from kiln.ops.attention.rope import apply_rope_ref
from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.op import kiln_op

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------- reference
def mla_rope_kvwrite_ref(kv_a, q, positions, cos_sin, norm_w, eps, cache, out_slots, is_neox):
    """Plain torch with the op's contract (writes the cache, returns ``q_pe``): the op's CPU path,
    the tests' oracle and, run on fake tensors, its shape rule."""
    dr = cos_sin.shape[1]
    r = kv_a.shape[1] - dr
    c_kv = head_rmsnorm_ref(kv_a[:, :r], norm_w, eps)  # [T, r]
    k_pe = apply_rope_ref(kv_a[:, None, r:], positions, cos_sin, dr, is_neox)[:, 0]  # [T, dr]
    slots = out_slots.long()
    page = cache.shape[1]
    cache[slots // page, slots % page] = torch.cat([c_kv.to(cache.dtype), k_pe.to(cache.dtype)], -1)
    q_pe = apply_rope_ref(q[..., q.shape[2] - dr :], positions, cos_sin, dr, is_neox)  # [T, H, dr]
    return q_pe.to(q.dtype).contiguous()


def _check(kv_a, q, positions, cos_sin, norm_w, eps, cache, out_slots, is_neox):
    """The op's argument check (both paths): every message names the argument and its shape."""
    t = kv_a.shape[0]
    dr = cos_sin.shape[-1]
    if kv_a.dim() != 2 or q.dim() != 3 or q.shape[0] != t or cos_sin.dim() != 2:
        raise ValueError(
            f"mla_rope_kvwrite: kv_a {list(kv_a.shape)}, q {list(q.shape)} and cos_sin "
            f"{list(cos_sin.shape)} must be [T, kv_lora_rank + qk_rope_head_dim], [T, H, "
            "qk_nope_head_dim + qk_rope_head_dim] and [max_position, qk_rope_head_dim]."
        )
    r = kv_a.shape[1] - dr
    if dr % 2 or dr < 2 or r < 1 or q.shape[2] <= dr:
        raise ValueError(
            f"mla_rope_kvwrite: qk_rope_head_dim = cos_sin columns ({dr}) must be even and smaller than "
            f"kv_a's {kv_a.shape[1]} and q's {q.shape[2]} columns."
        )
    if positions.shape != (t,) or out_slots.shape != (t,) or out_slots.dtype != torch.int64:
        raise ValueError(
            f"mla_rope_kvwrite: positions {list(positions.shape)} and out_slots {list(out_slots.shape)} "
            f"{out_slots.dtype} must be [T = {t}], out_slots int64."
        )
    if norm_w.shape != (r,):
        raise ValueError(f"mla_rope_kvwrite: norm_w must be [kv_lora_rank = {r}], got {list(norm_w.shape)}.")
    if cache.dim() != 3 or cache.shape[2] != r + dr:
        raise ValueError(
            f"mla_rope_kvwrite: cache must be [num_pages, page_size or 1, {r + dr}], got {list(cache.shape)}."
        )
    if kv_a.dtype not in ACT_DTYPES or q.dtype != kv_a.dtype or cache.dtype != kv_a.dtype:
        raise ValueError(
            f"mla_rope_kvwrite: kv_a, q and cache must share one dtype of {ACT_DTYPES} (no FP8 latent "
            f"cache yet), got {kv_a.dtype}, {q.dtype}, {cache.dtype}."
        )
    if kv_a.stride(-1) != 1 or q.stride(-1) != 1 or cache.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("mla_rope_kvwrite: kv_a, q, cache and cos_sin need a contiguous last dimension.")


# --------------------------------------------------------------------------- kernel
@triton.jit
def _rotate(src, a_off, b_off, mask, cos, sin):
    """The RoPE pairs ``(src[a_off], src[b_off])`` rotated by ``(cos, sin)``, float32."""
    a = tl.load(src + a_off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + b_off, mask=mask, other=0.0).to(tl.float32)
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _mla_rope_kvwrite_kernel(
    kv_ptr, q_ptr, pos_ptr, cs_ptr, w_ptr, cache_ptr, slot_ptr, out_ptr,
    stride_kv_t, stride_q_t, stride_q_h, stride_cs_p, stride_cp, stride_ct, eps,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, Q_OFF: tl.constexpr, IS_NEOX: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    RNE_IN: tl.constexpr, RNE_OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)  # kv_a and q are the projections' just before
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    HALF = DR // 2
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    if IS_NEOX:  # pairs (i, i + dr/2)
        a_off = i
        b_off = i + HALF
    else:  # pairs (2i, 2i + 1)
        a_off = 2 * i
        b_off = 2 * i + 1
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs_p + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs_p + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    # (each branch names its own values: Triton 3.6 refuses a name bound to a scalar pointer in one
    # branch and to a block of pointers in the other, which the interpreter accepts)
    if blk == 0:  # the latent row: RMSNorm of c, RoPE of k_pe, both to the cache
        slot = tl.load(slot_ptr + t)
        c_dst = cache_ptr + (slot // PAGE) * stride_cp + (slot % PAGE) * stride_ct
        c_src = kv_ptr + t * stride_kv_t
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        x = tl.load(c_src + r, mask=r_ok, other=0.0).to(tl.float32)  # [BLOCK_R]
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / R + eps)
        y = _rne_bf16(x * rstd, RNE_IN).to(kv_ptr.dtype.element_ty).to(tl.float32)  # HF: cast, then * w
        y = y * tl.load(w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(c_dst + r, _rne_bf16(y, RNE_OUT).to(cache_ptr.dtype.element_ty), mask=r_ok)
        ka, kb = _rotate(c_src + R, a_off, b_off, i_ok, cos, sin)  # [BLOCK_HALF] each
        tl.store(c_dst + R + a_off, _rne_bf16(ka, RNE_OUT).to(cache_ptr.dtype.element_ty), mask=i_ok)
        tl.store(c_dst + R + b_off, _rne_bf16(kb, RNE_OUT).to(cache_ptr.dtype.element_ty), mask=i_ok)
    else:  # q_pe of heads (blk - 1) * BLOCK_H ..
        h = (blk - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (h < H)[:, None] & i_ok[None, :]  # [BLOCK_H, BLOCK_HALF]
        q_src = q_ptr + t * stride_q_t + h[:, None].to(tl.int64) * stride_q_h + Q_OFF
        qa, qb = _rotate(q_src, a_off[None, :], b_off[None, :], m, cos[None, :], sin[None, :])
        q_dst = out_ptr + t * (H * DR) + h[:, None] * DR  # out is contiguous [T, H, dr]
        tl.store(q_dst + a_off[None, :], _rne_bf16(qa, RNE_OUT).to(out_ptr.dtype.element_ty), mask=m)
        tl.store(q_dst + b_off[None, :], _rne_bf16(qb, RNE_OUT).to(out_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- op
@kiln_op("mla_rope_kvwrite", ref=mla_rope_kvwrite_ref, check=_check, mutates_args=("cache",))
def mla_rope_kvwrite_triton(
    kv_a: torch.Tensor,
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    out_slots: torch.Tensor,
    is_neox: bool,
    *,
    block_h: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused kernel (module docstring): writes ``[c_kv | k_pe]`` to the cache, returns ``q_pe
    [T, H, dr]``. ``out`` (contiguous ``[T, H, dr]`` in ``q``'s dtype) receives ``q_pe`` when given
    (tests poison it); ``block_h`` overrides the heads per program (benchmarks)."""
    t, heads, dq = q.shape
    dr = cos_sin.shape[1]
    r = kv_a.shape[1] - dr
    q_pe = out if out is not None else q.new_empty((t, heads, dr))
    if not q_pe.is_contiguous() or q_pe.shape != (t, heads, dr) or q_pe.dtype != q.dtype:
        raise ValueError(
            f"mla_rope_kvwrite: out must be a contiguous [T, H, dr] = {[t, heads, dr]} {q.dtype}."
        )
    if t == 0:
        return q_pe
    bh = block_h or max(1, min(next_pow2(heads), 2048 // next_pow2(dr)))
    rne = interpreting() and not kv_a.is_cuda  # the interpreter truncates bf16 casts; the GPU rounds
    _mla_rope_kvwrite_kernel[(t, 1 + triton.cdiv(heads, bh))](
        kv_a, q, positions, cos_sin, norm_w, cache, out_slots, q_pe,
        kv_a.stride(0), q.stride(0), q.stride(1), cos_sin.stride(0), cache.stride(0), cache.stride(1),
        float(eps), H=heads, R=r, DR=dr, Q_OFF=dq - dr, IS_NEOX=bool(is_neox), PAGE=cache.shape[1],
        BLOCK_R=next_pow2(r), BLOCK_HALF=next_pow2(dr // 2), BLOCK_H=bh,
        RNE_IN=rne and kv_a.dtype == torch.bfloat16, RNE_OUT=rne and cache.dtype == torch.bfloat16,
        num_warps=4, **pdl_args(kv_a),
    )  # fmt: skip
    return q_pe


__all__ = ["mla_rope_kvwrite_ref", "mla_rope_kvwrite_triton"]
