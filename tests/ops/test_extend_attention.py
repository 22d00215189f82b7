"""Paged extend attention: the Triton kernel (interpreter on CPU, real on GPU) vs the torch
reference on fresh random inputs, outputs poisoned with NaN; plus a torch.export round trip of a
module that calls both attention ops.

Tolerances as in test_decode_attention.py: relative error below 1e-5 in float32 (interpreter and
GPU ``ieee`` dots are float32; observed ~2e-7), below 1e-2 in bfloat16 (softmax weights rounded to
bf16 before P @ V; observed ~5e-3).
"""

import io

import pytest
import test_decode_attention as decode_tests
import torch
from test_decode_attention import TOL, fp8_caches, rel_err

from kiln.ops.attention import paged  # noqa: F401  (registers the three attention ops)
from kiln.ops.attention.extend import ExtendConfig, _resolve_pack, extend_attention_triton
from kiln.ops.attention.qkv_rope import quantize_kv_rows
from kiln.ops.attention.reference import decode_attention_ref, extend_attention_ref, random_block_table

seed, triton_on_cpu = decode_tests.seed, decode_tests.triton_on_cpu  # the fixtures, shared


def make_inputs(ext, prefix, pad, hq, hkv, d, dv, page_size, dtype, device="cpu"):
    """Requests with ``ext[b]`` new tokens over ``prefix[b]`` cached ones; ``pad`` padding rows."""
    lens = [e + p for e, p in zip(ext, prefix)]
    block_table, req_rows, num_slots = random_block_table(lens, page_size, device)
    indptr = torch.tensor([0, *torch.tensor(ext).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(ext) + pad, hq, d, dtype=dtype, device=device)
    k_cache = torch.randn(num_slots, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(num_slots, hkv, dv, dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_table, req_rows, seq_lens, indptr


def check(seed, ext, prefix, pad, hq, hkv, d, dv, page_size, dtype, window=-1, cap=0.0, config=None,
          device="cpu", kv_fp8=False):  # fmt: skip
    """The kernel vs the reference on fresh inputs; ``kv_fp8``: on FP8 caches with random per-row
    scales (test_decode_attention.py ``fp8_caches``: NaN rows and scales where no request reads)."""
    q, k, v, bt, rows, lens, indptr = make_inputs(ext, prefix, pad, hq, hkv, d, dv, page_size, dtype, device)
    scales = ()
    if kv_fp8:
        k, v, *scales = fp8_caches(k, v, bt, rows, lens, page_size)
    args = (q, k, v, bt, rows, lens, indptr, d**-0.5, page_size, window, cap, *scales)
    if config is None:
        out = torch.ops.kiln.extend_attention(*args)
    else:
        out = extend_attention_triton(*args, config=config)
    ref = extend_attention_ref(*args)
    assert out.shape == (q.shape[0], hq, dv) and out.dtype == dtype
    assert not out.isnan().any(), f"seed {seed}: NaN in output (unwritten rows, or a masked key's NaN read?)"
    if pad:
        assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:])), f"seed {seed}: padding rows not zero"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "ext, prefix, pad, hq, hkv, d, dv, page_size, dtype",
    [
        # mixed lengths, a request with no new tokens, empty and non-empty prefixes, Hq=12/Hkv=3
        ([5, 0, 40, 17], [0, 3, 30, 50], 6, 12, 3, 64, 64, 16, torch.float32),
        ([1], [20], 0, 8, 8, 64, 64, 1, torch.bfloat16),  # one token, ratio 1, page size 1
        ([33, 7], [70, 0], 3, 16, 2, 128, 128, 16, torch.bfloat16),  # ratio 8
        ([9], [12], 0, 4, 1, 256, 256, 1, torch.float32),  # head_dim 256
        ([20, 3], [16, 40], 2, 8, 2, 64, 32, 16, torch.bfloat16),  # Dv != D
        ([11], [5], 1, 4, 2, 80, 48, 16, torch.float32),  # head dims that are not powers of two
    ],
)
def test_extend_matches_reference(triton_on_cpu, seed, ext, prefix, pad, hq, hkv, d, dv, page_size, dtype):
    check(seed, ext, prefix, pad, hq, hkv, d, dv, page_size, dtype)


