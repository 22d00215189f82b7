"""The decoder-only skeleton every model definition shares: embed -> layers -> norm -> LM head.

A model definition only says how one decoder layer is built (``make_layer``); this class owns the
residual stream (SGLang-style fused add+RMSNorm between blocks) and computes logits only for the
rows that are sampled.

With ``fold_norms`` (set by the compiler for the batch-1 decode graph, compiler/norm_folds.py)
the layers run the residual-stream layout instead: one tensor ``h`` carries the stream; the o and
down (or MoE w2) projections add their output to it in their epilogue; each RMSNorm runs inside
the linear behind it with its weight folded into that linear's weights at load time
(weights/fold.py). At one token a layer is then qkv GEMV (norm inside) -> RoPE -> attention ->
o GEMV (+h) -> router GEMV (norm inside, writes the normalized row) -> top-k -> experts (+h),
with no norm kernel. Where a linear is not on the GEMV (its role missing from the plan, the
run-time ``gemv`` setting off, the CPU) the norm kernel (unit weight) runs before it and cuBLAS
``addmm`` adds the residual.

The GEMV plan (``kiln compile --gemv-plan``, ops/linear/gemv.py ``gemv_plan``) is a constructor argument
(default: ops/linear/gemv.py ``DEFAULT_PLAN``); each linear and router keeps its role's ``max_m``
(compiler/layers.py ``use_gemv_plan``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kiln.compiler.config import ModelConfig
from kiln.compiler.context import ForwardContext
from kiln.compiler.layers import (
    MLP,
    Act,
    Attention,
    Embedding,
    LMHead,
    RMSNorm,
    norm_linear,
    use_gemv_plan,
)
from kiln.ops.linear.gemv import gemv_plan as parse_gemv_plan


def vocab_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Vocab rows per rank: the vocab padded up to a multiple of tp (padding rows are zero)."""
    return -(-cfg.vocab_size // tp)


def llama_attention(
    cfg: ModelConfig, layer: int, dtype: torch.dtype, tp: int, quant: str | None
) -> Attention:
    """Llama-style attention for ``layer`` as the config describes it (QKV bias, QK-norm, head_dim,
    partial rotary, sliding window), per tensor-parallel rank."""
    return Attention(
        layer,
        cfg.hidden_size,
        cfg.num_heads // tp,
        cfg.kv_heads_per_rank(tp),
        cfg.head_dim,
        cfg.rotary_dim,
        cfg.rope_is_neox,
        dtype,
        qkv_bias=cfg.qkv_bias,
        qk_norm=cfg.qk_norm,
        eps=cfg.rms_norm_eps,
        sliding_window=cfg.sliding_window,
        quant=quant,
        tp_reduce=tp > 1,
    )


def dense_mlp(cfg: ModelConfig, dtype: torch.dtype, tp: int, quant: str | None) -> MLP:
    return MLP(cfg.hidden_size, -(-cfg.intermediate_size // tp), dtype, quant, tp_reduce=tp > 1)


class DecoderLayer(nn.Module):
    """input_norm -> attention -> post_attn_norm -> mlp, residual carried by the fused norms."""

    def __init__(
        self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module, dtype: torch.dtype, quant: str | None
    ):
        super().__init__()
        fp8 = quant == "fp8"
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, quant_out=fp8)
        self.attn = attn
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, quant_out=fp8)
        self.mlp = mlp

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # h, residual: [T, H]
        h, residual = self.attention(h, residual, ctx)
        return self.feed_forward(h, residual)

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """post_attn_norm (adding ``residual``) -> mlp: ``(mlp output, residual)``."""
        return self.mlp(self.post_attn_norm(h, residual)), residual

    def attention(
        self, h: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_norm (adding ``residual``) -> attention: ``(attention output, residual)``."""
        if residual is None:
            residual = h
            x: Act = self.input_norm(h)
        else:
            x = self.input_norm(h, residual)
        return self.attn(x, ctx), residual

    def stream(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The residual-stream layout (module docstring): ``h [T, H]`` in, ``h`` after the layer out."""
        h = self.attn(h, ctx, residual=h, norm=self.input_norm)  # [T, H]: h + o(attention)
        return self.stream_feed_forward(h)

    def stream_feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h + mlp(post_attn_norm(h))``, the norm inside gate_up, the add inside down."""
        assert isinstance(self.mlp, MLP)
        gu = self.mlp.gate_up
        act, _ = norm_linear(self.post_attn_norm, h, gu.weight, gu.bias, gu.max_m, gate_up=True)
        return self.mlp(h, act, residual=h)


class DecoderOnlyLM(nn.Module):
    """A decoder-only LM: embedding, ``cfg.num_layers`` layers from :meth:`make_layer`, final norm,
    LM head. An architecture is a subclass that overrides :meth:`make_layer` (models/llama.py,
    models/moe.py); the constructor's arguments are the same for all of them (``ep``, the
    expert-parallel size, matters to MoE models only)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: int = 1,
        quant: str | None = None,
        gemv_plan: Mapping[str, int] | None = None,
        ep: int = 1,
    ):
        super().__init__()
        self.cfg = cfg
        self.ep = ep  # expert-parallel size (MoE models, compiler/models/moe.py); read by make_layer
        v_rank = vocab_per_rank(cfg, tp)
        self.embed = Embedding(v_rank, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(self.make_layer(i, dtype, tp, quant) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = LMHead(cfg.vocab_size, v_rank, cfg.hidden_size, dtype, cfg.tie_word_embeddings, tp)
        self.tp = tp
        self.fold_norms = False  # the residual-stream layout (module docstring); the compiler sets it
        # layers whose input residual stream the graphs hand out in ctx.aux_hidden (L: the stream
        # before the final norm); the compiler sets them (manifest.aux_layers)
        self.aux_layers: tuple[int, ...] = ()
        # role -> the largest T on the GEMV (None: the default plan)
        self.gemv_plan = dict(parse_gemv_plan() if gemv_plan is None else gemv_plan)
        use_gemv_plan(self, self.gemv_plan)

    def _save_stream(self, aux: torch.Tensor, layer: int, stream: torch.Tensor) -> None:
        """The residual stream at ``layer``'s input into its block of ``aux`` (kiln::save_hidden)."""
        torch.ops.kiln.save_hidden(aux, stream, self.aux_layers.index(layer) * stream.shape[1])

    def make_layer(self, i: int, dtype: torch.dtype, tp: int, quant: str | None) -> DecoderLayer:
        """Layer ``i`` (``self.cfg`` is set): Llama-style attention and the dense MLP."""
        cfg = self.cfg
        attn = llama_attention(cfg, i, dtype, tp, quant)
        return DecoderLayer(cfg, attn, dense_mlp(cfg, dtype, tp, quant), dtype, quant)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] int64 -> logits [B, V] f32 at the rows ``ctx.logits_indices``."""
        h = self.embed(input_ids)  # [T, H]
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        aux = ctx.aux_hidden if self.aux_layers else None
        if self.fold_norms:
            for i, layer in enumerate(layers):
                if aux is not None and i in self.aux_layers:
                    self._save_stream(aux, i, h)
                h = layer.stream(h, ctx)
            if aux is not None and len(layers) in self.aux_layers:
                self._save_stream(aux, len(layers), h)
            h = self.norm(h)  # [T, H]
        else:
            residual: torch.Tensor | None = None
            for i, layer in enumerate(layers):
                if aux is not None and i in self.aux_layers:
                    self._save_stream(aux, i, h if residual is None else h + residual)
                h, residual = layer(h, residual, ctx)
            if aux is not None and len(layers) in self.aux_layers:
                self._save_stream(aux, len(layers), h if residual is None else h + residual)
            h = self.norm(h, residual)  # [T, H]
        h = h.index_select(0, ctx.logits_indices)  # [B, H]
        return self.lm_head(h, self.embed.weight)
