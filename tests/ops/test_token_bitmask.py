"""ops/sampling/bitmask.py: the packed token masks of structured outputs applied to the logits."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.sampling.bitmask import apply_token_bitmask_, apply_token_bitmask_ref


def _allowed(bitmask: torch.Tensor, v: int) -> torch.Tensor:
    """[n, V] bool from a packed mask, bit by bit in Python (the test's own reading of the layout)."""
    out = torch.zeros(bitmask.shape[0], v, dtype=torch.bool)
    for i in range(bitmask.shape[0]):
        for t in range(v):
            out[i, t] = (int(bitmask[i, t // 32]) >> (t % 32)) & 1 == 1
    return out


def _case(b: int, v: int, rows: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g)
    words = -(-v // 32) + 1  # one spare word past V: ignored
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    bitmask[0, 0] = -(2**31)  # only bit 31 of word 0: token 31 alone among the first 32
    if len(rows) > 1:
        bitmask[1] = 0  # a row with nothing allowed
    return logits, bitmask, torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("path", ["ref", "kernel"])
@pytest.mark.parametrize(("b", "v", "rows"), [(4, 100, [2, 0]), (3, 4099, [1]), (5, 64, [4, 1, 3])])
def test_masked_rows_keep_only_allowed_tokens(path, b, v, rows, request):
    if path == "kernel":
        request.getfixturevalue("kernel_on_cpu")
    logits, bitmask, idx = _case(b, v, rows, seed=b * v)
    before = logits.clone()
    (apply_token_bitmask_ if path == "kernel" else apply_token_bitmask_ref)(logits, bitmask, idx)
    allowed = _allowed(bitmask, v)
    for i, r in enumerate(rows):
        assert torch.equal(logits[r][allowed[i]], before[r][allowed[i]])  # allowed logits untouched
        assert torch.isneginf(logits[r][~allowed[i]]).all()
    others = [r for r in range(b) if r not in rows]
    assert torch.equal(logits[others], before[others])  # unconstrained rows pay nothing
    assert allowed[0, 31] and not allowed[0, :31].any()


def test_no_rows_is_a_no_op_and_bad_shapes_name_the_argument():
    logits = torch.randn(2, 70)
    before = logits.clone()
    apply_token_bitmask_(logits, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[n, >= ceil\(V/32\) = 3\]"):
        apply_token_bitmask_(logits, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows must be"):
        apply_token_bitmask_(logits, torch.zeros(1, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))


@pytest.mark.gpu
def test_kernel_matches_reference_gpu():
    logits, bitmask, idx = _case(64, 128256, list(range(0, 64, 2)), seed=1)
    ref = logits.clone()
    apply_token_bitmask_ref(ref, bitmask, idx)
    got = logits.cuda()
    apply_token_bitmask_(got, bitmask.cuda(), idx.cuda())
    assert torch.equal(got.cpu(), ref)
