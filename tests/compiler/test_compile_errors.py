"""`kiln compile` refuses, with a message naming the problem and the fix: an existing output
directory without --force, an unsupported architecture, a config that contradicts the weights
(naming the tensor), and a device that is not there."""

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import make_checkpoint


def compile_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kiln", "compile", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
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


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from tiny_moe_models import make_moe_checkpoint

    d = tmp_path_factory.mktemp("moe")
    make_moe_checkpoint(d / "hf", "qwen3-moe")  # 16 experts of intermediate size 48, hidden 64
    return d / "hf"


def test_moe_compiles_for_tensor_and_expert_parallel_ranks(moe_ckpt, tmp_path):
    # --tp 2 --ep 2 through the CLI: each rank's pack holds 8 whole experts (the runtime test,
    # tests/runtime/test_tensor_parallel.py, runs them); the layout is in the manifest and pack.json,
    # and a one-rank process is refused as for a dense tp 2 artifact
    from click.testing import CliRunner

    from kiln.artifact_format import ArtifactError
    from kiln.cli import cli
    from kiln.manifest import Manifest
    from kiln.runtime.loader import load_model
    from kiln.weights import load_pack

    art = tmp_path / "art"
    p = compile_cli(moe_ckpt, "-o", art, "--device", "cpu", "--tp", "2", "--ep", "2", "--max-seq-len", "64")
    assert p.returncode == 0, p.stderr
    assert (Manifest.load(art).tp, Manifest.load(art).ep) == (2, 2)
    pack = json.loads((art / "weights" / "pack.json").read_text())
    assert (pack["tp"], pack["ep"]) == (2, 2)
    for rank in (0, 1):
        w = load_pack(art / "weights", rank, verify=False)
        assert w["layers.0.moe.w13"].shape == (8, 2 * 48, 64) and w["layers.0.moe.w2"].shape == (8, 64, 48)
        assert w["layers.0.moe.router.weight"].shape == (16, 64)  # replicated
    with pytest.raises(
        ArtifactError, match=r"is built for 2 tensor-parallel ranks \(kiln compile --tp 2 --ep 2\)"
    ):
        load_model(str(art), "cpu")
    assert "--ep INTEGER" in CliRunner().invoke(cli, ["compile", "--help"]).output


def test_a_parallel_layout_that_cannot_shard_the_model_is_one_line(moe_ckpt, tmp_path):
    p = compile_cli(moe_ckpt, "-o", tmp_path / "art", "--device", "cpu", "--tp", "3", "--ep", "3")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "num_attention_heads (4) is not divisible by tp=3" in p.stderr
    p = compile_cli(moe_ckpt, "-o", tmp_path / "art", "--device", "cpu", "--tp", "2", "--ep", "3")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "num_experts (16) is not divisible by ep=3; use an ep that divides it" in p.stderr
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize(
    "hf, tp, ep, message",
    [
        ("moe", 2, 4, r"tp=2 must be a multiple of ep=4"),
        ("moe", 1, 2, r"tp=1 must be a multiple of ep=2"),
        ("dense", 2, 2, r"--ep 2: LlamaForCausalLM has no experts; .* use --ep 1"),
    ],
)
def test_expert_parallel_layouts_validate_parallel_refuses(ckpt, moe_ckpt, tmp_path, hf, tp, ep, message):
    from kiln.compiler.build import CompileOptions, compile_model
    from kiln.compiler.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        compile_model(
            moe_ckpt if hf == "moe" else ckpt, tmp_path / "art", CompileOptions(device="cpu", tp=tp, ep=ep)
        )
    assert not (tmp_path / "art").exists()


def test_force_never_deletes_the_checkpoint_or_the_artifact_it_replaces(ckpt, tmp_path):
    """--force replaces an artifact only with a finished build: into the checkpoint (or a folder
    holding it) it refuses; a build that fails leaves the old artifact whole and nothing else."""
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    for out in (copy, tmp_path):
        p = compile_cli(copy, "-o", out, "--device", "cpu", "--force")
        assert p.returncode == 2 and "is the checkpoint" in p.stderr and "pick another -o" in p.stderr
    assert sorted(f.name for f in copy.iterdir()) == sorted(f.name for f in ckpt.iterdir())

    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text("the old artifact")
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])  # a truncated shard: the weights phase fails
    p = compile_cli(broken, "-o", art, "--device", "cpu", "--force")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert (art / "manifest.json").read_text() == "the old artifact"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["art", "broken", "ck"]  # no build left behind


def test_sizes_and_flags_refused_in_one_line(ckpt, tmp_path, demo_artifact):
    p = compile_cli(ckpt, "-o", tmp_path / "a", "--device", "cpu", "--max-seq-len", "8")
    assert p.returncode == 2 and "--max-seq-len (8) must be above the page size (16)" in p.stderr, p.stderr
    p = compile_cli(ckpt, "-o", tmp_path / "a", "--device", "cpu", "--max-seq-len", "0")
    assert p.returncode == 2 and "--max-seq-len" in p.stderr
    assert not (tmp_path / "a").exists() and "Traceback" not in p.stderr

    def kiln(*args):
        return subprocess.run(
            [sys.executable, "-m", "kiln", *map(str, args)], capture_output=True, text=True, timeout=300
        )

    p = kiln("pack", ckpt, "-o", tmp_path / "pk", "--max-file-size", "bogus")
    assert p.returncode == 2 and "--max-file-size" in p.stderr and "Traceback" not in p.stderr
    p = kiln("inspect", demo_artifact)
    assert p.returncode == 2 and "is a kiln artifact" in p.stderr and "checkpoint" in p.stderr
    p = kiln("generate", ckpt, "hi", "--device", "cpu", "--compile-args", "--max-batch-size 'abc")
    assert p.returncode == 2 and "--compile-args" in p.stderr and "No closing quotation" in p.stderr


def test_an_existing_folder_is_filled_in_place(ckpt, tmp_path):
    """``-o .`` (or a mount point: a folder that cannot be renamed) in an empty folder: the build
    swaps its files in, leaving no hidden build folder behind."""
    here = tmp_path / "here"
    here.mkdir()
    p = compile_cli(ckpt, "-o", ".", "--device", "cpu", cwd=here)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (here / "manifest.json").is_file() and not [e for e in here.iterdir() if e.name.startswith(".")]
