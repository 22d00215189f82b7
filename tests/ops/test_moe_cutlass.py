"""The CUTLASS backend of the fused MoE op (ops/moe/cutlass.py, ops/moe/permute.py) and its dispatch.

CPU (Triton interpreter): the sort / gather / weighted un-sort kernels and the GEMM argument kernel
against their torch references, the whole pipeline with a torch grouped GEMM in place of CUTLASS
against ``fused_moe_ref``, the tuning table's ``backend`` and the errors. GPU (``-m gpu``): the
compiled library (``KILN_CUTLASS_LIB``, else built with compiler/cutlass_build.py) against
``fused_moe_ref`` at Qwen3-30B-A3B and small shapes, and inside a CUDA graph with new routing.
"""

import gc
import json
import os
import weakref
from types import SimpleNamespace

import pytest
import torch
from test_moe_gemm import GEMV, SMALL, TOL, assert_rel, make_moe

from kiln.ops.moe import cutlass as moe_cutlass
from kiln.ops.moe import fused as moe
from kiln.ops.moe import gemm as mg
from kiln.ops.moe import permute as moe_permute

# (T, k, E, E_global or None, hot expert or None): several chunks of 128 pairs, experts with no rows
SORT_CASES = [(1, 1, 4, None, None), (7, 3, 8, None, None), (100, 4, 16, None, 3), (50, 4, 8, 16, None)]


