"""Tiny random Hugging Face MoE checkpoints (Qwen3-MoE, Mixtral), shared by the MoE tests."""

from __future__ import annotations

import torch
import transformers
from tiny_models import TINY, randomize

MOE_CONFIGS = {
    # 3 layers, the middle one dense (mlp_only_layers); 16 experts, top-4, no renormalization
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **(TINY | {"num_hidden_layers": 3}),
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # 8 experts, top-2, always renormalized; intermediate_size is the expert size
    "mixtral": lambda: transformers.MixtralConfig(
        **(TINY | {"intermediate_size": 96}), num_local_experts=8, num_experts_per_tok=2, sliding_window=None
    ),
}


def make_moe_checkpoint(path, name: str, seed: int = 0, eos: int | None = 2):
    cfg = MOE_CONFIGS[name]()
    cfg.eos_token_id = eos
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    )
    randomize(model, seed)
    model.save_pretrained(path, max_shard_size="200KB")
    return model.eval()
