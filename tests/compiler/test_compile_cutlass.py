"""``kiln compile --moe-backend``: the table's per-rung backend (forced, measured), building the CUTLASS
library (compiler/cutlass_build.py, a stand-in nvcc on CPU), its errors, the manifest record and the
runtime loader that reads it; on the GPU, tiny Qwen3-MoE artifacts with CUTLASS rungs against Triton.
The same for the FP8 GEMM library of ``--quant fp8`` (``--fp8-cutlass``)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import make_checkpoint, rel_err
from tiny_moe_models import make_moe_checkpoint

from kiln.artifact_format import bytes_digest
from kiln.compiler import cutlass_build as cb
from kiln.compiler.build import CompileOptions, compile_model
from kiln.compiler.moe_tune import MoEShape, candidates, force_backend, moe_tuning, tune
from kiln.manifest import FileEntry, LibraryRecord, Manifest, MoEChoice
from kiln.ops.linear import fp8_cutlass
from kiln.ops.moe import cutlass as moe_cutlass
from kiln.ops.moe import gemm as mg
from kiln.runtime.artifact import Artifact, ArtifactError
from kiln.runtime.loader import load_fp8_library, load_moe_library

CPU_OPTS = dict(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=128, chunk_size=64)


def test_forced_backend_splits_the_table_at_the_threshold():
    table = mg.moe_tuning_table(128, 768, 2048, 8, 4096)
    forced = force_backend(table, "cutlass", 2048)
    assert "2047" in json.loads(forced) and json.loads(forced)["4096"]["backend"] == "cutlass"
    for t in [*range(1, 40), 1024, 2046, 2047, 2048, 2049, 4096, 9000]:
        assert mg.pick_configs(forced, 128, 768, 2048, t, 8) == mg.pick_configs(table, 128, 768, 2048, t, 8)
        assert mg.pick_backend(forced, t) == ("cutlass" if t >= 2048 else "triton"), t
    assert all(mg.pick_backend(force_backend(table, "cutlass", 5000), t) == "triton" for t in (1, 4096, 9000))


def test_tuner_records_cutlass_where_it_wins():
    s = MoEShape(num_experts=16, inter=64, hidden=128, top_k=2)

    def time_pair(tokens, pair):
        return 1.0 - 0.01 * candidates(s, tokens).index(pair)  # the last candidate is the fastest Triton

    def time_cutlass(tokens):
        if tokens == 4:
            raise RuntimeError("CUTLASS failed")
        return 0.5 if tokens >= 16 else 2.0

    table, report = tune(s, 40, time_pair, ladder=(1, 4, 16), time_cutlass=time_cutlass)
    parsed = dict(mg.parse_tuning(table))
    assert [mg.pick_backend(table, t) for t in (1, 4, 16, 40, 100)] == ["triton"] * 2 + ["cutlass"] * 3
    for m, entry in parsed.items():  # the fastest Triton pair is kept on CUTLASS rungs too
        assert (entry["w13"], entry["w2"]) == candidates(s, m)[-1]
    rows = {r["tokens"]: r for r in report if "best_us" in r}
    assert (
        rows[16]["cutlass_us"] == 0.5e6
        and rows[16]["backend"] == "cutlass"
        and rows[1]["backend"] == "triton"
    )
    assert any(r.get("skipped") == "cutlass" for r in report) and "cutlass_us" not in rows[4]


def test_moe_tuning_records_the_backend_and_library():
    s = MoEShape(num_experts=16, inter=64, hidden=128, top_k=2)
    lib = {"library": "kernels/cutlass_moe_sm90.so", "arch": "sm_90a"}
    choice = moe_tuning(s, 100, False, torch.bfloat16, torch.device("cpu"), "cutlass", 50, lib)
    assert choice["backend"] == "cutlass" and choice["method"] == "default" and choice["cutlass"] == lib
    assert choice["cutlass_min_tokens"] == 50
    assert [mg.pick_backend(choice["table"], t) for t in (49, 50, 100)] == ["triton", "cutlass", "cutlass"]
    plain = moe_tuning(s, 100, False, torch.bfloat16, torch.device("cpu"))
    assert plain["backend"] == "triton" and "cutlass" not in plain and "backend" not in plain["table"]


# ---- building the library ------------------------------------------------------------------------


@pytest.fixture
def fake_toolchain(tmp_path, monkeypatch):
    """A stand-in nvcc (logs its arguments, writes -o) and a CUTLASS header tree."""
    root = tmp_path / "cutlass"
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("// stand-in\n")
    (root / "include" / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n")
    nvcc = tmp_path / "nvcc"
    log = tmp_path / "nvcc.log"
    nvcc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0"; exit 0; fi\n'
        f'echo "$@" >> {log}\n'
        'if [ -n "$FAKE_NVCC_FAIL" ]; then echo "error: no sm_90a" >&2; exit 2; fi\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo built > "$2"; fi; shift; done\n'
    )
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("KILN_NVCC", str(nvcc))
    monkeypatch.setenv("KILN_CUTLASS_DIR", str(root))
    monkeypatch.setenv("KILN_CUTLASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_CUTLASS_LIB", raising=False)
    monkeypatch.delenv("KILN_CUTLASS_FP8_LIB", raising=False)
    return root, log


def test_build_runs_nvcc_once_then_uses_the_cache(tmp_path, fake_toolchain, monkeypatch):
    root, log = fake_toolchain
    first = cb.build_library(tmp_path / "a" / "kernels")
    assert first["source"] == "nvcc" and Path(first["path"]).read_text() == "built\n"
    args = log.read_text().split()
    assert "-arch=sm_90a" in args and f"-I{root / 'include'}" in args and str(cb.source_file()) in args
    assert cb.source_file().is_file() and "-shared" in args
    second = cb.build_library(tmp_path / "b" / "kernels")
    assert second["source"] == "cache" and len(log.read_text().splitlines()) == 1  # nvcc not run again
    monkeypatch.setenv("KILN_CUTLASS_LIB", first["path"])
    assert cb.build_library(tmp_path / "c")["source"] == "prebuilt"
    monkeypatch.setenv("KILN_CUTLASS_LIB", str(tmp_path / "nope.so"))
    with pytest.raises(cb.CutlassBuildError, match=r"KILN_CUTLASS_LIB=.*does not exist"):
        cb.build_library(tmp_path / "d")


def test_build_errors_name_the_fix(tmp_path, fake_toolchain, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(cb.CutlassBuildError, match=r"(?s)nvcc failed \(2\).*no sm_90a.*--moe-backend triton"):
        cb.build_library(tmp_path / "k")
    monkeypatch.setenv("KILN_CUTLASS_DIR", str(tmp_path))
    with pytest.raises(cb.CutlassBuildError, match=r"holds no include/cutlass/cutlass\.h"):
        cb.cutlass_dir()
    monkeypatch.delenv("KILN_CUTLASS_DIR")
    monkeypatch.setattr(cb.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(cb.CutlassBuildError, match=r"CUTLASS headers not found.*pip install nvidia-cutlass"):
        cb.cutlass_dir()
    for var in ("KILN_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(cb.CutlassBuildError, match=r"nvcc not found.*KILN_CUTLASS_LIB.*--moe-backend triton"):
        cb.find_nvcc()


def test_backend_choice_on_a_machine_without_the_gpu(tmp_path):
    cpu = torch.device("cpu")
    assert cb.cutlass_backend("triton", cpu, "bfloat16", None, False, tmp_path) == ("triton", {})
    with pytest.raises(
        cb.CutlassBuildError, match=r"--moe-backend cutlass needs --device cuda.*--moe-backend triton"
    ):
        cb.cutlass_backend("cutlass", cpu, "bfloat16", None, False, tmp_path)
    with pytest.warns(UserWarning, match="auto keeps Triton"):
        backend, info = cb.cutlass_backend("auto", cpu, "bfloat16", None, True, tmp_path)
    assert backend == "triton" and "--device cuda" in info["note"]
    with pytest.raises(cb.CutlassBuildError, match="must be one of"):
        cb.check_request("cublas", cpu, "bfloat16", None)
    lib = tmp_path / "kernels" / cb.LIB_NAME
    lib.parent.mkdir()
    lib.write_bytes(b"x")
    choice = {
        "table": mg.moe_tuning_table(8, 32, 32, 2, 64),
        "cutlass": {"library": f"kernels/{cb.LIB_NAME}"},
    }
    cb.drop_unused(choice, tmp_path)
    assert not lib.exists() and "no rung" in choice["cutlass"]["note"]


def test_cpu_compile_refuses_cutlass_before_any_work(tmp_path):
    make_moe_checkpoint(tmp_path / "hf", "qwen3-moe")
    opts = CompileOptions(**(CPU_OPTS | {"dtype": "bfloat16"}), moe_backend="cutlass")
    with pytest.raises(cb.CutlassBuildError, match="needs --device cuda"):
        compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    assert not (tmp_path / "art" / "weights").exists()


def test_cli_flags_and_clean_error(tmp_path):
    from click.testing import CliRunner

    from kiln.cli import cli

    make_moe_checkpoint(tmp_path / "hf", "qwen3-moe")
    r = CliRunner().invoke(
        cli, ["compile", str(tmp_path / "hf"), "-o", str(tmp_path / "a"), "--moe-cutlass-min-tokens", "0"]
    )
    assert r.exit_code == 2 and "--moe-cutlass-min-tokens" in r.output
    args = [
        "compile",
        str(tmp_path / "hf"),
        "-o",
        str(tmp_path / "a"),
        "--device",
        "cpu",
        "--moe-backend",
        "cutlass",
    ]
    p = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True)
    assert p.returncode == 2 and "--moe-backend cutlass needs --device cuda" in p.stderr
    assert "Traceback" not in p.stderr


# ---- the manifest record, read by the runtime loader ------------------------------------------------


def _artifact(
    root: Path,
    base: Manifest,
    files: dict[str, FileEntry],
    moe: MoEChoice | None = None,
    fp8: LibraryRecord | None = None,
) -> Artifact:
    """The demo artifact's manifest with these kernel choices and this file table, at ``root``."""
    choices = replace(base.kernel_choices, moe=moe, fp8=fp8)
    return Artifact(root, replace(base, kernel_choices=choices, files=files))


