"""MoE alignment (ops/moe/align.py): the Triton kernels against the reference (interpreter on CPU,
compiled on the GPU), the layout invariants the grouped GEMM relies on, expert maps, fixed output
sizes and torch.export."""

import pytest
import torch

from kiln.ops.common.launch import interpreting
from kiln.ops.moe import align as ma


def routed(t, k, e, seed, device="cpu", hot=None):
    """Distinct experts per token (as top-k gives); ``hot``: every token's first choice is ``hot``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    if hot is not None and t:
        ids = torch.stack([torch.cat([torch.tensor([hot]), r[r != hot][: k - 1]]) for r in ids])
    return ids.to(torch.int32).to(device)


def check_layout(topk_ids, expert_map, e, bm, sorted_ids, block_expert, num_padded):
    """What the GEMM relies on: each local pair exactly once, in its expert's blocks, pair order
    inside an expert, sentinels elsewhere."""
    p = topk_ids.numel()
    flat = topk_ids.reshape(-1).long().cpu()
    local = expert_map.long().cpu()[flat] if expert_map is not None else flat
    s, be, n = sorted_ids.cpu().long(), block_expert.cpu().long(), int(num_padded.item())
    assert s.numel() == ma.align_rows(p, e, bm) and be.numel() == s.numel() // bm and n % bm == 0
    assert (be[: n // bm] >= 0).all() and (be[n // bm :] == -1).all()
    assert (be[: n // bm].diff() >= 0).all()  # experts in order
    real = s[s < p]
    assert sorted(real.tolist()) == [i for i in range(p) if local[i] >= 0]
    assert (s[n:] == p).all() and ((s == p) | (s < p)).all()
    owner = be.repeat_interleave(bm)
    assert torch.equal(owner[s < p], local[real])
    for x in range(e):
        mine = s[(owner == x) & (s < p)]
        assert (mine.diff() > 0).all()


CASES = [  # (T, k, E, block_m, how)
    (5, 2, 8, 16, "random"),
    (2, 2, 16, 16, "random"),  # most experts get no token
    (9, 3, 8, 16, "one-hot"),  # every token's first choice is expert 3
    (40, 1, 1, 16, "random"),  # a single expert takes everything (top-1)
    (7, 1, 16, 32, "random"),  # top-1
    (3, 8, 128, 16, "random"),  # Qwen3-30B-A3B decode shape
    (100, 8, 8, 64, "random"),  # 800 pairs: several chunks
    (1, 8, 64, 16, "random"),
    (0, 2, 8, 16, "random"),  # no tokens
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-bm{c[3]}-{c[4]}")
def test_kernel_matches_reference(kernel_on_cpu, case, device="cpu"):
    t, k, e, bm, how = case
    ids = routed(t, k, e, seed=t * 31 + e, device=device, hot=3 if how == "one-hot" else None)
    outs = tuple(o.fill_(-77) for o in ma.align_outputs(ids, None, e, bm))  # poisoned
    ma.moe_align_launch(ids, None, e, bm, *outs)
    ref = ma.moe_align_ref(ids, None, e, bm)
    for name, a, b in zip(("sorted_ids", "block_expert", "num_padded"), outs, ref):
        assert torch.equal(a, b), name
    check_layout(ids, None, e, bm, *outs)


def test_scan_over_chunks_in_several_steps(kernel_on_cpu, monkeypatch):
    monkeypatch.setattr(ma, "SCAN_ROWS", 2)  # 7 chunks: 4 steps of the offsets scan, the last partial
    ids = routed(100, 8, 8, seed=7)
    outs = ma.align_outputs(ids, None, 8, 16)
    ma.moe_align_launch(ids, None, 8, 16, *outs)
    assert all(torch.equal(a, b) for a, b in zip(outs, ma.moe_align_ref(ids, None, 8, 16)))


def test_expert_map_drops_other_ranks_experts(kernel_on_cpu):
    ids = routed(13, 4, 32, seed=5)
    emap = torch.full((32,), -1, dtype=torch.int32)
    emap[8:16] = torch.arange(8, dtype=torch.int32)  # this rank holds global experts 8..15
    out = torch.ops.kiln.moe_align(ids, emap, 8, 16)
    ref = ma.moe_align_ref(ids, emap, 8, 16)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    check_layout(ids, emap, 8, 16, *out)
    assert int(out[2]) < ma.align_rows(ids.numel(), 8, 16)


def test_output_size_depends_on_shapes_only():
    assert ma.align_rows(1 * 8, 128, 16) == 8 + 8 * 15  # decode: at most T*k experts are hit
    assert ma.align_rows(4096 * 8, 128, 128) == 32768 + 128 * 127 + 0  # already a multiple of 128
    assert ma.align_rows(5, 8, 16) % 16 == 0


@pytest.mark.parametrize("triton_on_cpu", ["1", "0"], ids=["kernel", "reference"])
def test_op_and_bad_arguments(monkeypatch, triton_on_cpu):
    if triton_on_cpu == "1" and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", triton_on_cpu)
    ids = routed(6, 2, 8, seed=1)
    check_layout(ids, None, 8, 16, *torch.ops.kiln.moe_align(ids, None, 8, 16))
    with pytest.raises(ValueError, match="topk_ids must be"):
        torch.ops.kiln.moe_align(ids.long(), None, 8, 16)
    with pytest.raises(ValueError, match="block_m a power of two"):
        torch.ops.kiln.moe_align(ids, None, 8, 24)


class _Align(torch.nn.Module):
    def forward(self, ids):
        return torch.ops.kiln.moe_align(ids, None, 16, 16)


def test_export_with_dynamic_tokens(kernel_on_cpu):
    t = torch.export.Dim("T", min=1, max=4096)
    ep = torch.export.export(_Align(), (routed(3, 4, 16, seed=2),), dynamic_shapes=({0: t},), strict=False)
    for n in (1, 2, 11, 40):  # below and above the point where every expert can be hit
        ids = routed(n, 4, 16, seed=n)
        out = ep.module()(ids)
        ref = ma.moe_align_ref(ids, None, 16, 16)
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), n


# ---- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "t,k,e,bm", [(1, 8, 128, 16), (256, 8, 128, 32), (4096, 8, 128, 128), (3000, 8, 256, 64)]
)
def test_gpu_matches_reference(compiled_gpu, t, k, e, bm):
    ids = routed(t, k, e, seed=t, device="cuda")
    outs = tuple(o.fill_(-77) for o in ma.align_outputs(ids, None, e, bm))
    ma.moe_align_launch(ids, None, e, bm, *outs)
    ref = ma.moe_align_ref(ids, None, e, bm)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(compiled_gpu):
    ids = routed(64, 8, 128, seed=0, device="cuda")
    out = torch.ops.kiln.moe_align(ids, None, 128, 16)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.kiln.moe_align(ids, None, 128, 16)
    for seed in (1, 2):
        ids.copy_(routed(64, 8, 128, seed=seed, device="cuda"))
        g.replay()
        ref = ma.moe_align_ref(ids, None, 128, 16)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
