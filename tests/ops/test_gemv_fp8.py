"""The GEMV with FP8 operands (ops/linear/gemv.py, ``x_scale`` / ``w_scale``): the CUDA-core kernel against
the float32 reference of the FP8 product through the interpreter (per-token and per-tensor scales,
bias, split-K, M = 1..4, ragged K), its errors, and ``fp8_linear``'s ``auto`` choosing it for
decode-sized products; on the GPU the same at Llama-3.1-8B shapes and inside a CUDA graph."""

import pytest
import torch
from test_fp8_gemm import check_graph_replay, make_case, rel_err

from kiln.ops.linear import fp8_linear as fl
from kiln.ops.linear import gemv as G

PATHS = {
    "default": {},
    "narrow": dict(block_n=4, block_k=32, split_k=1),
    "splitk": dict(block_n=8, block_k=16, split_k=3),
}


@pytest.fixture
def kernel_on_cpu(kernel_on_cpu, monkeypatch):
    monkeypatch.setenv("KILN_GEMV", "1")


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_token", "per_tensor"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fp8_gemv_matches_reference(kernel_on_cpu, m, path, per_tensor):
    xq, xs, wq, ws, bias = make_case(m, 40, 112, per_tensor=per_tensor)  # K not a multiple of the blocks
    for out_dtype in (torch.bfloat16, torch.float32):
        y = G.gemv(xq, wq, bias, x_scale=xs, w_scale=ws, out_dtype=out_dtype, **PATHS[path])
        ref = fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)
        assert y.dtype == out_dtype and y.shape == (m, 40)
        assert rel_err(y, ref) < (1e-2 if out_dtype == torch.bfloat16 else 1e-5), path


def test_fp8_gemv_errors():
    xq, xs, wq, ws, _ = make_case(2, 32, 64)
    with pytest.raises(ValueError, match="x_scale and w_scale"):
        G.gemv(xq, wq, x_scale=xs)
    with pytest.raises(ValueError, match="without gate_up"):
        G.gemv(xq, wq, x_scale=xs, w_scale=ws, gate_up=True)
    with pytest.raises(ValueError, match="w_scale must have 32"):
        G.gemv(xq, wq, x_scale=xs, w_scale=ws[:8])


def test_auto_runs_the_gemv_for_decode_sizes(kernel_on_cpu, monkeypatch):
    monkeypatch.delenv("KILN_FP8_GEMM", raising=False)
    calls, real = [], fl.gemv
    monkeypatch.setattr(fl, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, fl.FP8_GEMV_MAX_M, fl.FP8_GEMV_MAX_M + 1):
        xq, xs, wq, ws, bias = make_case(m, 48, 64, seed=m)
        y = torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16)
        assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-2
    assert calls == [1, fl.FP8_GEMV_MAX_M]  # above the limit: Triton GEMM / cuBLAS rules
    monkeypatch.setenv("KILN_GEMV", "0")  # the GEMV switch covers it
    torch.ops.kiln.fp8_linear(xq[:1], xs[:1], wq, ws, bias, torch.bfloat16)
    monkeypatch.setenv("KILN_GEMV", "1")
    monkeypatch.setenv("KILN_FP8_GEMM", "cublas")  # a forced backend is that backend
    torch.ops.kiln.fp8_linear(xq[:1], xs[:1], wq, ws, bias, torch.bfloat16)
    assert calls == [1, fl.FP8_GEMV_MAX_M]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], ids=str)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gpu_fp8_gemv_matches_reference(compiled_gpu, m, n, k):
    xq, xs, wq, ws, _ = make_case(m, n, k, "cuda", bias_dtype=None)
    y = G.gemv(xq, wq, None, x_scale=xs, w_scale=ws)
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, None, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_fp8_gemv_graph_replay(compiled_gpu, monkeypatch):
    monkeypatch.delenv("KILN_FP8_GEMM", raising=False)
    calls, real = [], fl.gemv
    monkeypatch.setattr(fl, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    check_graph_replay(1, 4096, 4096, lambda *a: torch.ops.kiln.fp8_linear(*a, torch.bfloat16))
    assert len(calls) == 2  # the warm-up and the capture ran the GEMV