def test_loader_loads_the_library_the_manifest_names(demo_artifact, tmp_path, monkeypatch):
    base = Manifest.load(demo_artifact)
    lib = tmp_path / "kernels" / cb.LIB_NAME
    lib.parent.mkdir()
    lib.write_bytes(b"library bytes")
    digest = bytes_digest(b"library bytes")
    table = json.loads(force_backend(mg.moe_tuning_table(8, 32, 32, 2, 64), "cutlass", 16))
    moe = MoEChoice("cutlass", "default", table, cutlass=LibraryRecord(library=f"kernels/{cb.LIB_NAME}"))
    files = {f"kernels/{cb.LIB_NAME}": FileEntry(size=13, xxh3_128=digest)}
    loaded = []
    monkeypatch.setattr(moe_cutlass, "load_library", lambda p: loaded.append(str(p)))
    art = _artifact(tmp_path, base, files, moe)
    assert load_moe_library(art, torch.device("cpu")) is None and not loaded  # CPU: the reference runs
    assert load_moe_library(art, torch.device("cuda")) == str(lib) and loaded == [str(lib)]
    triton_only = replace(moe, table=json.loads(mg.moe_tuning_table(8, 32, 32, 2, 64)))
    assert load_moe_library(_artifact(tmp_path, base, {}, triton_only), torch.device("cuda")) is None
    bad = _artifact(tmp_path, base, {f"kernels/{cb.LIB_NAME}": FileEntry(size=13, xxh3_128="0" * 32)}, moe)
    with pytest.raises(ArtifactError, match=f"kernels/{cb.LIB_NAME} fails its hash check"):
        load_moe_library(bad, torch.device("cuda"))
    unnamed = _artifact(tmp_path, base, files, replace(moe, cutlass=LibraryRecord()))
    with pytest.raises(ArtifactError, match=r"'kernel_choices\.moe\.cutlass\.library'.*kiln compile"):
        load_moe_library(unnamed, torch.device("cuda"))


