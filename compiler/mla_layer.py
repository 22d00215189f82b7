"""Multi-head latent attention (DeepSeek-V2/V3), absorbed form over a latent KV cache.

Parameter names (the packs' ``layers.{i}.attn.*``, compiler/mappings.py ``_mla``; shapes per
tensor-parallel rank, ``H`` heads of the rank, ``r = kv_lora_rank``, ``dn``/``dr``/``dv`` the nope,
rope and value head dims): ``qkv_a.weight [first + r + dr, hidden]``, the projections of the
layer's input in one GEMM: ``q_a_proj`` (``first = q_lora_rank``) or, without a q LoRA (V2-Lite),
the rank's ``q_proj`` rows (``first = H (dn + dr)``), then ``kv_a_proj_with_mqa`` (SGLang's
``fused_qkv_a_proj_with_mqa``; one launch, and the folded input norm runs inside it);
``q_a_norm.weight`` and ``q_b.weight [H (dn + dr), q_lora_rank]`` with a q LoRA;
``kv_a_norm.weight [r]``; ``w_kc [H, dn, r]``, ``w_vc [H, r, dv]`` (``kv_b_proj`` split per head);
``o.weight [hidden, H dv]``.

Forward (``T`` tokens)::

    [q_a | kv_a] = qkv_a(x)                                    [T, first], [T, r + dr] = [c | k_pe]
    q    = q_b(q_a_norm(q_a))  or  q_a                         [T, H, dn + dr]
    q_pe = kiln::mla_rope_kvwrite(kv_a, q, ...)                [T, H, dr]; cache row [norm(c) | rope(k_pe)]
    o    = kiln::mla_attention(absorb_q(q_nope, w_kc), q_pe, cache, ...)   [T, H, r]
    out  = o_proj(apply_uv(o, w_vc))                           [T, hidden]

The latent cache is the KV pool's K cache of an MLA artifact (compiler/build.py ``_kv_spec``: one
head of ``r + dr``, an empty V): ``ctx.k_cache[layer]`` ``[S, 1, r + dr]``, which the MLA ops take
as is (ops/attention/mla.py); ``ctx.v_cache`` is not read. The two LoRA norms use transformers'
module default epsilon (1e-6), not ``rms_norm_eps``. The softmax scale is ``1/sqrt(dn + dr)``,
times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` (``mla_softmax_scale``); the rotary table
(``ctx.cos_sin``, ``dr`` columns) folds in YaRN's attention factor, as for every model.

With tensor parallelism the heads are split (q, ``w_kc``, ``w_vc``, o), the latent is not: every
rank projects and caches the whole latent, and the o projection's partial sums are all-reduced.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.compiler.config import ModelConfig
from kiln.compiler.context import ForwardContext
from kiln.compiler.layers import Act, Linear, RMSNorm, norm_linear
from kiln.ops.attention.mla import absorb_q, apply_uv, mla_softmax_scale

LORA_NORM_EPS = 1e-6  # transformers' DeepseekV2RMSNorm default: q_a_layernorm and kv_a_layernorm


class MLAAttention(nn.Module):
    """One layer's MLA for ``tp`` ranks (module docstring): ``x [T, hidden]`` -> ``[T, hidden]``."""

    def __init__(
        self, cfg: ModelConfig, layer: int, dtype: torch.dtype, tp: int = 1, quant: str | None = None
    ):
        super().__init__()
        m = cfg.mla
        if m is None:
            raise ValueError(f"{cfg.architecture}: MLAAttention needs a config with MLA fields")
        self.layer, self.heads = layer, cfg.num_heads // tp
        self.r, self.dv = m.kv_lora_rank, m.v_head_dim
        self.dn, self.dr = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.is_neox = cfg.rope_is_neox
        self.scale = mla_softmax_scale(m.qk_head_dim, asdict(cfg.rope_scaling))
        self.tp_reduce = tp > 1  # o is row-parallel: kiln::tp_all_reduce after it
        h, q_out = cfg.hidden_size, self.heads * m.qk_head_dim
        self.q_lora = bool(m.q_lora_rank)
        self.first = m.q_lora_rank or q_out  # qkv_a's rows before the latent's: q_a's, or q's
        self.qkv_a = Linear(self.first + self.r + self.dr, h, dtype, False, quant)
        linears = [self.qkv_a]
        if m.q_lora_rank:
            self.q_a_norm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, dtype, quant_out=quant == "fp8")
            self.q_b = Linear(q_out, m.q_lora_rank, dtype, False, quant)
            linears.append(self.q_b)
        self.kv_a_norm = RMSNorm(self.r, LORA_NORM_EPS, dtype)  # its weight, fused into mla_rope_kvwrite
        # bmm operands, in the activation dtype also with --quant fp8 (compiler/mappings.py)
        self.w_kc = nn.Parameter(torch.empty(self.heads, self.dn, self.r, dtype=dtype), requires_grad=False)
        self.w_vc = nn.Parameter(torch.empty(self.heads, self.r, self.dv, dtype=dtype), requires_grad=False)
        self.o = Linear(h, self.heads * self.dv, dtype, False, quant)
        for lin in (*linears, self.o):
            lin.role = "attn"  # the GEMV plan's role (compiler/layers.py use_gemv_plan)
        # the per-head latent maps: kiln::mla_head_matmul up to max_m tokens where the plan has them
        self.role, self.max_m = "latent", 0

    def forward(
        self, x: Act, ctx: ForwardContext, residual: torch.Tensor | None = None, norm: RMSNorm | None = None
    ) -> torch.Tensor:
        # residual [T, hidden]: added by the o projection; norm: the layer's folded input norm, run
        # inside the qkv_a projection (x is then the stream; both: the residual stream,
        # compiler/models/base.py)
        if norm is not None:
            assert isinstance(x, torch.Tensor)
            y, _ = norm_linear(norm, x, self.qkv_a.weight, None, self.qkv_a.max_m)
        else:
            y = self.qkv_a(x)  # [T, first + r + dr]: q_a(x) or q(x), then kv_a(x)
        qa, kv_a = y[:, : self.first], y[:, self.first :]  # views, their rows strided
        if not self.q_lora:
            q = qa  # [T, H (dn + dr)]
        elif norm is not None:  # q_a_norm folded into q_b too
            q, _ = norm_linear(self.q_a_norm, qa, self.q_b.weight, None, self.q_b.max_m)
        else:
            q = self.q_b(self.q_a_norm(qa))
        t = q.shape[0]
        q = q.view(t, self.heads, self.dn + self.dr)
        cache = ctx.k_cache[self.layer]  # [S, 1, r + dr]: the layer's latent rows, one per slot
        q_pe = torch.ops.kiln.mla_rope_kvwrite(
            kv_a, q, ctx.positions, ctx.cos_sin, self.kv_a_norm.weight, LORA_NORM_EPS, cache, ctx.out_slots,
            self.is_neox,
        )  # fmt: skip
        # q_pe: [T, H, dr]; the cache holds this step's rows before attention reads them
        if self.max_m:  # [T, H, r]
            q_latent = torch.ops.kiln.mla_head_matmul(q[..., : self.dn], self.w_kc, self.max_m)
        else:
            q_latent = absorb_q(q[..., : self.dn], self.w_kc)
        o = torch.ops.kiln.mla_attention(
            q_latent, q_pe, cache, ctx.block_table, ctx.req_rows, ctx.seq_lens, ctx.qo_indptr, self.scale,
            ctx.page_size, ctx.num_splits, *(() if ctx.tree_mask is None else (ctx.tree_mask,)),
        )  # fmt: skip
        # o: [T, H, r] latent outputs -> the heads' values [T, H, dv]
        if self.max_m:
            v = torch.ops.kiln.mla_head_matmul(o, self.w_vc, self.max_m).view(t, self.heads * self.dv)
        else:
            v = apply_uv(o, self.w_vc).reshape(t, self.heads * self.dv)
        if self.tp_reduce:
            assert residual is None, "the residual stream is not for tensor parallelism (compile: no folds)"
            return torch.ops.kiln.tp_all_reduce(self.o(v))  # [T, hidden]
        return self.o(v, residual)  # [T, hidden]
