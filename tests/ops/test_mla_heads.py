"""MLA's per-head matmul (ops/attention/mla_heads.py) against the batched matmul the graphs run
(``absorb_q`` / ``apply_uv`` of ops/attention/mla.py): the Triton kernel in the interpreter on CPU,
at both of its uses (``x`` a strided slice of the q projection's output; ``x`` the latent attention
output), token counts that fill no tile, a tile exactly and several, float32 and bfloat16; the
output contiguous ``[T, H, N]``; bad arguments refused with the argument named."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.attention.mla import absorb_q, apply_uv
from kiln.ops.attention.mla_heads import HeadMatmulConfig, mla_head_matmul_ref, mla_head_matmul_triton

H, DN, DR, R, DV = 3, 24, 8, 40, 20  # heads, nope, rope, kv_lora_rank, v dims (none a power of two)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tokens", [1, 5, 16, 37])
@pytest.mark.parametrize("use", ["absorb_q", "apply_uv"])
def test_kernel_matches_the_batched_matmul(kernel_on_cpu, use, tokens, dtype, tol):
    g = torch.Generator().manual_seed(tokens)
    if use == "absorb_q":  # the q projection's output viewed per head; its nope part, not copied
        q = torch.randn(tokens, H, DN + DR, generator=g).to(dtype)
        x, w = q[..., :DN], torch.randn(H, DN, R, generator=g).to(dtype)
        expect = absorb_q(x, w)
    else:
        x, w = torch.randn(tokens, H, R, generator=g).to(dtype), torch.randn(H, R, DV, generator=g).to(dtype)
        expect = apply_uv(x, w)
    got = torch.ops.kiln.mla_head_matmul(x, w)
    assert got.shape == expect.shape and got.is_contiguous() and got.dtype == dtype
    assert _rel(got, expect) < tol
    assert torch.equal(mla_head_matmul_ref(x, w), expect.contiguous())


def test_a_config_with_several_tiles_each_way(kernel_on_cpu):
    """Two K steps, two column blocks, three row tiles (the last partial)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, H, 32, generator=g), torch.randn(H, 32, 40, generator=g)
    cfg = HeadMatmulConfig(block_t=16, block_k=16, block_n=32, num_warps=1, num_stages=1)
    assert _rel(mla_head_matmul_triton(x, w, config=cfg), mla_head_matmul_ref(x, w)) < 1e-6


def test_no_tokens(kernel_on_cpu):
    out = torch.ops.kiln.mla_head_matmul(torch.empty(0, H, R), torch.randn(H, R, DV))
    assert out.shape == (0, H, DV)


@pytest.mark.parametrize(
    "x, w, message",
    [
        (torch.randn(2, H, R), torch.randn(H + 1, R, DV), "disagree"),
        (torch.randn(2, H, R), torch.randn(H, R + 1, DV), "disagree"),
        (torch.randn(2, H * R), torch.randn(H, R, DV), r"x must be \[T, H, K\]"),
        (torch.randn(2, H, R), torch.randn(H, R, DV).double(), "pass one dtype"),
        (torch.randn(2, R, H).transpose(1, 2), torch.randn(H, R, DV), "unit stride"),
    ],
)
def test_bad_arguments_are_refused(x, w, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.kiln.mla_head_matmul(x, w)


def test_above_max_t_the_batched_matmul(kernel_on_cpu, monkeypatch):
    """The GEMV plan's bound: up to ``max_t`` tokens the kernel, above it the batched matmul."""
    import kiln.ops.attention.mla_heads as mh

    calls = []
    monkeypatch.setattr(mh, "_head_matmul_kernel", _Spy(mh._head_matmul_kernel, calls))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(H, R, DV, generator=g)
    for tokens in (4, 5):
        x = torch.randn(tokens, H, R, generator=g)
        got = torch.ops.kiln.mla_head_matmul(x, w, 4)
        assert _rel(got, mla_head_matmul_ref(x, w)) < 1e-6
    assert len(calls) == 1  # the 4-token call only


class _Spy:
    """A Triton kernel's ``kernel[grid](...)`` launches, counted."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]
