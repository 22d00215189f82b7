"""ops/moe_one_launch.py: the decode experts in one ticket-ordered launch against the reference and
the two-launch path (interpreter on CPU, compiled on the GPU), the tile order, the counters' reset,
the fallbacks, and a captured graph replayed with new routing."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from test_moe_gemm import TOL, _captured_decode_moe, _new_inputs, assert_rel, make_moe

from kiln.ops import moe
from kiln.ops import moe_one_launch as one


def _counters_zero(device) -> bool:
    buf = one.COUNTERS.buffers.get(torch.device(device))
    return buf is None or not buf.any().item()


@pytest.mark.parametrize("t, k, e", [(1, 2, 8), (1, 8, 16), (2, 4, 16), (3, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_and_resets_its_counters(kernel_on_cpu, t, k, e, dtype):
    h, i = 48, 40  # neither a multiple of the tiles: masked tails in both GEMVs
    x, w13, w2, w, ids, _, _ = make_moe(t, h, i, e, k, dtype, seed=t * 10 + k)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    assert one.moe_one_launch(x, w13, w2, w, ids, out)
    assert_rel(out, moe.fused_moe_ref(x, w13, w2, w, ids), TOL[dtype])
    assert _counters_zero("cpu"), "ticket, finish count and arrivals back at zero"
    res = torch.randn(t, h).to(dtype)
    out2 = torch.full((t, h), float("nan"), dtype=dtype)
    assert one.moe_one_launch(x, w13, w2, w, ids, out2, res)  # a second call: counters reused
    assert torch.equal(out2, moe.add_rounded(out, res))
    assert _counters_zero("cpu")


def test_the_switch_routes_fused_moe_through_it(kernel_on_cpu, monkeypatch):
    t, h, i, e, k = 1, 64, 32, 16, 4
    args = make_moe(t, h, i, e, k, torch.bfloat16, seed=5)
    calls = []
    real = moe.moe_one_launch
    monkeypatch.setattr(moe, "moe_one_launch", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("KILN_MOE_ONE_LAUNCH", "1")
    y = torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], "")
    assert calls == [1]
    monkeypatch.setenv("KILN_MOE_ONE_LAUNCH", "0")
    y2 = torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], "")
    assert calls == [1]
    assert_rel(y, y2, TOL[torch.bfloat16])
    monkeypatch.setenv("KILN_MOE_ONE_LAUNCH", "yes")
    with pytest.raises(ValueError, match="KILN_MOE_ONE_LAUNCH must be 0 or 1"):
        torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], "")


def test_declines_what_it_does_not_cover():
    x, w13, w2, w, ids, _, _ = make_moe(one.MAX_TOKENS + 1, 32, 16, 8, 2, torch.float32, seed=1)
    out = torch.empty_like(x)
    assert not one.moe_one_launch(x, w13, w2, w, ids, out)  # too many tokens
    assert not one.moe_one_launch(x[:1], w13.half(), w2, w[:1], ids[:1], out[:1])  # mixed dtypes
    wide = torch.empty(8, 32, one.EARLY_MAX_K + 1)  # I past the w2 slab's register budget
    assert not one.moe_one_launch(x[:1], w13, wide, w[:1], ids[:1], out[:1])
    assert not one.moe_one_launch(
        x[:1], w13.transpose(1, 2).contiguous().transpose(1, 2), w2, w[:1], ids[:1], out[:1]
    )


@triton.jit
def _tiles(OUT, P, NB13, NB2):
    tk = tl.program_id(0)
    is_w2, g, col = one.tile_of(tk, P, NB13, NB2)
    tl.store(OUT + 3 * tk, is_w2.to(tl.int32))
    tl.store(OUT + 3 * tk + 1, g)
    tl.store(OUT + 3 * tk + 2, col)


@pytest.mark.parametrize("p, nb13, nb2", [(1, 3, 2), (1, 1, 1), (4, 5, 3), (3, 1, 5), (8, 96, 128)])
def test_tile_order_covers_every_tile_once_after_its_inputs(kernel_on_cpu, p, nb13, nb2):
    """The kernel's ticket -> tile map: every (kind, pair, column) once, and a w2 tile of pair g only
    after all of pair g's w13 tiles (a waiting program never waits on a higher ticket)."""
    n = p * (nb13 + nb2)
    out = torch.full((n, 3), -1, dtype=torch.int32)
    _tiles[(n,)](out, p, nb13, nb2)
    seen, done13 = set(), [0] * p
    for tk, (is_w2, pair, col) in enumerate(out.tolist()):
        assert 0 <= pair < p and 0 <= col < (nb2 if is_w2 else nb13), (tk, is_w2, pair, col)
        assert (is_w2, pair, col) not in seen
        seen.add((is_w2, pair, col))
        if is_w2:
            assert done13[pair] == nb13, (tk, pair)
        else:
            done13[pair] += 1
    assert len(seen) == n


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_gpu_matches_reference_under_replay(compiled_gpu, monkeypatch, t):
    """Qwen3-30B-A3B shapes, captured with the switch on and replayed with new routing each time:
    a stale arrival or a counter left non-zero would show as a wrong sum or a hang."""
    monkeypatch.setenv("KILN_MOE_ONE_LAUNCH", "1")
    ran = []
    real = moe.moe_one_launch
    monkeypatch.setattr(moe, "moe_one_launch", lambda *a: ran.append(real(*a)) or ran[-1])
    (x, w13, w2, w, ids), g, out = _captured_decode_moe(t)
    assert ran and all(ran), "the one-launch path ran (warm-up and capture), no fallback"
    for i in range(40):
        _new_inputs(t, 300 + i, x, w, ids)
        out.fill_(float("nan"))
        g.replay()
        assert_rel(out, moe.fused_moe_ref(x, w13, w2, w, ids), TOL[torch.bfloat16])
    torch.cuda.synchronize()
    assert _counters_zero(x.device)
