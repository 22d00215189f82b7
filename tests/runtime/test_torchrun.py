"""``torchrun`` starts the ranks (runtime/tensor_parallel.py, "Launched ranks"): `kiln generate` on a
``--tp 2`` artifact, launched as two processes by torch.distributed's own launcher (gloo), prints
what the one-rank artifact prints; rank 1 follows rank 0 and exits with it. A launch whose size
differs from the artifact's is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tp2_demo(demo_tp2):
    return demo_tp2


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def _torchrun(nproc: int, art: Path, *flags: str) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return _run([*launcher, "-m", "kiln", "generate", str(art), PROMPT, "--device", "cpu", *flags])


def test_torchrun_ranks_generate_as_one_rank(tp2_demo, demo_artifact):
    flags = ("--max-tokens", "12", "--temperature", "0")
    one = _run(
        [sys.executable, "-m", "kiln", "generate", str(demo_artifact), PROMPT, "--device", "cpu", *flags]
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = _torchrun(2, tp2_demo, *flags)
    assert two.returncode == 0, two.stderr[-3000:]
    text = one.stdout.splitlines()[-1]  # after the engine's load log
    assert text.strip() and two.stdout.splitlines()[-1] == text
    assert two.stdout.count("[kiln] manifest") == 1  # rank 1 runs no engine: its log is rank 0's alone


def test_a_launch_of_the_wrong_size_is_one_error(tp2_demo):
    p = _torchrun(3, tp2_demo, "--max-tokens", "2")
    assert p.returncode != 0
    assert "built for 2 tensor-parallel rank(s) but the launcher started 3 processes" in p.stderr
