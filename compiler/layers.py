"""Shared layers that model definitions compose. Shapes are per tensor-parallel rank.

Parameter names follow docs/internals.md: they are the names in the weight pack, and the keys of
the weights dict the exported graphs take. Layers only hold parameter *shapes* (models are built
on the meta device); values arrive at call time through ``torch.func.functional_call``.

Quantization stays out of the model math: a layer built with ``quant="fp8"`` stores FP8 weights
with per-output-channel scales, and the norm / activation in front of it emits FP8 activations
with per-token scales (the fused norm+quant of the design card). With ``quant="fp8-block"`` (a
block-FP8 checkpoint, compiler/config.py ``resolve_quant``) a linear stores FP8 weights with a scale
per 128 x 128 block and takes the activation dtype: ``kiln::fp8_block_linear`` quantizes it per
token and 128-column group itself (ops/linear/fp8_block.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.compiler.context import ForwardContext

FP8 = torch.float8_e4m3fn


class QuantAct(NamedTuple):
    """An FP8 activation and its per-token scales."""

    data: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] f32


Act = torch.Tensor | QuantAct


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def quantize_per_token(x: torch.Tensor) -> QuantAct:
    """Dynamic per-token FP8 quantization of an activation that no fused kernel produced (the
    attention output before ``o``): one kernel (ops/activation/quantize.py)."""
    return QuantAct(*torch.ops.kiln.quantize_fp8_rows(x))


class RMSNorm(nn.Module):
    """RMSNorm; with ``quant_out`` it returns a :class:`QuantAct` for an FP8 GEMM behind it."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, quant_out: bool = False):
        super().__init__()
        self.weight = _param(hidden, dtype=dtype)
        self.eps = eps
        self.quant_out = quant_out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Act:
        # x: [T, H]; residual (updated in place to x + residual): [T, H]
        if residual is None:
            if self.quant_out:
                return QuantAct(*torch.ops.kiln.rmsnorm_quant(x, self.weight, self.eps, None))
            return torch.ops.kiln.rmsnorm(x, self.weight, self.eps)
        if self.quant_out:
            return QuantAct(*torch.ops.kiln.fused_add_rmsnorm_quant(x, residual, self.weight, self.eps, None))
        return torch.ops.kiln.fused_add_rmsnorm(x, residual, self.weight, self.eps)


