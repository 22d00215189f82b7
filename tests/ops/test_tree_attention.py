"""Tree attention in paged extend attention (``tree_mask``, speculative token trees): the Triton kernel
(interpreter on CPU, real on GPU) against the torch reference and against a plain computation per
path: for a random tree, each node's output must equal the last output of the chain made of its
ancestors (the prefix, then root..node), which is what attention over a tree means.

Chunks' K/V sit in slots by node index, as the kernel reads them; the caches are random (no RoPE),
so a node's keys are the same tensors in the tree and in its chain.
"""

from __future__ import annotations

import pytest
import test_decode_attention as decode_tests
import torch
from test_decode_attention import TOL, rel_err

from kiln.ops.attention import paged  # noqa: F401  (registers the attention ops)
from kiln.ops.attention.extend import ExtendConfig, extend_attention_triton
from kiln.ops.attention.reference import (
    decode_attention_ref,
    extend_attention_ref,
    random_block_table,
    request_slots,
)

seed, triton_on_cpu = decode_tests.seed, decode_tests.triton_on_cpu  # the fixtures, shared


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random tree of ``n`` nodes: node 0 the root, node i's parent one of 0..i-1 (-1 for the root).
    Biased to the latest nodes, so trees get deep as well as wide."""
    parents = [-1]
    for i in range(1, n):
        lo = max(0, i - 3) if torch.rand(1, generator=gen).item() < 0.6 else 0
        parents.append(int(torch.randint(lo, i, (1,), generator=gen)))
    return parents


def ancestors(parents: list[int], i: int) -> list[int]:
    """Root..i, the path of node i."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def masks_of(parents: list[int]) -> list[int]:
    """Each node's ancestor-or-self bitmask as a signed int64 value (bit 63 is the sign)."""
    out = []
    for i in range(len(parents)):
        m = sum(1 << j for j in ancestors(parents, i))
        out.append(m - (1 << 64) if m >= 1 << 63 else m)
    return out


def make_tree_inputs(sizes, prefix, pad, hq, hkv, d, dv, page_size, dtype, gen):
    """Requests with trees of ``sizes[b]`` nodes over ``prefix[b]`` cached tokens; ``pad`` padding rows."""
    lens = [n + p for n, p in zip(sizes, prefix)]
    block_table, req_rows, num_slots = random_block_table(lens, page_size)
    indptr = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(sizes) + pad, hq, d, dtype=dtype)
    k_cache = torch.randn(num_slots, hkv, d, dtype=dtype)
    v_cache = torch.randn(num_slots, hkv, dv, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    parents = [random_parents(n, gen) for n in sizes]
    masks = [m for p in parents for m in masks_of(p)] + [0] * pad
    tree_mask = torch.tensor(masks, dtype=torch.int64)
    return (q, k_cache, v_cache, block_table, req_rows, seq_lens, indptr), tree_mask, parents


def per_path(args, parents, page_size, sm_scale, logit_cap=0.0) -> torch.Tensor:
    """Each node's attention over its chain (the prefix, then its ancestors and itself), plain dense
    float32 softmax: ``[T, Hq, Dv]`` (padding rows zero)."""
    q, k_cache, v_cache, block_table, req_rows, seq_lens, indptr = args
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[2])
    for b, (row, seq_len) in enumerate(zip(req_rows.tolist(), seq_lens.tolist())):
        lo, n = int(indptr[b]), len(parents[b])
        prefix = seq_len - n
        slots = request_slots(block_table, row, seq_len, page_size)
        for i in range(n):
            keys = torch.cat([slots[:prefix], slots[[prefix + j for j in ancestors(parents[b], i)]]])
            k = k_cache[keys].float().repeat_interleave(group, 1)  # [L, Hq, D]
            v = v_cache[keys].float().repeat_interleave(group, 1)
            s = torch.einsum("hd,lhd->hl", q[lo + i].float(), k) * sm_scale
            if logit_cap > 0:
                s = logit_cap * torch.tanh(s / logit_cap)
            out[lo + i] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