def _routing(t, k, e, e_global, hot, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e_global or e, generator=g)
    scores[:, -2:] = -1.0  # never chosen: experts with no rows
    if hot is not None:
        scores[:, hot] = 2.0
    ids = scores.topk(k, dim=1).indices.to(torch.int32)
    emap = None
    if e_global:  # every other global expert is local, in a shuffled slot order
        emap = torch.full((e_global,), -1, dtype=torch.int32)
        emap[::2] = torch.randperm(e_global // 2, generator=g).to(torch.int32)
    return ids, emap


@pytest.mark.parametrize("case", SORT_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-map{c[3]}-hot{c[4]}")
def test_sort_matches_reference(kernel_on_cpu, monkeypatch, case):
    t, k, e, e_global, hot = case
    monkeypatch.setattr(moe_permute, "SCAN_ROWS", 2)  # the scan over chunks in several steps
    ids, emap = _routing(t, k, e, e_global, hot)
    dst, counts, starts = moe_permute.moe_sort(ids, emap, e)
    rdst, rcounts, rstarts = moe_permute.moe_sort_ref(ids, emap, e)
    assert torch.equal(dst, rdst) and torch.equal(counts, rcounts) and torch.equal(starts, rstarts)
    local = (emap.long()[ids.reshape(-1).long()] if emap is not None else ids.reshape(-1).long()).tolist()
    n_local = sum(x >= 0 for x in local)
    assert int(counts.sum()) == n_local and sorted(d for d in dst.tolist() if d >= 0) == list(range(n_local))
    for p, d in enumerate(dst.tolist()):  # each local pair inside its expert's row range, others -1
        e_p = local[p]
        assert d == -1 if e_p < 0 else starts[e_p] <= d < starts[e_p] + counts[e_p]
    assert (counts == 0).any()  # experts with no rows are covered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gather_and_unsort_combine_match_reference(kernel_on_cpu, dtype):
    t, k, e, h = 9, 3, 8, 40  # H not a multiple of the column block
    ids, emap = _routing(t, k, e, 2 * e, None, seed=1)
    dst, counts, _ = moe_permute.moe_sort_ref(ids, emap, e)
    n = int(counts.sum())
    x = torch.randn(t, h).to(dtype)
    a = torch.full((t * k, h), float("nan"), dtype=dtype)
    moe_permute.gather_rows(x, dst, k, a)
    assert torch.equal(a[:n], moe_permute.gather_rows_ref(x, dst, k)[:n])
    y = torch.randn(t * k, h).to(dtype)
    y[n:] = float("nan")  # rows no local pair owns must not be read
    w = torch.rand(t, k)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    moe_permute.unsort_combine(y, dst, w, out)
    ref = moe_permute.unsort_combine_ref(y, dst, w)
    assert not ref.isnan().any() and (ref != 0).any()
    torch.testing.assert_close(out, ref, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


def test_grouped_gemm_arguments_match_reference(kernel_on_cpu):
    e, n, k, p = 6, 24, 16, 20
    counts = torch.tensor([3, 0, 9, 0, 8, 0], dtype=torch.int32)
    starts = (counts.cumsum(0) - counts).to(torch.int32)
    a, w, d = (
        torch.empty(p, k, dtype=torch.bfloat16),
        torch.empty(e, n, k, dtype=torch.bfloat16),
        torch.empty(p, n),
    )
    sizes = torch.full((e, 3), -7, dtype=torch.int32)
    ptrs = torch.full((3, e), -7, dtype=torch.int64)
    moe_cutlass.fill_args(counts, starts, a, w, d, sizes, ptrs)
    rs, rp = moe_cutlass.grouped_args_ref(counts, starts, a, w, d)
    assert torch.equal(sizes, rs) and torch.equal(ptrs, rp)
    assert rp[0, 2] == a.data_ptr() + 3 * k * 2 and rp[2, 4] == d.data_ptr() + 12 * n * 4  # D is float32 here
    assert rp[1, 5] == w.data_ptr() + 5 * n * k * 2 and rs[:, 0].tolist() == counts.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [(1, 8, 2, None), (7, 8, 3, None), (20, 8, 2, 0), (33, 16, 4, None)])
def test_pipeline_with_a_torch_gemm_matches_reference(kernel_on_cpu, dtype, case):
    t, e, k, hot = case
    x, w13, w2, w, ids, _, _ = make_moe(t, 48, 24, e, k, dtype, seed=t, hot=hot)
    out = torch.full(x.shape, float("nan"), dtype=dtype)
    moe_cutlass.fused_moe_cutlass(x, w13, w2, w, ids, None, out=out, gemm=moe_cutlass.grouped_gemm_ref)
    assert_rel(out, moe.fused_moe_ref(x, w13, w2, w, ids), TOL[dtype])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # SiLU of the never-written rows past the local pairs
def test_pipeline_sums_only_local_experts(kernel_on_cpu):
    x, w13, w2, w, ids, _, _ = make_moe(12, 32, 16, 8, 2, torch.float32, seed=5)
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)  # 4 local of 8
    local = (w13[::2].contiguous(), w2[::2].contiguous())
    out = moe_cutlass.fused_moe_cutlass(x, *local, w, ids, emap, gemm=moe_cutlass.grouped_gemm_ref)
    assert_rel(out, moe.fused_moe_ref(x, *local, w, ids, emap), TOL[torch.float32])
    none = torch.full((8,), -1, dtype=torch.int32)  # no local expert: zeros
    assert torch.equal(moe_cutlass.fused_moe_cutlass(x, *local, w, ids, none, gemm=moe_cutlass.grouped_gemm_ref),
                       torch.zeros_like(x))  # fmt: skip


# ---- the table's backend and the dispatch ---------------------------------------------------------


def test_tuning_backend_parses_and_old_tables_are_unchanged():
    old = json.dumps({"2": {"w13": GEMV, "w2": GEMV}, "64": {"w13": SMALL, "w2": SMALL}})
    new = json.dumps(
        {"2": {"w13": GEMV, "w2": GEMV}, "64": {"w13": SMALL, "w2": SMALL, "backend": "cutlass"}}
    )
    assert [m for m, _ in mg.parse_tuning(old)] == [m for m, _ in mg.parse_tuning(new)] == [2, 64]
    for t in (1, 2, 3, 64, 500):
        assert mg.pick_configs(old, 8, 32, 32, t, 2) == mg.pick_configs(new, 8, 32, 32, t, 2)
        assert mg.pick_backend(old, t) == "triton"
        assert mg.pick_backend(new, t) == ("triton" if t <= 2 else "cutlass")
    assert mg.pick_backend("", 4096) == "triton"
    with pytest.raises(
        ValueError, match=r"entry '4': 'backend' must be one of \('triton', 'cutlass'\), got 'cublas'"
    ):
        mg.parse_tuning(json.dumps({"4": {"w13": SMALL, "w2": SMALL, "backend": "cublas"}}))
    with pytest.raises(ValueError, match="needs 'w13' and 'w2'"):
        mg.parse_tuning(json.dumps({"4": {"w13": SMALL, "backend": "cutlass"}}))
    # the warm-up runs the CUTLASS rungs apart from the Triton ones with the same configs
    same = json.dumps(
        {"40": {"w13": SMALL, "w2": SMALL}, "100": {"w13": SMALL, "w2": SMALL, "backend": "cutlass"}}
    )
    assert mg.moe_warmup_tokens(16, 32, 32, 4, 100, same) == [1, 33, 41]
    assert mg.moe_warmup_tokens(16, 32, 32, 4, 100, same.replace(', "backend": "cutlass"', "")) == [1, 33]


def test_dispatch_follows_the_table(kernel_on_cpu, monkeypatch):
    """With the CUTLASS path made runnable on CPU (torch GEMM), the op takes it exactly on the rungs
    the table names, and matches the reference on both."""
    calls, real = [], moe_cutlass.fused_moe_cutlass

    def spy(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw, gemm=moe_cutlass.grouped_gemm_ref)

    monkeypatch.setattr(moe_cutlass, "supports", lambda x, w13, w2: True)
    monkeypatch.setattr(moe.moe_cutlass, "fused_moe_cutlass", spy)
    table = json.dumps(
        {"4": {"w13": SMALL, "w2": SMALL}, "64": {"w13": SMALL, "w2": SMALL, "backend": "cutlass"}}
    )
    for t in (3, 9):
        args = make_moe(t, 32, 16, 8, 2, torch.float32, seed=t)
        out = torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], table)
        assert_rel(out, moe.fused_moe_ref(*args[:5], None, *args[5:]), TOL[torch.float32])
    assert calls == [9]


