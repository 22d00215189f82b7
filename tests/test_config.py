"""ModelConfig normalization against real published config.json values, with derived numbers
worked out by hand below."""

import json

import pytest

from kiln.compiler.cli_inspect import bundled_configs
from kiln.compiler.config import ConfigError, load_config, normalize_config
from kiln.compiler.parallel import ParallelConfig, kv_capacity_tokens, validate_parallel
from kiln.compiler.registry import UnsupportedArchitecture


def cfg(name):
    return load_config(bundled_configs()[name])


def raw(name):
    return json.loads(bundled_configs()[name].read_text())


def test_llama_3_1_8b():
    c = cfg("llama-3.1-8b")
    assert (c.attention, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "GQA",
        32,
        4096,
        32,
        8,
        128,
    )
    assert c.rope_scaling.type == "llama3" and c.rope_scaling.factor == 8.0
    assert c.rope_scaling.original_max_position == 8192 and c.rope_theta == 500000.0
    assert not c.tie_word_embeddings and c.rope_is_neox and c.moe is None and c.mla is None
    # 2 (K and V) x 8 kv heads x 128 x 2 bytes x 32 layers
    assert c.kv_bytes_per_token("bfloat16") == 2 * 8 * 128 * 2 * 32 == 131072
    # embed + lm_head 2*128256*4096; per layer q,o 4096^2 each, k,v 4096*1024 each, mlp 3*4096*14336,
    # two norms; final norm.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert c.num_params == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248
    assert c.weight_bytes("bfloat16") == 2 * c.num_params
    # tp=2: KV heads split 4 per rank
    assert c.kv_bytes_per_token("bfloat16", tp=2) == 65536


def test_llama_3_2_1b_tied():
    c = cfg("llama-3.2-1b")
    assert c.tie_word_embeddings and c.head_dim == 64 and c.rope_scaling.factor == 32.0
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert c.num_params == 128256 * 2048 + 16 * per_layer + 2048 == 1_235_814_400
    assert c.kv_bytes_per_token() == 2 * 8 * 64 * 2 * 16


def test_qwen2_5_7b_qkv_bias_and_inactive_sliding_window():
    c = cfg("qwen2.5-7b")
    assert c.qkv_bias and not c.qk_norm and c.head_dim == 128 and c.num_kv_heads == 4
    assert c.sliding_window is None  # use_sliding_window is false
    assert c.kv_bytes_per_token() == 2 * 4 * 128 * 2 * 28 == 57344
    qkv = 3584 * (28 + 8) * 128 + (28 + 8) * 128
    per_layer = qkv + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert c.num_params == 2 * 152064 * 3584 + 28 * per_layer + 3584


def test_qwen3_8b_qk_norm():
    c = cfg("qwen3-8b")
    assert c.qk_norm and not c.qkv_bias and c.rope_scaling.type == "default" and c.rope_theta == 1e6
    assert c.kv_bytes_per_token() == 2 * 8 * 128 * 2 * 36 == 147456
    assert c.eos_token_ids == (151645,)


def test_qwen3_30b_a3b_moe():
    c = cfg("qwen3-30b-a3b")
    m = c.moe
    assert m is not None and (m.num_experts, m.top_k, m.intermediate_size) == (128, 8, 768)
    assert m.norm_topk_prob and m.scoring_func == "softmax" and m.num_shared_experts == 0
    assert c.num_moe_layers == 48 and c.attention == "GQA"
    attn = 2048 * (32 + 8) * 128 + 32 * 128 * 2048 + 2 * 128
    moe = 128 * 3 * 2048 * 768 + 128 * 2048
    assert c.num_params == 2 * 151936 * 2048 + 48 * (attn + moe + 2 * 2048) + 2048
    assert (
        c.num_activated_params
        == 2 * 151936 * 2048 + 48 * (attn + 8 * 3 * 2048 * 768 + 128 * 2048 + 2 * 2048) + 2048
    )
    assert c.kv_bytes_per_token() == 2 * 4 * 128 * 2 * 48


def test_mixtral_8x7b():
    c = cfg("mixtral-8x7b")
    m = c.moe
    assert m is not None and (m.num_experts, m.top_k, m.intermediate_size) == (8, 2, 14336)
    assert m.norm_topk_prob  # Mixtral always renormalizes its top-2
    assert c.num_params == 46_702_792_704


def test_mistral_nemo_explicit_head_dim_wins():
    c = cfg("mistral-nemo-12b")
    assert 5120 // 32 == 160 and c.head_dim == 128
    assert c.kv_bytes_per_token() == 2 * 8 * 128 * 2 * 40