def norm_linear(
    norm: RMSNorm,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    max_m: int,
    gate_up: bool = False,
    normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm`` fused into the linear ``weight`` (ops/linear/norm_linear.py), its weight folded into
    ``weight`` (weights/fold.py; ``norm.weight`` is then ones), so the one-token GEMV does not load
    it (the residual-stream layout, compiler/models/base.py): ``(y [T, N], the normalized x [T, H]
    if normed)``."""
    y, _, xn = torch.ops.kiln.rmsnorm_linear(
        x, None, norm.weight, norm.eps, weight, bias, max_m, gate_up, normed, True
    )
    return y, xn


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with W ``[out, in]``; FP8 weights carry ``weight_scale [out]``, block-FP8
    weights ``weight_scale [ceil(out/128), ceil(in/128)]`` (``kiln::fp8_block_linear``).

    Non-FP8 weights: ``F.linear`` (cuBLAS). When the GEMV plan (``kiln compile --gemv-plan``, which
    the model build passes on: :func:`use_gemv_plan`) has this linear's ``role``, ``max_m`` is the
    plan's max T for it and the linear traces ``kiln::linear`` instead: at decode-sized T (<=
    ``max_m``) the GEMV kernel of ops/linear/gemv.py, otherwise cuBLAS, decided inside the op at run time
    (T is dynamic in the exported graph; the run-time ``gemv`` setting off sends it to cuBLAS).
    """

    def __init__(
        self,
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
        bias: bool = False,
        quant: str | None = None,
    ):
        super().__init__()
        self.quant = quant
        self.out_dtype = dtype
        self.weight = _param(out_features, in_features, dtype=FP8 if quant in ("fp8", "fp8-block") else dtype)
        if quant == "fp8":
            self.weight_scale = _param(out_features, dtype=torch.float32)
        elif quant == "fp8-block":
            self.weight_scale = _param(-(-out_features // 128), -(-in_features // 128), dtype=torch.float32)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.role: str | None = None  # "attn" / "mlp": the GEMV plan's role of this linear
        self.max_m = 0  # the plan's largest T on the GEMV for ``role`` (0: not in the plan)

    def unquantized(self) -> None:
        """Make this a linear in the activation dtype (a weight the checkpoint does not quantize:
        ``modules_to_not_convert``; ``match_pack_quant``). Parameters keep their device (meta)."""
        out_features, in_features = self.weight.shape
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=self.out_dtype, device=self.weight.device),
            requires_grad=False,
        )
        if hasattr(self, "weight_scale"):
            del self.weight_scale
        self.quant = None

    def forward(self, x: Act, residual: torch.Tensor | None = None) -> torch.Tensor:
        # residual [T, out]: returns residual + x W^T, the add in the GEMV's epilogue (or one addmm)
        if self.quant == "fp8-block":
            assert isinstance(x, torch.Tensor) and residual is None, "block FP8 takes bf16 activations"
            return torch.ops.kiln.fp8_block_linear(x, self.weight, self.weight_scale, self.bias)
        if self.quant != "fp8":
            assert isinstance(x, torch.Tensor)
            if self.max_m or residual is not None:
                return torch.ops.kiln.linear(x, self.weight, self.bias, self.max_m, residual)
            return nn.functional.linear(x, self.weight, self.bias)
        assert residual is None, "FP8 linears take no residual (the residual stream is not for --quant fp8)"
        q = x if isinstance(x, QuantAct) else quantize_per_token(x)
        return torch.ops.kiln.fp8_linear(
            q.data, q.scale, self.weight, self.weight_scale, self.bias, self.out_dtype
        )


class Embedding(nn.Module):
    """Vocab-parallel embedding (at tp=1 the whole table; else ``kiln::tp_embedding``)."""

    def __init__(self, vocab_per_rank: int, hidden: int, dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.weight = _param(vocab_per_rank, hidden, dtype=dtype)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            return torch.ops.kiln.tp_embedding(ids, self.weight)  # [T, H], summed over the ranks
        return nn.functional.embedding(ids, self.weight)  # [T, H]


class Attention(nn.Module):
    """Fused QKV linear -> qkv_rope_kvwrite -> paged attention (decode or extend) -> o_proj."""

    def __init__(
        self,
        layer: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        is_neox: bool,
        dtype: torch.dtype,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
        sliding_window: int | None = None,
        quant: str | None = None,
        tp_reduce: bool = False,
        in_features: int | None = None,
    ):
        super().__init__()
        # in_features: what the QKV projection reads (default ``hidden``; EAGLE-3's layer reads 2H)
        # tp_reduce: this rank's o projection is a partial sum (row-parallel): kiln::tp_all_reduce after it
        self.tp_reduce = tp_reduce
        self.layer, self.hq, self.hkv, self.d = layer, num_heads, num_kv_heads, head_dim
        self.rotary_dim, self.is_neox, self.eps = rotary_dim, is_neox, eps
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window or -1
        self.qkv = Linear(
            (num_heads + 2 * num_kv_heads) * head_dim, in_features or hidden, dtype, qkv_bias, quant
        )
        self.o = Linear(hidden, num_heads * head_dim, dtype, False, quant)
        self.qkv.role = self.o.role = "attn"
        self.q_norm = RMSNorm(head_dim, eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, dtype) if qk_norm else None

    def forward(
        self,
        x: Act,
        ctx: ForwardContext,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        # residual [T, H]: added by the o projection; norm: the layer's folded input norm, run inside
        # the qkv projection (x is then the stream; both: the residual stream, compiler/models/base.py)
        if norm is not None:
            assert isinstance(x, torch.Tensor)
            qkv, _ = norm_linear(norm, x, self.qkv.weight, self.qkv.bias, self.qkv.max_m)
        else:
            qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) D]
        k_cache, v_cache = ctx.k_cache[self.layer], ctx.v_cache[self.layer]  # [S, Hkv, D]
        # FP8 caches: each head row's float32 scale, [S, Hkv] (the ops' trailing arguments; None
        # for bf16 caches)
        scales = (None, None) if ctx.k_scale is None else (ctx.k_scale[self.layer], ctx.v_scale[self.layer])
        qn = self.q_norm.weight if self.q_norm is not None else None
        kn = self.k_norm.weight if self.k_norm is not None else None
        q = torch.ops.kiln.qkv_rope_kvwrite(
            qkv,
            ctx.positions,
            ctx.cos_sin,
            k_cache,
            v_cache,
            ctx.out_slots,
            self.hq,
            self.hkv,
            self.d,
            self.rotary_dim,
            self.is_neox,
            qn,
            kn,
            self.eps,
            *scales,
        )  # [T, Hq, D]
        o = torch.ops.kiln.paged_attention(
            q,
            k_cache,
            v_cache,
            ctx.block_table,
            ctx.req_rows,
            ctx.seq_lens,
            ctx.qo_indptr,
            self.scale,
            ctx.page_size,
            ctx.num_splits,
            self.sliding_window,
            0.0,
            *scales,
            *(() if ctx.tree_mask is None else (ctx.tree_mask,)),
        )  # [T, Hq, Dv]; decode kernel when every request brings one token (and no tree mask)
        if self.tp_reduce:
            assert residual is None, "the residual stream is not for tensor parallelism (compile: no folds)"
            return torch.ops.kiln.tp_all_reduce(self.o(o.flatten(1)))  # [T, H]
        return self.o(o.flatten(1), residual)  # [T, H]


class MLP(nn.Module):
    """Fused gate_up -> silu_and_mul (+ FP8 quant) -> down.

    With ``mlp`` in the GEMV plan, non-FP8 gate_up + SiLU-and-mul is ``kiln::linear_silu_mul`` (at
    decode-sized T one GEMV that writes ``silu(gate) * up`` directly, else cuBLAS then
    ``silu_and_mul``).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        quant: str | None = None,
        tp_reduce: bool = False,
    ):
        super().__init__()
        self.quant = quant
        self.tp_reduce = tp_reduce  # down is row-parallel: kiln::tp_all_reduce after it (Attention's)
        self.gate_up = Linear(2 * intermediate, hidden, dtype, False, quant)
        self.down = Linear(hidden, intermediate, dtype, False, quant)
        self.gate_up.role = self.down.role = "mlp"

    def forward(
        self, x: Act, act: torch.Tensor | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        # act: silu(gate) * up when a norm fused into gate_up computed it (x is then unused);
        # residual [T, H]: added by the down projection
        if act is not None:
            assert not self.tp_reduce, "the residual stream is not for tensor parallelism"
            return self.down(act, residual)  # [T, H]
        assert residual is None, "a residual goes with act (the residual stream fuses gate_up's norm)"
        if self.quant == "fp8":
            gu = self.gate_up(x)  # [T, 2I]
            out = self.down(QuantAct(*torch.ops.kiln.silu_and_mul_quant(gu, None)))
        else:
            max_m = self.gate_up.max_m if self.gate_up.quant is None else 0  # the GEMV: bf16 weights
            if max_m:
                assert isinstance(x, torch.Tensor)
                act = torch.ops.kiln.linear_silu_mul(
                    x, self.gate_up.weight, self.gate_up.bias, max_m
                )  # [T, I]
            else:
                act = torch.ops.kiln.silu_and_mul(self.gate_up(x))  # [T, I]
            out = self.down(act)  # [T, H]
        return torch.ops.kiln.tp_all_reduce(out) if self.tp_reduce else out


class LMHead(nn.Module):
    """Logits for the rows that are sampled only; float32 out."""

    def __init__(
        self, vocab: int, vocab_per_rank: int, hidden: int, dtype: torch.dtype, tied: bool, tp: int = 1
    ):
        super().__init__()
        self.vocab = vocab
        self.weight = None if tied else _param(vocab_per_rank, hidden, dtype=dtype)
        self.tp = tp

    def forward(self, h: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        w = embed_weight if self.weight is None else self.weight
        logits = nn.functional.linear(h, w)  # [B, V_rank]
        if self.tp > 1:  # vocab-parallel: every rank's columns, rank 0's first
            logits = torch.ops.kiln.tp_gather_cols(logits)  # [B, tp * V_rank]
        return logits[:, : self.vocab].float()


def match_pack_quant(model: nn.Module, pack: Mapping[str, torch.Tensor]) -> list[str]:
    """Turn every block-FP8 :class:`Linear` of ``model`` whose weight the pack holds unquantized (the
    checkpoint's ``modules_to_not_convert``, compiler/mappings.py) into a linear of the activation
    dtype; returns their names. Call before tracing."""
    changed = []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.quant == "fp8-block":
            w = pack.get(f"{name}.weight")
            if w is not None and w.dtype != FP8:
                mod.unquantized()
                changed.append(name)
    return changed


def use_gemv_plan(model: nn.Module, plan: Mapping[str, int]) -> None:
    """Give every module of ``model`` with a GEMV ``role`` (the linears, the MoE router, MLA's latent
    maps) its ``max_m`` from ``plan`` (ops/linear/gemv.py ``gemv_plan``: role -> the largest T on the
    GEMV; a role left out: 0, cuBLAS). The layers read their own ``max_m`` while tracing."""
    for mod in model.modules():
        role = getattr(mod, "role", None)  # Linear, moe_layer.Router, mla_layer.MLAAttention
        if role is not None:
            mod.max_m = int(plan.get(role, 0))  # type: ignore[assignment]