# ---- GPU: an artifact with CUTLASS rungs, the measured choice ----------------------------------------


@pytest.mark.gpu
def test_gpu_cutlass_artifact_matches_its_triton_configs(compiled_gpu, tmp_path, monkeypatch):
    """One compile with ``--moe-backend cutlass`` (rungs from 8 tokens): the library is in the
    artifact and the manifest, the loader loads it, prefills of 32 tokens run CUTLASS, and match
    the same artifact with ``KILN_MOE_CUTLASS=0`` (the rungs' Triton configs)."""
    from kiln.runtime.direct import DirectRunner

    make_moe_checkpoint(tmp_path / "hf", "qwen3-moe")
    opts = CompileOptions(device="cuda", dtype="bfloat16", max_batch_size=2, max_seq_len=128, chunk_size=32,
                          moe_backend="cutlass", moe_cutlass_min_tokens=8)  # fmt: skip
    try:
        m = compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    except cb.CutlassBuildError as err:
        pytest.skip(f"no CUTLASS toolchain here: {err}")
    moe = m.kernel_choices.moe
    lib = moe.cutlass.library
    assert moe.backend == "cutlass" and lib in m.files and (tmp_path / "art" / lib).is_file()
    table = json.dumps(moe.table)
    assert mg.pick_backend(table, 8) == "cutlass" and mg.pick_backend(table, 7) == "triton"
    calls, real = [], moe_cutlass.fused_moe_cutlass
    monkeypatch.setattr(moe_cutlass, "fused_moe_cutlass", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [list(range(5, 25)), list(range(40, 52))]  # 32 tokens: a CUTLASS rung
    out = DirectRunner(str(tmp_path / "art"), device="cuda", num_slots=256).prefill(prompts)
    assert calls and moe_cutlass.library_path() == (tmp_path / "art" / lib).resolve()
    monkeypatch.setenv("KILN_MOE_CUTLASS", "0")
    n = len(calls)
    ref = DirectRunner(str(tmp_path / "art"), device="cuda", num_slots=256).prefill(prompts)
    assert len(calls) == n  # switched off: the Triton kernels ran
    assert rel_err(out.float(), ref.float()) < 3e-2


@pytest.mark.gpu
def test_gpu_auto_times_both_backends(compiled_gpu, tmp_path):
    """What ``--moe-backend auto --moe-tune`` runs, at one rung (each Triton candidate compiles):
    the library built and loaded, CUTLASS timed beside the candidates on the device (its output
    checked against the default Triton table's), the winner recorded."""
    from kiln.compiler.moe_tune import cuda_timer

    try:
        backend, lib = cb.cutlass_backend(
            "auto", torch.device("cuda"), "bfloat16", None, True, tmp_path / "kernels"
        )
    except cb.CutlassBuildError as err:
        pytest.skip(f"no CUTLASS toolchain here: {err}")
    if backend == "triton":  # auto keeps Triton (with a warning) where headers or nvcc are missing
        pytest.skip(f"no CUTLASS toolchain here: {lib.get('note')}")
    assert backend == "auto" and lib["library"] == f"kernels/{cb.LIB_NAME}"
    s = MoEShape(num_experts=32, inter=256, hidden=512, top_k=4)
    timer = cuda_timer(s, torch.bfloat16, torch.device("cuda"))
    table, report = tune(s, 256, timer, ladder=(256,), time_cutlass=lambda t: timer(t, None))
    (row,) = [r for r in report if "best_us" in r]
    assert row["tokens"] == 256 and row["cutlass_us"] > 0 and row["best_us"] > 0, report
    assert (
        mg.pick_backend(table, 256)
        == row["backend"]
        == ("cutlass" if row["cutlass_us"] < row["best_us"] else "triton")
    )


# ---- the FP8 GEMM library (--quant fp8) -----------------------------------------------------------


def test_fp8_library_builds_its_own_source_and_cache_entry(tmp_path, fake_toolchain, monkeypatch):
    _, log = fake_toolchain
    moe = cb.build_library(tmp_path / "a")
    fp8 = cb.build_library(tmp_path / "b", lib=cb.FP8)
    assert Path(fp8["path"]).name == "cutlass_fp8_sm90.so" and fp8["source"] == "nvcc"
    first, second = (line.split() for line in log.read_text().splitlines())
    assert str(cb.source_file()) in first and str(cb.source_file(cb.FP8)) in second
    assert cb.source_file(cb.FP8).is_file() and moe["source"] == "nvcc"
    assert cb.build_library(tmp_path / "c", lib=cb.FP8)["source"] == "cache"
    monkeypatch.setenv("KILN_CUTLASS_FP8_LIB", str(tmp_path / "nope.so"))
    with pytest.raises(cb.CutlassBuildError, match=r"KILN_CUTLASS_FP8_LIB=.*does not exist"):
        cb.build_library(tmp_path / "d", lib=cb.FP8)
    monkeypatch.delenv("KILN_CUTLASS_FP8_LIB")
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    (tmp_path / "cache").rename(tmp_path / "old-cache")
    with pytest.raises(cb.CutlassBuildError, match=r"(?s)sm90_fp8_gemm\.cu.*--no-fp8-cutlass"):
        cb.build_library(tmp_path / "e", lib=cb.FP8)


def test_fp8_library_record_says_why_not(tmp_path):
    cpu = torch.device("cpu")
    assert cb.fp8_library(True, cpu, None, tmp_path) == {}  # not an FP8 compile
    assert "--no-fp8-cutlass" in cb.fp8_library(False, cpu, "fp8", tmp_path)["note"]
    assert "needs --device cuda" in cb.fp8_library(True, cpu, "fp8", tmp_path)["note"]
    assert not (tmp_path / "kernels").exists()


def test_fp8_library_that_does_not_load_is_left_out_with_a_warning(tmp_path, monkeypatch):
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a shared library")
    monkeypatch.setenv("KILN_CUTLASS_FP8_LIB", str(bogus))
    monkeypatch.setattr(cb, "_not_sm90", lambda device: None)  # as on an H100/H200
    with pytest.warns(UserWarning, match="without CUTLASS"):
        rec = cb.fp8_library(True, torch.device("cuda"), "fp8", tmp_path / "kernels")
    assert "does not load" in rec["note"] and not (tmp_path / "kernels" / cb.FP8.name).exists()


def test_loader_loads_the_fp8_library_the_manifest_names(demo_artifact, tmp_path, monkeypatch):
    base = Manifest.load(demo_artifact)
    lib = tmp_path / "kernels" / cb.FP8.name
    lib.parent.mkdir()
    lib.write_bytes(b"fp8 library")
    rel = f"kernels/{cb.FP8.name}"
    files = {rel: FileEntry(size=11, xxh3_128=bytes_digest(b"fp8 library"))}
    loaded = []
    monkeypatch.setattr(fp8_cutlass, "load_library", lambda p: loaded.append(str(p)))
    art = _artifact(tmp_path, base, files, fp8=LibraryRecord(library=rel))
    assert load_fp8_library(art, torch.device("cpu")) is None and not loaded
    assert load_fp8_library(art, torch.device("cuda")) == str(lib) and loaded == [str(lib)]
    noted = _artifact(tmp_path, base, {}, fp8=LibraryRecord(note="no CUTLASS FP8 GEMM library"))
    assert load_fp8_library(noted, torch.device("cuda")) is None
    unlisted = _artifact(tmp_path, base, {}, fp8=LibraryRecord(library=rel))
    with pytest.raises(ArtifactError, match=r"'kernel_choices\.fp8\.library'.*kiln compile"):
        load_fp8_library(unlisted, torch.device("cuda"))

    def refuse(path):
        raise fp8_cutlass.CutlassUnavailable("ABI 0")

    monkeypatch.setattr(fp8_cutlass, "load_library", refuse)
    with pytest.raises(ArtifactError, match=r"CUTLASS FP8 GEMM library\) does not load here \(ABI 0\)"):
        load_fp8_library(art, torch.device("cuda"))


def test_cli_has_the_fp8_cutlass_switch():
    from click.testing import CliRunner

    from kiln.cli import cli

    r = CliRunner().invoke(cli, ["compile", "--help"])
    assert r.exit_code == 0 and "--no-fp8-cutlass" in r.output


@pytest.mark.gpu
def test_gpu_fp8_artifact_runs_cutlass_for_prefill(compiled_gpu, tmp_path, monkeypatch):
    """An FP8 compile on the H200 puts the FP8 library in the artifact and the manifest; the loader
    loads it; a 100-token prefill (M bucket 128) runs it and matches cuBLAS (``KILN_FP8_GEMM``)."""
    from kiln.runtime.direct import DirectRunner

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUTLASS FP8 GEMM is built for sm90 (H100/H200)")
    make_checkpoint(tmp_path / "hf", "qwen3-qknorm", seed=6, eos=None)
    opts = CompileOptions(
        device="cuda", dtype="bfloat16", quant="fp8", max_batch_size=4, max_seq_len=256, chunk_size=128
    )
    m = compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    fp8 = m.kernel_choices.fp8
    if fp8.note is not None:
        pytest.skip(f"no CUTLASS toolchain here: {fp8.note}")
    assert fp8.library in m.files and (tmp_path / "art" / fp8.library).is_file()
    calls, real = [], fp8_cutlass.launch
    monkeypatch.setattr(fp8_cutlass, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fp8_cutlass, "_LIB", None)  # the compile loaded it: the loader must load it again
    monkeypatch.setattr(fp8_cutlass, "_LIB_PATH", None)
    prompts = [list(range(5, 65)), list(range(100, 140))]  # 100 tokens
    out = DirectRunner(str(tmp_path / "art"), device="cuda", num_slots=512).prefill(prompts)
    assert calls and fp8_cutlass.library_path() == (tmp_path / "art" / fp8.library).resolve()
    monkeypatch.setenv("KILN_FP8_GEMM", "cublas")
    n = len(calls)
    ref = DirectRunner(str(tmp_path / "art"), device="cuda", num_slots=512).prefill(prompts)
    assert len(calls) == n
    assert rel_err(out.float(), ref.float()) < 3e-2
