"""kiln::qkv_rope_kvwrite at Llama-3.1-8B shapes (Hq=32, Hkv=8, D=128, bf16) against torch eager
(the reference composition) and torch.compile of it.

Bytes counted: read qkv, write q, write k and v, read one cos/sin row, read positions and slots
per token. ``frac_bw`` is that over the same session's measured read bandwidth. Target on an
H200: >= 0.70 at 4096 tokens. ``test_block_h_sweep`` times the kernel's launch choices so the
heuristic in ``ops/attention/qkv_rope.py:_pick_block_h`` can be checked against the best one.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SMOKE, pick

from kiln.ops.attention.qkv_rope import qkv_rope_kvwrite_ref, qkv_rope_kvwrite_triton
from kiln.ops.attention.rope import rope_cos_sin_cache

HQ, HKV, D = pick(32, 4), pick(8, 2), pick(128, 64)
MAX_POS = pick(131072, 2048)
PAGE = 16
EPS = 1e-6
DEV = "cpu" if SMOKE else "cuda"
TOKENS = [1, 8, 64, 256, 4096]


def _setup(tokens: int, norm: bool = False, seed: int = 0):
    """Inputs for one call: pages of 16 slots scattered over a two-layer pool, layer 1 written."""
    g = torch.Generator().manual_seed(seed)
    t = pick(tokens, min(tokens, 8))
    n_pages = (t + PAGE - 1) // PAGE
    pool_pages = max(4 * n_pages, pick(8192, 8))
    pages = torch.randperm(pool_pages - 1, generator=g)[:n_pages] + 1  # page 0 holds the sink
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:t]
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, MAX_POS, (t,), generator=g)
    pool = torch.zeros(2, pool_pages * PAGE, HKV, D, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(2, D, generator=g)).to(torch.bfloat16) if norm else None
    to = lambda x: None if x is None else x.to(DEV)
    cos_sin = rope_cos_sin_cache(D, MAX_POS, 500000.0, None, device=DEV)
    args = (to(qkv), to(positions), cos_sin, to(pool)[1], to(pool.clone())[1], to(slots), HQ, HKV, D, D, True)
    norms = (None, None) if w is None else (to(w[0]), to(w[1]))
    return args + (*norms, EPS, None, None)  # bf16 caches: no FP8 scales


def _bytes(t: int) -> float:
    es = 2  # bf16
    return t * ((HQ + 2 * HKV) * D * es + HQ * D * es + 2 * HKV * D * es + D * 4 + 16)


def _check(args, q: torch.Tensor) -> None:
    """The timed kernel's last result matches the reference (q and the written cache rows)."""
    k, v, slots = args[3], args[4], args[5]
    k_ref, v_ref = torch.zeros_like(k), torch.zeros_like(v)
    q_ref = qkv_rope_kvwrite_ref(*args[:3], k_ref, v_ref, *args[5:])
    for a, b in ((q, q_ref), (k[slots], k_ref[slots]), (v[slots], v_ref[slots])):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, err


@pytest.mark.parametrize("impl", ["triton", "eager", "compile"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_qkv_rope(measure, tokens, impl):
    if impl == "compile" and SMOKE:
        pytest.skip("torch.compile baseline runs on the GPU only")
    args = _setup(tokens)
    if impl == "triton":
        fn = lambda: qkv_rope_kvwrite_triton(*args)
    elif impl == "eager":
        fn = lambda: qkv_rope_kvwrite_ref(*args)
    else:
        compiled = torch.compile(qkv_rope_kvwrite_ref, dynamic=False)
        fn = lambda: compiled(*args)
    q = fn()  # warm up (JIT, compile)
    measure(fn, bytes=_bytes(args[0].shape[0]), tokens=tokens, impl=impl, shape=f"{HQ}x{HKV}x{D}")
    _check(args, q)


@pytest.mark.parametrize("impl", ["triton", "eager"])
@pytest.mark.parametrize("tokens", [1, 4096])
def test_qkv_rope_qk_norm(measure, tokens, impl):
    """Qwen3-style QK-norm on the same shapes: the norm should cost next to nothing."""
    args = _setup(tokens, norm=True)
    fn = (
        (lambda: qkv_rope_kvwrite_triton(*args))
        if impl == "triton"
        else (lambda: qkv_rope_kvwrite_ref(*args))
    )
    q = fn()
    measure(fn, bytes=_bytes(args[0].shape[0]), tokens=tokens, impl=impl, qk_norm=True)
    _check(args, q)


@pytest.mark.parametrize("num_warps", [2, 4, 8])
@pytest.mark.parametrize("block_h", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_block_h_sweep(measure, tokens, block_h, num_warps):
    if SMOKE and (tokens, block_h, num_warps) != (1, 4, 4):
        pytest.skip("the launch sweep runs on the GPU only")
    args = _setup(tokens)
    fn = lambda: qkv_rope_kvwrite_triton(*args, block_h=block_h, num_warps=num_warps)
    q = fn()
    measure(fn, bytes=_bytes(args[0].shape[0]), tokens=tokens, block_h=block_h, num_warps=num_warps)
    _check(args, q)
