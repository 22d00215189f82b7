"""`kiln compile` refuses, with a message naming the problem and the fix: an existing output
directory without --force, an unsupported architecture, a config that contradicts the weights
(naming the tensor), and a device that is not there."""

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import make_checkpoint


def compile_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kiln", "compile", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    make_checkpoint(d / "hf", "llama-untied")
    return d / "hf"


def test_existing_output_needs_force(ckpt, tmp_path):
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "keep.txt").write_text("x")
    p = compile_cli(ckpt, "-o", tmp_path / "art", "--device", "cpu")
    assert p.returncode == 2 and "exists and is not empty; pass --force" in p.stderr
    assert (tmp_path / "art" / "keep.txt").exists()


def test_unsupported_architecture_lists_supported(ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    (bad / "config.json").write_text(json.dumps(cfg))
    p = compile_cli(bad, "-o", tmp_path / "art", "--device", "cpu")
    assert p.returncode == 2 and "'GPT2LMHeadModel'" in p.stderr and "LlamaForCausalLM" in p.stderr


def test_config_contradicting_weights_names_the_tensor(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text()) | {"intermediate_size": 96}
    (bad / "config.json").write_text(json.dumps(cfg))
    p = compile_cli(bad, "-o", tmp_path / "art", "--device", "cpu")
    assert p.returncode == 2 and "mlp" in p.stderr and ("gate_proj" in p.stderr or "gate_up" in p.stderr), (
        p.stderr
    )
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_missing_device(ckpt, tmp_path):
    p = compile_cli(ckpt, "-o", tmp_path / "art", "--device", "cuda")
    assert p.returncode == 2 and "no CUDA device is visible; use --device cpu" in p.stderr


def test_compile_forgets_kernels_the_process_already_loaded():
    # a kernel launched before is served from memory, never from the new artifact's cache dir:
    # the compiler clears those caches so that its warm-up writes every kernel into the artifact
    import types

    from triton.runtime.jit import JITFunction

    from kiln.compiler.build import forget_loaded_kernels

    def _probe(x_ptr):  # never launched: only its cache dict is used
        pass

    fn = JITFunction(_probe)
    fn.device_caches["probe"] = None  # what a launch leaves behind
    mod = types.SimpleNamespace(kernel=fn, wrapped=types.SimpleNamespace(fn=JITFunction(_probe)))
    mod.wrapped.fn.device_caches["probe"] = None
    assert forget_loaded_kernels([mod]) == 2
    assert not fn.device_caches and not mod.wrapped.fn.device_caches
    assert forget_loaded_kernels([mod]) == 0
    forget_loaded_kernels()  # the default (every kiln.ops module) runs under any Triton mode


def test_tensor_parallel_artifact_is_refused_by_a_one_rank_process(ckpt, tmp_path):
    # a tp 2 artifact builds (the engine runs it on two processes: tests/runtime/test_tensor_parallel.py);
    # loading it in a process that is not one of two ranks is refused with the way out, not an IndexError
    from kiln.artifact_format import ArtifactError
    from kiln.runtime.loader import load_model

    p = compile_cli(ckpt, "-o", tmp_path / "art", "--device", "cpu", "--tp", "2", "--max-seq-len", "64")
    assert p.returncode == 0, p.stderr
    with pytest.raises(
        ArtifactError,
        match=r"is built for 2 tensor-parallel ranks \(kiln compile --tp 2\) but this process runs 1",
    ):
        load_model(str(tmp_path / "art"), "cpu")


def test_tensor_parallel_moe_compile_is_refused_before_any_work(tmp_path):
    from tiny_moe_models import make_moe_checkpoint

    make_moe_checkpoint(tmp_path / "hf", "qwen3-moe")
    p = compile_cli(tmp_path / "hf", "-o", tmp_path / "art", "--device", "cpu", "--tp", "2")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "expert and tensor parallelism of MoE models are not built yet; compile with --tp 1" in p.stderr
    assert not (tmp_path / "art").exists()
