"""The CUTLASS FP8 GEMM backend of ``fp8_linear`` (ops/linear/fp8_cutlass.py, ops/cutlass/sm90_fp8_gemm.cu).

CPU: the tables name instantiations the default build has, the ``auto`` backend's choice, the
errors without a library. GPU (``-m gpu``): the library (``KILN_CUTLASS_FP8_LIB``, else built with
compiler/cutlass_build.py) against the float32 reference for every instantiation, M not a multiple
of any tile, bias and per-tensor scales, and inside a CUDA graph with new inputs.
"""

import re
import shutil
import subprocess

import pytest
import torch
from test_fp8_gemm import check_graph_replay, make_case, rel_err

from kiln.compiler import cutlass_build
from kiln.ops.common.launch import CutlassUnavailable
from kiln.ops.linear import fp8_cutlass as fc
from kiln.ops.linear import fp8_linear as fl

LLAMA_NK = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]


def built_configs(sweep: bool) -> list[str]:
    """The instantiation names of the .cu source's default list (and, with ``sweep``, KF_SWEEP's)."""
    src = cutlass_build.source_file(cutlass_build.FP8).read_text()
    default = src[src.index("#define KF_CONFIGS(X)") :]
    names = re.findall(r'X\("(\w+)"', default)
    if sweep:
        block = src[src.index("#ifdef KF_SWEEP") : src.index("#define KF_CONFIGS(X)")]
        names += re.findall(r'X\("(\w+)"', block)
    return names


def test_tables_name_instantiations_of_the_default_build():
    names = built_configs(sweep=False)
    assert len(names) == len(set(names)) and len(set(built_configs(sweep=True))) > len(names)
    used = set(fc.TABLE.values()) | set(fc.BUCKET_DEFAULTS.values())
    assert used <= set(names), sorted(used - set(names))
    for name in names:  # the name spells the tile: schedule_MxNxK_cCMxCN
        assert re.fullmatch(r"(pp|co)_\d+x\d+x\d+_c\dx\d(_sk)?", name), name
    for m in (128, 256, 512, 1024):  # every Llama-3.1-8B shape measured at every bucket
        assert all((m, n, k) in fc.TABLE for n, k in LLAMA_NK)


def test_config_for_covers_the_measured_buckets_only():
    assert fc.config_for(200, 4096, 4096) == fc.TABLE[(256, 4096, 4096)]
    assert fc.config_for(65, 1024, 2048) == fc.BUCKET_DEFAULTS[128]  # unmeasured shape: the bucket's default
    assert fc.config_for(1024, 6144, 4096) == fc.TABLE[(1024, 6144, 4096)]
    for m in (1, 16, 64):  # decode sizes: the GEMV / cuBLAS
        assert fc.config_for(m, 4096, 4096) is None, m
    assert fc.config_for(1025, 4096, 4096) == fc.config_for(9000, 128, 256) == fc.BUCKET_DEFAULTS[fc.math.inf]


def test_auto_backend_prefers_cutlass_where_it_can_run(monkeypatch):
    xq, _, wq, _, _ = make_case(256, 4096, 64)  # only the shapes matter here
    wq = torch.empty(4096, 4096, dtype=wq.dtype)
    xq = torch.empty(256, 4096, dtype=xq.dtype)
    monkeypatch.delenv("KILN_FP8_FAST_ACCUM", raising=False)
    assert not fc.supports(xq, wq, torch.bfloat16)  # no library, CPU tensors
    assert fl.auto_backend(xq, wq, torch.bfloat16) == "triton"  # fp8_gemm.TABLE has the shape
    monkeypatch.setattr(fc, "supports", lambda x, w, dt: dt == torch.bfloat16)
    assert fl.auto_backend(xq, wq, torch.bfloat16) == "cutlass"
    assert fl.auto_backend(xq, wq, torch.float16) == "triton"  # bf16 output only
    assert fl.auto_backend(xq[:16], wq, torch.bfloat16) == "cublas"  # decode size: not measured
    big = torch.empty(4096, 4096, dtype=xq.dtype)
    assert fl.auto_backend(big, wq, torch.bfloat16) == "cutlass"
    monkeypatch.setenv("KILN_FP8_FAST_ACCUM", "0")  # CUTLASS accumulates fast only
    assert fl.auto_backend(xq, wq, torch.bfloat16) == "triton"


