"""ops/attention/rope.py against transformers: the cos/sin table of every scaling type, the reference
rotation in NeoX style (transformers' apply_rotary_pos_emb) and GPT-J style (DeepSeek's complex
formulation)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kiln.compiler.config import RopeScaling
from kiln.ops.attention.rope import apply_rope_ref, rope_cos_sin_cache, rope_inv_freq

MAX_POS = 131072
POSITIONS = [0, 1, 17, 4095, 8191, 8192, 32768, 65537, 100_000, MAX_POS - 1]

# name: (rotary_dim, theta, RopeScaling, transformers rope_parameters)
CASES = {
    "default": (128, 500000.0, RopeScaling(), {"rope_type": "default"}),
    "linear": (128, 10000.0, RopeScaling(type="linear", factor=4.0), {"rope_type": "linear", "factor": 4.0}),
    "llama3": (
        128,
        500000.0,
        RopeScaling(
            type="llama3", factor=8.0, original_max_position=8192, low_freq_factor=1.0, high_freq_factor=4.0
        ),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    "yarn_qwen": (  # Qwen3 long-context recipe: factor 4 over 32k
        128,
        1000000.0,
        RopeScaling(type="yarn", factor=4.0, original_max_position=32768),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "yarn_deepseek": (  # DeepSeek-V2-Lite: rope dim 64, mscale / mscale_all_dim
        64,
        10000.0,
        RopeScaling(
            type="yarn",
            factor=40.0,
            original_max_position=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    "yarn_mscale_ratio": (  # mscale != mscale_all_dim: attention factor folded into cos/sin
        64,
        10000.0,
        RopeScaling(
            type="yarn",
            factor=16.0,
            original_max_position=4096,
            beta_fast=24,
            beta_slow=2,
            mscale=1.0,
            mscale_all_dim=0.5,
        ),
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 24,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ),
    "yarn_attention_factor": (
        128,
        10000.0,
        RopeScaling(type="yarn", factor=8.0, original_max_position=8192, attention_factor=0.9),
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "attention_factor": 0.9,
        },
    ),
}


def _hf_config(rot: int, theta: float, params: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=rot * 4,
        num_attention_heads=4,
        head_dim=rot,
        max_position_embeddings=MAX_POS,
        rope_parameters={**params, "rope_theta": theta},
    )


@pytest.fixture
def hf_quiet():
    import transformers

    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # yarn warns when factor != max_pos / original
    yield
    transformers.logging.set_verbosity(old)


@pytest.mark.parametrize("name", list(CASES))
def test_cache_matches_transformers(name, hf_quiet):
    rot, theta, scaling, params = CASES[name]
    cfg = _hf_config(rot, theta, params)
    kind = params["rope_type"]
    if kind == "default":
        inv_hf, att_hf = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv_hf, att_hf = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    inv, att = rope_inv_freq(rot, MAX_POS, theta, dataclasses.asdict(scaling))
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(att_hf, rel=1e-12)
    if kind == "yarn":
        assert att != 1.0 or name == "yarn_deepseek"  # the factor really is folded in below

    cache = rope_cos_sin_cache(rot, MAX_POS, theta, dataclasses.asdict(scaling))
    assert cache.shape == (MAX_POS, rot) and cache.dtype == torch.float32
    pos = torch.tensor([POSITIONS])
    cos_hf, sin_hf = LlamaRotaryEmbedding(cfg)(torch.zeros(1, len(POSITIONS), rot), pos)  # [1, N, rot]
    half = rot // 2
    # transformers duplicates the frequencies ([f, f]); the cache keeps one half of each
    torch.testing.assert_close(cos_hf[0, :, half:], cos_hf[0, :, :half])
    torch.testing.assert_close(cache[POSITIONS, :half], cos_hf[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(cache[POSITIONS, half:], sin_hf[0, :, :half], rtol=0, atol=2e-6)


def test_cache_dtype_and_device_args():
    c = rope_cos_sin_cache(64, 100, 10000.0, None, dtype=torch.bfloat16, device="cpu")
    assert c.dtype == torch.bfloat16 and c.shape == (100, 64)
    ref = rope_cos_sin_cache(64, 100, 10000.0, None)
    torch.testing.assert_close(c.float(), ref, rtol=0, atol=4e-3)
    assert torch.all(c[0, :32] == 1) and torch.all(c[0, 32:] == 0)  # position 0: cos 1, sin 0


def test_dynamic_follows_documented_formula(hf_quiet):
    rot, theta, factor, orig, max_pos = 128, 10000.0, 4.0, 4096, 16384
    scaling = dataclasses.asdict(RopeScaling(type="dynamic", factor=factor, original_max_position=orig))
    inv, att = rope_inv_freq(rot, max_pos, theta, scaling)
    # the formula, in float64: base' = base * (factor * L / L0 - (factor - 1)) ** (rot / (rot - 2))
    base = theta * (factor * max_pos / orig - (factor - 1)) ** (rot / (rot - 2))
    expect = base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    torch.testing.assert_close(inv.double(), expect, rtol=1e-6, atol=0)
    assert att == 1.0
    cache = rope_cos_sin_cache(rot, max_pos, theta, scaling)
    pos = torch.tensor([0, 5, 4095, 9000, max_pos - 1])
    ang = pos[:, None].double() * expect[None, :]
    # float32 angles (like transformers and vLLM): error grows with position * ulp(inv_freq)
    torch.testing.assert_close(cache[pos, : rot // 2].double(), ang.cos(), rtol=0, atol=2e-3)
    torch.testing.assert_close(cache[pos, rot // 2 :].double(), ang.sin(), rtol=0, atol=2e-3)

    # transformers computes the same frequencies for a sequence of length max_pos ...
    cfg = _hf_config(rot, theta, {"rope_type": "dynamic", "factor": factor})
    cfg.max_position_embeddings = orig
    inv_hf, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, None, seq_len=max_pos)
    torch.testing.assert_close(inv, inv_hf, rtol=1e-6, atol=0)
    # ... but the unscaled base for sequences shorter than L0 (its per-length recomputation)
    inv_short, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, None, seq_len=100)
    assert not torch.allclose(inv, inv_short)
    # L0 defaults to max_position: then nothing is rescaled
    plain, _ = rope_inv_freq(rot, orig, theta, {"type": "dynamic", "factor": factor})
    torch.testing.assert_close(plain, rope_inv_freq(rot, orig, theta, None)[0])


def test_bad_scaling_is_rejected():
    with pytest.raises(ValueError, match="longrope"):
        rope_cos_sin_cache(64, 10, 1e4, {"type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_cos_sin_cache(63, 10, 1e4, None)
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_cos_sin_cache(64, 10, 1e4, {"type": "llama3", "factor": 8.0, "original_max_position": 8})


@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary of a 64-dim head
def test_neox_matches_transformers_apply_rotary(rot):
    torch.manual_seed(0)
    t, h, d = 9, 3, 64
    cache = rope_cos_sin_cache(rot, 200_000, 500000.0, None)
    positions = torch.tensor([0, 3, 7, 4096, 8191, 65536, 100_000, 150_001, 199_999])
    x = torch.randn(t, h, d)
    out = apply_rope_ref(x, positions, cache, rot, is_neox=True)
    half = rot // 2
    cos = cache[positions, :half].repeat(1, 2)[None]  # [1, T, rot], transformers' layout
    sin = cache[positions, half:].repeat(1, 2)[None]
    xh = x.transpose(0, 1)[None]  # [1, H, T, D]
    q_rot, _ = apply_rotary_pos_emb(xh[..., :rot], xh[..., :rot], cos, sin)
    expect = torch.cat([q_rot, xh[..., rot:]], -1)[0].transpose(0, 1)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[..., rot:], x[..., rot:])  # partial rotary: the tail passes through


def _deepseek_apply_rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2/V3's own formulation: x as complex pairs (2i, 2i+1) times e^{i*angle}.
    x: [T, H, rot], freqs (angles): [T, rot/2]."""
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]  # [T, 1, rot/2] complex64
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [T, H, rot/2]
    return torch.view_as_real(xc * freqs_cis).flatten(-2).to(x.dtype)


