"""The sparse MoE block: router + top-k routing -> fused experts (grouped GEMMs) [+ shared experts].

Parameter names (docs/internals.md, under ``layers.{i}.moe.``): ``router.weight [E, H]``
(``router.bias [E]``: DeepSeek-V3's correction bias), ``w13 [E, 2I, H]`` gate rows then up rows,
``w2 [E, H, I]``, with FP8 ``w13_scale [E, 2I]`` / ``w2_scale [E, H]`` (``--quant fp8``: per output
channel) or ``w13_scale [E, ceil(2I/128), ceil(H/128)]`` / ``w2_scale [E, ceil(H/128), ceil(I/128)]``
(``--quant fp8-block``: per 128 x 128 block, a block-FP8 checkpoint's ``weight_scale_inv``), and
``shared.gate_up.weight`` / ``shared.down.weight`` when the config has shared experts.

Block-FP8 experts (:func:`block_fp8_experts`) need each rank's expert slice ``I / etp`` to be a
multiple of 128, so that gate and up each start a 128-row block of ``w13`` (the checkpoint's blocks
are then copied as they are). Otherwise the routed experts fall back to the activation dtype (the
block-FP8 checkpoint dequantized, as before this path existed), with a note on stderr; the dense
linears and the shared experts stay block FP8.

Tensor and expert parallelism (``kiln compile --tp N --ep M``; the packs' placement,
compiler/mappings.py): with ``etp = N / M`` ranks per expert group, a rank holds ``E / M`` experts
(``w13 [E/M, 2I/etp, H]``, ``w2 [E/M, H, I/etp]``: column-parallel gate/up, row-parallel down), the
router whole, and the shared experts split over all ``N`` ranks like a dense MLP. Every rank routes
every token alike; with ``M > 1`` ``fused_moe`` gets the rank's local-expert map (``expert_map``,
built once per forward: ops/moe/expert_map.py), so tokens routed to other ranks' experts add
nothing here. Each rank's output is then a partial sum of the block's (routed experts and shared
experts together), and one ``kiln::tp_all_reduce`` after the block sums the ranks'.

The router needs the un-quantized activation, so with ``--quant fp8`` :class:`MoEDecoderLayer`'s
post-attention norm emits the activation dtype and ``fused_moe`` quantizes per token itself (per
token and 128-column group with block scales).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.compiler.config import ModelConfig
from kiln.compiler.context import ForwardContext
from kiln.compiler.layers import FP8, MLP, norm_linear
from kiln.compiler.models.base import DecoderLayer
from kiln.ops.linear.fp8_block import BLOCK as FP8_BLOCK
from kiln.ops.linear.fp8_block import block_grid


def block_fp8_experts(cfg: ModelConfig, expert_tp: int = 1) -> str | None:
    """Why ``cfg``'s routed experts cannot be packed and run block FP8 with ``expert_tp`` ranks
    splitting each expert (``tp / ep``), or None when they can: each rank's slice of the
    intermediate dim must be a multiple of 128, so that gate and up each start a 128-row block of
    ``w13 [E, 2I, H]``. compiler/mappings.py asks this too, so the pack and the model agree."""
    m = cfg.moe
    if m is None:
        return f"{cfg.architecture} has no routed experts"
    per = -(-m.intermediate_size // expert_tp)
    if per % FP8_BLOCK:
        split = f" split over {expert_tp} ranks (tp / ep)" if expert_tp > 1 else ""
        return (
            f"the experts' intermediate size {m.intermediate_size}{split} = {per} is not a multiple of "
            f"{FP8_BLOCK} (gate and up must each start a {FP8_BLOCK}-row block)"
        )
    return None


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


_NOTED: set[str] = set()  # fall-back notes printed by this process (one per reason)


class Router(nn.Module):
    """Replicated router linear ``[E, H]`` (activation dtype), optional correction bias ``[E]``
    (DeepSeek-V3's ``e_score_correction_bias``: float32 whatever the activation dtype, as Hugging Face
    keeps it; added to float32 sigmoid scores, where a bf16 copy would move near ties)."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype, bias: bool):
        super().__init__()
        self.weight = _param(num_experts, hidden, dtype=dtype)
        self.bias = _param(num_experts, dtype=torch.float32) if bias else None
        self.role = "router"  # the GEMV plan's role (compiler/layers.py use_gemv_plan)
        self.max_m = 0  # the plan's largest T on the router GEMV (0: cuBLAS)


