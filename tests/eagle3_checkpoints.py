"""EAGLE-3 head checkpoints in the published layout (``LlamaForCausalLMEagle3``: config.json with one
layer, ``draft_vocab_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; a safetensors
file named as SGLang's and SpecForge's heads are, ``d2t`` and ``t2d`` included, no embedding: the
target's), random weights, for a target checkpoint directory: what the compiler and engine tests
of ``kiln compile --eagle3`` read."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_eagle3_head(
    path: Path,
    target: Path,
    aux_ids: list[int] | None = None,
    draft_vocab: int | None = None,
    seed: int = 0,
    embed: bool = False,
) -> dict[str, torch.Tensor]:
    """A head for the checkpoint in ``target`` (its hidden size, heads and vocabulary) into
    ``path``; ``draft_vocab`` (default: the whole vocabulary) ids drafted, a random increasing
    subset of the target's when smaller (``d2t[i] = target_id - i``); ``aux_ids``: the config's
    layer ids (None: left out); ``embed``: the head carries its own ``embed_tokens.weight``.
    Returns the tensors written."""
    raw = json.loads((target / "config.json").read_text())
    h, v = raw["hidden_size"], raw["vocab_size"]
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    d = raw.get("head_dim") or h // heads
    inter = raw["intermediate_size"]
    vd = draft_vocab or v
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": d,
        "num_hidden_layers": 1,
        "vocab_size": v,
        "draft_vocab_size": vd,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-5),
        "rope_theta": raw.get("rope_theta", 10000.0),
        "max_position_embeddings": raw["max_position_embeddings"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return scale * torch.randn(shape, generator=g)

    def norm() -> torch.Tensor:
        return 1 + rand(h, scale=0.1)

    w = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": norm(),
        "lm_head.weight": rand(vd, h, scale=0.5),
    }
    ids = torch.randperm(v, generator=g)[:vd].sort().values if vd < v else torch.arange(v)
    w["d2t"] = ids - torch.arange(vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    if embed:
        w["embed_tokens.weight"] = rand(v, h, scale=1.0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(w, str(path / "model.safetensors"))
    return w
