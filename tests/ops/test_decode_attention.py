"""Paged decode attention: the Triton kernels (interpreter on CPU, real on GPU) vs the torch
reference, on fresh random inputs with NaN-poisoned outputs and intermediates.

Tolerances: relative error ||out - ref|| / ||ref|| below 1e-5 in float32 (the interpreter computes
``tl.dot`` in float32 numpy, GPU float32 runs with ``input_precision="ieee"``; both land near 1e-7)
and below 1e-2 in bfloat16 (the kernel rounds the softmax weights to bf16 before P @ V, as flash
attention does; that alone costs a few 1e-3). FP8 caches are checked against the reference on the
same caches with the same bounds: float32 q measured ~5e-7; bfloat16 q up to 8e-3 over 40 seeds
(the weights times the value scales are no longer the exact 1.0 of the largest key, and the
interpreter truncates their bf16 cast where the GPU rounds: a bias of about -3e-3).

Interpreter cost is about 2 ms per program even for a split that exits at once, so the grids
here stay small.
"""

import random

import pytest
import torch

from kiln.ops.attention import decode as dec
from kiln.ops.attention.qkv_rope import qkv_rope_kvwrite_ref, qkv_rope_kvwrite_triton
from kiln.ops.attention.reference import decode_attention_ref, random_block_table, request_slots
from kiln.ops.attention.rope import rope_cos_sin_cache

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture
def seed():
    s = random.randrange(2**31)
    torch.manual_seed(s)
    return s


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route the op to the Triton kernel under the interpreter, and poison every float buffer the
    op allocates with ``torch.empty`` (output, split partials) with NaN."""
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_inputs(seq_lens, hq, hkv, d, dv, page_size, dtype, device="cpu"):
    block_table, req_rows, num_slots = random_block_table(seq_lens, page_size, device)
    q = torch.randn(len(seq_lens), hq, d, dtype=dtype, device=device)
    k_cache = torch.randn(num_slots, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(num_slots, hkv, dv, dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_table, req_rows, lens


def check(seed, seq_lens, hq, hkv, d, dv, page_size, num_splits, dtype, window=-1, cap=0.0, device="cpu",
          kv_fp8=False):  # fmt: skip
    """The op vs the reference on fresh inputs; ``kv_fp8``: on FP8 caches (:func:`fp8_caches`),
    which the reference dequantizes at gather."""
    q, k, v, bt, rows, lens = make_inputs(seq_lens, hq, hkv, d, dv, page_size, dtype, device)
    scales = ()
    if kv_fp8:
        k, v, *scales = fp8_caches(k, v, bt, rows, lens, page_size)
    args = (q, k, v, bt, rows, lens, d**-0.5, page_size, num_splits, window, cap, *scales)
    out = torch.ops.kiln.decode_attention(*args)
    ref = decode_attention_ref(*args)
    assert out.shape == (len(seq_lens), hq, dv) and out.dtype == dtype
    assert not out.isnan().any(), f"seed {seed}: NaN in output (unwritten, 0/0, or a masked key's NaN read)"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e}"
    return out


@pytest.mark.parametrize(
    "seq_lens, hq, hkv, d, dv, page_size, num_splits, dtype",
    [
        ([1], 8, 2, 64, 64, 16, 1, torch.float32),  # one token
        ([1, 37, 70], 12, 3, 64, 64, 16, 3, torch.float32),  # Hq=12, Hkv=3; pages crossed
        ([5, 33], 8, 8, 64, 64, 1, 1, torch.bfloat16),  # ratio 1, page size 1, direct write
        ([1, 100, 20], 16, 2, 128, 128, 16, 8, torch.bfloat16),  # ratio 8, more splits than needed
        ([9, 24], 4, 1, 256, 256, 1, 2, torch.float32),  # head_dim 256, MQA
        ([17, 50], 8, 2, 64, 32, 16, 4, torch.bfloat16),  # Dv != D
        ([30], 4, 2, 80, 48, 1, 2, torch.float32),  # head dims that are not powers of two
    ],
)
def test_decode_matches_reference(
    triton_on_cpu, seed, seq_lens, hq, hkv, d, dv, page_size, num_splits, dtype
):
    check(seed, seq_lens, hq, hkv, d, dv, page_size, num_splits, dtype)


@pytest.mark.parametrize(
    "window, cap, dtype",
    [
        (5, 0.0, torch.float32),
        (-1, 5.0, torch.float32),
        (20, 30.0, torch.bfloat16),
        (500, 0.0, torch.float32),
    ],
)
def test_decode_window_and_softcap(triton_on_cpu, seed, window, cap, dtype):
    check(seed, [3, 41, 66], 8, 2, 64, 64, 16, 3, dtype, window=window, cap=cap)


def test_decode_long_context(triton_on_cpu, seed):
    # positions far into a long context, over many scattered pages
    check(seed, [3000, 2500], 4, 1, 64, 64, 16, 4, torch.bfloat16)


def test_decode_empty_sequence_gives_zeros(triton_on_cpu, seed):
    q, k, v, bt, rows, _ = make_inputs([1, 40], 8, 2, 64, 64, 16, torch.float32)
    lens = torch.tensor([0, 40], dtype=torch.int32)
    args = (q, k, v, bt, rows, lens, 0.125, 16, 4, -1, 0.0)
    out = torch.ops.kiln.decode_attention(*args)
    ref = decode_attention_ref(*args)
    assert torch.equal(out[0], torch.zeros_like(out[0])), f"seed {seed}"
    assert rel_err(out[1], ref[1]) < 1e-5, f"seed {seed}"


# Mixed batches: empty, one token, page-boundary (16, 32) and page-crossing (17) lengths, and one
# long enough for many active splits; 16 splits leave most of them empty for the short requests.
MIXED = [0, 1, 16, 17, 32, 150]


@pytest.mark.parametrize(
    "hq, hkv, d, dtype",
    [
        (2, 2, 64, torch.float32),  # GQA 1
        (8, 2, 128, torch.bfloat16),  # GQA 4
        (8, 1, 256, torch.float32),  # GQA 8, head_dim 256
    ],
)
def test_decode_mixed_lengths_many_splits(triton_on_cpu, seed, hq, hkv, d, dtype):
    check(seed, MIXED, hq, hkv, d, d, 16, 16, dtype)


def test_decode_splits_far_above_active(triton_on_cpu, seed):
    # a bucket sized for a long context (128 splits) serving 40 tokens: 3 active splits
    check(seed, [40, 1], 4, 1, 64, 64, 16, 128, torch.float32)


@pytest.mark.parametrize("window, cap", [(20, 30.0), (33, 0.0)])
def test_decode_window_softcap_many_splits(triton_on_cpu, seed, window, cap):
    # the window moves the first key block (base > 0) and so which splits are active
    check(seed, [0, 1, 37, 100], 8, 1, 64, 64, 16, 32, torch.float32, window=window, cap=cap)


@pytest.mark.parametrize("prewait", ["none", "attn"])
def test_decode_prewait_split_and_direct(triton_on_cpu, seed, monkeypatch, prewait):
    # the first block's K/V loaded before the wait (PREWAIT), the new row's after it, or all after:
    # same output, split or direct
    monkeypatch.setenv("KILN_PREWAIT", prewait)
    q, k, v, bt, rows, lens = make_inputs([0, 1, 37, 50], 8, 2, 64, 64, 1, torch.float32)
    ref = decode_attention_ref(q, k, v, bt, rows, lens, 0.125, 1, 1, -1, 0.0)
    for splits in (1, 3):
        out = dec.decode_attention_triton(q, k, v, bt, rows, lens, 0.125, 1, splits, -1, 0.0)
        assert rel_err(out, ref) < 1e-5, f"seed {seed}, {splits} splits"


# --------------------------------------------------------------------------- FP8 KV caches
FP8 = torch.float8_e4m3fn
FP8_NAN = 0x7F  # an e4m3fn NaN byte


def fp8_caches(k, v, block_table, req_rows, seq_lens, page_size):
    """FP8 caches standing for random rows: e4m3 values of ``k``/``v`` with random per-row scales
    ``[S, Hkv]`` (log-normal, a factor e^±1 around 1, different for K and V, so that a kernel that
    drops or misplaces a scale is far off). Slots no request reads hold NaN rows and NaN scales: a
    masked key must read neither. Returns ``(k_fp8, v_fp8, k_scale, v_scale)``."""
    used = torch.zeros(k.shape[0], dtype=torch.bool, device=k.device)
    for r, n in zip(req_rows.tolist(), seq_lens.tolist()):
        used[request_slots(block_table, r, n, page_size)] = True
    out = []
    for x in (k, v):
        q = x.float().to(FP8)
        q.view(torch.uint8)[~used] = FP8_NAN
        out.append(q)
    for x in (k, v):
        scale = torch.exp(0.5 * torch.randn(x.shape[:2], device=x.device))
        scale[~used] = float("nan")
        out.append(scale)
    return tuple(out)


@pytest.mark.parametrize(
    "seq_lens, hq, hkv, d, dv, page_size, num_splits, dtype, window, cap",
    [
        ([1, 37, 70], 8, 2, 64, 64, 16, 1, torch.bfloat16, -1, 0.0),  # direct write
        ([0, 1, 17, 50], 8, 2, 64, 64, 16, 4, torch.bfloat16, -1, 0.0),  # split + merge, empty request
        ([3, 41, 66], 8, 2, 64, 64, 16, 3, torch.float32, -1, 0.0),  # float32 q: tight check
        ([3, 41, 66], 8, 2, 64, 64, 16, 3, torch.float32, 20, 30.0),  # sliding window + soft-cap
        ([5, 33], 4, 4, 64, 32, 1, 2, torch.bfloat16, 9, 0.0),  # Dv != D, page size 1, window
    ],
)
def test_decode_fp8_matches_reference(
    triton_on_cpu, seed, seq_lens, hq, hkv, d, dv, page_size, num_splits, dtype, window, cap
):
    check(seed, seq_lens, hq, hkv, d, dv, page_size, num_splits, dtype, window, cap, kv_fp8=True)


def test_decode_fp8_accuracy_vs_bf16_cache(triton_on_cpu, seed):
    """What FP8 KV costs: K and V written through qkv_rope_kvwrite's FP8 path (per-row amax
    scales), decode attention over them vs the reference over the same rows in a bf16 cache.
    Relative error measured over 300 seeds (reference math): mean 3.3e-2, max 3.8e-2; bound 5e-2.
    (Channels of unequal magnitudes cost more: with each channel scaled by e^(0.3 N(0, 1)), mean
    3.7e-2, max 4.8e-2 at longer lengths.)"""
    hq, hkv, d, page = 8, 2, 64, 16
    lens = [12, 30, 20, 17]
    bt, rows, num_slots = random_block_table(lens, page)
    total = sum(lens)
    cs = rope_cos_sin_cache(d, 128, 10000.0, None)
    qkv = torch.randn(total, (hq + 2 * hkv) * d).bfloat16()  # the projection of every cached token
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([request_slots(bt, r, n, page) for r, n in zip(rows.tolist(), lens)])
    meta = (hq, hkv, d, d, True, None, None, 1e-6)
    k16 = torch.zeros(num_slots, hkv, d, dtype=torch.bfloat16)
    v16 = torch.zeros_like(k16)
    qkv_rope_kvwrite_ref(qkv, positions, cs, k16, v16, slots, *meta, None, None)
    k8, v8 = torch.zeros(num_slots, hkv, d, dtype=FP8), torch.zeros(num_slots, hkv, d, dtype=FP8)
    ks, vs = torch.zeros(num_slots, hkv), torch.zeros(num_slots, hkv)
    q = qkv_rope_kvwrite_triton(qkv, positions, cs, k8, v8, slots, *meta, ks, vs, block_h=16)
    last = torch.tensor(lens).cumsum(0) - 1  # each request's newest token queries its cache
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ref = decode_attention_ref(q[last], k16, v16, bt, rows, lens_t, d**-0.5, page, 2, -1, 0.0)
    out = dec.decode_attention_triton(q[last], k8, v8, bt, rows, lens_t, d**-0.5, page, 2, -1, 0.0, ks, vs)
    err = rel_err(out, ref)
    assert err < 5e-2, f"seed {seed}: FP8 KV relative error {err:.2e}"
    assert err > 1e-3, f"seed {seed}: {err:.2e}: the FP8 caches look unquantized"


def test_kv_scale_errors_are_named(seed, monkeypatch):
    q, k, v, bt, rows, lens = make_inputs([4], 8, 2, 64, 64, 16, torch.bfloat16)
    kq, vq, ks, vs = fp8_caches(k, v, bt, rows, lens, 16)
    meta = (bt, rows, lens, 0.125, 16, 1, -1, 0.0)
    for kernel in ("1", "0"):  # the Triton launch, then the reference
        monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
        with pytest.raises(ValueError, match=r"k_scale must be a float32 \[.*\] tensor .* got None"):
            torch.ops.kiln.decode_attention(q, kq, vq, *meta)
        with pytest.raises(ValueError, match="v_scale must be a float32"):
            torch.ops.kiln.decode_attention(q, kq, vq, *meta, ks, vs[:, :1])
        with pytest.raises(ValueError, match=r"k_scale is only for .*float8_e4m3fn caches; pass None"):
            torch.ops.kiln.decode_attention(q, k, v, *meta, ks, vs)
        with pytest.raises(ValueError, match=r"must both be torch\.float8_e4m3fn or neither"):
            torch.ops.kiln.decode_attention(q, kq, v, *meta, ks, vs)


class _LaunchSpy:
    """Counts launches of a jitted kernel (``kernel[grid](...)``) and keeps the last one's keyword
    arguments, forwarding them."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.kwargs = kernel, 0, {}

    def __getitem__(self, grid):
        self.launches += 1

        def launch(*args, **kwargs):
            self.kwargs = kwargs
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_decode_fp8_cache_takes_no_prewait(triton_on_cpu, seed, monkeypatch):
    # with the attn pre-wait on, a 16-bit cache's split kernel loads its first block before the
    # wait and an FP8 cache's does not (its kernel spilled with them: the module docstring)
    monkeypatch.setenv("KILN_PREWAIT", "attn")
    q, k, v, bt, rows, lens = make_inputs([1, 37, 50], 8, 2, 64, 64, 1, torch.float32)
    k8, v8, *scales = fp8_caches(k, v, bt, rows, lens, 1)
    for cache, kv_scales, want in (((k, v), (), True), ((k8, v8), scales, False)):
        ref = decode_attention_ref(q, *cache, bt, rows, lens, 0.125, 1, 3, -1, 0.0, *kv_scales)
        spy = _LaunchSpy(dec._decode_split_kernel)
        monkeypatch.setattr(dec, "_decode_split_kernel", spy)
        out = dec.decode_attention_triton(q, *cache, bt, rows, lens, 0.125, 1, 3, -1, 0.0, *kv_scales)
        assert spy.kwargs["PREWAIT"] is want and spy.kwargs["KV_FP8"] is not want
        assert rel_err(out, ref) < 1e-5, f"seed {seed}, pre-wait {want}"


