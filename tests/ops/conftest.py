"""Fixtures of the kernel tests: ``kernel_on_cpu`` runs the ops' Triton kernels in the interpreter
on CPU tensors (a test file may override it with more switches); ``cuda_scalar_division`` makes
torch divide by a Python number as it does on CUDA tensors. (``compiled_gpu`` is in
tests/conftest.py: the compiler's GPU tests use it too.)"""

from __future__ import annotations

import pytest
import torch

from kiln.ops.common.launch import interpreting


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    if not interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set by tests/conftest.py)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")


@pytest.fixture
def cuda_scalar_division(monkeypatch):
    """``tensor / python_number`` as torch computes it on CUDA tensors: a product with the divisor's
    reciprocal in the tensor's dtype (ATen's ``div_true_kernel_cuda`` for a CPU-scalar divisor), one
    ulp off the IEEE quotient for about half of the float32 inputs. On CPU torch divides."""
    true_div = torch.Tensor.__truediv__

    def div(self, other):
        if isinstance(other, (int, float)) and self.is_floating_point():
            return self * (1.0 / other)
        return true_div(self, other)

    monkeypatch.setattr(torch.Tensor, "__truediv__", div)
    assert not torch.equal(torch.tensor([3.0]) / 448.0, torch.tensor([3.0]).double().div(448.0).float())
