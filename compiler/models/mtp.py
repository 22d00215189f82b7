"""DeepSeek-V3's next-token-prediction (MTP) layer as a draft head (``kiln compile TARGET --mtp``;
compiler/mtp.py; docs/speculative.md section 4), run by runtime/spec_eagle.py as an EAGLE-3 head is.

The checkpoint's layer ``L = num_hidden_layers`` (``model.layers.{L}.*``) predicts the token after
next. For the token ``t_{i+1}`` at position ``i`` and ``h_i``, the target's hidden state there as
its LM head reads it (its last decoder layer output through the final norm ``model.norm``), as
SGLang's ``deepseek_nextn`` and vLLM's ``deepseek_mtp`` compute it::

    x      = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))     [T, 2H] -> [T, H]
    y      = decoder_layer(x)                                    [T, H]; MLA over its own one-layer
                                                                 KV cache, DeepSeek's MoE (L >=
                                                                 first_k_dense_replace)
    logits = shared_head.head(shared_head.norm(y))               [N, V] f32, predicting t_{i+2}

A chain of drafts feeds ``shared_head.norm(y)`` back as the next position's ``h`` (SGLang with one
MTP module; the normed state, as for the target's). The target's graphs hand out the stream before
their final norm (``aux_layers = (L,)``): the catch-up graph applies ``model.norm`` itself
(:meth:`MtpForCausalLM.fuse`, its weight packed as ``final_norm.weight``).

Kiln names (:data:`EXTRA_NAMES` maps the MTP-only ones; the layer's are any DeepSeek layer's
``layers.0.*``, compiler/mappings.py): ``embed.weight`` and ``final_norm.weight`` (the target's
embedding and final norm), ``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight [H, 2H]``,
``layers.0.*``, ``norm.weight`` (``shared_head.norm``), ``lm_head.weight [V, H]``
(``shared_head.head``).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.compiler.config import ModelConfig
from kiln.compiler.context import ForwardContext
from kiln.compiler.layers import Embedding, Linear, RMSNorm
from kiln.compiler.models.deepseek import deepseek_layer
from kiln.compiler.models.eagle3 import AuxHeadGraph

# kiln parameter -> its suffix in the checkpoint under model.layers.{L}.
EXTRA_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
    "lm_head.weight": "shared_head.head.weight",
}


class MtpForCausalLM(AuxHeadGraph):
    """The MTP layer (module docstring) of the target config ``cfg`` (its checkpoint layer
    ``cfg.num_layers``) as its graphs run it (:class:`AuxHeadGraph`: the fused input, the target's
    stream, and the fed-back one are both ``H`` columns). Activation dtype only (no FP8), one rank."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden = self.width = h
        self.dtype = dtype
        self.fused = True
        self.embed = Embedding(cfg.vocab_size, h, dtype)
        self.final_norm = RMSNorm(h, eps, dtype)  # the target's model.norm
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        self.eh_proj = Linear(h, 2 * h, dtype, False, None)
        # its KV cache layer 0; dense or MoE as checkpoint layer L is
        self.layers = nn.ModuleList([deepseek_layer(cfg, cfg.num_layers, dtype, 1, None, kv_layer=0)])
        self.norm = RMSNorm(h, eps, dtype)
        self.lm_head = Linear(cfg.vocab_size, h, dtype, False, None)

    def fuse(self, x: torch.Tensor) -> torch.Tensor:
        """The target's stream ``[T, H]`` through its final norm: the state its LM head reads."""
        return self.final_norm(x)

    def layer(
        self, input_ids: torch.Tensor, h: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [N, V] f32 at ctx.logits_indices, shared_head.norm(y) [T, H])`` from ``h``."""
        x = torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(h)], dim=-1)  # [T, 2H]
        x = self.eh_proj(x)  # [T, H]
        out, residual = self.layers[0](x, None, ctx)  # residual: x + attention, updated in place
        y = self.norm(out + residual)  # [T, H]: what the head reads, and the next draft's h
        logits = self.lm_head(y.index_select(0, ctx.logits_indices))
        return logits.float(), y