class FusedMoE(nn.Module):
    """``x [T, H]`` (activation dtype) -> ``[T, H]``: routed experts plus shared experts, if any.

    ``round_weights``: round the routing weights to the activation dtype before the experts use
    them (Hugging Face's Qwen3-MoE does; Mixtral keeps them float32). ``tuning``: a recorded
    block-size table for ``kiln.fused_moe`` ("" = the op's default table). ``tp``, ``ep``: the
    tensor- and expert-parallel sizes (module docstring); with ``tp > 1`` the block ends in one
    all-reduce. ``float_router``: the router linear in float32, then ``kiln::moe_topk`` (DeepSeek's
    routers: transformers' ``F.linear(x.float(), weight.float())``), instead of the router GEMV in
    the activation dtype; the config's ``group_score`` ``max`` (DeepSeek-V2's groups) needs it (the
    router GEMV's ``moe_route`` scores groups by their two best experts only).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: int = 1,
        quant: str | None = None,
        round_weights: bool = False,
        tuning: str = "",
        ep: int = 1,
        float_router: bool = False,
    ):
        super().__init__()
        m = cfg.moe
        if m is None:
            raise ValueError(f"{cfg.architecture}: FusedMoE needs a config with MoE fields")
        if ep < 1 or tp % ep or m.num_experts % ep:
            raise ValueError(f"FusedMoE: ep={ep} must divide tp={tp} and num_experts={m.num_experts}")
        h, e = cfg.hidden_size, m.num_experts // ep  # e: the experts this rank holds
        self.expert_tp = tp // ep  # ranks splitting each expert's intermediate dim
        self.tp_reduce = tp > 1  # the rank's output is a partial sum: one all-reduce after the block
        inter = -(-m.intermediate_size // self.expert_tp)
        self.top_k, self.renormalize, self.scoring = m.top_k, m.norm_topk_prob, m.scoring_func
        self.num_groups, self.topk_groups = m.num_groups, m.topk_groups
        self.scale = m.routed_scaling_factor
        self.group_score = m.group_score
        self.float_router = float_router
        if m.group_score != "top2_sum" and not float_router:
            raise ValueError(
                f"{cfg.architecture}: group_score={m.group_score!r} needs FusedMoE(float_router=True)"
            )
        self.tuning = tuning
        low = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "")  # f32: no-op
        self.round_to = low if round_weights else ""  # moe_topk's argument
        self.router = Router(m.num_experts, h, dtype, bias=m.has_correction_bias)  # replicated
        self.expert_quant = quant if quant == "fp8" else None  # the routed experts': fp8, fp8-block, None
        if quant == "fp8-block":
            why = block_fp8_experts(cfg, self.expert_tp)
            if why is None:
                self.expert_quant = quant
            elif why not in _NOTED:
                _NOTED.add(why)
                print(f"[kiln compile] routed experts up-cast to {dtype}: {why}", file=sys.stderr, flush=True)
        wdtype = FP8 if self.expert_quant else dtype
        self.w13 = _param(e, 2 * inter, h, dtype=wdtype)
        self.w2 = _param(e, h, inter, dtype=wdtype)
        self.w13_scale = self.w2_scale = None
        if self.expert_quant == "fp8":  # per output channel
            self.w13_scale = _param(e, 2 * inter, dtype=torch.float32)
            self.w2_scale = _param(e, h, dtype=torch.float32)
        elif self.expert_quant == "fp8-block":  # per 128 x 128 block
            self.w13_scale = _param(e, *block_grid(2 * inter, h), dtype=torch.float32)
            self.w2_scale = _param(e, *block_grid(h, inter), dtype=torch.float32)
        shared = m.num_shared_experts * m.shared_intermediate_size
        # split over all tp ranks (compiler/mappings.py), reduced with the routed experts below
        self.shared = MLP(h, -(-shared // tp), dtype, quant) if shared else None

    def forward(
        self,
        x: torch.Tensor,
        logits: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        expert_map: torch.Tensor | None = None,
        shared_act: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x: [T, H]; logits: [T, E] router logits when a norm fused into the router computed them;
        # residual [T, H]: returns residual + the block's output (the routed experts' last kernel
        # adds it when there are no shared experts); expert_map [E] int32: the rank's local-expert
        # map (expert parallelism, ctx.expert_map), None when the rank holds every expert;
        # shared_act [T, I_s]: the shared experts' silu(gate) * up when a norm fused into their
        # gate_up computed it (the routed experts then add residual, the shared down adds their sum)
        bias = self.router.bias  # [E] f32 or None
        routing = (
            self.top_k,
            self.renormalize,
            self.scoring,
            self.num_groups,
            self.topk_groups,
            self.scale,
            self.round_to,  # HF's cast of the weights to the activation dtype, fused
        )
        fused_res = residual if self.shared is None or shared_act is not None else None  # fused_moe adds it
        if self.float_router:
            assert logits is None, "a float32 router computes its logits itself"
            logits = torch.ops.kiln.router_linear(x, self.router.weight, self.router.max_m)  # [T, E] f32
        if logits is not None:
            w, ids = torch.ops.kiln.moe_topk(logits, bias, *routing, self.group_score)
        else:  # T up to the plan's router max: the router GEMV, then the top-k kernel
            w, ids = torch.ops.kiln.moe_route(x, self.router.weight, bias, *routing, self.router.max_m)
        # w, ids: [T, k] f32, [T, k] int32
        y = torch.ops.kiln.fused_moe(
            x, self.w13, self.w2, w, ids, expert_map, self.w13_scale, self.w2_scale, self.tuning, fused_res
        )  # [T, H]
        if shared_act is not None:  # [T, H]: residual + routed + shared, the last add in the GEMV
            assert self.shared is not None and not self.tp_reduce
            return self.shared(x, shared_act, residual=y)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.tp_reduce:  # routed and shared experts' partial sums, one all-reduce
            assert residual is None, "the residual stream is not for tensor parallelism (compile: no folds)"
            return torch.ops.kiln.tp_all_reduce(y)  # [T, H]
        return y if residual is None or fused_res is not None else residual + y


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a :class:`FusedMoE` registered as ``moe`` (the pack's names)
    and fed the activation dtype even with FP8 (the router must see un-quantized activations)."""

    def __init__(
        self, cfg: ModelConfig, attn: nn.Module, moe: FusedMoE, dtype: torch.dtype, quant: str | None
    ):
        super().__init__(cfg, attn, moe, dtype, quant)
        self._modules["moe"] = self._modules.pop("mlp")  # parameter names layers.{i}.moe.*
        self.post_attn_norm.quant_out = False

    @property
    def mlp(self) -> nn.Module:  # DecoderLayer.feed_forward reads self.mlp
        return self._modules["moe"]

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer's, the MoE block given the rank's local-expert map (``ctx.expert_map``)."""
        h, residual = self.attention(h, residual, ctx)
        return self.mlp(self.post_attn_norm(h, residual), expert_map=ctx.expert_map), residual

    def stream_feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h + moe(post_attn_norm(h))`` (the residual-stream layout, compiler/models/base.py): the
        norm inside the router GEMV, which writes the normalized row for the experts (sigmoid
        routing or a float32 router: the norm kernel, then the router), the add in the experts'
        last kernel. DeepSeek's float32 router with shared experts: the norm inside the shared
        experts' gate_up GEMV instead (which writes the normalized row for the router and the routed
        experts), the routed experts adding ``h``, the shared down GEMV adding their sum."""
        moe = self.mlp
        assert isinstance(moe, FusedMoE)
        if moe.float_router and moe.shared is not None:  # DeepSeek: the norm inside the shared gate_up
            gu = moe.shared.gate_up
            act, x = norm_linear(
                self.post_attn_norm, h, gu.weight, gu.bias, gu.max_m, gate_up=True, normed=True
            )
            return moe(x, residual=h, shared_act=act)
        if moe.scoring == "sigmoid" or moe.float_router:
            return moe(self.post_attn_norm(h), residual=h)
        m = moe.router.max_m
        logits, x = norm_linear(self.post_attn_norm, h, moe.router.weight, None, m, normed=True)
        return moe(x, logits, residual=h)