def check_tree(seed, sizes, prefix, pad, hq, hkv, d, dv, page_size, dtype, cap=0.0, config=None):
    gen = torch.Generator().manual_seed(seed)
    args, tree_mask, parents = make_tree_inputs(sizes, prefix, pad, hq, hkv, d, dv, page_size, dtype, gen)
    full = (*args, d**-0.5, page_size, -1, cap, None, None, tree_mask)
    if config is None:
        out = torch.ops.kiln.extend_attention(*full)
    else:
        out = extend_attention_triton(*full, config=config)
    ref = extend_attention_ref(*full)
    plain = per_path(args, parents, page_size, d**-0.5, cap)
    assert not out.isnan().any(), f"seed {seed}: NaN in the output"
    if pad:
        assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:])), f"seed {seed}: padding rows not zero"
    assert rel_err(ref, plain) < TOL[dtype], f"seed {seed}: the reference is not attention over each path"
    err = rel_err(out, plain)
    assert err < TOL[dtype], f"seed {seed}: kernel vs per-path relative error {err:.2e}"
    # the tree matters: causal attention over the chunk (no mask) differs wherever a node has a
    # non-ancestor before it
    causal = extend_attention_ref(*full[:-1])
    if any(p != list(range(-1, len(p) - 1)) for p in parents):
        assert rel_err(causal, plain) > 1e-3
    return out


@pytest.mark.parametrize(
    "sizes, prefix, pad, hq, hkv, d, dv, page_size, dtype",
    [
        ([5, 9, 1, 17], [0, 3, 30, 50], 3, 8, 2, 64, 64, 16, torch.float32),  # mixed, a 1-node tree
        ([33], [21], 0, 4, 4, 32, 32, 1, torch.float32),  # chunk over several key blocks, page 1
        ([64, 6], [5, 16], 2, 4, 2, 32, 48, 16, torch.float32),  # 64 nodes: bit 63 (the sign bit)
        ([12, 7], [40, 9], 1, 8, 2, 64, 64, 16, torch.bfloat16),
    ],
)
def test_tree_kernel_matches_reference_and_paths(
    triton_on_cpu, seed, sizes, prefix, pad, hq, hkv, d, dv, page_size, dtype
):
    check_tree(seed, sizes, prefix, pad, hq, hkv, d, dv, page_size, dtype)


def test_tree_with_softcap_and_packing(triton_on_cpu, seed):
    cfg = ExtendConfig(block_m=32, block_n=16, pack=2, num_warps=1, num_stages=1)
    check_tree(seed, [11, 20], [7, 33], 1, 8, 2, 32, 32, 16, torch.float32, cap=5.0, config=cfg)


def test_chain_mask_is_causal_attention(triton_on_cpu, seed):
    """A chain (each node's parent the one before) is the plain causal chunk."""
    from test_extend_attention import make_inputs

    args = make_inputs([9, 4], [13, 0], 0, 4, 2, 32, 32, 16, torch.float32)
    chain = torch.tensor([(1 << (i + 1)) - 1 for n in (9, 4) for i in range(n)], dtype=torch.int64)
    full = (*args, 32**-0.5, 16, -1, 0.0)
    plain = torch.ops.kiln.extend_attention(*full)
    tree = torch.ops.kiln.extend_attention(*full, None, None, chain)
    assert rel_err(tree, plain) < TOL[torch.float32]


def test_tree_mask_errors_name_the_argument(seed):
    from test_extend_attention import make_inputs

    args = make_inputs([3], [2], 0, 4, 2, 32, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="tree_mask must be an int64"):
        torch.ops.kiln.extend_attention(*args, 1.0, 16, -1, 0.0, None, None, torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="tree_mask must be an int64"):
        torch.ops.kiln.extend_attention(*args, 1.0, 16, -1, 0.0, None, None, torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="sliding_window"):
        torch.ops.kiln.extend_attention(*args, 1.0, 16, 8, 0.0, None, None, torch.ones(3, dtype=torch.int64))


