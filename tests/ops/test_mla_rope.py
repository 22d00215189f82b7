"""kiln::mla_rope_kvwrite (ops/attention/mla_rope.py): the fused latent norm + RoPE + cache write
of DeepSeek's MLA, its Triton kernel (interpreter on CPU) against the reference, in place on a layer
view of the pool in pages and flat; the MLA attention ops over the flat ``[S, 1, W]`` layer view
(what an MLA artifact's graph passes them); and ``kiln_op``'s ``-> None`` writers.

The reference itself is checked against Hugging Face's whole attention layer by
tests/compiler/test_deepseek.py (the compiled model's logits).
"""

from __future__ import annotations

import io
import random

import pytest
import torch

from kiln.ops.attention import mla
from kiln.ops.attention.mla_rope import mla_rope_kvwrite_ref, mla_rope_kvwrite_triton
from kiln.ops.attention.qkv_rope import head_rmsnorm_ref
from kiln.ops.attention.reference import random_block_table
from kiln.ops.attention.rope import apply_rope_ref, rope_cos_sin_cache
from kiln.ops.common.op import kiln_op

NAN = float("nan")
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.fixture
def seed():
    s = random.randrange(2**31)
    torch.manual_seed(s)
    return s


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_inputs(t, heads, r, dn, dr, dtype, slots_total=96, pad=2):
    """One step's inputs: kv_a row-strided (a slice of a wider projection), q a view of the q
    projection ``[T, H (dn + dr)]``, distinct slots then ``pad`` padding rows (slot 0; fewer when
    ``t`` is small: one row at least is real)."""
    pad = min(pad, t - 1)  # at least one real row
    kv_a = torch.randn(t, r + dr + 5, dtype=dtype)[:, : r + dr]
    q = torch.randn(t, heads * (dn + dr), dtype=dtype).view(t, heads, dn + dr)
    positions = torch.randint(0, 200, (t,))
    slots = torch.randperm(slots_total - 1)[: t - pad] + 1
    out_slots = torch.cat([slots, torch.zeros(pad, dtype=torch.int64)])
    norm_w = 1 + 0.2 * torch.randn(r, dtype=dtype)
    return kv_a, q, positions, norm_w, out_slots


