"""Triton's kernel cache and the artifact (kiln.kernel_cache): compile writes kernels into the
artifact with group files that name their children relative to themselves (two compiles into two
directories give the same bytes); the runtime reads a copied or moved artifact's kernels and
compiles anything new into the per-user cache, never into the artifact; a flipped byte in a kernel
file is refused by the same file-table check as every other file.

Real Triton compiles for an sm_90 target (codegen and ptxas need no GPU, ~1.5 s each), through the
cache manager protocol Triton itself drives (``triton.compile`` -> ``get_group`` / ``put`` /
``put_group``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kiln.kernel_cache import CacheDirs, active_dirs, kernel_cache, reset_kernel_cache
from kiln.manifest import Manifest, file_table
from kiln.runtime.artifact import ArtifactError, open_artifact


def _add_one_fn(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


def _compile(block: int, write: Path, read: tuple[Path, ...] = ()) -> None:
    """Compile ``_add_one_fn`` at ``BLOCK=block`` for sm_90 through a kiln kernel cache of these
    directories, in a fresh process: once the Triton interpreter (which tests/conftest.py turns on
    without a GPU) has run a kernel in this process, it has patched triton.language for good and
    real compiles here fail."""
    _wait(_start(block, write, read))


def _start(block: int, write: Path, read: tuple[Path, ...] = ()) -> subprocess.Popen:
    """:func:`_compile`'s child process, started (several can run side by side)."""
    cmd = [sys.executable, __file__, str(block), str(write), *map(str, read)]
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(p: subprocess.Popen) -> None:
    try:
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == 0, err[-3000:]


def _compile_here(block: int, write: Path, read: tuple[Path, ...]) -> None:
    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    with kernel_cache(write=write, read=read):
        src = ASTSource(JITFunction(_add_one_fn), sig, constexprs={"BLOCK": block})
        triton.compile(src, target=GPUTarget("cuda", 90, 32))


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes] | None]:
    """Every path under ``root`` (directories: None), each file's size, mtime and bytes."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        if p.is_file()
        else None
        for p in sorted(root.rglob("*"))
    }


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One kernel compiled the way `kiln compile` does into two directories, by two processes
    (run side by side: each is ~3 s of Python and Triton start-up)."""
    root = tmp_path_factory.mktemp("kc")
    for p in [_start(64, root / name / "kernels") for name in ("a", "b")]:
        _wait(p)
    return root


def test_compile_writes_the_kernels_into_the_artifact_with_relative_groups(built):
    kernels = built / "a" / "kernels"
    files = _files(kernels)
    assert any(f.endswith(".cubin") for f in files) and any(f.endswith(".json") for f in files)
    groups = [json.loads(data) for rel, data in files.items() if Path(rel).name.startswith("__grp__")]
    assert len(groups) == 1
    children = groups[0]["child_paths"]
    assert children and all("/" not in p for p in children.values()), children


def test_kernel_cache_block_restores_what_was_there(tmp_path):
    before = active_dirs()
    with kernel_cache(write=tmp_path / "w", read=(tmp_path / "r",)):
        assert active_dirs() == CacheDirs((tmp_path / "w").resolve(), ((tmp_path / "r").resolve(),))
    assert active_dirs() == before


def test_two_compiles_into_two_directories_give_the_same_bytes(built):
    assert _files(built / "a" / "kernels") == _files(built / "b" / "kernels")


def test_runtime_reads_a_moved_artifact_and_compiles_new_kernels_elsewhere(built, tmp_path):
    moved = tmp_path / "moved" / "kernels"
    shutil.copytree(built / "a" / "kernels", moved)
    shutil.rmtree(built / "a")  # the compile's own directory is gone
    before = snapshot(moved.parent)
    user = tmp_path / "user-cache"
    _compile(64, user, (moved,))  # as load_model installs it; in the artifact: a hit, nothing written
    assert not user.exists() or not any(user.rglob("*"))
    _compile(128, user, (moved,))  # not in the artifact: compiled into the user cache
    assert snapshot(moved.parent) == before
    assert any(p.suffix == ".cubin" for p in user.rglob("*"))


