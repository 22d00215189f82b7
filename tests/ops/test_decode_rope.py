"""kiln::decode_rope_attention (ops/decode_rope.py) against qkv_rope_kvwrite's reference followed by
decode attention's: the Triton split kernel computing q and writing the new k / v itself
(interpreter on CPU, compiled on the GPU), both merge paths, argument checks and torch.export."""

from __future__ import annotations

import random

import pytest
import torch

from kiln.ops.attention_ref import decode_attention_ref, random_block_table
from kiln.ops.decode_rope import rope_in_attention
from kiln.ops.qkv_rope import qkv_rope_kvwrite_ref
from kiln.ops.rope import rope_cos_sin_cache

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture
def on_kernel(monkeypatch):
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _step(seq_lens, hq, hkv, d, rot, page, norm, dtype, device, seed):
    """A decode step's inputs: request b's new token sits at position ``seq_lens[b] - 1`` (a zero
    length is a padding row: slot 0, the sink)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # random_block_table draws from the global generator
    bt, rows, slots_total = random_block_table([max(n, 1) for n in seq_lens], page)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = (lens - 1).clamp_min(0).long()
    slot = [int(bt[r, p // page]) * page + p % page for r, p in zip(rows.tolist(), pos.tolist(), strict=True)]
    out_slots = torch.tensor([s if n else 0 for s, n in zip(slot, seq_lens, strict=True)])
    qkv = torch.randn(len(seq_lens), (hq + 2 * hkv) * d, generator=g).to(dtype)
    k_cache = torch.randn(slots_total, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(slots_total, hkv, d, generator=g).to(dtype)
    qw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype) if norm else None
    kw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype) if norm else None
    cs = rope_cos_sin_cache(rot, 4096, 10000.0, None)
    mv = lambda t: None if t is None else t.to(device)
    return [mv(x) for x in (qkv, pos, cs, k_cache, v_cache, out_slots, bt, rows, lens, qw, kw)]


def _check(seq_lens, hq, hkv, d, rot, neox, page, splits, norm, dtype, window=-1, device="cpu", seed=None):
    seed = random.randrange(2**31) if seed is None else seed
    qkv, pos, cs, k_cache, v_cache, out_slots, bt, rows, lens, qw, kw = _step(
        seq_lens, hq, hkv, d, rot, page, norm, dtype, device, seed
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    scale = d**-0.5
    q = qkv_rope_kvwrite_ref(qkv, pos, cs, ref_k, ref_v, out_slots, hq, hkv, d, rot, neox, qw, kw, 1e-6)
    ref = decode_attention_ref(q, ref_k, ref_v, bt, rows, lens, scale, page, window, 0.0)
    out = torch.ops.kiln.decode_rope_attention(
        qkv, pos, cs, k_cache, v_cache, out_slots, bt, rows, lens, hq, hkv, d, rot, neox, qw, kw, 1e-6, scale,
        page, splits, window, 0.0,
    )  # fmt: skip
    assert out.shape == (len(seq_lens), hq, d) and out.dtype == dtype
    real = lens > 0
    err = ((out - ref).float().norm() / ref.float().norm()).item()
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e}"
    keep = torch.ones(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    keep[0] = False  # the sink row: the reference writes padding rows there, the kernel does not
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the rotation's float32 math, then one rounding
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        torch.testing.assert_close(
            got[keep], want[keep], rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}"
        )
    written = out_slots[real]
    assert torch.equal(v_cache[written], qkv[real, (hq + hkv) * d :].reshape(-1, hkv, d).to(v_cache.dtype))


CASES = [  # seq_lens, hq, hkv, d, rot, neox, page, splits, norm, dtype, sliding window
    ([1, 37, 70], 8, 2, 64, 64, True, 16, 3, True, torch.float32, -1),  # Qwen3-style norm, pages crossed
    ([5, 33], 4, 4, 64, 32, False, 1, 1, False, torch.float32, -1),  # GPT-J pairs, partial, direct write
    ([20, 0, 9], 8, 1, 64, 64, True, 4, 4, True, torch.bfloat16, -1),  # MQA, a padding row, bf16
    ([40, 12], 4, 2, 64, 32, True, 4, 3, True, torch.float32, -1),  # NeoX, partial rotary, norm
    ([26, 3], 4, 2, 32, 32, False, 2, 2, True, torch.float32, 9),  # GPT-J with norm, sliding window
]


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"B{len(c[0])}-{c[1]}x{c[2]}x{c[3]}-rot{c[4]}-s{c[7]}-w{c[10]}"
)
def test_kernel_matches_the_two_ops(on_kernel, monkeypatch, case, merge):
    monkeypatch.setenv("KILN_ATTN_MERGE", merge)
    _check(*case)


def test_reference_path_and_errors():
    _check([3, 12], 4, 2, 32, 32, True, 4, 2, True, torch.float32, seed=1)  # CPU: the two references
    qkv, pos, cs, k, v, slots, bt, rows, lens, _, _ = _step(
        [3, 4], 4, 2, 32, 32, 4, False, torch.float32, "cpu", 2
    )
    good = (
        qkv,
        pos,
        cs,
        k,
        v,
        slots,
        bt,
        rows,
        lens,
        4,
        2,
        32,
        32,
        True,
        None,
        None,
        1e-6,
        0.1,
        4,
        2,
        -1,
        0.0,
    )
    bad = [  # {argument index: value}, and the error it must give
        ({0: qkv[:1], 1: pos[:1], 5: slots[:1]}, "a decode step, one token per request"),
        ({0: qkv[:, :224], 9: 3}, r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
        ({18: 0}, "page_size must be >= 1"),
        ({2: torch.cat([cs, cs], 1)[:, ::2]}, "cos_sin needs unit stride"),
    ]
    for change, message in bad:
        args = [change.get(i, a) for i, a in enumerate(good)]
        with pytest.raises(ValueError, match=message):
            torch.ops.kiln.decode_rope_attention(*args)


def test_switch(monkeypatch):
    monkeypatch.delenv("KILN_ROPE_IN_ATTN", raising=False)
    assert not rope_in_attention()  # the default
    monkeypatch.setenv("KILN_ROPE_IN_ATTN", "1")
    assert rope_in_attention()
    monkeypatch.setenv("KILN_ROPE_IN_ATTN", "on")
    with pytest.raises(ValueError, match="KILN_ROPE_IN_ATTN must be 0 or 1"):
        rope_in_attention()


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["separate", "fused"])
def test_gpu_matches_the_two_ops(monkeypatch, merge):
    monkeypatch.setenv("KILN_ATTN_MERGE", merge)
    _check([544], 32, 4, 128, 128, True, 1, 128, True, torch.bfloat16, device="cuda", seed=3)  # Qwen3-30B-A3B
    _check([1, 300, 4000, 0], 32, 8, 128, 128, True, 16, 32, False, torch.bfloat16, device="cuda", seed=4)
    _check([77, 5], 16, 2, 64, 64, False, 16, 8, True, torch.float32, 33, device="cuda", seed=5)