def test_decode_merge_launches(triton_on_cpu, seed, monkeypatch):
    # split partials are merged by a second kernel; with one split the split kernel writes the output
    q, k, v, bt, rows, lens = make_inputs([0, 1, 17, 50], 8, 2, 64, 64, 16, torch.float32)
    ref = decode_attention_ref(q, k, v, bt, rows, lens, 0.125, 16, 1, -1, 0.0)
    for splits, merge_launches in ((4, 1), (1, 0)):
        spy = _LaunchSpy(dec._decode_merge_kernel)
        monkeypatch.setattr(dec, "_decode_merge_kernel", spy)
        out = dec.decode_attention_triton(q, k, v, bt, rows, lens, 0.125, 16, splits, -1, 0.0)
        assert spy.launches == merge_launches, splits
        assert rel_err(out, ref) < 1e-5, f"seed {seed}, {splits} splits"


def test_choose_num_splits():
    # batch 1 at a long context: enough programs to fill 132 SMs several times over
    s = dec.choose_num_splits(1, 32768, 8)
    assert 8 * s >= 4 * 132 and s <= dec.MAX_SPLITS
    # a full batch needs no split; a short context never gets splits under MIN_KEYS_PER_SPLIT keys
    assert dec.choose_num_splits(64, 8192, 8) <= 3
    # batch x KV heads programs filling the SMs three times over: one split, no merge
    assert dec.choose_num_splits(64, 32768, 8) == dec.choose_num_splits(50, 32768, 8) == 1
    assert dec.choose_num_splits(48, 32768, 8) > 1
    assert dec.choose_num_splits(1, 300, 8) == 1
    assert all(
        dec.choose_num_splits(b, n, 8) >= dec.choose_num_splits(2 * b, n, 8)
        for b in (1, 4, 16)
        for n in (1024, 32768)
    )
    with pytest.raises(ValueError, match="batch"):
        dec.choose_num_splits(0, 1024, 8)