def test_loading_and_generating_leave_the_artifact_unchanged(demo_artifact, tmp_path, monkeypatch):
    """Load, generate, chat, then compile a kernel the artifact lacks (what a cache miss at run time
    does): every file, mtime and the listing of the artifact stay as they were; the kernel lands in
    the per-user cache (HOME/.cache/kiln/triton)."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    art = copy_artifact(demo_artifact, tmp_path / "art")
    before = snapshot(art)
    try:
        llm = LLM(str(art), device="cpu")
        assert active_dirs().read == ((art / "kernels").resolve(),)
        llm.generate(["Once upon a time", "The"], SamplingParams(max_tokens=6, temperature=0))
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, temperature=0))
        dirs = active_dirs()
        _compile(32, dirs.write, dirs.read)
    finally:
        reset_kernel_cache()
    assert snapshot(art) == before
    user = tmp_path / "home" / ".cache" / "kiln" / "triton"
    assert any(p.suffix == ".cubin" for p in user.rglob("*"))


def test_a_flipped_byte_in_a_kernel_file_is_refused(demo_artifact, tmp_path):
    art = copy_artifact(demo_artifact, tmp_path / "art")
    assert not any((art / "kernels").rglob("*"))  # a CPU compile has no Triton kernels: add one
    _compile(16, art / "kernels")
    manifest = replace(Manifest.load(art), files=file_table(art))  # the table a GPU compile would write
    manifest.save(art)
    files = manifest.files
    cubin = next(rel for rel in files if rel.startswith("kernels/") and rel.endswith(".cubin"))
    open_artifact(art, "cpu", verify=True)  # intact: accepted
    flip_byte(art / cubin)
    with pytest.raises(ArtifactError, match=f"artifact file {cubin} fails its hash check"):
        open_artifact(art, "cpu", verify=True)
    open_artifact(art, "cpu", verify=False)  # --no-verify: sizes only


@pytest.mark.gpu
def test_gpu_moved_artifact_runs_from_its_own_kernels(compiled_gpu, tmp_path):
    """On the GPU: a compiled tiny model, moved, loads and generates in a fresh process (`kiln
    generate`) without compiling a kernel (the per-user cache stays empty) and without writing into
    the artifact; a flipped byte in one of its kernel files is refused."""
    from kiln.compiler.build import CompileOptions, compile_model
    from kiln.compiler.synth import make_checkpoint
    from kiln.demo import DEMO_CONFIG

    make_checkpoint(tmp_path / "hf", DEMO_CONFIG, dtype="float32", seed=0, with_tokenizer=True)
    opts = CompileOptions(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=256, chunk_size=64)
    compile_model(tmp_path / "hf", tmp_path / "built", opts, verbose=False)
    art = tmp_path / "moved"
    shutil.move(tmp_path / "built", art)
    before = snapshot(art)
    home = tmp_path / "home"  # the per-user cache is HOME/.cache/kiln/triton
    env = dict(os.environ, HOME=str(home), TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "kiln", "generate", str(art), "Once upon a time", "--max-tokens", "8"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert snapshot(art) == before
    caches = (home / ".cache" / "kiln" / "triton", home / ".triton")  # kiln's per-user cache, Triton's own
    new = [q for c in caches if c.exists() for q in c.rglob("*") if q.is_file()]
    assert not new, f"compiled at load: {new[:5]}"
    cubins = sorted((art / "kernels").rglob("*.cubin"))
    assert cubins
    flip_byte(cubins[0])
    with pytest.raises(ArtifactError, match="fails its hash check"):
        open_artifact(art, "cuda", verify=True)


if __name__ == "__main__":  # _compile's child process: BLOCK WRITE [READ ...]
    _compile_here(int(sys.argv[1]), Path(sys.argv[2]), tuple(Path(a) for a in sys.argv[3:]))
