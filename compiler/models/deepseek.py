"""DeepSeek-V2 and DeepSeek-V3: MLA attention (compiler/mla_layer.py) and DeepSeek's MoE.

Every layer's attention is :class:`~kiln.compiler.mla_layer.MLAAttention`. The first
``first_k_dense_replace`` layers (V2-Lite 1, V3 3) keep the dense MLP (``intermediate_size``); the
others are a :class:`~kiln.compiler.moe_layer.FusedMoE` with a float32 router: the routed experts (``moe_intermediate_size`` each) plus the
shared experts (``n_shared_experts`` of them as one MLP, ``moe.shared.*``) added to the routed sum.
Routing, as transformers' ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter`` compute it (the
normalized ``topk_method`` of compiler/config.py), on float32 router logits:

* V3 ``noaux_tc``: sigmoid scores, experts chosen on scores plus the correction bias
  (``router.bias``), among the ``topk_group`` best of ``n_group`` groups (a group's score: its two
  best choices summed); weights the chosen sigmoid scores, renormalized with ``norm_topk_prob``.
* V2 ``group_limited_greedy``: softmax, groups scored by their best expert.
* V2-Lite ``greedy``: softmax top-k.

All three multiply the weights by ``routed_scaling_factor``. The correction bias is float32 in every
dtype (Hugging Face keeps ``e_score_correction_bias`` so; compiler/moe_layer.py ``Router``).

DeepSeek-V3's official block-FP8 checkpoints (``--quant fp8-block``) keep their 128 x 128 blocks in
the dense linears and, where each rank's expert slice is a multiple of 128 (V3: 2048 / etp), in the
routed experts too (``kiln::fused_moe`` with block scales); the shared experts are a block-FP8 MLP.

The next-token-prediction (MTP) layer of DeepSeek-V3 (``num_nextn_predict_layers``) is not part
of this model: its pack leaves it out (layers past ``num_hidden_layers``, compiler/mappings.py
``nextn``). ``kiln compile --mtp`` compiles it as a draft head of its own (compiler/models/mtp.py,
its decoder layer built by :func:`deepseek_layer`).

At tp 1 without FP8 the norms fold (compiler/norm_folds.py) and the batch-1 decode graph runs the
residual-stream layout: the input norm inside the ``qkv_a`` GEMV; ``q_a_norm`` inside ``q_b``; the
post-attention norm inside the shared experts' gate_up GEMV (its normalized row feeds the float32
router and the routed experts), the routed experts adding the stream and the shared down GEMV
adding their sum.
"""

from __future__ import annotations

import torch

from kiln.compiler.config import ConfigError, ModelConfig
from kiln.compiler.mla_layer import MLAAttention
from kiln.compiler.models.base import DecoderLayer, dense_mlp
from kiln.compiler.models.moe import MoEForCausalLM
from kiln.compiler.moe_layer import FusedMoE, MoEDecoderLayer


def deepseek_layer(
    cfg: ModelConfig,
    i: int,
    dtype: torch.dtype,
    tp: int,
    quant: str | None,
    ep: int = 1,
    kv_layer: int | None = None,
) -> DecoderLayer:
    """Checkpoint layer ``i`` of a DeepSeek-V2/V3 config (module docstring): MLA attention over KV
    cache layer ``kv_layer`` (default ``i``; an MTP layer's own one-layer cache: 0), the dense MLP
    in the first ``first_k_dense_replace`` layers, else DeepSeek's MoE."""
    if cfg.qkv_bias:
        raise ConfigError(
            f"config.json field 'attention_bias' is true; kiln's MLA ({cfg.architecture}) has no "
            "attention biases (DeepSeek's checkpoints have none). Set it to false."
        )
    attn = MLAAttention(cfg, i if kv_layer is None else kv_layer, dtype, tp, quant)
    if not cfg.is_moe_layer(i):  # the first first_k_dense_replace layers
        return DecoderLayer(cfg, attn, dense_mlp(cfg, dtype, tp, quant), dtype, quant)
    return MoEDecoderLayer(cfg, attn, FusedMoE(cfg, dtype, tp, quant, ep=ep, float_router=True), dtype, quant)


class DeepseekForCausalLM(MoEForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (module docstring); ``MoEForCausalLM``'s
    forward (the local-expert map with ``--ep``)."""

    def make_layer(self, i: int, dtype: torch.dtype, tp: int, quant: str | None) -> DecoderLayer:
        return deepseek_layer(self.cfg, i, dtype, tp, quant, self.ep)
