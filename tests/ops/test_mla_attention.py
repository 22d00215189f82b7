"""MLA (DeepSeek-V2/V3) attention over a paged latent cache, absorbed form: ops/attention/mla.py.

Oracles, strongest first:

* transformers' own ``DeepseekV2Attention`` / ``DeepseekV3Attention`` forward on tiny random layers
  (eager, float32, no download): the kiln pipeline (projections in plain torch, kiln's RoPE table,
  ``mla_kv_write`` -> ``mla_attention`` -> ``apply_uv`` -> o_proj) must give HF's output rows for the
  new tokens of requests with cached prefixes, in extend and in decode steps; V2 (q_lora set and
  unset, YaRN with ``mscale_all_dim``) and V3 (interleaved and NeoX rope);
* the expanded form computed here in float64 (per head ``k = [k_nope from kv_b_proj | k_pe]``, ``v``
  from kv_b_proj, causal softmax), independent of the absorbed ops;
* the reference, for the Triton kernels (run in the interpreter on CPU, compiled on a GPU at
  DeepSeek-V2-Lite / V3 shapes), outputs and unwritten cache rows poisoned with NaN; on a GPU also
  through CUDA-graph replays.

Tolerance: relative error ||out - ref|| / ||ref|| below 1e-5 in float32 (observed 1e-7..4e-7:
summation orders differ), 1e-2 in bfloat16 (observed ~5e-3: the kernel rounds the softmax weights
to bf16 before P @ V).
"""

from __future__ import annotations

import io
import math

import pytest
import test_decode_attention as decode_tests
import torch
import transformers
from test_decode_attention import rel_err
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from kiln.ops.attention import mla
from kiln.ops.attention.reference import random_block_table, request_slots
from kiln.ops.attention.rope import apply_rope_ref, rope_cos_sin_cache

seed, triton_on_cpu = decode_tests.seed, decode_tests.triton_on_cpu  # the fixtures, shared

H, R, DR, DN, DV = 4, 32, 16, 24, 20  # heads, kv_lora_rank, rope, nope, v head dims
NAN = float("nan")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (cached prefix, new tokens) per request
REQS = [(0, 5), (7, 3), (20, 1), (33, 9), (16, 16)]


@pytest.fixture(params=["reference", "kernel"])
def path(request):
    """Both paths of the ops: the torch reference, or the Triton kernels in the interpreter."""
    if request.param == "kernel":
        request.getfixturevalue("triton_on_cpu")
    return request.param


