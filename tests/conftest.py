"""Shared test configuration.

GPU tests carry ``@pytest.mark.gpu`` and skip without CUDA. Without a GPU, kernel tests run the
real Triton kernels through the interpreter: ``TRITON_INTERPRET=1`` is set here, before any
kernel module is imported (on a GPU machine the kernels compile for the device instead).
"""

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Test tensors are tiny: on the 2-core CI machines OpenMP's thread hand-off made a [4,1,16]x[4,16,50]
# matmul take ~3 ms with 2 threads against ~5 us with one.
torch.set_num_threads(1)
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests count verify steps and drafts; the measured speculative policy (the default) turns
# speculation off where a verify step's wall time loses, which depends on the machine's timing.
# tests/runtime/test_spec_policy.py and the policy tests in test_speculative_successor.py set it.
os.environ.setdefault("KILN_SPECULATIVE_POLICY", "always")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run on the H200)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_setting_overrides():
    """An engine applies its options' run-time settings process-wide (kiln/settings.py): a test's
    engine must not leave them to the next test."""
    yield
    from kiln import settings

    settings.clear_overrides()


@pytest.fixture(scope="session")
def demo_one_rank(tmp_path_factory):
    """The built-in demo model (``kiln demo``'s), compiled for the CPU once per test session."""
    from kiln.demo import build_demo

    return build_demo(tmp_path_factory.mktemp("demo"), "cpu")


@pytest.fixture(scope="session")
def demo_tp2(demo_one_rank, tmp_path_factory):
    """The demo checkpoint compiled for two tensor-parallel ranks (the TP server and torchrun tests)."""
    from kiln.compiler.build import CompileOptions, compile_model

    art = tmp_path_factory.mktemp("demo-tp2") / "art"
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=8, max_seq_len=1024, chunk_size=512, tp=2
    )
    compile_model(Path(demo_one_rank).parent / "checkpoint", art, opts, verbose=False)
    return art


@pytest.fixture(scope="session")
def demo_artifact(demo_one_rank):
    """The demo artifact the tests run (tests/server may swap in a tensor-parallel build of it)."""
    return demo_one_rank


@pytest.fixture
def compiled_gpu():
    """Guards GPU tests against an interpreter left on (they must run the compiled kernels)."""
    from kiln.ops.common.launch import interpreting

    if interpreting():
        pytest.fail("GPU kernel tests must run compiled: run them with TRITON_INTERPRET=0")
