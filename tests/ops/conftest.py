"""Fixtures of the kernel tests: ``kernel_on_cpu`` runs the ops' Triton kernels in the interpreter
on CPU tensors (a test file may override it with more switches). (``compiled_gpu`` is in
tests/conftest.py: the compiler's GPU tests use it too.)"""

from __future__ import annotations

import pytest

from kiln.ops.common.launch import interpreting


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    if not interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set by tests/conftest.py)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
