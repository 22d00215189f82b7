"""Tree attention in MLA extend (``tree_mask``: speculative token trees on DeepSeek models): the Triton
kernel (interpreter on CPU) against the torch reference, and the reference against attention over
each node's path: a node's output must equal the last output of the chain of its ancestors (the
prefix, then root..node) over the same latent rows, as for the GQA kernel
(tests/ops/test_tree_attention.py). The cache rows are random (the op applies no RoPE), chunk rows in
slots by node index, as the runtime writes them.
"""

from __future__ import annotations

import pytest
import test_decode_attention as decode_tests
import torch
from test_decode_attention import rel_err
from test_mla_attention import TOL, indptr_of, paged_cache, token_slots
from test_tree_attention import ancestors, masks_of, random_parents

from kiln.ops.attention import mla

seed, triton_on_cpu = decode_tests.seed, decode_tests.triton_on_cpu  # the fixtures, shared


def tree_args(sizes, prefix, pad, heads, r, dr, page_size, dtype, gen):
    """``kiln::mla_extend``'s arguments for requests with trees of ``sizes[b]`` nodes over
    ``prefix[b]`` cached tokens, the tree masks and each request's parents."""
    lens = [n + p for n, p in zip(sizes, prefix)]
    block_table, req_rows, cache = paged_cache(lens, page_size, r + dr, dtype)
    slots = token_slots(block_table, req_rows, lens, page_size, [0] * len(lens), lens)
    rows = torch.randn(slots.shape[0], r + dr, generator=gen).to(dtype)
    cache[slots // page_size, slots % page_size] = rows
    t = sum(sizes) + pad
    q_latent = torch.randn(t, heads, r, generator=gen).to(dtype)
    q_pe = torch.randn(t, heads, dr, generator=gen).to(dtype)
    parents = [random_parents(n, gen) for n in sizes]
    masks = torch.tensor([m for p in parents for m in masks_of(p)] + [0] * pad, dtype=torch.int64)
    meta = (block_table, req_rows, torch.tensor(lens, dtype=torch.int32), indptr_of(sizes))
    return (q_latent, q_pe, cache, *meta, (r + dr) ** -0.5, page_size), masks, parents


def per_path(args, parents) -> torch.Tensor:
    """Each node's MLA attention over its chain, from the reference's one-request form (positions
    by path: the chain's rows in order, causal): ``[T, H, r]`` float32, padding rows zero."""
    q_latent, q_pe, cache, block_table, req_rows, seq_lens, indptr, sm_scale, page_size = args
    out = torch.zeros(q_latent.shape, dtype=torch.float32)
    for b, (row, seq_len) in enumerate(zip(req_rows.tolist(), seq_lens.tolist())):
        lo, n = int(indptr[b]), len(parents[b])
        prefix = seq_len - n
        rows = mla._rows(cache, block_table, row, seq_len, page_size)
        for i in range(n):
            path = ancestors(parents[b], i)
            chain = torch.cat([rows[:prefix], rows[[prefix + j for j in path]]])
            q_pos = torch.tensor([chain.shape[0] - 1])
            out[lo + i] = mla.mla_attend(
                q_latent[lo + i : lo + i + 1], q_pe[lo + i : lo + i + 1], chain, q_pos, sm_scale
            )[0]
    return out


@pytest.mark.parametrize(
    "sizes, prefix, pad, heads, r, dr, page_size, dtype",
    [
        ([5, 9, 1, 17], [0, 3, 30, 50], 3, 4, 32, 16, 16, torch.float32),  # mixed, a 1-node tree
        ([33], [21], 0, 4, 40, 8, 1, torch.float32),  # several key blocks, page 1, r not a power of 2
        ([64, 6], [5, 16], 2, 2, 32, 16, 16, torch.float32),  # 64 nodes: bit 63 (the sign bit)
        ([12, 7], [40, 9], 1, 4, 32, 16, 16, torch.bfloat16),
    ],
)
def test_tree_kernel_matches_reference_and_paths(
    triton_on_cpu, seed, sizes, prefix, pad, heads, r, dr, page_size, dtype
):
    gen = torch.Generator().manual_seed(seed)
    args, masks, parents = tree_args(sizes, prefix, pad, heads, r, dr, page_size, dtype, gen)
    out = torch.ops.kiln.mla_extend(*args, masks)
    ref = mla.mla_extend_ref(*args, masks)
    plain = per_path(args, parents)
    assert not out.isnan().any() and (out[out.shape[0] - pad :] == 0).all(), f"seed {seed}"
    assert rel_err(ref, plain) < TOL[dtype], f"seed {seed}: the reference is not attention over each path"
    assert rel_err(out, plain) < TOL[dtype], f"seed {seed}: kernel vs paths {rel_err(out, plain):.2e}"
    # the tree matters: causal attention over the chunk differs where a node has a non-ancestor before it
    assert rel_err(mla.mla_extend_ref(*args), plain) > 1e-3, f"seed {seed}"


def test_mla_attention_with_a_mask_is_extend_even_for_roots_alone(triton_on_cpu, seed, monkeypatch):
    """``kiln::mla_attention`` with a tree mask runs the extend kernel also at T == B (each request's
    root alone), and passes the mask on; a wrong mask is named."""
    gen = torch.Generator().manual_seed(seed)
    args, masks, _ = tree_args([1, 1], [7, 20], 0, 4, 32, 16, 16, torch.float32, gen)
    calls = []
    extend = mla.mla_extend_triton
    monkeypatch.setattr(mla, "mla_decode_triton", lambda *a, **k: calls.append("decode"))
    out = mla.by_step(mla.mla_decode_triton, lambda *a: calls.append(len(a)) or extend(*a))(*args, 0, masks)
    assert calls == [10] and rel_err(out, mla.mla_extend_ref(*args, masks)) < 1e-5
    with pytest.raises(ValueError, match="tree_mask must be an int64 \\[T\\] = \\[2\\]"):
        mla.check_mla_extend(*args, masks.int())