def test_without_a_library_cutlass_requests_fall_back_or_fail_clearly(monkeypatch):
    monkeypatch.setattr(fc, "_LIB", None)
    xq, xs, wq, ws, bias = make_case(20, 32, 64)
    y = fl.fp8_linear_forward(xq, xs, wq, ws, bias, torch.bfloat16, backend="cutlass")  # CPU: reference
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.bfloat16)) == 0
    with pytest.raises(CutlassUnavailable, match="no library is loaded"):
        fc.fp8_gemm_cutlass(xq, xs, wq, ws, bias, torch.bfloat16)
    with pytest.raises(CutlassUnavailable, match="does not exist"):
        fc.load_library("/nonexistent/cutlass_fp8_sm90.so")
    with pytest.raises(ValueError, match="KILN_FP8_GEMM"):
        fl.fp8_backend("cutlas")


STAND_IN = """
int kf_abi(void) { return %d; }
int kf_num_configs(void) { return %d; }
static const char* names[] = {%s};
const char* kf_config_name(int i) { return names[i]; }
long long kf_workspace(int c, int m, int n, int k, int s) { return 0; }
int kf_run(void) { return 0; }
"""


def stand_in_library(tmp_path, abi: int, names: list[str]):
    """A C library with the FP8 library's C API (no GPU code), built with the host compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    src = tmp_path / f"stand_in_{abi}_{len(names)}.c"
    src.write_text(STAND_IN % (abi, len(names), ", ".join(f'"{n}"' for n in names)))
    out = src.with_suffix(".so")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(out)], check=True, capture_output=True)
    return out


def test_load_library_checks_abi_and_instantiations(tmp_path, monkeypatch):
    monkeypatch.setattr(fc, "_LIB", None)
    monkeypatch.setattr(fc, "_LIB_PATH", None)
    with pytest.raises(CutlassUnavailable, match="has ABI 7, kiln drives ABI 1"):
        fc.load_library(stand_in_library(tmp_path, 7, ["x"]))
    with pytest.raises(CutlassUnavailable, match=r"lacks the instantiations \[.*pp_64x128x128_c1x1.*rebuild"):
        fc.load_library(stand_in_library(tmp_path, fc.ABI, built_configs(sweep=False)[:2]))
    assert not fc.loaded()
    full = stand_in_library(tmp_path, fc.ABI, built_configs(sweep=True))
    fc.load_library(full)
    assert fc.library_path() == full.resolve() and fc.config_names() == built_configs(sweep=True)
    assert fc.resolve_config(16, 4096, 4096) == fc.BUCKET_DEFAULTS[fc.math.inf]


# ---- GPU -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_library(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU (H100/H200)")
    from kiln.compiler.cutlass_build import FP8, CutlassBuildError, build_library

    try:
        path = build_library(tmp_path_factory.mktemp("cutlass"), lib=FP8)["path"]
    except CutlassBuildError as err:
        pytest.skip(f"no CUTLASS toolchain and no KILN_CUTLASS_FP8_LIB: {err}")
    fc.load_library(path)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (77, 4096, 4096), (256, 6144, 4096), (1000, 1024, 14336)])
def test_gpu_every_instantiation_matches_reference(fp8_library, m, n, k):
    xq, xs, wq, ws, _ = make_case(m, n, k, "cuda", bias_dtype=None)
    ref = fl.fp8_linear_ref(xq, xs, wq, ws, None, torch.float32)
    for name in fc.config_names():
        y = fc.fp8_gemm_cutlass(xq, xs, wq, ws, None, torch.bfloat16, name)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert rel_err(y, ref) < 1e-2, f"{name} at {m}x{n}x{k}: {rel_err(y, ref):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_token", "per_tensor"])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32], ids=str)
def test_gpu_bias_and_scales(fp8_library, per_tensor, bias_dtype):
    xq, xs, wq, ws, bias = make_case(300, 512, 1024, "cuda", per_tensor=per_tensor, bias_dtype=bias_dtype)
    y = fl.fp8_linear_forward(xq, xs, wq, ws, bias, torch.bfloat16, backend="cutlass")
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_auto_runs_cutlass_and_replays_in_a_graph(fp8_library, monkeypatch):
    monkeypatch.delenv("KILN_FP8_GEMM", raising=False)
    monkeypatch.delenv("KILN_FP8_FAST_ACCUM", raising=False)
    calls, real = [], fc.launch
    monkeypatch.setattr(fc, "launch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    check_graph_replay(256, 4096, 4096, lambda *a: fl.fp8_linear_forward(*a, torch.bfloat16))
    assert len(calls) == 2  # the warm-up and the capture ran CUTLASS