def test_unsupported_calls_fall_back_and_missing_library_is_named(kernel_on_cpu, monkeypatch):
    x, w13, w2, w, ids, _, _ = make_moe(5, 32, 16, 8, 2, torch.bfloat16, seed=2)
    assert not moe_cutlass.supports(x, w13, w2)  # CPU / interpreter: the Triton kernels run
    table = json.dumps({"64": {"w13": SMALL, "w2": SMALL, "backend": "cutlass"}})
    out = torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, table)
    assert_rel(out, moe.fused_moe_ref(x, w13, w2, w, ids), TOL[torch.bfloat16])
    monkeypatch.setattr(moe_cutlass, "supports", lambda x, w13, w2: True)
    monkeypatch.setattr(moe_cutlass, "_LIB", None)
    with pytest.raises(moe_cutlass.CutlassUnavailable, match=r"no CUTLASS library is loaded.*load_library"):
        torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, table)


def test_load_library_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_cutlass, "_LIB", None)
    monkeypatch.setattr(moe_cutlass, "_LIB_PATH", None)
    with pytest.raises(moe_cutlass.CutlassUnavailable, match=r"does not exist.*--moe-backend cutlass"):
        moe_cutlass.load_library(tmp_path / "missing.so")
    other = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")  # a library that is not ours
    if os.path.isfile(other):
        with pytest.raises(moe_cutlass.CutlassUnavailable, match="ABI None"):
            moe_cutlass.load_library(other)
    assert moe_cutlass.library_path() is None


def test_switching_library_keeps_the_old_handles(tmp_path, monkeypatch):
    """Loading another library path must not destroy the handles made with the first one: CUDA
    graphs captured with them hold their workspace and their sizes / ptrs arrays."""
    destroyed = []

    class Fn:
        def __init__(self, f):
            self.f, self.restype, self.argtypes = f, None, None

        def __call__(self, *a):
            return self.f(*a)

    class FakeLib:  # the C API of ops/cutlass/sm90_grouped.cu, without CUDA
        def __init__(self, path):
            self.kg_abi = Fn(lambda: moe_cutlass.ABI)
            self.kg_create = Fn(lambda *a: setattr(a[-1]._obj, "value", 0) or 1234)
            self.kg_run = Fn(lambda h, s: 0)
            self.kg_destroy = Fn(lambda h: destroyed.append((path, h)))

    monkeypatch.setattr(moe_cutlass.ctypes, "CDLL", FakeLib)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for name in ("_LIB", "_LIB_PATH"):
        monkeypatch.setattr(moe_cutlass, name, None)
    monkeypatch.setattr(moe_cutlass, "_GEMMS", {})
    monkeypatch.setattr(moe_cutlass, "_RETIRED", [])
    for name in ("a.so", "b.so"):
        (tmp_path / name).write_bytes(b"x")
    moe_cutlass.load_library(tmp_path / "a.so")
    moe_cutlass._GEMMS[(0, 4, 32, 16)] = moe_cutlass.GroupedGemm(torch.device("cpu"), 4, 32, 16)
    sizes = weakref.ref(moe_cutlass._GEMMS[(0, 4, 32, 16)].sizes)
    moe_cutlass.load_library(tmp_path / "b.so")
    gc.collect()
    assert moe_cutlass._GEMMS == {} and destroyed == [] and sizes() is not None


