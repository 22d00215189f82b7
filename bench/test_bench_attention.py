"""Paged attention kernels at Llama-3.1-8B shapes (Hq=32, Hkv=8, D=128, bf16, page size 16).

* decode at batch 1/8/32/64 and contexts 1k/8k/32k: ``bytes`` = K and V of every token read once
  + q + out, reported as a fraction of the measured read bandwidth (targets on H200: >= 75% at
  batch 32 / 8k, >= 50% at batch 1 / 32k); plus batch 1 at 512 and 8k tokens with ``num_splits``
  sized for a 32k bucket (``cap``), as the runtime's batch-1 graph runs them, where the kernels are
  latency bound. ``triton``: the split kernel and, with more than one split, the merge kernel;
* decode at a serving engine's shapes (``test_decode_engine``) with a bf16 and an FP8 KV cache
  (``kv``): FP8 ``bytes`` count one byte a cached value plus the float32 scale of each K and V head
  row (``kv_bytes_per_token``);
* a verify step's attention (5 new tokens per request at batch 1/8/32 over 512 and 4k tokens) on
  ``kiln::verify_attention`` and on extend attention: ``bytes`` as decode's, each request's K and V;
* extend of 4096 new tokens over a 0 and a 4k prefix: ``flops`` = 4 * Hq * D * (visible keys
  summed over queries), as a fraction of the measured bf16 matmul rate (target >= 50% over 4k).

Each beside ``sdpa`` (torch eager: gather K/V by slot, then scaled_dot_product_attention) and, on
a GPU, ``compiled`` (torch.compile of the dense reference math). On a GPU every variant is timed
as a CUDA-graph replay, as the runtime runs it, so host dispatch does not count. The ``*_sweep``
benchmarks time kernel configurations at the target shapes, to retune the defaults in
ops/attention/decode.py and ops/attention/extend.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOKE, pick

from kiln.ops.attention.decode import DecodeConfig, choose_num_splits, decode_attention_triton
from kiln.ops.attention.extend import ExtendConfig, extend_attention_triton
from kiln.ops.attention.qkv_rope import quantize_kv_rows
from kiln.ops.attention.reference import random_block_table, request_slots
from kiln.ops.attention.verify import verify_attention_triton

HQ, HKV, D = pick(32, 4), pick(8, 2), pick(128, 32)
PAGE = 16
DTYPE = torch.bfloat16
DEV = "cpu" if SMOKE else "cuda"


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture ``fn`` in a CUDA graph and return its replay (on CPU: ``fn`` itself)."""
    if SMOKE:
        return fn
    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _paged(lens: list[int], page: int = PAGE):
    block_table, req_rows, num_slots = random_block_table(lens, page, DEV)
    k_cache = torch.randn(num_slots, HKV, D, dtype=DTYPE, device=DEV)
    v_cache = torch.randn(num_slots, HKV, D, dtype=DTYPE, device=DEV)
    rows = req_rows.tolist()
    slots = torch.stack([request_slots(block_table, r, lens[0], page) for r in rows])  # [B, L]
    return k_cache, v_cache, block_table, req_rows, torch.tensor(lens, dtype=torch.int32, device=DEV), slots