def test_gptj_matches_deepseek_complex_formulation():
    torch.manual_seed(1)
    t, h, d, rot = 6, 4, 96, 64  # DeepSeek: 64 rope dims; the rest of this head passes through
    scaling = dataclasses.asdict(RopeScaling(type="yarn", factor=40.0, original_max_position=4096))
    inv, att = rope_inv_freq(rot, 163840, 10000.0, scaling)
    cache = rope_cos_sin_cache(rot, 163840, 10000.0, scaling)
    positions = torch.tensor([0, 1, 4097, 50_000, 100_000, 163_839])
    x = torch.randn(t, h, d)
    out = apply_rope_ref(x, positions, cache, rot, is_neox=False)
    angles = torch.outer(positions.float(), inv)  # [T, rot/2] f32
    expect = _deepseek_apply_rotary_emb(x[..., :rot], angles) * att
    torch.testing.assert_close(out[..., :rot], expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[..., rot:], x[..., rot:])


def test_neox_and_gptj_differ_and_preserve_norm():
    torch.manual_seed(2)
    x = torch.randn(4, 2, 64)
    cache = rope_cos_sin_cache(64, 1000, 10000.0, None)
    pos = torch.tensor([1, 10, 100, 999])
    a = apply_rope_ref(x, pos, cache, 64, True)
    b = apply_rope_ref(x, pos, cache, 64, False)
    assert not torch.allclose(a, b)
    for y in (a, b):  # a rotation keeps each head's norm (no attention factor here)
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_bf16_reference_rounds_once():
    torch.manual_seed(3)
    x = torch.randn(5, 3, 128, dtype=torch.bfloat16)
    cache = rope_cos_sin_cache(128, 100_001, 1e6, None)
    pos = torch.tensor([0, 9, 99, 9_999, 100_000])
    out = apply_rope_ref(x, pos, cache, 128, True)
    assert out.dtype == torch.bfloat16
    expect = apply_rope_ref(x.float(), pos, cache, 128, True).to(torch.bfloat16)
    assert torch.equal(out, expect)
    assert not math.isnan(out.float().sum().item())