# --------------------------------------------------------------------------- helpers
def paged_cache(lens, page_size, width=R + DR, dtype=torch.float32):
    """A random paged layout for ``lens`` and a NaN-poisoned latent cache for it."""
    block_table, req_rows, num_slots = random_block_table(lens, page_size)
    cache = torch.full((num_slots // page_size, page_size, width), NAN, dtype=dtype)
    return block_table, req_rows, cache


def token_slots(block_table, req_rows, lens, page_size, lo, hi):
    """Slots of positions ``lo[b]..hi[b]-1`` of every request, concatenated: ``[sum] int64``."""
    return torch.cat(
        [request_slots(block_table, r, n, page_size)[a:n] for r, a, n in zip(req_rows.tolist(), lo, hi)]
    ).long()


def indptr_of(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def expanded(q_nope, q_pe, c_kv, k_pe, kv_b, q_pos, sm_scale):
    """HF's expanded form of one request in float64: ``[n, H, DV]``."""
    n_keys = c_kv.shape[0]
    kv = (c_kv.double() @ kv_b.double().T).view(n_keys, H, DN + DV)  # kv_b_proj
    k = torch.cat([kv[..., :DN], k_pe.double()[:, None, :].expand(n_keys, H, DR)], -1)
    q = torch.cat([q_nope, q_pe], -1).double()
    s = torch.einsum("nhd,lhd->hnl", q, k) * sm_scale
    s = s.masked_fill(torch.arange(n_keys)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hnl,lhv->nhv", torch.softmax(s, -1), kv[..., DN:])


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


# --------------------------------------------------------------------------- weights and scale
def test_split_kv_b_proj_is_hf_view():
    """w_kc / w_vc reproduce HF's ``kv_b_proj(c).view(.., H, dn + dv)`` split into k_nope and v."""
    kv_b, c = torch.randn(H * (DN + DV), R), torch.randn(6, R)
    w_kc, w_vc = mla.split_kv_b_proj(kv_b, H, DN, DV)
    assert w_kc.shape == (H, DN, R) and w_vc.shape == (H, R, DV)
    kv = (c @ kv_b.T).view(6, H, DN + DV)
    torch.testing.assert_close(torch.einsum("hdr,tr->thd", w_kc, c), kv[..., :DN])
    torch.testing.assert_close(torch.einsum("hrv,tr->thv", w_vc, c), kv[..., DN:])
    with pytest.raises(ValueError, match=r"kv_b_proj.weight must be \[num_heads"):
        mla.split_kv_b_proj(kv_b[1:], H, DN, DV)


def test_split_matches_the_weight_pack():
    """The ops' w_kc / w_vc are what compiler/mappings.py packs as layers.{i}.attn.w_kc / w_vc
    (rank 1 of tp 2 holds heads 2..3)."""
    from kiln.compiler.config import normalize_config
    from kiln.compiler.mappings import param_specs
    from kiln.compiler.parallel import ParallelConfig

    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": H, "vocab_size": 32, "intermediate_size": 64, "kv_lora_rank": R,
        "q_lora_rank": None, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR, "v_head_dim": DV,
        "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1,
    }  # fmt: skip
    kv_b = torch.randn(H * (DN + DV), R)
    w_kc, w_vc = mla.split_kv_b_proj(kv_b, H, DN, DV)
    specs = {s.name: s for s in param_specs(normalize_config(raw), ParallelConfig(tp=2), rank=1)}
    for name, want in (("w_kc", w_kc[2:]), ("w_vc", w_vc[2:])):
        spec = specs[f"layers.0.attn.{name}"]
        out = torch.full(spec.shape, NAN)
        for piece in spec.pieces:
            piece.place(piece.sources[0], kv_b, out)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "scaling, expect",
    [
        (None, 1.0),
        (
            {"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            (0.1 * math.log(40) + 1) ** 2,
        ),
        ({"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707}, None),
        ({"type": "yarn", "factor": 4.0}, 1.0),  # no mscale_all_dim: only the rope table scales
        ({"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0}, 1.0),  # factor <= 1: mscale 1
    ],
)
def test_softmax_scale_matches_hf(scaling, expect):
    from transformers.modeling_rope_utils import yarn_apply_mscale

    got = mla.mla_softmax_scale(DN + DR, scaling)
    params = {"rope_type": "default"} if scaling is None else {"rope_type": "yarn", **scaling}
    assert got == pytest.approx(yarn_apply_mscale(params, (DN + DR) ** -0.5), rel=1e-12)
    if expect is not None:
        assert got == pytest.approx((DN + DR) ** -0.5 * expect, rel=1e-12)


# --------------------------------------------------------------------------- the writer
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_write_slots(path, seed, page_size):
    """Row ``out_slots[t]`` of the cache gets ``[latent | k_pe]``; padding rows go to the sink
    (slot 0); nothing else changes, in a strided layer view of a two-layer pool too."""
    lens = [5, 17, 1]
    block_table, req_rows, layer = paged_cache(lens, page_size)
    pool = torch.full((2, *layer.shape), NAN)
    cache = pool[1]  # a layer's view
    slots = token_slots(block_table, req_rows, lens, page_size, [0, 3, 0], lens)
    slots = torch.cat([slots, torch.zeros(2, dtype=torch.int64)])  # two padding rows
    t = slots.shape[0]
    latent, k_pe = torch.randn(t, R), torch.randn(2 * t, DR)[::2]  # k_pe row-strided
    assert torch.ops.kiln.mla_kv_write(latent, k_pe, cache, slots) is None
    rows = cache[slots // page_size, slots % page_size]
    torch.testing.assert_close(rows[:-2], torch.cat([latent, k_pe], -1)[:-2], rtol=0, atol=0)
    assert not cache[0, 0].isnan().any()  # the sink took a padding row
    written = torch.zeros(cache.shape[:2], dtype=torch.bool)
    written[slots // page_size, slots % page_size] = True
    assert cache[~written].isnan().all() and pool[0].isnan().all()


def test_kv_write_bad_inputs_are_named(seed):
    cache = torch.zeros(4, 16, R + DR)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match=r"mla_kv_write: cache must be \[num_pages, page_size, 48\]"):
        torch.ops.kiln.mla_kv_write(torch.randn(3, R), torch.randn(3, DR), cache[..., 1:], slots)
    with pytest.raises(ValueError, match="share one dtype"):
        torch.ops.kiln.mla_kv_write(torch.randn(3, R).bfloat16(), torch.randn(3, DR), cache, slots)
    with pytest.raises(ValueError, match="out_slots must be int64"):
        torch.ops.kiln.mla_kv_write(torch.randn(3, R), torch.randn(3, DR), cache, slots.int())


# --------------------------------------------------------------------------- absorbed vs expanded
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_matches_expanded(path, seed, page_size):
    """New tokens over cached prefixes (two writes: the prefix, then the chunk), two padding rows;
    absorbed extend + apply_uv against the expanded form."""
    lens = [p + n for p, n in REQS]
    block_table, req_rows, cache = paged_cache(lens, page_size)
    c_kv = [torch.randn(n, R) for n in lens]
    k_pe = [torch.randn(n, DR) for n in lens]
    for lo, hi in (([0] * len(lens), [p for p, _ in REQS]), ([p for p, _ in REQS], lens)):
        slots = token_slots(block_table, req_rows, lens, page_size, lo, hi)
        latent = torch.cat([c[a:b] for c, a, b in zip(c_kv, lo, hi)])
        pe = torch.cat([k[a:b] for k, a, b in zip(k_pe, lo, hi)])
        torch.ops.kiln.mla_kv_write(latent, pe, cache, slots)
    t = sum(n for _, n in REQS) + 2
    kv_b = torch.randn(H * (DN + DV), R) / R**0.5
    w_kc, w_vc = mla.split_kv_b_proj(kv_b, H, DN, DV)
    q_nope, q_pe = torch.randn(t, H, DN), torch.randn(t, H, DR)
    scale = mla.mla_softmax_scale(DN + DR, None)
    indptr = indptr_of([n for _, n in REQS])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    o_latent = torch.ops.kiln.mla_extend(
        mla.absorb_q(q_nope, w_kc), q_pe, cache, block_table, req_rows, seq_lens, indptr, scale, page_size
    )
    out = mla.apply_uv(o_latent, w_vc)
    assert out.shape == (t, H, DV) and not out.isnan().any()
    assert (o_latent[-2:] == 0).all()  # padding rows
    for b, (p, n) in enumerate(REQS):
        lo, hi = indptr[b].item(), indptr[b + 1].item()
        want = expanded(q_nope[lo:hi], q_pe[lo:hi], c_kv[b], k_pe[b], kv_b, torch.arange(p, p + n), scale)
        err = rel_err(out[lo:hi], want)
        assert err < 1e-5, f"seed {seed}, request {b}: relative error {err:.2e}"


def test_decode_split_plan_follows_waves(monkeypatch):
    """The GPU launch (not the interpreter's): the plan costs ``s`` splits at ``ceil(P s / slots) /
    s`` (``P`` = head blocks x batch, ``slots`` = two resident programs an SM for 16-head blocks, one
    for 64-head blocks) and takes the fewest waves near the best cost, then the most splits; at
    least ``MIN_KEYS_PER_SPLIT`` keys a split."""
    from kiln.ops.attention.decode import MIN_KEYS_PER_SPLIT

    monkeypatch.setattr(mla, "interpreting", lambda: False)
    assert mla.default_decode_config(16).resident == 2
    wide = mla.default_decode_config(128)
    assert (wide.block_h, wide.resident) == (64, 1)
    assert mla.mla_num_splits(64, 8192, 16) == 4  # one wave: 256 programs of 264 (a fifth split: 320)
    assert mla.mla_num_splits(32, 8192, 16) == 8
    assert mla.mla_num_splits(64, 8192, 128) == 1  # two head blocks x 64 = 128 of 132
    assert mla.mla_num_splits(256, 32768, 16) == 1
    assert mla.mla_num_splits(8, 32768, 16) == 33
    assert mla.mla_num_splits(1, 4 * MIN_KEYS_PER_SPLIT, 16) == 4  # bounded by the keys
    # between half a wave and a wave the batch alone leaves SMs one program: more waves of splits
    assert mla.mla_num_splits(192, 8192, 16) == 4  # three waves of 768 programs: 0.75 of one split's time
    assert mla.mla_num_splits(160, 8192, 16) == 3  # two waves of 480
    assert mla.mla_num_splits(64, 8192, 16, num_sms=114) == 7  # 448 programs, two waves of 228
    with pytest.raises(ValueError, match=r"heads \(0\)"):
        mla.mla_num_splits(64, 8192, 0)


@pytest.mark.parametrize("page_size, num_splits", [(1, 3), (16, 1), (16, 0)])
def test_decode_matches_expanded(path, seed, page_size, num_splits):
    """One new token per request (its latent written by the op), a padding row (block-table row 0,
    length 0: zeros); absorbed decode + apply_uv against the expanded form."""
    lens = [1, 9, 40, 17, 64]
    block_table, req_rows, cache = paged_cache(lens, page_size)
    c_kv = [torch.randn(n, R) for n in lens]
    k_pe = [torch.randn(n, DR) for n in lens]
    slots = token_slots(block_table, req_rows, lens, page_size, [0] * len(lens), lens)
    torch.ops.kiln.mla_kv_write(torch.cat(c_kv), torch.cat(k_pe), cache, slots)
    req_rows = torch.cat([req_rows, torch.zeros(1, dtype=torch.int32)])
    seq_lens = torch.tensor([*lens, 0], dtype=torch.int32)
    kv_b = torch.randn(H * (DN + DV), R) / R**0.5
    w_kc, w_vc = mla.split_kv_b_proj(kv_b, H, DN, DV)
    q_nope, q_pe = torch.randn(len(lens) + 1, H, DN), torch.randn(len(lens) + 1, H, DR)
    scale = 0.7 * mla.mla_softmax_scale(DN + DR, None)
    o_latent = torch.ops.kiln.mla_decode(
        mla.absorb_q(q_nope, w_kc), q_pe, cache, block_table, req_rows, seq_lens, scale, page_size, num_splits
    )
    out = mla.apply_uv(o_latent, w_vc)
    assert not out.isnan().any() and (out[-1] == 0).all()
    for b, n in enumerate(lens):
        want = expanded(
            q_nope[b : b + 1], q_pe[b : b + 1], c_kv[b], k_pe[b], kv_b, torch.tensor([n - 1]), scale
        )
        err = rel_err(out[b : b + 1], want)
        assert err < 1e-5, f"seed {seed}, request {b}: relative error {err:.2e}"


# --------------------------------------------------------------------------- against transformers
@pytest.fixture
def hf_quiet():
    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(old)


YARN_HF = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}  # fmt: skip
YARN_KILN = {"type": "yarn", "factor": 4.0, "original_max_position": 32, "beta_fast": 32, "beta_slow": 1,
             "mscale": 1.0, "mscale_all_dim": 0.8}  # fmt: skip
THETA = 10000.0


def hf_layer(version, q_lora_rank, yarn, interleave=True):
    """A tiny random DeepseekV{2,3}Attention (eager, float32) with its rotary embedding."""
    rope = {**(YARN_HF if yarn else {"rope_type": "default"}), "rope_theta": THETA}
    common = dict(
        hidden_size=64, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=R,
        qk_rope_head_dim=DR, qk_nope_head_dim=DN, v_head_dim=DV, max_position_embeddings=128,
        rope_parameters=rope, num_hidden_layers=1, vocab_size=32, intermediate_size=32,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    )  # fmt: skip
    if version == 2:
        cfg = transformers.DeepseekV2Config(**common)
        attn, rotary = hf_v2.DeepseekV2Attention(cfg, 0), hf_v2.DeepseekV2RotaryEmbedding(cfg)
    else:
        cfg = transformers.DeepseekV3Config(**common, rope_interleave=interleave)
        attn, rotary = hf_v3.DeepseekV3Attention(cfg, 0), hf_v3.DeepseekV3RotaryEmbedding(cfg)
    cfg._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(
                1 + 0.2 * torch.randn_like(p)
                if "layernorm" in name
                else torch.randn_like(p) / p.shape[-1] ** 0.5
            )
    return attn.eval(), rotary


def hf_forward(attn, rotary, x):
    """HF's attention over one whole sequence ``x [L, hidden]``, causal: ``[L, hidden]``."""
    n = x.shape[0]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attn(hidden_states=x[None], attention_mask=mask, position_embeddings=rotary(x[None], pos))
    return out[0]


def kiln_inputs(attn, x, positions, cos_sin, is_neox):
    """The layer's projections in plain torch from HF's weights, RoPE by kiln's table:
    ``(q_nope [T, H, dn], q_pe [T, H, dr] roped, c_kv [T, r] normalized, k_pe [T, dr] roped)``."""
    if attn.q_lora_rank is None:
        q = x @ attn.q_proj.weight.T
    else:
        qa = attn.q_a_layernorm
        q = rms(x @ attn.q_a_proj.weight.T, qa.weight, qa.variance_epsilon) @ attn.q_b_proj.weight.T
    q = q.view(x.shape[0], H, DN + DR)
    kv = x @ attn.kv_a_proj_with_mqa.weight.T
    norm = attn.kv_a_layernorm
    c_kv = rms(kv[:, :R], norm.weight, norm.variance_epsilon)
    q_pe = apply_rope_ref(q[..., DN:].contiguous(), positions, cos_sin, DR, is_neox)
    k_pe = apply_rope_ref(kv[:, None, R:].contiguous(), positions, cos_sin, DR, is_neox)[:, 0]
    return q[..., :DN], q_pe, c_kv, k_pe


def check_against_hf(attn, rotary, yarn, is_neox, page_size):
    """Requests of REQS: HF over each whole sequence; kiln writes each prefix, then runs one extend
    step over the new tokens and, separately, one decode step for every request's last token."""
    scaling = YARN_KILN if yarn else None
    cos_sin = rope_cos_sin_cache(DR, 128, THETA, scaling)
    sm_scale = mla.mla_softmax_scale(DN + DR, scaling)
    assert sm_scale == pytest.approx(attn.scaling, rel=1e-12)
    w_kc, w_vc = mla.split_kv_b_proj(attn.kv_b_proj.weight.detach(), H, DN, DV)
    lens = [p + n for p, n in REQS]
    xs = [torch.randn(n, 64) for n in lens]
    hf = [hf_forward(attn, rotary, x) for x in xs]
    block_table, req_rows, cache = paged_cache(lens, page_size)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with torch.no_grad():
        parts = [kiln_inputs(attn, x, torch.arange(x.shape[0]), cos_sin, is_neox) for x in xs]
        o_proj = attn.o_proj.weight

        def write(lo, hi):
            slots = token_slots(block_table, req_rows, lens, page_size, lo, hi)
            c_kv, k_pe = (torch.cat([p[i][a:b] for p, a, b in zip(parts, lo, hi)]) for i in (2, 3))
            torch.ops.kiln.mla_kv_write(c_kv, k_pe.contiguous(), cache, slots)

        def run(lo, qo_indptr, num_splits=0):
            """Write positions lo..len-1, attend from them; HF's rows and kiln's ``[T, hidden]``."""
            write(lo, lens)
            pick = [slice(a, n) for a, n in zip(lo, lens)]
            q_nope, q_pe = (torch.cat([p[i][s] for p, s in zip(parts, pick)]) for i in (0, 1))
            o = torch.ops.kiln.mla_attention(
                mla.absorb_q(q_nope, w_kc), q_pe, cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale,
                page_size, num_splits,
            )  # fmt: skip
            out = mla.apply_uv(o, w_vc).reshape(o.shape[0], H * DV) @ o_proj.T
            return torch.cat([h[s] for h, s in zip(hf, pick)]), out

        write([0] * len(lens), [p for p, _ in REQS])  # the cached prefixes
        want, got = run([p for p, _ in REQS], indptr_of([n for _, n in REQS]))  # extend
        assert rel_err(got, want) < 1e-5, f"extend: relative error {rel_err(got, want):.2e}"
        want, got = run([n - 1 for n in lens], indptr_of([1] * len(lens)), num_splits=2)  # decode
        assert rel_err(got, want) < 1e-5, f"decode: relative error {rel_err(got, want):.2e}"


@pytest.mark.parametrize(
    "path, q_lora_rank, yarn",
    [("reference", None, False), ("reference", 24, False), ("reference", None, True), ("kernel", 24, True)],
    indirect=["path"],
)
def test_matches_hf_deepseek_v2_attention(path, seed, hf_quiet, q_lora_rank, yarn):
    """DeepSeek-V2: q through q_proj (V2-Lite) or the q_lora path, with and without YaRN (its
    rope table's attention factor and the softmax scale's mscale**2)."""
    attn, rotary = hf_layer(2, q_lora_rank, yarn)
    check_against_hf(attn, rotary, yarn, is_neox=False, page_size=16 if yarn else 1)


@pytest.mark.parametrize(
    "path, interleave", [("kernel", True), ("reference", True), ("reference", False)], indirect=["path"]
)
def test_matches_hf_deepseek_v3_attention(path, seed, hf_quiet, interleave):
    """V3 rotates interleaved pairs (and de-interleaves its output: the same dot products as kiln's
    GPT-J rotation), or NeoX halves with ``rope_interleave: false``."""
    attn, rotary = hf_layer(3, 24, yarn=True, interleave=interleave)
    check_against_hf(attn, rotary, yarn=True, is_neox=not interleave, page_size=16)


# --------------------------------------------------------------------------- the decode kernel
@pytest.mark.parametrize(
    "lens, heads, r, dr, page_size, num_splits, dtype",
    [
        ([1, 37, 70], 4, 32, 16, 16, 3, torch.float32),  # pages crossed, merge
        ([5, 33, 0], 20, 32, 16, 1, 1, torch.float32),  # two head blocks, an empty request, direct
        ([50, 3], 16, 40, 8, 16, 4, torch.float32),  # widths that are not powers of two
        ([17, 80], 8, 64, 32, 16, 3, torch.bfloat16),
        ([9], 4, 32, 16, 1, 8, torch.bfloat16),  # more splits than keys need
    ],
)
def test_decode_kernel_matches_reference(
    triton_on_cpu, seed, lens, heads, r, dr, page_size, num_splits, dtype
):
    block_table, req_rows, cache = paged_cache(lens, page_size, r + dr, dtype)
    slots = token_slots(block_table, req_rows, lens, page_size, [0] * len(lens), lens)
    cache[slots // page_size, slots % page_size] = torch.randn(slots.shape[0], r + dr, dtype=dtype)
    q_latent = torch.randn(len(lens), heads, r, dtype=dtype)
    q_pe = torch.randn(2 * len(lens), heads, dr, dtype=dtype)[::2]  # row-strided
    args = (q_latent, q_pe, cache, block_table, req_rows, torch.tensor(lens, dtype=torch.int32),
            (r + dr) ** -0.5, page_size, num_splits)  # fmt: skip
    out = torch.ops.kiln.mla_decode(*args)
    assert out.shape == (len(lens), heads, r) and out.dtype == dtype and not out.isnan().any()
    err = rel_err(out, mla.mla_decode_ref(*args))
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e}"


def test_decode_bad_inputs_are_named(seed):
    block_table, req_rows, cache = paged_cache([3, 4], 16)
    seq_lens = torch.tensor([3, 4], dtype=torch.int32)
    q, pe = torch.randn(2, H, R), torch.randn(2, H, DR)
    base = (block_table, req_rows, seq_lens, 0.1)
    with pytest.raises(ValueError, match=r"cache must be \[num_pages, page_size=1, kv_lora_rank"):
        torch.ops.kiln.mla_decode(q, pe, cache, *base, 1, 0)
    with pytest.raises(ValueError, match="same T and H"):
        torch.ops.kiln.mla_decode(q, pe[:, :2], cache, *base, 16, 0)
    with pytest.raises(ValueError, match="no FP8 latent cache yet"):
        torch.ops.kiln.mla_decode(q, pe, cache.to(torch.float8_e4m3fn), *base, 16, 0)
    with pytest.raises(ValueError, match="num_splits must be >= 0"):
        torch.ops.kiln.mla_decode(q, pe, cache, *base, 16, -1)
    with pytest.raises(ValueError, match=r"qo_indptr has 2 entries"):
        torch.ops.kiln.mla_extend(q, pe, cache, *base[:3], torch.zeros(2, dtype=torch.int32), 0.1, 16)


# --------------------------------------------------------------------------- the extend kernel
def extend_args(reqs, heads, r, dr, page_size, pad, dtype, flat=False, device="cpu"):
    """``kiln::mla_extend``'s arguments for requests ``reqs`` of (cached prefix, new tokens): their
    rows random in a NaN-poisoned cache (``flat``: the pool layer's ``[S, 1, r + dr]`` view), ``q_pe``
    head-strided, ``pad`` padding query rows."""
    lens = [p + n for p, n in reqs]
    block_table, req_rows, cache = paged_cache(lens, page_size, r + dr, dtype)
    slots = token_slots(block_table, req_rows, lens, page_size, [0] * len(lens), lens)
    cache[slots // page_size, slots % page_size] = torch.randn(slots.shape[0], r + dr, dtype=dtype)
    if flat:
        cache = cache.view(-1, 1, r + dr)
    t = sum(n for _, n in reqs) + pad
    q_latent = torch.randn(t, heads, r, dtype=dtype)
    q_pe = torch.randn(t, 2 * heads, dr, dtype=dtype)[:, ::2]
    meta = (block_table, req_rows, torch.tensor(lens, dtype=torch.int32), indptr_of([n for _, n in reqs]))
    tensors = [x.to(device) for x in (q_latent, q_pe, cache, *meta)]
    return (*tensors, (r + dr) ** -0.5, page_size)


def check_extend(args, pad, seed):
    """The op (kernel path) against the reference: no NaN, zero padding rows, the dtype's bound."""
    out = torch.ops.kiln.mla_extend(*args)
    t, dtype = args[0].shape[0], args[0].dtype
    assert out.shape == args[0].shape and out.dtype == dtype and not out.isnan().any(), f"seed {seed}"
    assert (out[t - pad :] == 0).all(), f"seed {seed}: padding rows not zeroed"
    err = rel_err(out, mla.mla_extend_ref(*args))
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e}"


# (cached prefix, new tokens): an empty request, one without a prefix, chunks crossing tiles and key
# blocks, a single new token
EXTEND_REQS = [(0, 5), (7, 3), (40, 0), (33, 9), (16, 17), (3, 1)]
# more requests than one scan of qo_indptr takes (64): a long one first, the last ones after empties
MANY_REQS = [(0, 40)] + [(i, 0) for i in range(63)] + [(j + 2, 1) for j in range(6)]
CFG = mla.MLAExtendConfig


@pytest.mark.parametrize(
    "reqs, heads, r, dr, page_size, pad, dtype, config, flat",
    [
        (EXTEND_REQS, 4, 32, 16, 16, 2, torch.float32, None, False),  # 4 tokens x 4 heads a tile
        # flat cache; two head blocks (the second mostly masked), two latent column blocks, widths
        # not powers of two
        (EXTEND_REQS, 20, 40, 8, 1, 3, torch.float32, CFG(block_m=32, block_v=32, pack=16), True),
        ([(5, 30), (70, 6)], 8, 64, 32, 16, 0, torch.bfloat16, CFG(block_m=16, block_n=32, pack=4), False),
        (MANY_REQS, 4, 32, 16, 16, 3, torch.float32, None, False),
    ],
    ids=["default", "flat-split", "bf16-nopad", "many-requests"],
)
def test_extend_kernel_matches_reference(
    triton_on_cpu, monkeypatch, seed, reqs, heads, r, dr, page_size, pad, dtype, config, flat
):
    if config is not None:  # the op's launch with this tiling
        monkeypatch.setattr(mla, "default_extend_config", lambda _dtype: config)
    check_extend(extend_args(reqs, heads, r, dr, page_size, pad, dtype, flat), pad, seed)


def test_extend_reads_no_tensor_values_on_the_host(triton_on_cpu, seed):
    """CUDA-graph safety: the extend launch takes every length from the device (the reference
    reads qo_indptr and seq_lens on the host), so a captured graph replays with new lengths."""
    args = extend_args(EXTEND_REQS, 4, 32, 16, 16, 2, torch.float32)

    def host_read(*_args, **_kwargs):
        raise AssertionError("mla_extend read a tensor's value on the host")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("tolist", "item", "__int__", "__index__", "__bool__", "__float__"):
            mp.setattr(torch.Tensor, name, host_read)
        out = torch.ops.kiln.mla_extend(*args)
    assert rel_err(out, mla.mla_extend_ref(*args)) < 1e-5, f"seed {seed}"


def test_extend_bad_config_is_named(triton_on_cpu):
    args = extend_args([(3, 2)], 4, 32, 16, 16, 0, torch.float32)
    for bad in (CFG(block_m=48), CFG(block_m=16, pack=32), CFG(block_v=8), CFG(block_v=64)):
        with pytest.raises(ValueError, match=r"mla_extend: config .* needs powers of two"):
            mla.mla_extend_triton(*args, config=bad)


# --------------------------------------------------------------------------- graphs
class _Layer(torch.nn.Module):
    """The op calls of an MLA layer: write the new latents, attend (decode or extend), apply w_vc."""

    def forward(self, latent, k_pe, q_latent, q_pe, w_vc, cache, out_slots, block_table, req_rows, seq_lens,
                qo_indptr):  # fmt: skip
        torch.ops.kiln.mla_kv_write(latent, k_pe, cache, out_slots)
        o = torch.ops.kiln.mla_attention(
            q_latent, q_pe, cache, block_table, req_rows, seq_lens, qo_indptr, 0.125, 16, 0
        )
        return mla.apply_uv(o, w_vc)


def _step(counts, prefix, cache, block_table, req_rows):
    """One step's inputs: ``counts[b]`` new tokens over ``prefix[b]`` cached ones."""
    lens = [p + n for p, n in zip(prefix, counts)]
    t = sum(counts)
    slots = token_slots(block_table, req_rows, lens, 16, prefix, lens)
    return (torch.randn(t, R), torch.randn(t, DR), torch.randn(t, H, R), torch.randn(t, H, DR),
            torch.randn(H, R, DV), cache, slots, block_table, req_rows, torch.tensor(lens, dtype=torch.int32),
            indptr_of(counts))  # fmt: skip


def test_export_round_trip(seed):
    """torch.export traces the writer (in place on the cache input) and mla_attention through their
    fakes with a dynamic token count; the saved and loaded program, run at another T (a decode
    step, T == B), matches the references."""
    block_table, req_rows, cache = paged_cache([40, 40], 16)
    cache.zero_()
    t_dim = torch.export.Dim("T")
    dyn = ({0: t_dim}, {0: t_dim}, {0: t_dim}, {0: t_dim}, None, None, {0: t_dim}, None, None, None, None)
    ep = torch.export.export(
        _Layer(), _step([5, 3], [0, 10], cache, block_table, req_rows), dynamic_shapes=dyn, strict=False
    )
    code = ep.graph_module.code
    assert "kiln.mla_kv_write" in code and "kiln.mla_attention" in code
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    loaded = torch.export.load(io.BytesIO(buf.getvalue())).module()
    args = _step([1, 1], [20, 7], cache, block_table, req_rows)
    ref_cache = cache.clone()
    out = loaded(*args)
    mla.mla_kv_write_ref(*args[:2], ref_cache, args[6])
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)  # written in place
    o = mla.mla_decode_ref(*args[2:4], ref_cache, *args[7:10], 0.125, 16, 0)
    torch.testing.assert_close(out, mla.apply_uv(o, args[4]))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, pe = torch.empty(7, H, R, dtype=torch.bfloat16), torch.empty(7, H, DR, dtype=torch.bfloat16)
        cache, bt = torch.empty(5, 16, R + DR, dtype=torch.bfloat16), torch.empty(3, 4, dtype=torch.int32)
        rows, lens, indptr = (
            torch.empty(2, dtype=torch.int32),
            torch.empty(2, dtype=torch.int32),
            torch.empty(3),
        )
        outs = [
            torch.ops.kiln.mla_extend(q, pe, cache, bt, rows, lens, indptr, 0.1, 16),
            torch.ops.kiln.mla_decode(q[:2], pe[:2], cache, bt, rows, lens, 0.1, 16, 0),
            torch.ops.kiln.mla_attention(q, pe, cache, bt, rows, lens, indptr, 0.1, 16, 0),
        ]
    assert [(tuple(o.shape), o.dtype) for o in outs] == [
        ((7, H, R), torch.bfloat16),
        ((2, H, R), torch.bfloat16),
        ((7, H, R), torch.bfloat16),
    ]


# --------------------------------------------------------------------------- GPU, DeepSeek sizes
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # V3 at tp 8 / V2-Lite; V3 at tp 1
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_gpu_deepseek_shapes(compiled_gpu, seed, heads, page_size):
    lens = [1, 17, 1000, 4097, 300, 65]
    dtype = torch.bfloat16
    block_table, req_rows, cache = paged_cache(lens, page_size, 576, dtype)
    block_table, req_rows, cache = block_table.cuda(), req_rows.cuda(), cache.cuda()
    slots = token_slots(block_table.cpu(), req_rows.cpu(), lens, page_size, [0] * len(lens), lens).cuda()
    cache[slots // page_size, slots % page_size] = torch.randn(
        slots.shape[0], 576, dtype=dtype, device="cuda"
    )
    for num_splits in (0, 1):
        args = (torch.randn(len(lens), heads, 512, dtype=dtype, device="cuda"),
                torch.randn(len(lens), heads, 64, dtype=dtype, device="cuda"), cache, block_table, req_rows,
                torch.tensor(lens, dtype=torch.int32, device="cuda"), 192**-0.5, page_size, num_splits)  # fmt: skip
        out = torch.ops.kiln.mla_decode(*args)
        ref = mla.mla_decode_ref(*args)
        assert not out.isnan().any() and rel_err(out, ref) < 1e-2, f"seed {seed}"


@pytest.mark.gpu
def test_decode_gpu_cuda_graph_replay(compiled_gpu, seed):
    """The writer and decode captured once at a bucket (splits sized for the table's capacity),
    replayed as the requests grow: every replay matches the reference."""
    dtype, page_size, lens = torch.bfloat16, 16, [5, 300, 1, 2000]
    block_table, req_rows, cache = paged_cache([n + 8 for n in lens], page_size, 576, dtype)
    block_table, req_rows, cache = block_table.cuda(), req_rows.cuda(), cache.cuda()
    cache.normal_()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), 16, 512, dtype=dtype, device="cuda")
    pe = torch.randn(len(lens), 16, 64, dtype=dtype, device="cuda")
    latent = torch.randn(len(lens), 512, dtype=dtype, device="cuda")
    k_pe = torch.randn(len(lens), 64, dtype=dtype, device="cuda")
    slots = torch.zeros(len(lens), dtype=torch.int64, device="cuda")

    def step():
        torch.ops.kiln.mla_kv_write(latent, k_pe, cache, slots)
        return torch.ops.kiln.mla_decode(q, pe, cache, block_table, req_rows, seq_lens, 0.1, page_size, 0)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for grow in range(1, 4):
        new = [n + grow for n in lens]
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        pos = [n - 1 for n in new]
        slots.copy_(token_slots(block_table.cpu(), req_rows.cpu(), new, page_size, pos, new).cuda())
        for t in (q, pe, latent, k_pe):
            t.normal_()
        out.fill_(float("nan"))
        graph.replay()
        ref = mla.mla_decode_ref(q, pe, cache, block_table, req_rows, seq_lens, 0.1, page_size, 0)
        assert cache[slots // page_size, slots % page_size].equal(torch.cat([latent, k_pe], -1))
        assert not out.isnan().any() and rel_err(out, ref) < 1e-2, f"seed {seed}, lens {new}"


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float buffer an op allocates with ``torch.empty`` starts as NaN (on any device)."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


GPU_EXTEND_REQS = [(0, 300), (1000, 17), (4000, 1), (37, 64), (2048, 500), (50, 0), (129, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, dtype", [(16, torch.bfloat16), (128, torch.bfloat16), (16, torch.float32)]
)  # V2-Lite / V3 at tp 8; V3 at tp 1
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_gpu_deepseek_shapes(compiled_gpu, nan_empty, seed, heads, dtype, page_size):
    """r = 512, dr = 64; page size 1 in the pool layer's flat view, 16 paged; five padding rows."""
    args = extend_args(GPU_EXTEND_REQS, heads, 512, 64, page_size, 5, dtype, page_size == 1, "cuda")
    check_extend(args, 5, seed)


@pytest.mark.gpu
def test_extend_gpu_cuda_graph_replay(compiled_gpu, seed):
    """Extend captured once at a 64-row bucket of 4 requests, replayed with other chunk sizes,
    prefixes and padding (the lengths only on the device): every replay matches the reference."""
    dtype, page_size, heads = torch.bfloat16, 16, 16
    block_table, req_rows, cache = paged_cache([3000] * 4, page_size, 576, dtype)
    block_table, req_rows, cache = block_table.cuda(), req_rows.cuda(), cache.cuda()
    cache.normal_()
    seq_lens = torch.tensor([64] * 4, dtype=torch.int32, device="cuda")
    indptr = indptr_of([16] * 4).cuda()
    q = torch.randn(64, heads, 512, dtype=dtype, device="cuda")
    pe = torch.randn(64, heads, 64, dtype=dtype, device="cuda")

    def step():
        return torch.ops.kiln.mla_extend(
            q, pe, cache, block_table, req_rows, seq_lens, indptr, 0.1, page_size
        )

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for counts, prefix in (
        ([10, 20, 3, 1], [0, 500, 2000, 7]),
        ([60, 0, 2, 1], [100, 9, 2900, 0]),
        ([1, 1, 1, 1], [2999, 0, 1500, 31]),
    ):
        seq_lens.copy_(torch.tensor([p + n for p, n in zip(prefix, counts)], dtype=torch.int32))
        indptr.copy_(indptr_of(counts))
        q.normal_()
        pe.normal_()
        out.fill_(float("nan"))
        graph.replay()
        ref = mla.mla_extend_ref(q, pe, cache, block_table, req_rows, seq_lens, indptr, 0.1, page_size)
        used = sum(counts)
        assert not out.isnan().any() and (out[used:] == 0).all(), f"seed {seed}, counts {counts}"
        assert rel_err(out, ref) < 1e-2, f"seed {seed}, counts {counts}"
