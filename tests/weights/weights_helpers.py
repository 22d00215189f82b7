"""Tiny model configs for the weights tests and helpers that pack them and read them back."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from kiln.compiler.config import load_config
from kiln.compiler.mappings import all_rank_specs, skip_patterns
from kiln.compiler.parallel import ParallelConfig
from kiln.weights import expected_tensors, load_pack, pack_checkpoint

_ATTN = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=64, vocab_size=250)
CONFIGS: dict[str, dict] = {
    # kv_heads=2 so that tp=4 replicates KV heads; intermediate 90 and vocab 250 split unevenly over 4.
    "llama": dict(
        _ATTN,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        intermediate_size=90,
        num_hidden_layers=2,
        num_key_value_heads=2,
    ),
    "llama_tied": dict(
        _ATTN,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        intermediate_size=64,
        num_hidden_layers=1,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        _ATTN,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        intermediate_size=64,
        num_hidden_layers=1,
        num_key_value_heads=2,
    ),
    "qwen3": dict(
        _ATTN,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        intermediate_size=64,
        num_hidden_layers=1,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3_moe": dict(
        _ATTN,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        norm_topk_prob=True,
    ),
    "mixtral": dict(
        _ATTN,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_key_value_heads=2,
    ),
    "deepseek_v2": dict(
        _ATTN,
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        intermediate_size=96,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_hidden_layers=2,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
    ),
    "deepseek_v3": dict(
        _ATTN,
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        intermediate_size=96,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_hidden_layers=2,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        topk_method="noaux_tc",
        num_nextn_predict_layers=1,
    ),
}


def wsum64_definition(data: bytes) -> int:
    """wsum64 as weights/checksum.py defines it, in plain Python integers (slow; small inputs)."""
    n = len(data)
    data = bytes(data) + bytes(-n % 8)
    total = 0
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i : 8 * i + 8], "little")
        total += (w ^ (w >> 32)) * (2 * i + 1)
    return (total + n * 0x9E3779B97F4A7C15) % 2**64


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint, by name (tiny checkpoints only)."""
    out: dict[str, torch.Tensor] = {}
    for p in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(p))
    return out


def pack(model_dir: Path, out: Path, tp: int = 1, ep: int = 1, dtype: str = "float32", quant=None, **kw):
    """Pack with the architecture's declared specs; returns (index, specs_per_rank)."""
    cfg = load_config(model_dir)
    spec_kw = {k: kw.pop(k) for k in ("fuse_shared_experts", "nextn") if k in kw}
    specs = all_rank_specs(cfg, ParallelConfig(tp=tp, ep=ep), quant, **spec_kw)
    index = pack_checkpoint(
        model_dir,
        out,
        specs,
        tp,
        ep,
        dtype,
        quant,
        progress=False,
        skip=skip_patterns(cfg, spec_kw.get("nextn", False)),
        **kw,
    )
    return index, specs


def load_ranks(out: Path, specs, dtype: str = "float32") -> list[dict[str, torch.Tensor]]:
    """Every rank of a pack, each checked against its specs' names, shapes and dtypes."""
    return [load_pack(out, r, "cpu", expected=expected_tensors(s, dtype)) for r, s in enumerate(specs)]


def index_json(model_dir: Path) -> dict:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())


def cat_padded(parts, n, dim=0):
    """Concatenate rank shards and check everything past the real ``n`` rows/cols is zero."""
    full = torch.cat(parts, dim)
    assert torch.count_nonzero(full.narrow(dim, n, full.shape[dim] - n)) == 0, "padding must be zero"
    return full.narrow(dim, 0, n)


def check_dense(ranks, hf, cfg, tp):
    d, hq, hkv, inter = (
        cfg.head_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
    )
    hl, kvl = hq // tp, cfg.kv_heads_per_rank(tp)
    assert torch.equal(
        cat_padded([r["embed.weight"] for r in ranks], cfg.vocab_size), hf["model.embed_tokens.weight"]
    )
    if not cfg.tie_word_embeddings:
        assert torch.equal(
            cat_padded([r["lm_head.weight"] for r in ranks], cfg.vocab_size), hf["lm_head.weight"]
        )
    for r in ranks:
        assert torch.equal(r["norm.weight"], hf["model.norm.weight"])
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q_full, k_full, v_full = (hf[f"{p}self_attn.{x}_proj.{suffix}"] for x in "qkv")
            qs, ks, vs = zip(*(r[f"{a}attn.qkv.{suffix}"].split([hl * d, kvl * d, kvl * d]) for r in ranks))
            if hkv >= tp:
                fused = torch.cat([torch.cat(qs), torch.cat(ks), torch.cat(vs)])
            else:  # replicated: rank r holds KV head r // (tp / kv_heads)
                for rank, (k, v) in enumerate(zip(ks, vs)):
                    head = rank // (tp // hkv)
                    assert torch.equal(k, k_full[head * d : (head + 1) * d])
                    assert torch.equal(v, v_full[head * d : (head + 1) * d])
                fused = torch.cat([torch.cat(qs), torch.cat(ks[:: tp // hkv]), torch.cat(vs[:: tp // hkv])])
            assert torch.equal(fused, torch.cat([q_full, k_full, v_full]))
        assert torch.equal(
            torch.cat([r[f"{a}attn.o.weight"] for r in ranks], 1), hf[f"{p}self_attn.o_proj.weight"]
        )
        gates, ups = zip(*(r[f"{a}mlp.gate_up.weight"].chunk(2) for r in ranks))
        fused = torch.cat([cat_padded(gates, inter), cat_padded(ups, inter)])
        assert torch.equal(fused, torch.cat([hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]]))
        down = cat_padded([r[f"{a}mlp.down.weight"] for r in ranks], inter, dim=1)
        assert torch.equal(down, hf[f"{p}mlp.down_proj.weight"])
        for r in ranks:
            assert torch.equal(r[f"{a}input_norm.weight"], hf[f"{p}input_layernorm.weight"])
            assert torch.equal(r[f"{a}post_attn_norm.weight"], hf[f"{p}post_attention_layernorm.weight"])
            if cfg.qk_norm:
                assert torch.equal(r[f"{a}attn.q_norm.weight"], hf[f"{p}self_attn.q_norm.weight"])
                assert torch.equal(r[f"{a}attn.k_norm.weight"], hf[f"{p}self_attn.k_norm.weight"])