@pytest.mark.parametrize(
    "t, heads, r, dn, dr, neox, dtype, page",
    [
        (7, 4, 32, 24, 16, False, torch.float32, 16),  # DeepSeek-V2 (interleaved pairs), pages
        (5, 20, 40, 8, 8, True, torch.float32, 1),  # V3 rope_interleave false; two head blocks; flat
        (9, 16, 64, 32, 32, False, torch.bfloat16, 16),
        (3, 3, 24, 16, 16, True, torch.bfloat16, 1),  # widths that are not powers of two
    ],
)
def test_kernel_matches_reference(kernel_on_cpu, seed, t, heads, r, dn, dr, neox, dtype, page):
    """Kernel vs reference on the same inputs, each into its own NaN-poisoned two-layer pool (the
    layer's view: pages ``[N, P, W]`` or flat ``[S, 1, W]``): same rows written, nothing else."""
    kv_a, q, positions, norm_w, out_slots = make_inputs(t, heads, r, dn, dr, dtype)
    cos_sin = rope_cos_sin_cache(dr, 256, 10000.0, None)
    caches = [torch.full((2, 96 // page, page, r + dr), NAN, dtype=dtype) for _ in range(2)]
    out = torch.full((t, heads, dr), NAN, dtype=dtype)
    args = (kv_a, q, positions, cos_sin, norm_w, 1e-6)
    got = mla_rope_kvwrite_triton(*args, caches[0][1], out_slots, neox, block_h=16, out=out)
    want = mla_rope_kvwrite_ref(*args, caches[1][1], out_slots, neox)
    assert got is out and rel_err(got, want) < TOL[dtype], f"seed {seed}"
    written = torch.zeros(96, dtype=torch.bool)
    written[out_slots] = True
    for pool in caches:
        flat = pool[1].view(96, r + dr)
        assert flat[~written].isnan().all() and pool[0].isnan().all()
    rows = [pool[1].view(96, r + dr)[out_slots[:-2]] for pool in caches]
    assert not rows[0].isnan().any() and rel_err(rows[0], rows[1]) < TOL[dtype], f"seed {seed}"


def test_reference_is_the_norm_and_rope_of_the_layer(seed):
    """The reference's row is ``[kv_a_layernorm(c) | rope(k_pe)]`` and its output ``rope(q_pe)``,
    built here from the pieces (norm as transformers' DeepseekV2RMSNorm, RoPE in GPT-J pairs)."""
    t, heads, r, dn, dr = 6, 2, 16, 8, 8
    kv_a, q, positions, norm_w, out_slots = make_inputs(t, heads, r, dn, dr, torch.float32, pad=0)
    cos_sin = rope_cos_sin_cache(dr, 256, 10000.0, None)
    cache = torch.full((96, 1, r + dr), NAN)
    q_pe = mla_rope_kvwrite_ref(kv_a, q, positions, cos_sin, norm_w, 1e-6, cache, out_slots, False)
    c = kv_a[:, :r]
    normed = norm_w * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6))
    k_pe = apply_rope_ref(kv_a[:, None, r:], positions, cos_sin, dr, False)[:, 0]
    torch.testing.assert_close(cache[out_slots, 0], torch.cat([normed, k_pe], -1))
    torch.testing.assert_close(q_pe, apply_rope_ref(q[..., dn:], positions, cos_sin, dr, False))
    torch.testing.assert_close(normed, head_rmsnorm_ref(c, norm_w, 1e-6))


def test_bad_inputs_are_named():
    kv_a, q, positions, norm_w, out_slots = make_inputs(4, 2, 16, 8, 8, torch.float32)
    cos_sin = rope_cos_sin_cache(8, 64, 10000.0, None)
    cache = torch.zeros(96, 1, 24)
    ok = (kv_a, q, positions, cos_sin, norm_w, 1e-6, cache, out_slots, False)

    def call(**change):
        names = ("kv_a", "q", "positions", "cos_sin", "norm_w", "eps", "cache", "out_slots", "is_neox")
        args = dict(zip(names, ok)) | change
        torch.ops.kiln.mla_rope_kvwrite(*args.values())

    with pytest.raises(ValueError, match=r"norm_w must be \[kv_lora_rank = 16\]"):
        call(norm_w=norm_w[:8])
    with pytest.raises(ValueError, match=r"cache must be \[num_pages, page_size or 1, 24\]"):
        call(cache=torch.zeros(96, 1, 20))
    with pytest.raises(ValueError, match="no FP8 latent cache yet"):
        call(cache=cache.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"out_slots .* int64"):
        call(out_slots=out_slots.int())
    with pytest.raises(ValueError, match="must be even"):
        call(cos_sin=rope_cos_sin_cache(8, 64, 10000.0, None)[:, :7])


class _Writer(torch.nn.Module):
    def forward(self, kv_a, q, positions, cos_sin, norm_w, pool, out_slots):
        return torch.ops.kiln.mla_rope_kvwrite(
            kv_a, q, positions, cos_sin, norm_w, 1e-6, pool[1], out_slots, False
        )


def test_export_writes_the_pool_in_place(seed):
    """torch.export traces the op through its reference (the fake) with a dynamic token count and
    keeps the in-place write of the pool's layer view; the loaded program at another T matches."""
    cos_sin = rope_cos_sin_cache(8, 256, 10000.0, None)
    pool = torch.zeros(2, 96, 1, 24)
    t_dim = torch.export.Dim("T", min=1, max=64)

    def inputs(t):
        kv_a, q, positions, norm_w, out_slots = make_inputs(t, 2, 16, 8, 8, torch.float32)
        return kv_a.contiguous(), q, positions, cos_sin, norm_w, pool, out_slots

    dyn = ({0: t_dim}, {0: t_dim}, {0: t_dim}, None, None, None, {0: t_dim})
    ep = torch.export.export(_Writer(), inputs(5), dynamic_shapes=dyn, strict=False)
    assert "kiln.mla_rope_kvwrite" in ep.graph_module.code
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    loaded = torch.export.load(io.BytesIO(buf.getvalue())).module()
    args = inputs(9)
    ref_pool = pool.clone()
    q_pe = loaded(*args)
    want = mla_rope_kvwrite_ref(*args[:5], 1e-6, ref_pool[1], args[6], False)
    torch.testing.assert_close(q_pe, want)
    torch.testing.assert_close(pool, ref_pool, rtol=0, atol=0)  # the graph wrote the caller's pool
    assert pool[1].abs().sum() > 0


# --------------------------------------------------------------------------- the flat layer view
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_over_the_flat_layer_view(kernel_on_cpu, seed, page_size):
    """``mla_decode`` (kernel) and ``mla_extend`` over the pool's flat ``[S, 1, W]`` layer view give
    what they give over the same slots viewed in pages ``[S / P, P, W]``."""
    r, dr, heads = 32, 16, 4
    lens = [7, 40, 1]
    block_table, req_rows, num_slots = random_block_table(lens, page_size)
    flat = torch.randn(num_slots, 1, r + dr)
    paged = flat.view(num_slots // page_size, page_size, r + dr)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q, pe = torch.randn(3, heads, r), torch.randn(3, heads, dr)
    meta = (block_table, req_rows, seq_lens)
    for num_splits in (1, 3):
        got = torch.ops.kiln.mla_decode(q, pe, flat, *meta, 0.1, page_size, num_splits)
        want = torch.ops.kiln.mla_decode(q, pe, paged, *meta, 0.1, page_size, num_splits)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert rel_err(got, mla.mla_decode_ref(q, pe, paged, *meta, 0.1, page_size, 0)) < 1e-5
    indptr = torch.tensor([0, 3, 8, 9], dtype=torch.int32)  # 3, 5 and 1 new tokens
    q, pe = torch.randn(9, heads, r), torch.randn(9, heads, dr)
    got = torch.ops.kiln.mla_extend(q, pe, flat, *meta, indptr, 0.1, page_size)
    want = torch.ops.kiln.mla_extend(q, pe, paged, *meta, indptr, 0.1, page_size)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not got.isnan().any() and got.abs().sum() > 0


# --------------------------------------------------------------------------- kiln_op: -> None
def test_writers_declared_none_return_nothing():
    """A launch annotated ``-> None`` is an op with the schema ``-> ()`` that returns None (before
    kiln_op mapped ``NoneType`` to None, ``infer_schema`` refused it and a writer had to be
    declared ``-> tuple[()]``)."""
    assert str(torch.ops.kiln.mla_kv_write.default._schema).endswith("-> ()")

    def ref(x: torch.Tensor) -> None:
        x.add_(1)

    @kiln_op("test_none_return", ref=ref, mutates_args=("x",))
    def launch(x: torch.Tensor) -> None:
        x.add_(1)

    assert (
        str(torch.ops.kiln.test_none_return.default._schema) == "kiln::test_none_return(Tensor(a0!) x) -> ()"
    )
    x = torch.zeros(3)
    assert torch.ops.kiln.test_none_return(x) is None and torch.equal(x, torch.ones(3))


# --------------------------------------------------------------------------- GPU, DeepSeek sizes
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # V2-Lite / V3 at tp 8; V3 at tp 1
@pytest.mark.parametrize("t", [1, 37, 600])
def test_gpu_deepseek_shapes(compiled_gpu, seed, heads, t):
    """The compiled kernel at DeepSeek's widths (r 512, dr 64, dn 128), bf16, into the flat layer
    view of a bf16 pool (page 16 slots), against the reference on the same device."""
    r, dn, dr, dtype = 512, 128, 64, torch.bfloat16
    kv_a, q, positions, norm_w, out_slots = (x.cuda() for x in make_inputs(t, heads, r, dn, dr, dtype, 2048))
    cos_sin = rope_cos_sin_cache(dr, 256, 10000.0, None, device="cuda")
    pools = [torch.zeros(2, 2048, 1, r + dr, dtype=dtype, device="cuda") for _ in range(2)]
    args = (kv_a, q, positions, cos_sin, norm_w, 1e-6)
    got = torch.ops.kiln.mla_rope_kvwrite(*args, pools[0][1], out_slots, False)
    want = mla_rope_kvwrite_ref(*args, pools[1][1], out_slots, False)
    # slot 0, the sink, holds one of the padding rows: the last in the reference's order, any on
    # the GPU, where programs race (the H200 run: pools 3-18% apart with the sink, from it alone)
    assert rel_err(got, want) < 1e-2 and rel_err(pools[0][:, 1:], pools[1][:, 1:]) < 1e-2, f"seed {seed}"
