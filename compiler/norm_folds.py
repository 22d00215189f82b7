"""Which RMSNorm weights a compile folds into the linears behind them (weights/fold.py applies the
folds at load time; compiler/models/base.py's residual-stream layout is what they buy).

A norm folds when every reader of its normalized row is a known linear weight: per decoder layer,
``input_norm`` into the qkv projection (MLA: into ``qkv_a``, and ``q_a_norm`` into ``q_b``) and
``post_attn_norm`` into the dense gate_up, or into the MoE router, the stacked experts' ``w13`` and
a shared expert's gate_up. Exact block types only: a subclass could read the row somewhere this
list does not know.

A compile folds them where :func:`norm_folds` allows it unless ``kiln compile --no-fold-norms``
(``CompileOptions.fold_norms``, kiln/settings.py). Measured on the H200
(bench/results/2026-11-30_h200_s9c_fold_e2e.json): batch-1 decode 943.5 vs 922.0 tok/s at
Qwen3-30B-A3B shapes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.compiler.layers import MLP, Attention, Linear
from kiln.compiler.mla_layer import MLAAttention
from kiln.compiler.models.base import DecoderLayer, DecoderOnlyLM
from kiln.compiler.moe_layer import FusedMoE, MoEDecoderLayer


def norm_folds(model: nn.Module) -> tuple[dict[str, list[str]], str]:
    """``({norm weight: [consumer weights]}, "")`` when every layer of ``model`` can fold its norms
    and run the residual-stream layout (tp 1; Llama-style attention; a dense MLP or a
    :class:`FusedMoE`; no FP8), else ``({}, why not)``."""
    if not isinstance(model, DecoderOnlyLM) or model.tp != 1:
        return {}, "only single-rank (tp 1) decoder-only models"
    names = {id(p): n for n, p in model.named_parameters()}
    folds: dict[str, list[str]] = {}
    for i, layer in enumerate(model.layers):
        attn: Any = getattr(layer, "attn", None)
        ffn: Any = getattr(layer, "mlp", None)
        if type(layer) not in (DecoderLayer, MoEDecoderLayer) or type(attn) not in (Attention, MLAAttention):
            return {}, f"layer {i}: not a Llama-style or MLA decoder layer"
        first = attn.qkv_a if type(attn) is MLAAttention else attn.qkv  # what the input norm feeds
        # every linear of the layer: the folds write into some, the residual adds go into others
        # (a block-FP8 checkpoint may leave some of them unquantized and not others)
        if any(m.quant is not None for m in layer.modules() if isinstance(m, Linear)) or (
            getattr(ffn, "w13_scale", None) is not None
        ):
            return {}, f"layer {i}: FP8 linears (--quant fp8) keep their norms"
        if type(layer) is DecoderLayer and type(ffn) is MLP:
            consumers = [ffn.gate_up.weight]
        elif type(layer) is MoEDecoderLayer and type(ffn) is FusedMoE:
            consumers = [ffn.router.weight, ffn.w13]
            if ffn.shared is not None:
                consumers.append(ffn.shared.gate_up.weight)
        else:
            return {}, f"layer {i}: its feed-forward is neither a dense MLP nor a FusedMoE"
        folds[names[id(layer.input_norm.weight)]] = [names[id(first.weight)]]
        if type(attn) is MLAAttention and attn.q_lora:
            folds[names[id(attn.q_a_norm.weight)]] = [names[id(attn.q_b.weight)]]
        folds[names[id(layer.post_attn_norm.weight)]] = [names[id(p)] for p in consumers]
    return folds, ""