def _dense_reference(q, k_cache, v_cache, slots, scale: float, prefix: int):
    """The reference math on uniform lengths, batched: q ``[B, n, Hq, D]``, slots ``[B, L]``."""
    b, n, hq, d = q.shape
    k = k_cache[slots].float()  # [B, L, Hkv, D]
    v = v_cache[slots].float()
    hkv = k.shape[2]
    qf = q.float().view(b, n, hkv, hq // hkv, d)
    s = torch.einsum("bnhgd,blhd->bhgnl", qf, k) * scale  # [B, Hkv, G, n, L]
    qpos = prefix + torch.arange(n, device=q.device)
    kpos = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    o = torch.einsum("bhgnl,blhd->bnhgd", torch.softmax(s, dim=-1), v)
    return o.reshape(b, n, hq, d).to(q.dtype)


def _sdpa(q, k_cache, v_cache, slots, scale: float, prefix: int):
    """Eager baseline: gather K/V by slot, expand the GQA heads, then SDPA (bottom-right causal)."""
    n, hq = q.shape[1], q.shape[2]
    group = hq // k_cache.shape[1]
    k = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[slots].transpose(1, 2)
    qt = q.transpose(1, 2)  # [B, Hq, n, D]
    if n == 1:  # no mask: GQA handled inside SDPA
        return F.scaled_dot_product_attention(qt, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, L, D]: the masked backends want equal heads
    v = v.repeat_interleave(group, dim=1)
    mask = torch.ones(n, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=prefix)
    return F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


_compiled_reference = None


def _compiled(*args):
    global _compiled_reference
    if _compiled_reference is None:
        for knob in ("recompile_limit", "cache_size_limit"):  # one graph per benchmark shape
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
        _compiled_reference = torch.compile(_dense_reference, dynamic=True)
    return _compiled_reference(*args)


IMPLS = ["triton", "sdpa", "compiled"]


def _skip_impl(impl: str) -> None:
    if impl == "compiled" and SMOKE:
        pytest.skip("torch.compile baseline runs on the GPU only")


# --------------------------------------------------------------------------- decode
def kv_bytes_per_token(kv: str) -> int:
    """Bytes decode attention reads per cached token: K and V rows of every KV head, plus their
    float32 scales for an FP8 cache."""
    if kv == "fp8":
        return 2 * HKV * (D + 4)
    return 2 * HKV * D * DTYPE.itemsize


def _decode_case(batch: int, ctx: int, page: int = PAGE, kv: str = "bf16"):
    """A decode batch over ``[ctx] * batch`` tokens. ``kv="fp8"``: the caches quantized per row
    (``quantize_kv_rows``, what qkv_rope_kvwrite writes); ``kv_scales`` is then ``(k_scale,
    v_scale)`` (the ops' trailing arguments), else ``()``."""
    k_cache, v_cache, bt, rows, lens, slots = _paged([ctx] * batch, page)
    kv_scales: tuple[torch.Tensor, ...] = ()
    if kv == "fp8":
        k_cache, k_scale = quantize_kv_rows(k_cache.float())
        v_cache, v_scale = quantize_kv_rows(v_cache.float())
        kv_scales = (k_scale, v_scale)
    q = torch.randn(batch, HQ, D, dtype=DTYPE, device=DEV)
    nbytes = batch * ctx * kv_bytes_per_token(kv) + 2 * q.numel() * q.element_size()
    return q, k_cache, v_cache, bt, rows, lens, slots, nbytes, kv_scales


DECODE_IMPLS = ["triton", "sdpa", "compiled"]
# (batch, ctx, cap): num_splits is chosen for a bucket of ``cap`` tokens, as the runtime sizes it
# for the block table's capacity; ``cap > ctx`` leaves most splits without keys
DECODE_CASES = pick(
    [(b, c, c) for b in (1, 8, 32, 64) for c in (1024, 8192, 32768)]
    + [(1, 512, 512), (1, 512, 32768), (1, 8192, 32768)],
    [(1, 40, 40), (3, 40, 40), (1, 40, 2048)],
)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
@pytest.mark.parametrize("batch, ctx, cap", DECODE_CASES)
def test_decode(measure, batch, ctx, cap, impl):
    _skip_impl(impl)
    if cap != ctx and impl != "triton":
        pytest.skip("the baselines do not split: same as the cap == ctx case")
    q, k_cache, v_cache, bt, rows, lens, slots, nbytes, _ = _decode_case(batch, ctx)
    scale = D**-0.5
    splits = choose_num_splits(batch, cap, HKV)
    if impl == "triton":
        fn = lambda: decode_attention_triton(
            q, k_cache, v_cache, bt, rows, lens, scale, PAGE, splits, -1, 0.0
        )
    else:
        base = _sdpa if impl == "sdpa" else _compiled
        fn = lambda: base(q[:, None], k_cache, v_cache, slots, scale, ctx - 1)
    out = fn()
    assert out.shape[-1] == D and not out.isnan().any()
    measure(_graphed(fn), bytes=nbytes, impl=impl, batch=batch, ctx=ctx, num_splits=splits)


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("splits_factor", [0.25, 0.5, 1, 2, 4])
@pytest.mark.parametrize("cfg", [(32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 2), (32, 4, 4)])
@pytest.mark.parametrize("batch, ctx", [(32, 8192), (1, 32768)])
def test_decode_sweep(measure, batch, ctx, cfg, splits_factor):
    q, k_cache, v_cache, bt, rows, lens, _, nbytes, _ = _decode_case(batch, ctx)
    config = DecodeConfig(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    splits = max(1, round(choose_num_splits(batch, ctx, HKV) * splits_factor))
    fn = lambda: decode_attention_triton(
        q, k_cache, v_cache, bt, rows, lens, D**-0.5, PAGE, splits, -1, 0.0, config=config
    )
    measure(_graphed(fn), bytes=nbytes, batch=batch, ctx=ctx, num_splits=splits, config=str(config))


# The shapes a serving engine's decode steps run (issue 27): batch 64-256 at 512-1024 tokens, num_splits
# sized for the engine's 32k block table, pages scattered over the pool as after hours of traffic
# (page size 1: every key row on its own; 16: runs of 16 rows).
ENGINE_CASES = pick(
    [(b, c, p) for b in (64, 128, 256) for c in (512, 1024) for p in (1, 16)],
    [(3, 40, 1), (3, 40, 16)],
)
ENGINE_CAP = pick(32768, 2048)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("batch, ctx, page", ENGINE_CASES)
def test_decode_engine(measure, batch, ctx, page, kv):
    q, k_cache, v_cache, bt, rows, lens, _, nbytes, kv_scales = _decode_case(batch, ctx, page, kv)
    splits = choose_num_splits(batch, ENGINE_CAP, HKV)
    fn = lambda: decode_attention_triton(
        q, k_cache, v_cache, bt, rows, lens, D**-0.5, page, splits, -1, 0.0, *kv_scales
    )
    out = fn()
    assert out.shape == (batch, HQ, D) and not out.isnan().any()
    measure(_graphed(fn), bytes=nbytes, batch=batch, ctx=ctx, page=page, num_splits=splits, kv=kv)


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("splits", ["auto", "one", "double"])
@pytest.mark.parametrize(
    "cfg",
    [(64, 4, 2), (128, 8, 2), (64, 4, 3), (32, 4, 2), (64, 8, 2), (128, 4, 2), (128, 8, 3), (32, 2, 3)],
    ids=lambda c: "n{}-w{}-s{}".format(*c),  # (block_n, warps, stages)
)  # fmt: skip
@pytest.mark.parametrize("batch, ctx, page", [(64, 512, 1), (64, 512, 16), (256, 1024, 1), (256, 1024, 16)])
def test_decode_engine_sweep(measure, batch, ctx, page, cfg, splits, kv):
    q, k_cache, v_cache, bt, rows, lens, _, nbytes, kv_scales = _decode_case(batch, ctx, page, kv)
    config = DecodeConfig(*cfg)
    auto = choose_num_splits(batch, ENGINE_CAP, HKV)
    n = {"auto": auto, "one": 1, "double": 2 * auto}[splits]
    fn = lambda: decode_attention_triton(
        q, k_cache, v_cache, bt, rows, lens, D**-0.5, page, n, -1, 0.0, *kv_scales, config=config
    )
    measure(
        _graphed(fn), bytes=nbytes, batch=batch, ctx=ctx, page=page, num_splits=n, config=str(config), kv=kv
    )


# --------------------------------------------------------------------------- extend
def _extend_case(new: int, prefix: int):
    k_cache, v_cache, bt, rows, lens, slots = _paged([prefix + new])
    q = torch.randn(new, HQ, D, dtype=DTYPE, device=DEV)
    indptr = torch.tensor([0, new], dtype=torch.int32, device=DEV)
    visible = new * prefix + new * (new + 1) // 2  # keys summed over queries
    return q, k_cache, v_cache, bt, rows, lens, indptr, slots, 4 * HQ * D * visible


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("prefix", pick([0, 4096], [0, 20]))
def test_extend(measure, prefix, impl):
    _skip_impl(impl)
    new = pick(4096, 24)
    q, k_cache, v_cache, bt, rows, lens, indptr, slots, flops = _extend_case(new, prefix)
    scale = D**-0.5
    if impl == "triton":
        fn = lambda: extend_attention_triton(
            q, k_cache, v_cache, bt, rows, lens, indptr, scale, PAGE, -1, 0.0
        )
    else:
        base = _sdpa if impl == "sdpa" else _compiled
        fn = lambda: base(q[None], k_cache, v_cache, slots, scale, prefix)
    out = fn()
    assert out.shape[-1] == D and not out.isnan().any()
    measure(_graphed(fn), flops=flops, impl=impl, new_tokens=new, prefix=prefix)


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize(
    "cfg",
    [
        (128, 64, 4, 8, 2), (128, 64, 1, 8, 2), (128, 64, 2, 8, 2), (128, 64, 4, 8, 3),
        (128, 128, 4, 8, 2), (128, 128, 1, 8, 2), (128, 32, 4, 8, 4), (64, 64, 4, 4, 3),
        (64, 64, 1, 4, 3), (128, 64, 4, 4, 2),
    ],
)  # fmt: skip
@pytest.mark.parametrize("prefix", [0, 4096])
def test_extend_sweep(measure, prefix, cfg):
    q, k_cache, v_cache, bt, rows, lens, indptr, _, flops = _extend_case(4096, prefix)
    config = ExtendConfig(block_m=cfg[0], block_n=cfg[1], pack=cfg[2], num_warps=cfg[3], num_stages=cfg[4])
    fn = lambda: extend_attention_triton(
        q, k_cache, v_cache, bt, rows, lens, indptr, D**-0.5, PAGE, -1, 0.0, config=config
    )
    measure(_graphed(fn), flops=flops, prefix=prefix, config=str(config))


# --------------------------------------------------------------------------- verify
VERIFY_CASES = pick([(1, 512), (1, 4096), (8, 512), (32, 512)], [(2, 40)])


def _verify_case(batch: int, ctx: int):
    """A verify step's inputs: 5 new tokens per request (k = 4) over ``ctx`` cached ones, the
    block table as wide as the engine's (``ENGINE_CAP`` keys: the automatic split count reads its
    width), and the bytes read (each request's K and V once)."""
    new = 5
    k_cache, v_cache, bt, rows, lens, _ = _paged([ctx + new] * batch)
    bt = torch.nn.functional.pad(bt, (0, ENGINE_CAP // PAGE - bt.shape[1]))
    q = torch.randn(batch * new, HQ, D, dtype=DTYPE, device=DEV)
    indptr = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=DEV)
    nbytes = batch * (ctx + new) * HKV * D * 2 * DTYPE.itemsize
    return (q, k_cache, v_cache, bt, rows, lens, indptr, D**-0.5, PAGE), nbytes


@pytest.mark.parametrize("impl", ["verify", "extend"])
@pytest.mark.parametrize("batch, ctx", VERIFY_CASES)
def test_verify(measure, batch, ctx, impl):
    """A speculative verify step's attention on ``kiln::verify_attention`` (split over the keys, as
    many splits as the engine's graphs pick: 0, automatic) and on extend attention."""
    args, nbytes = _verify_case(batch, ctx)
    if impl == "verify":
        fn = lambda: verify_attention_triton(*args, 0, 0.0)
    else:
        fn = lambda: extend_attention_triton(*args, -1, 0.0)
    out = fn()
    assert out.shape == args[0].shape and not out.isnan().any()
    measure(_graphed(fn), bytes=nbytes, batch=batch, ctx=ctx, impl=impl)


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("rule", ["auto", "decode"])
@pytest.mark.parametrize("min_chunk", [32, 64, 128, 256])
@pytest.mark.parametrize("batch, ctx", VERIFY_CASES)
def test_verify_sweep(measure, batch, ctx, min_chunk, rule):
    """``kiln::verify_attention``'s fewest keys per split (ops/attention/verify.py ``MIN_CHUNK``)
    under its automatic split count (``PROGRAMS_PER_SM``) and under decode's."""
    args, nbytes = _verify_case(batch, ctx)
    splits = 0 if rule == "auto" else choose_num_splits(batch, ENGINE_CAP, HKV)
    fn = lambda: verify_attention_triton(*args, splits, 0.0, min_chunk=min_chunk)
    measure(_graphed(fn), bytes=nbytes, batch=batch, ctx=ctx, min_chunk=min_chunk, rule=rule)


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("merge_tile", [4, 8, 16, 64])
@pytest.mark.parametrize("batch, ctx", VERIFY_CASES)
def test_verify_merge_sweep(measure, batch, ctx, merge_tile):
    """``kiln::verify_attention``'s splits per merge pass (ops/attention/verify.py ``MERGE_TILE``),
    automatic split count."""
    args, nbytes = _verify_case(batch, ctx)
    fn = lambda: verify_attention_triton(*args, 0, 0.0, merge_tile=merge_tile)
    measure(_graphed(fn), bytes=nbytes, batch=batch, ctx=ctx, merge_tile=merge_tile)


def test_bench_bytes_and_flops_formulas():
    # the figures the fractions rest on, checked on a case small enough to count by hand
    *_, nbytes, _ = _decode_case(2, 48)
    assert nbytes == 2 * 2 * 48 * HKV * D * 2 + 2 * 2 * HQ * D * 2
    _, k_cache, _, _, _, _, _, nbytes, (k_scale, _) = _decode_case(2, 48, kv="fp8")
    assert k_cache.dtype == torch.float8_e4m3fn and k_scale.shape == k_cache.shape[:2]
    assert nbytes == 2 * 48 * (2 * HKV * D * 1 + 2 * HKV * 4) + 2 * 2 * HQ * D * 2
    *_, flops = _extend_case(3, 5)
    assert flops == 4 * HQ * D * (6 + 7 + 8)
    assert math.isfinite(flops)