# --------------------------------------------------------------------------- kiln::paged_attention
@pytest.mark.parametrize("kernel", ["1", "0"])  # the Triton launches (interpreter), then the references
def test_paged_attention_passes_the_tree_mask_on(seed, monkeypatch, kernel):
    """The graphs' op (compiler/layers.py ``Attention``) with a tree mask is extend attention with it."""
    monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
    gen = torch.Generator().manual_seed(seed)
    args, tree_mask, parents = make_tree_inputs([7, 12], [5, 20], 2, 4, 2, 32, 32, 16, torch.float32, gen)
    meta = (32**-0.5, 16)
    out = torch.ops.kiln.paged_attention(*args, *meta, 2, -1, 0.0, None, None, tree_mask)
    want = torch.ops.kiln.verify_attention(*args, *meta, 2, 0.0, tree_mask)  # few nodes a request
    assert torch.equal(out, want), f"seed {seed}: paged_attention is not verify_attention with the mask"
    ext = torch.ops.kiln.extend_attention(*args, *meta, -1, 0.0, None, None, tree_mask)
    assert rel_err(out, ext) < TOL[torch.float32], f"seed {seed}: verify and extend differ on the tree"
    assert rel_err(out, per_path(args, parents, 16, 32**-0.5)) < TOL[torch.float32], f"seed {seed}"
    # without the mask: the causal chunk, on verify attention (few tokens per request; the trees
    # branch, so it differs from the above)
    plain = torch.ops.kiln.paged_attention(*args, *meta, 2, -1, 0.0)
    assert torch.equal(plain, torch.ops.kiln.verify_attention(*args, *meta, 2, 0.0))
    assert rel_err(plain, out) > 1e-3, f"seed {seed}: the mask changed nothing"


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_one_node_per_request_with_a_mask_is_a_chunk(seed, monkeypatch, kernel):
    """T == B with a tree mask is a tree chunk, not a decode step: the chunk path (verify attention,
    few tokens per request) reads qo_indptr (here [0, 0, 2]: two root-level nodes of request 1, none
    of request 0), decode would not."""
    from test_extend_attention import make_inputs

    monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
    q, k, v, bt, rows, lens, _ = make_inputs([1, 1], [6, 9], 0, 4, 2, 32, 32, 16, torch.float32)
    meta = (32**-0.5, 16)
    # roots alone (the natural case): the prefix and the root, which decode attention also computes
    roots = torch.ones(2, dtype=torch.int64)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.ops.kiln.paged_attention(
        q, k, v, bt, rows, lens, indptr, *meta, 2, -1, 0.0, None, None, roots
    )
    assert torch.equal(
        out, torch.ops.kiln.verify_attention(q, k, v, bt, rows, lens, indptr, *meta, 2, 0.0, roots)
    )
    assert rel_err(out, decode_attention_ref(q, k, v, bt, rows, lens, *meta, 2, -1, 0.0)) < TOL[torch.float32]
    # siblings of one request: each sees the prefix and itself only
    uneven, siblings = torch.tensor([0, 0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int64)
    out = torch.ops.kiln.paged_attention(
        q, k, v, bt, rows, lens, uneven, *meta, 2, -1, 0.0, None, None, siblings
    )
    want = extend_attention_ref(q, k, v, bt, rows, lens, uneven, *meta, -1, 0.0, None, None, siblings)
    assert rel_err(out, want) < TOL[torch.float32], f"seed {seed}: not the chunk path"
    decode = decode_attention_ref(q, k, v, bt, rows, lens, *meta, 2, -1, 0.0)
    assert rel_err(out, decode) > 1e-3


def test_paged_attention_checks_the_tree_mask(seed, monkeypatch):
    """Its check is extend attention's, on both paths, also when T == B."""
    from test_extend_attention import make_inputs

    args = make_inputs([1, 1], [2, 3], 0, 4, 2, 32, 32, 16, torch.float32)
    for kernel in ("1", "0"):
        monkeypatch.setenv("KILN_TRITON_ON_CPU", kernel)
        for bad in (torch.ones(2, dtype=torch.int32), torch.ones(3, dtype=torch.int64)):
            with pytest.raises(ValueError, match="tree_mask must be an int64"):
                torch.ops.kiln.paged_attention(*args, 1.0, 16, 2, -1, 0.0, None, None, bad)
        with pytest.raises(ValueError, match="sliding_window"):
            torch.ops.kiln.paged_attention(
                *args, 1.0, 16, 2, 8, 0.0, None, None, torch.ones(2, dtype=torch.int64)
            )


def test_paged_attention_fake_with_a_tree_mask():
    """The shape rule torch.export runs: ``[T, Hq, Dv]`` with a mask too (T == B included)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(7, 8, 64), torch.empty(40, 2, 64), torch.empty(40, 2, 32)
        bt, rows, lens = torch.empty(3, 4, dtype=torch.int32), *torch.empty(2, 2, dtype=torch.int32)
        indptr, mask = torch.empty(3, dtype=torch.int32), torch.empty(7, dtype=torch.int64)
        meta = (0.125, 16, 2, -1, 0.0, None, None)
        outs = [
            torch.ops.kiln.paged_attention(q, k, v, bt, rows, lens, indptr, *meta, mask),
            torch.ops.kiln.paged_attention(q[:2], k, v, bt, rows, lens, indptr, *meta, mask[:2]),
        ]
    assert [tuple(o.shape) for o in outs] == [(7, 8, 32), (2, 8, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_gpu(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    sizes, prefix = [9, 5, 64, 1], [700, 33, 1000, 5]
    args, tree_mask, parents = make_tree_inputs(sizes, prefix, 3, 32, 8, 128, 128, 16, dtype, gen)
    dev = [a.cuda() for a in args]
    out = torch.ops.kiln.extend_attention(*dev, 128**-0.5, 16, -1, 0.0, None, None, tree_mask.cuda())
    plain = per_path(args, parents, 16, 128**-0.5)
    assert rel_err(out.cpu(), plain) < TOL[torch.bfloat16], f"seed {seed}"