def test_cpu_path_is_reference(seed, monkeypatch):
    monkeypatch.delenv("KILN_TRITON_ON_CPU", raising=False)
    q, k, v, bt, rows, lens = make_inputs([7, 19], 8, 2, 64, 64, 16, torch.float32)
    args = (q, k, v, bt, rows, lens, 0.125, 16, 2, -1, 0.0)
    assert torch.equal(torch.ops.kiln.decode_attention(*args), decode_attention_ref(*args))


def test_bad_shapes_are_named(seed):
    q, k, v, bt, rows, lens = make_inputs([4], 6, 4, 64, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        torch.ops.kiln.decode_attention(q, k, v, bt, rows, lens, 0.125, 16, 1, -1, 0.0)


def test_negative_num_splits_is_named_on_both_paths(seed, monkeypatch):
    q, k, v, bt, rows, lens = make_inputs([4], 8, 2, 64, 64, 16, torch.float32)
    for kernel in ("1", "0"):  # the Triton launch, then the reference
        monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
        with pytest.raises(ValueError, match="num_splits must be >= 0"):
            torch.ops.kiln.decode_attention(q, k, v, bt, rows, lens, 0.125, 16, -1, -1, 0.0)


# --------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_gpu_llama_shapes(seed, dtype, page_size):
    lens = [1, 17, 1000, 4097, 8192, 300, 2048, 65]
    splits = dec.choose_num_splits(len(lens), 8192, 8)
    check(seed, lens, 32, 8, 128, 128, page_size, splits, dtype, device="cuda")
    check(seed, lens, 32, 8, 128, 128, page_size, 1, dtype, device="cuda")
    check(seed, lens[:3], 16, 2, 256, 256, page_size, 4, dtype, window=700, cap=30.0, device="cuda")
    # batch 1, ~600 tokens in a bucket sized for a long context: 10 of 128 splits active
    check(seed, [600], 32, 8, 128, 128, page_size, dec.MAX_SPLITS, dtype, device="cuda")
    check(seed, [0, 1, 64, 65, 600, 9000], 32, 8, 128, 128, page_size, dec.MAX_SPLITS, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_gpu_fp8_cache(seed, page_size):
    lens = [1, 17, 1000, 4097, 8192, 300, 2048, 65]
    splits = dec.choose_num_splits(len(lens), 8192, 8)
    check(seed, lens, 32, 8, 128, 128, page_size, splits, torch.bfloat16, device="cuda", kv_fp8=True)
    check(seed, lens, 32, 8, 128, 128, page_size, 1, torch.bfloat16, device="cuda", kv_fp8=True)
    check(
        seed, lens[:3], 16, 2, 256, 256, page_size, 4, torch.bfloat16, 700, 30.0, device="cuda", kv_fp8=True
    )
    check(seed, [0, 1, 64, 65, 600, 9000], 32, 8, 128, 128, page_size, dec.MAX_SPLITS, torch.bfloat16,
          device="cuda", kv_fp8=True)  # fmt: skip


@pytest.mark.gpu
def test_decode_gpu_cuda_graph_replay(seed):
    """One capture serves other sequence lengths: lengths are read on the device."""
    q, k, v, bt, rows, lens = make_inputs([4096] * 4, 32, 8, 128, 128, 16, torch.bfloat16, "cuda")
    lens.copy_(torch.tensor([5, 100, 2000, 4000], dtype=torch.int32))
    splits = dec.choose_num_splits(4, 4096, 8)
    args = (q, k, v, bt, rows, lens, 128**-0.5, 16, splits, -1, 0.0)
    torch.ops.kiln.decode_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kiln.decode_attention(*args)
    for new in ([1, 4096, 17, 3000], [4096, 4096, 4096, 1], [0, 600, 64, 65], [4096, 4096, 4096, 1]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = decode_attention_ref(*args)
        assert not out.isnan().any() and rel_err(out, ref) < 1e-2, f"seed {seed}, lens {new}"