# ---- GPU: the compiled library ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cutlass_lib(tmp_path_factory):
    path = os.environ.get("KILN_CUTLASS_LIB")
    if not path:
        from kiln.compiler.cutlass_build import CutlassBuildError, build_library

        try:
            path = build_library(tmp_path_factory.mktemp("cutlass"))["path"]
        except CutlassBuildError as err:
            pytest.skip(f"no CUTLASS library: {err}")
    moe_cutlass.load_library(path)
    return path


QWEN = (2048, 768, 128, 8)  # H, I, E, k


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,t,hot",
    [(QWEN, t, None) for t in (1, 7, 64, 1000)]
    + [((256, 128, 16, 4), t, h) for t, h in ((1, None), (33, 2), (300, 5))],
)
def test_gpu_matches_reference(compiled_gpu, cutlass_lib, shape, t, hot):
    h, i, e, k = shape
    x, w13, w2, w, ids, _, _ = make_moe(t, h, i, e, k, torch.bfloat16, device="cuda", seed=t, hot=hot)
    assert moe_cutlass.supports(x, w13, w2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_MOE_CUTLASS", "0")  # the switch, read at call time
        assert not moe_cutlass.supports(x, w13, w2)
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_cutlass.fused_moe_cutlass(x, w13, w2, w, ids, None, out=out)
    assert_rel(out, moe.fused_moe_ref(x, w13, w2, w, ids), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_grouped_gemm_empty_experts_and_expert_map(compiled_gpu, cutlass_lib):
    e, n, k = 16, 256, 128
    counts = torch.tensor(
        [0, 5, 0, 0, 300, 1, 0, 0, 0, 0, 0, 0, 0, 0, 129, 0], dtype=torch.int32, device="cuda"
    )
    starts = (counts.cumsum(0) - counts).to(torch.int32)
    p = int(counts.sum())
    a = torch.randn(p, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(e, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    d = torch.full((p, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = torch.empty_like(d)
    moe_cutlass.cutlass_grouped_gemm(a, w, d, counts, starts)
    moe_cutlass.grouped_gemm_ref(a, w, ref, counts, starts)
    assert_rel(d, ref, 1e-2, "grouped GEMM")
    x, w13, w2, tw, ids, _, _ = make_moe(40, 256, 128, 32, 4, torch.bfloat16, device="cuda", seed=9)
    emap = torch.full((32,), -1, dtype=torch.int32, device="cuda")
    emap[1::2] = torch.arange(16, dtype=torch.int32, device="cuda")
    local = (w13[1::2].contiguous(), w2[1::2].contiguous())
    out = moe_cutlass.fused_moe_cutlass(x, *local, tw, ids, emap)
    assert_rel(out, moe.fused_moe_ref(x, *local, tw, ids, emap), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_routing(compiled_gpu, cutlass_lib):
    h, i, e, k = QWEN
    table = json.dumps({"4096": {"w13": SMALL, "w2": SMALL, "backend": "cutlass"}})
    x, w13, w2, w, ids, _, _ = make_moe(64, h, i, e, k, torch.bfloat16, device="cuda", seed=1)
    torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, table)  # setup outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, table)
    for seed, hot in ((3, None), (4, 7)):
        nx, _, _, nw, nids, _, _ = make_moe(64, h, i, e, k, torch.bfloat16, device="cuda", seed=seed, hot=hot)
        x.copy_(nx), w.copy_(nw), ids.copy_(nids)
        out.fill_(float("nan"))
        g.replay()
        assert_rel(out, moe.fused_moe_ref(x, w13, w2, w, ids), TOL[torch.bfloat16])
