"""Tiny random DeepSeek-V3 checkpoints with their MTP layer (compiler/synth.py writes it), shared by
the MTP tests (tests/compiler/test_mtp.py, tests/runtime/test_mtp_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from kiln.compiler.synth import make_checkpoint

H, V, L = 64, 300, 2  # hidden, vocab, target layers (the MTP layer is checkpoint layer L)
# q LoRA, one dense layer then MoE (4 routed experts, grouped top-k), one MTP layer
V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=H, intermediate_size=96,
    moe_intermediate_size=32, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=V,
    max_position_embeddings=512, rms_norm_eps=1e-6, first_k_dense_replace=1, n_routed_experts=4,
    num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, num_nextn_predict_layers=1, tie_word_embeddings=False,
)  # fmt: skip


def sharpen(ckpt: Path, scale: float = 5.0) -> None:
    """The MTP layer's attention and MLP matrices scaled up in the checkpoint: at its random 0.02
    scale the attention is near uniform, and a wrong position or K/V row would hide below 1e-4."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    for f in {f for n, f in index.items() if n.startswith(f"model.layers.{L}.")}:
        w = load_file(ckpt / f)
        for n, t in w.items():
            inside = n.startswith((f"model.layers.{L}.self_attn.", f"model.layers.{L}.mlp."))
            if inside and t.dim() == 2 and not n.endswith("mlp.gate.weight"):
                w[n] = t * scale
        save_file(w, str(ckpt / f))


def make_mtp_checkpoint(path: Path, seed: int) -> None:
    """A float32 :data:`V3` checkpoint (hf engine, no tokenizer) in ``path``, its MTP layer sharpened."""
    make_checkpoint(path, dict(V3), "float32", seed=seed, with_tokenizer=False, engine="hf")
    sharpen(path)