def test_deepseek_v2_lite_mla():
    c = cfg("deepseek-v2-lite")
    assert c.attention == "MLA"
    a = c.mla
    assert a is not None and a.q_lora_rank is None and a.kv_lora_rank == 512
    assert (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (128, 64, 128)
    assert c.rotary_dim == 64 and c.head_dim == 192 and not c.rope_is_neox
    assert c.rope_scaling.type == "yarn" and c.rope_scaling.mscale_all_dim == 0.707
    m = c.moe
    assert m is not None and (m.num_experts, m.top_k, m.num_shared_experts, m.first_dense_layers) == (
        64,
        6,
        2,
        1,
    )
    assert not m.norm_topk_prob and c.num_moe_layers == 26
    assert c.kv_bytes_per_token() == 27 * (512 + 64) * 2 == 31104


def test_deepseek_v3():
    c = cfg("deepseek-v3")
    assert c.kv_bytes_per_token("bfloat16") == 61 * 576 * 2 == 70272
    m = c.moe
    assert m is not None and m.scoring_func == "sigmoid" and m.has_correction_bias
    assert (m.num_groups, m.topk_groups, m.routed_scaling_factor) == (8, 4, 2.5)
    assert c.num_moe_layers == 58 and c.num_nextn_layers == 1 and c.mla.q_lora_rank == 1536
    # MLA's latent is not sharded by tp
    assert c.kv_bytes_per_token("bfloat16", tp=8) == 70272
    # 671B main model (the 14B next-token-prediction module is not served)
    assert 670e9 < c.num_params < 672e9


def test_rope_parameters_spelling_of_transformers_5():
    r = raw("llama-3.1-8b")
    scaling = r.pop("rope_scaling")
    r["rope_parameters"] = {**scaling, "rope_theta": r.pop("rope_theta")}
    c = normalize_config(r)
    assert c.rope_scaling.type == "llama3" and c.rope_theta == 500000.0


def test_partial_rotary_factor():
    r = raw("llama-3.1-8b") | {"partial_rotary_factor": 0.5}
    assert normalize_config(r).rotary_dim == 64


def test_mqa_kind():
    r = raw("llama-3.1-8b") | {"num_key_value_heads": 1}
    assert normalize_config(r).attention == "MQA"
    r = raw("llama-3.1-8b") | {"num_key_value_heads": 32}
    assert normalize_config(r).attention == "MHA"


def test_kv_capacity():
    c = cfg("llama-3.1-8b")
    assert kv_capacity_tokens(c, 40 * 1024**3) == 40 * 1024**3 // 131072 == 327680


# ----------------------------------------------------------------- errors name field and fix
def test_unknown_architecture_lists_supported():
    r = raw("llama-3.1-8b") | {"architectures": ["FooForCausalLM"]}
    with pytest.raises(UnsupportedArchitecture, match=r"'FooForCausalLM'.*Supported: .*LlamaForCausalLM"):
        normalize_config(r)


def test_missing_architectures():
    with pytest.raises(ConfigError, match="'architectures' is missing"):
        normalize_config({"hidden_size": 8})
    with pytest.raises(ConfigError, match=r"not a list: .* got 'LlamaForCausalLM'"):
        normalize_config({"hidden_size": 8, "architectures": "LlamaForCausalLM"})


def test_missing_field_named():
    r = raw("llama-3.1-8b")
    del r["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        normalize_config(r)


def test_kv_heads_must_divide_heads():
    r = raw("llama-3.1-8b") | {"num_key_value_heads": 5}
    with pytest.raises(ConfigError, match="'num_key_value_heads' \\(5\\) must divide"):
        normalize_config(r)


def test_bad_rope_type():
    r = raw("llama-3.1-8b")
    r["rope_scaling"]["rope_type"] = "longrope"
    with pytest.raises(ConfigError, match=r"rope_type.*longrope"):
        normalize_config(r)


def test_heads_not_divisible_by_tp():
    with pytest.raises(
        ConfigError, match=r"num_attention_heads \(32\) is not divisible by tp=3; .*\[1, 2, 4, 8, 16, 32\]"
    ):
        validate_parallel(cfg("llama-3.1-8b"), ParallelConfig(tp=3))


def test_kv_heads_ge_tp_must_divide():
    r = raw("llama-3.1-8b") | {"num_attention_heads": 48, "num_key_value_heads": 12, "head_dim": 128}
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(12\) is not divisible by tp=8"):
        validate_parallel(normalize_config(r), ParallelConfig(tp=8))


def test_kv_heads_lt_tp_replication_rule():
    r = raw("llama-3.1-8b") | {"num_attention_heads": 24, "num_key_value_heads": 3, "head_dim": 128}
    with pytest.raises(ConfigError, match=r"tp=4 is not a multiple of num_key_value_heads \(3\)"):
        validate_parallel(normalize_config(r), ParallelConfig(tp=4))
    c = normalize_config(r | {"num_key_value_heads": 2})
    validate_parallel(c, ParallelConfig(tp=4))  # 2 KV heads, each replicated twice
    assert c.kv_heads_per_rank(4) == 1


def test_moe_intermediate_not_divisible():
    c = normalize_config(raw("qwen3-30b-a3b") | {"moe_intermediate_size": 1000})
    with pytest.raises(
        ConfigError, match=r"moe_intermediate_size \(1000\) is not divisible by the expert TP size \(16"
    ):
        validate_parallel(c, ParallelConfig(tp=16))


def test_experts_not_divisible_by_ep():
    with pytest.raises(ConfigError, match=r"num_experts \(8\) is not divisible by ep=3"):
        validate_parallel(cfg("mixtral-8x7b"), ParallelConfig(tp=1, ep=3))


def test_valid_layouts_pass():
    validate_parallel(cfg("llama-3.1-8b"), ParallelConfig(tp=8))
    validate_parallel(cfg("qwen3-30b-a3b"), ParallelConfig(tp=4, ep=4))
    validate_parallel(cfg("deepseek-v3"), ParallelConfig(tp=8, ep=8))
