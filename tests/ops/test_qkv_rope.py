"""kiln::qkv_rope_kvwrite: the fused Triton kernel (interpreter on CPU, real on GPU) against the
composition of references, in place on a layer view of the [L, S, Hkv, D] pool, under
torch.export and inside a CUDA graph."""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass

import pytest
import torch

from kiln.ops.attention.qkv_rope import (  # registers kiln::
    qkv_rope_kvwrite_ref,
    qkv_rope_kvwrite_triton,
    quantize_kv_rows,
)
from kiln.ops.attention.rope import rope_cos_sin_cache
from kiln.ops.common.quant import fp8_error_bound

MAX_POS = 131072
PAGE = 16
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    t: int
    hq: int
    hkv: int
    d: int
    rot: int
    neox: bool
    norm: bool
    dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype | None = None  # default: dtype
    norm_dtype: torch.dtype | None = None  # default: dtype
    pad: int = 0  # trailing padding rows (out_slots == 0)
    layers: int = 2
    slots: int = 256

    @property
    def tol(self) -> float:
        low = torch.bfloat16 in (self.dtype, self.cache_dtype)
        return 1e-2 if low else 1e-5


@functools.lru_cache(maxsize=4)
def _cos_sin(rot: int, device: str) -> torch.Tensor:
    return rope_cos_sin_cache(rot, MAX_POS, 500000.0, None, device=device)


def _slots(c: Case, g: torch.Generator) -> torch.Tensor:
    """Distinct rows of [1, S) for the real tokens (always both sides of the first page boundary
    and the pool's last row when there are enough tokens), then 0 for the padding rows."""
    n = c.t - c.pad
    special = torch.tensor([PAGE - 1, PAGE, c.slots - 1])
    rest = torch.randperm(c.slots - 1, generator=g) + 1
    s = torch.cat([special, rest[~torch.isin(rest, special)]])[:n]
    s = s[torch.randperm(n, generator=g)]
    return torch.cat([s, torch.zeros(c.pad, dtype=torch.int64)])


