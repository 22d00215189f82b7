"""Fixtures: one server on the demo artifact (``demo_artifact``, tests/conftest.py) for the session.
With ``KILN_TEST_TP=N`` (kiln/settings.py ``test_tp``) the server tests' demo artifact is the same
checkpoint compiled with ``--tp N``: every server here runs N ranks, and the offline oracles stay on
the one-rank build (``demo_one_rank``). A process holds one tensor-parallel engine (its
torch.distributed group), so a test that starts a second in-process server beside the session's
is skipped in that mode, saying so (serve_harness.LiveServer)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_harness import LiveServer

from kiln import settings


@pytest.fixture(scope="session")
def demo_artifact(demo_one_rank, tmp_path_factory):
    tp = settings.value("test_tp")
    if tp <= 1:
        return demo_one_rank
    from pathlib import Path

    from kiln.compiler.build import CompileOptions, compile_model

    art = tmp_path_factory.mktemp(f"demo-tp{tp}") / "art"
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=8, max_seq_len=1024, chunk_size=512, tp=tp
    )
    compile_model(Path(demo_one_rank).parent / "checkpoint", art, opts, verbose=False)
    return art


@pytest.fixture(scope="session")
def server(demo_artifact):
    s = LiveServer(demo_artifact)
    yield s
    s.stop()