@pytest.mark.parametrize(
    "hq, hkv, config",
    [
        (9, 3, ExtendConfig(block_m=32, block_n=16, pack=3, num_warps=1, num_stages=1)),  # 10 tokens/tile
        (16, 2, ExtendConfig(block_m=64, block_n=32, pack=8, num_warps=1, num_stages=1)),
        (16, 2, ExtendConfig(block_m=32, block_n=16, pack=2, num_warps=1, num_stages=1)),
        (12, 2, ExtendConfig(block_m=32, block_n=16, max_pack=4, num_warps=1, num_stages=1)),  # pack 3
    ],
)
def test_extend_gqa_packing(triton_on_cpu, seed, hq, hkv, config):
    check(seed, [19, 1, 30], [0, 45, 17], 5, hq, hkv, 64, 64, 16, torch.float32, config=config)


@pytest.mark.parametrize(
    "group, config, want",
    [
        (4, ExtendConfig(block_m=128), 4),
        (4, ExtendConfig(block_m=128, max_pack=2), 2),
        (6, ExtendConfig(block_m=128, max_pack=4), 3),
        (7, ExtendConfig(block_m=128, max_pack=2), 1),
        (8, ExtendConfig(block_m=32), 2),  # at least 16 tokens per tile
    ],
)
def test_automatic_pack(group, config, want):
    assert _resolve_pack(config, group) == want


@pytest.mark.parametrize(
    "window, cap, dtype",
    [(6, 0.0, torch.float32), (-1, 5.0, torch.float32), (25, 30.0, torch.bfloat16)],
)
def test_extend_window_and_softcap(triton_on_cpu, seed, window, cap, dtype):
    check(seed, [30, 4], [20, 60], 2, 8, 2, 64, 64, 16, dtype, window=window, cap=cap)


def test_extend_more_requests_than_one_scan(triton_on_cpu, seed):
    """A program finds its request by scanning qo_indptr 64 requests at a time (SCAN): the tiles of
    a request still open at the end of one round must count in the next. A long first request, 63
    empty ones, then 6 of one token (70 > 64): before the fix, the one-token requests' programs
    counted the first request's later tiles as theirs (relative error 0.51)."""
    check(seed, [40] + [0] * 63 + [1] * 6, [3] + [0] * 63 + [5] * 6, 2, 4, 2, 32, 32, 16, torch.float32)


def test_extend_long_prefix(triton_on_cpu, seed):
    # a few new tokens far into a long context, over many scattered pages
    cfg = ExtendConfig(block_m=16, block_n=64, num_warps=1, num_stages=1)
    check(seed, [5], [3000], 3, 4, 1, 64, 64, 16, torch.bfloat16, config=cfg)


def test_cpu_path_is_reference(seed, monkeypatch):
    monkeypatch.delenv("KILN_TRITON_ON_CPU", raising=False)
    q, k, v, bt, rows, lens, indptr = make_inputs([4, 9], [3, 0], 2, 8, 2, 64, 64, 16, torch.float32)
    args = (q, k, v, bt, rows, lens, indptr, 0.125, 16, -1, 0.0)
    assert torch.equal(torch.ops.kiln.extend_attention(*args), extend_attention_ref(*args))


@pytest.mark.parametrize("kernel", ["1", "0"])  # the Triton launches, then the references
def test_paged_attention_is_decode_or_extend_by_shape(seed, monkeypatch, kernel):
    monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
    q, k, v, bt, rows, lens, indptr = make_inputs([4, 9], [3, 0], 2, 8, 2, 64, 64, 16, torch.float32)
    out = torch.ops.kiln.paged_attention(q, k, v, bt, rows, lens, indptr, 0.125, 16, 2, -1, 0.0)
    ref = extend_attention_ref(q, k, v, bt, rows, lens, indptr, 0.125, 16, -1, 0.0)
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"
    # T == B: one token per request, whatever qo_indptr says (extend would read [0, 0, 2] as two
    # tokens of request 1 and none of request 0)
    uneven = torch.tensor([0, 0, 2], dtype=torch.int32)
    out = torch.ops.kiln.paged_attention(q[:2], k, v, bt, rows, lens, uneven, 0.125, 16, 2, -1, 0.0)
    ref = decode_attention_ref(q[:2], k, v, bt, rows, lens, 0.125, 16, 2, -1, 0.0)
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"


def test_short_qo_indptr_is_named_on_both_paths(seed, monkeypatch):
    q, k, v, bt, rows, lens, indptr = make_inputs([4, 9], [3, 0], 2, 8, 2, 64, 64, 16, torch.float32)
    for kernel in ("1", "0"):  # the Triton launch, then the reference
        monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
        for op in (torch.ops.kiln.extend_attention, torch.ops.kiln.paged_attention):
            extra = (2,) if op is torch.ops.kiln.paged_attention else ()
            with pytest.raises(ValueError, match="qo_indptr has 2 entries, expected B \\+ 1 = 3"):
                op(q, k, v, bt, rows, lens, indptr[:2], 0.125, 16, *extra, -1, 0.0)