def _inputs(c: Case, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    cd = c.cache_dtype or c.dtype
    qkv = torch.randn(c.t, (c.hq + 2 * c.hkv) * c.d, generator=g).to(c.dtype)
    positions = torch.randint(0, MAX_POS, (c.t,), generator=g)
    positions[0] = MAX_POS - 1  # far into a long context
    if c.t > 1:
        positions[1] = 0
    slots = _slots(c, g)
    assert len(set(slots[: c.t - c.pad].tolist())) == c.t - c.pad
    pool_k = torch.randn(c.layers, c.slots, c.hkv, c.d, generator=g).to(cd)  # untouched rows: random
    pool_v = torch.randn(c.layers, c.slots, c.hkv, c.d, generator=g).to(cd)
    written = slots[slots > 0]
    pool_k[1, written] = float("nan")  # poison the rows the op must write
    pool_v[1, written] = float("nan")
    nd = c.norm_dtype or c.dtype
    qw = (1 + 0.5 * torch.randn(c.d, generator=g)).to(nd) if c.norm else None
    kw = (1 + 0.5 * torch.randn(c.d, generator=g)).to(nd) if c.norm else None
    mv = lambda x: None if x is None else x.to(device)
    return (
        mv(qkv),
        mv(positions),
        _cos_sin(c.rot, device),
        mv(pool_k),
        mv(pool_v),
        mv(slots),
        mv(qw),
        mv(kw),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "unwritten (poisoned) or non-finite elements"
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _run_and_check(c: Case, device: str, call, seed: int = 0) -> None:
    """Run ``call`` (the op's signature) on fresh inputs; compare with the reference composition."""
    qkv, positions, cs, pool_k, pool_v, slots, qw, kw = _inputs(c, device, seed)
    before_k, before_v = pool_k.clone(), pool_v.clone()
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    meta = (c.hq, c.hkv, c.d, c.rot, c.neox, qw, kw, EPS, None, None)  # no FP8 scales
    q_ref = qkv_rope_kvwrite_ref(qkv, positions, cs, ref_k[1], ref_v[1], slots, *meta)
    # each row's own k and v (padding rows all share the sink row of the pool)
    rows_k = torch.empty(c.t, c.hkv, c.d, dtype=pool_k.dtype, device=device)
    rows_v = torch.empty_like(rows_k)
    idx = torch.arange(c.t, device=device)
    qkv_rope_kvwrite_ref(qkv, positions, cs, rows_k, rows_v, idx, *meta)

    q = call(qkv, positions, cs, pool_k[1], pool_v[1], slots, *meta)

    assert q.shape == (c.t, c.hq, c.d) and q.dtype == c.dtype
    assert _rel(q, q_ref) < c.tol
    written = slots[slots > 0]
    untouched = torch.ones(c.slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    for pool, ref, before, rows in ((pool_k, ref_k, before_k, rows_k), (pool_v, ref_v, before_v, rows_v)):
        assert pool.dtype == (c.cache_dtype or c.dtype)
        assert _rel(pool[1, written], ref[1, written]) < c.tol
        assert torch.equal(pool[1, untouched], before[1, untouched])
        assert torch.equal(pool[0], before[0]) and torch.equal(pool[2:], before[2:])  # other layers
        if c.pad:  # padding rows race on the sink row: it may hold a mix of them, but only theirs
            sink = pool[1, 0].float()
            lo = torch.stack([rows[r] for r in range(c.t - c.pad, c.t)]).float().amin(0)
            hi = torch.stack([rows[r] for r in range(c.t - c.pad, c.t)]).float().amax(0)
            slack = 0.02 * torch.maximum(lo.abs(), hi.abs()) + 1e-3  # kernel vs reference rounding
            assert bool(((sink >= lo - slack) & (sink <= hi + slack)).all())


def _poisoned_triton(*args):
    q = torch.full(
        (args[0].shape[0], args[6], args[8]), float("nan"), dtype=args[0].dtype, device=args[0].device
    )
    out = qkv_rope_kvwrite_triton(*args, out=q)
    assert out is q
    return q


CPU_CASES = [
    Case(t=7, hq=4, hkv=1, d=64, rot=64, neox=True, norm=False, pad=2),  # GQA 4, padding rows
    Case(t=5, hq=6, hkv=2, d=64, rot=32, neox=False, norm=True),  # 10 heads, partial, GPT-J
    Case(t=1, hq=8, hkv=1, d=128, rot=128, neox=True, norm=True, dtype=torch.bfloat16),  # GQA 8
    Case(t=4, hq=3, hkv=3, d=256, rot=64, neox=True, norm=False, dtype=torch.bfloat16, pad=1),  # MHA
    Case(
        t=4, hq=2, hkv=2, d=128, rot=96, neox=False, norm=True, dtype=torch.bfloat16, norm_dtype=torch.float32
    ),
    Case(t=3, hq=4, hkv=2, d=64, rot=64, neox=True, norm=False, cache_dtype=torch.bfloat16),
]


def _op(*args):
    return torch.ops.kiln.qkv_rope_kvwrite(*args)


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"T{c.t}-{c.hq}x{c.hkv}x{c.d}-rot{c.rot}")
def test_kernel_matches_reference_cpu(case, kernel_on_cpu):
    _run_and_check(case, "cpu", _poisoned_triton, seed=case.t * 31 + case.d)


def test_op_dispatches_to_kernel_and_reference(kernel_on_cpu, monkeypatch):
    case = Case(t=3, hq=4, hkv=2, d=64, rot=64, neox=True, norm=True, pad=1)
    _run_and_check(case, "cpu", _op, seed=1)  # the kernel, through torch.ops.kiln
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0")
    _run_and_check(case, "cpu", _op, seed=2)  # the CPU reference


def test_shape_errors_name_the_field():
    c = Case(t=2, hq=4, hkv=2, d=64, rot=64, neox=True, norm=False)
    qkv, positions, cs, pool_k, pool_v, slots, _, _ = _inputs(c, "cpu", 0)
    meta = (4, 2, 64, 64, True, None, None, EPS, None, None)
    with pytest.raises(ValueError, match="num_q_heads"):
        _op(qkv[:, :-64], positions, cs, pool_k[1], pool_v[1], slots, *meta)
    with pytest.raises(ValueError, match="k_cache"):
        _op(qkv, positions, cs, pool_k[1, :, :1], pool_v[1], slots, *meta)
    with pytest.raises(ValueError, match="rotary_dim"):
        _op(qkv, positions, cs, pool_k[1], pool_v[1], slots, 4, 2, 64, 32, True, None, None, EPS, None, None)
    with pytest.raises(ValueError, match="out_slots"):
        _op(qkv, positions, cs, pool_k[1], pool_v[1], slots[:1], *meta)


class _OneLayer(torch.nn.Module):
    """What a traced attention layer does: select layer 1 of the pool, call the op on the views."""

    def __init__(self, c: Case):
        super().__init__()
        self.c = c

    def forward(self, qkv, positions, cos_sin, k_pool, v_pool, out_slots, q_norm_w, k_norm_w):
        c = self.c
        q = torch.ops.kiln.qkv_rope_kvwrite(
            qkv, positions, cos_sin, k_pool[1], v_pool[1], out_slots, c.hq, c.hkv, c.d, c.rot, c.neox,
            q_norm_w, k_norm_w, EPS, None, None,
        )  # fmt: skip
        return q.flatten(1)


def _export_in_place(module: torch.nn.Module, args: tuple, mutated: list[int]):
    """``module`` exported, saved and loaded back, after checking the graph mutates its inputs in
    place: no clone or copy, and the op's arguments ``mutated`` are ``select(input, 0, 1)`` views."""
    ep = torch.export.export(module, args)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "kiln.qkv_rope_kvwrite.default" in targets
    assert not any(("clone" in t or "copy" in t or "functionalized" in t) for t in targets), targets
    op = next(n for n in ep.graph.nodes if str(n.target) == "kiln.qkv_rope_kvwrite.default")
    for view in (op.args[i] for i in mutated):
        assert str(view.target) == "aten.select.int" and view.args[0].op == "placeholder"
    assert not ep.graph_signature.buffers_to_mutate and not ep.graph_signature.user_inputs_to_mutate
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def test_export_mutates_the_pool_in_place(kernel_on_cpu):
    c = Case(t=4, hq=4, hkv=2, d=64, rot=32, neox=True, norm=True, pad=1, layers=3)
    loaded = _export_in_place(_OneLayer(c), _inputs(c, "cpu", 3), [3, 4])  # the caches

    def call(qkv, positions, cs, k_layer, v_layer, slots, hq, hkv, d, rot, neox, qw, kw, eps, k_sc, v_sc):
        pool_k, pool_v = k_layer._base, v_layer._base  # the op is handed the pool's layer-1 views
        ptrs = (pool_k.data_ptr(), pool_v.data_ptr())
        out = loaded.module()(qkv, positions, cs, pool_k, pool_v, slots, qw, kw)
        assert (pool_k.data_ptr(), pool_v.data_ptr()) == ptrs
        return out.view(c.t, c.hq, c.d)

    _run_and_check(c, "cpu", call, seed=4)


# --------------------------------------------------------------------------- FP8 caches
# The kernel quantizes each k / v head row with the float32 values the reference computes, the same
# multiplier (448 / amax, IEEE division) and round-to-nearest-even: on CPU (interpreter) every byte
# and scale measured equal, but for a norm's float32 statistics summed in another order (a scale a
# float32 ulp off, 1.4e-7). Asserted: every byte within one e4m3 step of the reference's, at most
# 1% of them differing (a truncating cast would flip about half), scales within 1e-6 relative. On
# the GPU (FMA contraction, approximate rsqrt) a QK-normed row's largest value can round to another
# bf16 value than the reference's (about 3e-5 a row), moving that row's scale by up to 2^-7: at
# most 0.1% of the scales may differ by that much.
FP8 = torch.float8_e4m3fn
MAX_STEP_FLIPS = 0.01
MAX_SCALE_MOVES = 0.001


def _e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance of two e4m3fn tensors in representable steps (sign-magnitude codes)."""

    def ordinal(x: torch.Tensor) -> torch.Tensor:
        code = x.view(torch.uint8).int()
        mag = code & 0x7F
        return torch.where(code >= 0x80, -mag, mag)

    return (ordinal(a) - ordinal(b)).abs()


def _check_fp8_rows(got, want, got_scale, want_scale, what: str) -> None:
    assert not got.float().isnan().any(), f"{what}: NaN bytes (unwritten rows?)"
    steps = _e4m3_steps(got, want)
    assert steps.max() <= 1, f"{what}: bytes up to {steps.max().item()} e4m3 steps off"
    assert (steps > 0).float().mean() <= MAX_STEP_FLIPS, f"{what}: {(steps > 0).float().mean():.2%} differ"
    assert torch.isfinite(got_scale).all(), f"{what}: unwritten scales"
    rel = (got_scale - want_scale).abs() / want_scale.abs().clamp_min(1e-30)
    moved = rel > 1e-6
    assert moved.float().mean() <= MAX_SCALE_MOVES and rel.max() <= 2**-7, f"{what}: scales differ"


def _run_and_check_fp8(c: Case, device: str, call, seed: int = 0) -> None:
    """``call`` (the op's signature, scales last) on an FP8 pool and its scales vs the reference:
    bytes and scales as the section comment says, the zero row, untouched rows and the sink."""
    assert c.cache_dtype == FP8
    qkv, positions, cs, pool_k, pool_v, slots, qw, kw = _inputs(c, device, seed)
    qkv[0, (c.hq) * c.d : (c.hq + 1) * c.d] = 0  # token 0: k head 0 a row of zeros
    qkv[0, (c.hq + c.hkv) * c.d : (c.hq + c.hkv + 1) * c.d] = 0  # and v head 0
    g = torch.Generator().manual_seed(seed + 1)
    pool_ks = (0.5 + torch.rand(c.layers, c.slots, c.hkv, generator=g)).to(device)  # the pool's scales
    pool_vs = (0.5 + torch.rand(c.layers, c.slots, c.hkv, generator=g)).to(device)
    written = slots[slots > 0]
    pool_ks[1, written] = float("nan")  # poison the scales the op must write
    pool_vs[1, written] = float("nan")
    before = [x.clone() for x in (pool_k, pool_v, pool_ks, pool_vs)]
    ref = [x.clone() for x in (pool_k, pool_v, pool_ks, pool_vs)]
    meta = (c.hq, c.hkv, c.d, c.rot, c.neox, qw, kw, EPS)
    q_ref = qkv_rope_kvwrite_ref(qkv, positions, cs, ref[0][1], ref[1][1], slots, *meta, ref[2][1], ref[3][1])
    # each token's own rows (padding rows all land on the sink slot of the pool)
    own = [torch.empty(c.t, c.hkv, c.d, dtype=FP8, device=device) for _ in range(2)]
    own += [torch.empty(c.t, c.hkv, device=device) for _ in range(2)]
    idx = torch.arange(c.t, device=device)
    qkv_rope_kvwrite_ref(qkv, positions, cs, own[0], own[1], idx, *meta, own[2], own[3])

    q = call(qkv, positions, cs, pool_k[1], pool_v[1], slots, *meta, pool_ks[1], pool_vs[1])

    assert q.shape == (c.t, c.hq, c.d) and q.dtype == c.dtype
    assert _rel(q, q_ref) < c.tol
    untouched = torch.ones(c.slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    got = (pool_k, pool_v, pool_ks, pool_vs)
    for i, name in ((0, "k"), (1, "v")):
        rows, scales = got[i][1], got[i + 2][1]
        _check_fp8_rows(rows[written], ref[i][1, written], scales[written], ref[i + 2][1, written], name)
        assert torch.equal(rows[slots[0], 0].float(), torch.zeros(c.d, device=device)), f"{name}: zero row"
        assert scales[slots[0], 0] == 0, f"{name}: a zero row's scale must be 0"
        for j in (i, i + 2):  # other rows and layers untouched, scales included
            bits = lambda x: x.view(torch.uint8) if x.dtype == FP8 else x
            assert torch.equal(bits(got[j][1, untouched]), bits(before[j][1, untouched]))
            assert torch.equal(bits(got[j][0]), bits(before[j][0]))
            assert torch.equal(bits(got[j][2:]), bits(before[j][2:]))
        if c.pad:  # the sink holds, per element, what one of the padding rows wrote
            pads = range(c.t - c.pad, c.t)
            steps = torch.stack([_e4m3_steps(rows[0], own[i][r]) for r in pads]).amin(0)
            assert steps.max() <= 1, f"{name}: the sink row holds bytes no padding row wrote"
            rel = torch.stack([(scales[0] - own[i + 2][r]).abs() / own[i + 2][r] for r in pads]).amin(0)
            assert (rel <= 1e-6).all(), f"{name}: the sink's scale is no padding row's"


_BF16_FP8 = {"dtype": torch.bfloat16, "cache_dtype": FP8}
FP8_CASES = [
    Case(t=7, hq=4, hkv=1, d=64, rot=64, neox=True, norm=False, pad=2, **_BF16_FP8),  # GQA 4, padding
    Case(t=5, hq=6, hkv=2, d=64, rot=32, neox=False, norm=True, cache_dtype=FP8),  # f32, pass-through dims
    Case(t=4, hq=2, hkv=2, d=128, rot=96, neox=True, norm=True, pad=1, **_BF16_FP8),
    Case(t=3, hq=4, hkv=2, d=64, rot=64, neox=True, norm=True, norm_dtype=torch.float32, **_BF16_FP8),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"T{c.t}-{c.hq}x{c.hkv}x{c.d}-rot{c.rot}-n{c.norm}")
def test_fp8_cache_matches_reference_cpu(case, kernel_on_cpu):
    _run_and_check_fp8(case, "cpu", _poisoned_triton, seed=case.t * 7 + case.d)


def test_fp8_cache_through_the_op(kernel_on_cpu, monkeypatch):
    case = FP8_CASES[2]
    _run_and_check_fp8(case, "cpu", _op, seed=11)  # the kernel, through torch.ops.kiln
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0")
    _run_and_check_fp8(case, "cpu", _op, seed=12)  # the CPU reference


def test_quantize_kv_rows():
    """The reference quantizer: each row's largest magnitude maps to +-448, the rest within one e4m3
    rounding (ops/common/quant.py ``fp8_error_bound``); a zero row gives zeros and scale 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=g) * torch.exp(4 * torch.randn(6, 3, 1, generator=g))
    x[2, 1] = 0
    x[3, 0, :5] = 1e-35  # below KV_AMAX_FLOOR: finite, never NaN
    q, scale = quantize_kv_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (6, 3)
    assert torch.equal(q[2, 1].float(), torch.zeros(64)) and scale[2, 1] == 0
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
    live = scale > 1e-30
    assert torch.equal(q.float().abs().amax(-1)[live], torch.full_like(scale[live], 448.0))
    deq = q.float() * scale[..., None]
    assert bool((((deq - x).abs() <= fp8_error_bound(x, scale)) | ~live[..., None]).all())


def test_fp8_scale_errors_name_the_field():
    c = Case(t=2, hq=4, hkv=2, d=64, rot=64, neox=True, norm=False, cache_dtype=FP8)
    qkv, positions, cs, pool_k, pool_v, slots, _, _ = _inputs(c, "cpu", 0)
    ks, vs = torch.zeros(c.slots, 2), torch.zeros(c.slots, 2)
    meta = (4, 2, 64, 64, True, None, None, EPS)
    head = (qkv, positions, cs, pool_k[1], pool_v[1], slots)
    with pytest.raises(ValueError, match=r"qkv_rope_kvwrite: k_scale must be a float32 \[256, 2\] tensor"):
        _op(*head, *meta, None, None)
    with pytest.raises(ValueError, match=r"v_scale must be a float32 .* got torch\.bfloat16"):
        _op(*head, *meta, ks, vs.bfloat16())
    bf16 = (qkv, positions, cs, pool_k[1].bfloat16(), pool_v[1].bfloat16(), slots)
    with pytest.raises(ValueError, match=r"k_scale is only for torch\.float8_e4m3fn caches; pass None"):
        _op(*bf16, *meta, ks, vs)


class _OneLayerFP8(torch.nn.Module):
    """_OneLayer on an FP8 pool: the layer's views of the pool and of its scales ``[L, S, Hkv]``."""

    def __init__(self, c: Case):
        super().__init__()
        self.c = c

    def forward(self, qkv, positions, cos_sin, k_pool, v_pool, out_slots, q_norm_w, k_norm_w, k_sc, v_sc):
        c = self.c
        q = torch.ops.kiln.qkv_rope_kvwrite(
            qkv, positions, cos_sin, k_pool[1], v_pool[1], out_slots, c.hq, c.hkv, c.d, c.rot, c.neox,
            q_norm_w, k_norm_w, EPS, k_sc[1], v_sc[1],
        )  # fmt: skip
        return q.flatten(1)


def test_export_fp8_mutates_pool_and_scales_in_place(kernel_on_cpu):
    c = Case(t=3, hq=4, hkv=2, d=64, rot=64, neox=True, norm=True, cache_dtype=FP8, layers=3, pad=1)
    qkv, positions, cs, pool_k, pool_v, slots, qw, kw = _inputs(c, "cpu", 5)
    k_sc, v_sc = torch.zeros(c.layers, c.slots, c.hkv), torch.zeros(c.layers, c.slots, c.hkv)
    args = (qkv, positions, cs, pool_k, pool_v, slots, qw, kw, k_sc, v_sc)
    loaded = _export_in_place(_OneLayerFP8(c), args, [3, 4, 14, 15])  # the caches and the scales

    def call(qkv, positions, cs, k_layer, v_layer, slots, hq, hkv, d, rot, neox, qw, kw, eps, ks, vs):
        ptrs = [x._base.data_ptr() for x in (k_layer, v_layer, ks, vs)]
        pools = (k_layer._base, v_layer._base)
        out = loaded.module()(qkv, positions, cs, *pools, slots, qw, kw, ks._base, vs._base)
        assert [x._base.data_ptr() for x in (k_layer, v_layer, ks, vs)] == ptrs
        return out.view(c.t, c.hq, c.d)

    _run_and_check_fp8(c, "cpu", call, seed=6)


# --------------------------------------------------------------------------- GPU (real sizes)
GPU_CASES = [
    Case(t=1, hq=32, hkv=8, d=128, rot=128, neox=True, norm=False, dtype=torch.bfloat16, slots=70001),
    Case(t=4096, hq=32, hkv=8, d=128, rot=128, neox=True, norm=False, dtype=torch.bfloat16, slots=70001),
    Case(t=333, hq=32, hkv=8, d=128, rot=128, neox=True, norm=True, dtype=torch.bfloat16, pad=13, slots=9000),
    Case(t=4096, hq=64, hkv=4, d=128, rot=128, neox=True, norm=True, dtype=torch.bfloat16, slots=70001),
    Case(t=77, hq=8, hkv=4, d=256, rot=256, neox=True, norm=False, dtype=torch.bfloat16, slots=4096),
    Case(t=500, hq=32, hkv=8, d=128, rot=64, neox=True, norm=False, dtype=torch.bfloat16, slots=4096),
    Case(t=500, hq=16, hkv=16, d=192, rot=64, neox=False, norm=False, dtype=torch.bfloat16, slots=4096),
    Case(t=64, hq=28, hkv=4, d=128, rot=128, neox=True, norm=False, dtype=torch.float32, slots=4096),
    Case(t=64, hq=12, hkv=2, d=64, rot=64, neox=True, norm=True, dtype=torch.float32, pad=5, slots=4096),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c.t}-{c.hq}x{c.hkv}x{c.d}-rot{c.rot}")
def test_kernel_matches_reference_gpu(case):
    _run_and_check(case, "cuda", _poisoned_triton, seed=5)
    _run_and_check(case, "cuda", _op, seed=6)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        Case(t=1, hq=32, hkv=8, d=128, rot=128, neox=True, norm=False, slots=70001, **_BF16_FP8),
        Case(t=4096, hq=32, hkv=8, d=128, rot=128, neox=True, norm=False, slots=70001, **_BF16_FP8),
        Case(t=333, hq=64, hkv=4, d=128, rot=128, neox=True, norm=True, pad=13, slots=9000, **_BF16_FP8),
        Case(t=500, hq=16, hkv=16, d=192, rot=64, neox=False, norm=False, slots=4096, **_BF16_FP8),
    ],
    ids=lambda c: f"T{c.t}-{c.hq}x{c.hkv}x{c.d}-rot{c.rot}",
)
def test_fp8_cache_matches_reference_gpu(case):
    _run_and_check_fp8(case, "cuda", _poisoned_triton, seed=13)
    _run_and_check_fp8(case, "cuda", _op, seed=14)


@pytest.mark.gpu
def test_cuda_graph_replay():
    c = Case(t=8, hq=32, hkv=8, d=128, rot=128, neox=True, norm=True, dtype=torch.bfloat16, pad=2, slots=4096)
    static = list(_inputs(c, "cuda", 7))
    meta = (c.hq, c.hkv, c.d, c.rot, c.neox, static[6], static[7], EPS, None, None)
    run = lambda: _op(*static[:3], static[3][1], static[4][1], static[5], *meta)
    run()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_static = run()

    def replay(qkv, positions, cs, k_layer, v_layer, slots, hq, hkv, d, rot, neox, qw, kw, eps, k_sc, v_sc):
        static[0].copy_(qkv)
        static[1].copy_(positions)
        static[5].copy_(slots)
        static[6].copy_(qw)  # the norm weights are drawn afresh for every seed too
        static[7].copy_(kw)
        static[3].copy_(k_layer._base)
        static[4].copy_(v_layer._base)
        graph.replay()
        k_layer._base.copy_(static[3])
        v_layer._base.copy_(static[4])
        return q_static.clone()

    for seed in (8, 9):  # new tokens, positions and slots each replay
        _run_and_check(c, "cuda", replay, seed=seed)