def test_fake_shapes():
    """Under fake tensors (torch.export's tracing) the ops give ``[T, Hq, Dv]`` in q's dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(7, 8, 64, dtype=torch.bfloat16), torch.empty(40, 2, 64), torch.empty(40, 2, 32)
        bt, rows, lens = torch.empty(3, 4, dtype=torch.int32), *torch.empty(2, 2, dtype=torch.int32)
        indptr = torch.empty(3, dtype=torch.int32)
        meta = (0.125, 16, 2, -1, 0.0)
        outs = [
            torch.ops.kiln.extend_attention(q, k, v, bt, rows, lens, indptr, *meta[:2], *meta[3:]),
            torch.ops.kiln.decode_attention(q[:2], k, v, bt, rows, lens, *meta),
            torch.ops.kiln.paged_attention(q, k, v, bt, rows, lens, indptr, *meta),
            torch.ops.kiln.paged_attention(q[:2], k, v, bt, rows, lens, indptr, *meta),
        ]
    assert [(tuple(o.shape), o.dtype) for o in outs] == [
        ((7, 8, 32), torch.bfloat16),
        ((2, 8, 32), torch.bfloat16),
        ((7, 8, 32), torch.bfloat16),
        ((2, 8, 32), torch.bfloat16),
    ]


# --------------------------------------------------------------------------- FP8 KV caches
@pytest.mark.parametrize(
    "ext, prefix, pad, hq, hkv, d, dv, dtype, window, cap",
    [
        ([5, 0, 20], [0, 3, 37], 3, 8, 2, 64, 64, torch.float32, -1, 0.0),  # tight float32 check
        ([33, 7], [20, 0], 2, 8, 2, 64, 64, torch.bfloat16, -1, 0.0),
        ([30, 4], [20, 60], 2, 8, 2, 64, 64, torch.float32, 6, 5.0),  # sliding window + soft-cap
        ([20, 3], [16, 40], 0, 4, 1, 64, 32, torch.bfloat16, 25, 0.0),  # Dv != D, window
    ],
)
def test_extend_fp8_matches_reference(
    triton_on_cpu, seed, ext, prefix, pad, hq, hkv, d, dv, dtype, window, cap
):
    check(seed, ext, prefix, pad, hq, hkv, d, dv, 16, dtype, window, cap, kv_fp8=True)


def test_extend_fp8_gqa_packing(triton_on_cpu, seed):
    cfg = ExtendConfig(block_m=32, block_n=16, pack=3, num_warps=1, num_stages=1)  # 3 heads, 10 tokens a tile
    check(seed, [19, 1], [0, 45], 2, 9, 3, 64, 64, 1, torch.float32, config=cfg, kv_fp8=True)


@pytest.mark.parametrize("kernel", ["1", "0"])  # the Triton launches, then the references
def test_paged_attention_fp8_passes_scales_on(seed, monkeypatch, kernel):
    monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
    q, k, v, bt, rows, lens, indptr = make_inputs([4, 9], [3, 0], 2, 8, 2, 64, 64, 16, torch.float32)
    kq, vq, ks, vs = fp8_caches(k, v, bt, rows, lens, 16)
    out = torch.ops.kiln.paged_attention(q, kq, vq, bt, rows, lens, indptr, 0.125, 16, 2, -1, 0.0, ks, vs)
    ref = extend_attention_ref(q, kq, vq, bt, rows, lens, indptr, 0.125, 16, -1, 0.0, ks, vs)
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"
    out = torch.ops.kiln.paged_attention(q[:2], kq, vq, bt, rows, lens, indptr, 0.125, 16, 2, -1, 0.0, ks, vs)
    ref = decode_attention_ref(q[:2], kq, vq, bt, rows, lens, 0.125, 16, 2, -1, 0.0, ks, vs)
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"
    with pytest.raises(ValueError, match="k_scale must be a float32"):
        torch.ops.kiln.paged_attention(q, kq, vq, bt, rows, lens, indptr, 0.125, 16, 2, -1, 0.0)


def test_extend_fp8_accuracy_vs_bf16_cache(triton_on_cpu, seed):
    """What FP8 KV costs in prefill: bf16 caches quantized per row (``quantize_kv_rows``, the
    bytes qkv_rope_kvwrite writes), the kernel over them vs the reference over the bf16 caches.
    Relative error measured over 300 seeds (reference math): mean 3.4e-2, max 3.7e-2; bound 5e-2."""
    q, k, v, bt, rows, lens, indptr = make_inputs([20, 6], [10, 30], 0, 8, 2, 64, 64, 16, torch.bfloat16)
    (kq, ks), (vq, vs) = quantize_kv_rows(k.float()), quantize_kv_rows(v.float())
    ref = extend_attention_ref(q, k, v, bt, rows, lens, indptr, 0.125, 16, -1, 0.0)
    out = torch.ops.kiln.extend_attention(q, kq, vq, bt, rows, lens, indptr, 0.125, 16, -1, 0.0, ks, vs)
    err = rel_err(out, ref)
    assert err < 5e-2, f"seed {seed}: FP8 KV relative error {err:.2e}"
    assert err > 1e-3, f"seed {seed}: {err:.2e}: the FP8 caches look unquantized"


class TinyAttention(torch.nn.Module):
    """Calls both ops the way a traced layer does (caches are per-layer views of [L, S, H, D])."""

    def forward(self, q_ext, q_dec, k_cache, v_cache, block_table, rows, lens, indptr, dec_rows, dec_lens):
        ext = torch.ops.kiln.extend_attention(
            q_ext, k_cache[1], v_cache[1], block_table, rows, lens, indptr, 0.125, 16, -1, 0.0
        )
        dec = torch.ops.kiln.decode_attention(
            q_dec, k_cache[1], v_cache[1], block_table, dec_rows, dec_lens, 0.125, 16, 2, -1, 0.0
        )
        return ext.flatten(1), dec.flatten(1)


def test_export_round_trip(triton_on_cpu, seed):
    q, k, v, bt, rows, lens, indptr = make_inputs([6, 3], [10, 0], 2, 8, 2, 64, 64, 16, torch.float32)
    k_cache, v_cache = torch.stack([torch.randn_like(k), k]), torch.stack([torch.randn_like(v), v])
    q_dec = torch.randn(2, 8, 64)
    args = (q, q_dec, k_cache, v_cache, bt, rows, lens, indptr, rows.flip(0), lens.flip(0))
    ep = torch.export.export(TinyAttention(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"kiln.extend_attention.default", "kiln.decode_attention.default"} <= targets, targets
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    ext, dec = torch.export.load(buf).module()(*args)
    ref_ext = extend_attention_ref(q, k, v, bt, rows, lens, indptr, 0.125, 16, -1, 0.0)
    ref_dec = decode_attention_ref(q_dec, k, v, bt, rows.flip(0), lens.flip(0), 0.125, 16, 2, -1, 0.0)
    assert rel_err(ext, ref_ext.flatten(1)) < 1e-5, f"seed {seed}"
    assert rel_err(dec, ref_dec.flatten(1)) < 1e-5, f"seed {seed}"


# --------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_gpu_llama_shapes(seed, dtype, page_size):
    check(seed, [4096], [4096], 0, 32, 8, 128, 128, page_size, dtype, device="cuda")
    check(seed, [1000, 77, 2000, 1], [3000, 0, 129, 5000], 18, 32, 8, 128, 128, page_size, dtype,
          device="cuda")  # fmt: skip
    check(seed, [700, 30], [900, 0], 5, 16, 2, 256, 256, page_size, dtype, window=512, cap=30.0,
          device="cuda")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("pack", [1, 2, 4])
def test_extend_gpu_pack_variants(seed, pack):
    cfg = ExtendConfig(block_m=128, block_n=64, pack=pack, num_warps=8, num_stages=2)
    check(seed, [1500, 33], [2000, 0], 7, 32, 8, 128, 128, 16, torch.bfloat16, config=cfg, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_gpu_fp8_cache(seed, page_size):
    check(seed, [4096], [4096], 0, 32, 8, 128, 128, page_size, torch.bfloat16, device="cuda", kv_fp8=True)
    check(seed, [1000, 77, 2000, 1], [3000, 0, 129, 5000], 18, 32, 8, 128, 128, page_size, torch.bfloat16,
              device="cuda", kv_fp8=True)  # fmt: skip
    check(seed, [700, 30], [900, 0], 5, 16, 2, 256, 256, page_size, torch.bfloat16, window=512, cap=30.0,
              device="cuda", kv_fp8=True)  # fmt: skip
