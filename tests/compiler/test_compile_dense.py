"""`kiln compile` on tiny random dense checkpoints reproduces Hugging Face transformers.

float32 on CPU: a prefill of two prompts (32 and 20 tokens) and 8 greedy decode steps; logits
max relative error (max |kiln - hf| / max |hf|) <= 1e-4 at every step.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import CONFIGS, check_against_hf, make_checkpoint

from kiln.compiler.build import CompileOptions, compile_model
from kiln.manifest import Manifest
from kiln.runtime.direct import DirectRunner
from kiln.runtime.model_runner import run_extend_graph


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def compiled(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(root / "hf", request.param)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    return hf, root


def test_prefill_and_decode_match_hf(compiled):
    hf, root = compiled
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (32, 20)]
    check_against_hf(runner, hf, prompts, decode_steps=8)


def test_compile_is_reproducible_to_the_byte(compiled, tmp_path):
    """A second compile of the same checkpoint into another directory: the same files with the same
    bytes, but build-log.json (timings, source path, time, host), which no table lists."""
    _, root = compiled
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    manifest = compile_model(root / "hf", tmp_path / "again", opts, verbose=False)
    a, b = root / "art", tmp_path / "again"
    assert Manifest.load(b) == manifest  # the typed record compile_model returns is the file's
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*"))
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*"))
    differ = [n for n in names if (a / n).is_file() and (a / n).read_bytes() != (b / n).read_bytes()]
    assert set(differ) <= {"build-log.json"}, differ
    log = json.loads((b / "build-log.json").read_text())
    assert log["source"] == str((root / "hf").resolve()) and set(log["compile_seconds"]) >= {
        "trace",
        "kernels",
    }
    on_disk = json.loads((b / "manifest.json").read_text())
    assert "build-log.json" not in on_disk["files"] and not {"source", "compile_seconds"} & set(on_disk)
    listed = sorted(n for n in names if (a / n).is_file() and n not in ("manifest.json", "build-log.json"))
    assert sorted(on_disk["files"]) == listed


@pytest.mark.gpu
def test_gpu_compile_is_reproducible_to_the_byte(compiled_gpu, tmp_path):
    """On the GPU the Triton cache joins in: kernels, their group files, the launchers and the
    driver helper module (built through a compiler wrapper that drops its temporary path)."""
    make_checkpoint(tmp_path / "hf", "llama-tied")
    opts = CompileOptions(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=256, chunk_size=64)
    for name in ("a", "b"):
        compile_model(tmp_path / "hf", tmp_path / name, opts, verbose=False)
    a, b = tmp_path / "a", tmp_path / "b"
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*"))
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*"))
    assert any(n.endswith(".cubin") for n in names) and any("cuda_utils" in n for n in names)
    differ = [n for n in names if (a / n).is_file() and (a / n).read_bytes() != (b / n).read_bytes()]
    assert set(differ) <= {"build-log.json"}, differ


def test_per_bucket_decode_graphs_match_shared(compiled, tmp_path):
    _, root = compiled
    opts = CompileOptions(
        device="cpu",
        dtype="float32",
        max_batch_size=2,
        max_seq_len=128,
        chunk_size=64,
        decode_graphs="per-bucket",
    )
    compile_model(root / "hf", tmp_path / "pb", opts, verbose=False)
    assert sorted(p.name for p in (tmp_path / "pb" / "graphs").iterdir()) == [
        "decode_b1.pt2",
        "decode_b1.py",
        "decode_b2.pt2",
        "decode_b2.py",
        "model.pt2",
        "model.py",
    ]
    a = DirectRunner(str(root / "art"), device="cpu", num_slots=256)
    b = DirectRunner(str(tmp_path / "pb"), device="cpu", num_slots=256)
    prompts = [[5, 6, 7, 8], [9, 10]]
    torch.testing.assert_close(a.prefill(prompts), b.prefill(prompts), rtol=0, atol=0)
    torch.testing.assert_close(a.decode([11, 12]), b.decode([11, 12]), rtol=0, atol=0)


def test_python_graphs_match_pt2(compiled, monkeypatch):
    # the generated source (default) and torch.export.load of the .pt2 run the same graph
    _, root = compiled
    monkeypatch.setenv("KILN_GRAPH_FORMAT", "python")
    a = DirectRunner(str(root / "art"), device="cpu", num_slots=256)
    assert type(a.model.graphs["model"]).__name__ == "CodeGraph"
    monkeypatch.setenv("KILN_GRAPH_FORMAT", "pt2")
    b = DirectRunner(str(root / "art"), device="cpu", num_slots=256)
    assert type(b.model.graphs["model"]).__name__ != "CodeGraph"
    prompts = [[5, 6, 7, 8, 9], [9, 10]]
    torch.testing.assert_close(a.prefill(prompts), b.prefill(prompts), rtol=0, atol=0)
    torch.testing.assert_close(a.decode([11, 12]), b.decode([11, 12]), rtol=0, atol=0)


def _every_token_logits(runner: DirectRunner, prompts: list[list[int]]) -> torch.Tensor:
    """The shared graph over ``prompts`` with the logits of every new token (``logits_indices`` of
    length T, not B: what a speculative verify step and teacher-forced accuracy need)."""
    rows, lens, ids, pos, slots, indptr = [], [], [], [], [], [0]
    for p in prompts:
        row = runner.bt.alloc_row()
        assert row is not None and runner.bt.cover(row, len(p), runner.pool)
        rows.append(row)
        lens.append(len(p))
        ids += p
        pos += range(len(p))
        slots += runner.bt.slots(row, 0, len(p))
        indptr.append(indptr[-1] + len(p))
    return run_extend_graph(runner.model, runner.pool, runner.bt, ids, pos, slots, rows, lens, indptr, True)


def test_graphs_return_logits_of_every_token(compiled, monkeypatch):
    # logits_indices has its own dynamic size (compiler/trace.py): the exported .pt2 graph takes
    # T rows as the generated source does, and agrees with the last-token logits of a prefill
    _, root = compiled
    prompts = [[5, 6, 7, 8, 9], [9, 10]]
    got = {}
    for fmt in ("python", "pt2"):
        monkeypatch.setenv("KILN_GRAPH_FORMAT", fmt)
        runner = DirectRunner(str(root / "art"), device="cpu", num_slots=256)
        got[fmt] = _every_token_logits(runner, prompts)
        last = DirectRunner(str(root / "art"), device="cpu", num_slots=256).prefill(prompts)
        assert got[fmt].shape[0] == 7
        torch.testing.assert_close(got[fmt][[4, 6]], last, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["python"], got["pt2"], rtol=0, atol=0)


@pytest.mark.parametrize("roles", ["attn:1", "1"])
def test_gemv_roles_pick_the_traced_linears(compiled, tmp_path, roles):
    # --gemv-plan attn:1: only qkv and o trace kiln::linear, for T = 1 (cuBLAS is weakest there)
    hf, root = compiled
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=2, max_seq_len=128, chunk_size=64, gemv_plan=roles
    )
    compile_model(root / "hf", tmp_path / "g", opts, verbose=False)
    src = (tmp_path / "g" / "graphs" / "model.py").read_text()
    layers = hf.config.num_hidden_layers
    linears, fused, normed = (
        src.count("torch.ops.kiln.linear.default("),
        src.count("torch.ops.kiln.linear_silu_mul.default("),
        src.count("torch.ops.kiln.rmsnorm_linear.default("),
    )
    # "1": every role: qkv, o and down on kiln::linear, gate_up + SiLU on linear_silu_mul; the norms
    # run apart (this graph is not the folded batch-1 one)
    want = (2 * layers, 0, 0) if roles == "attn:1" else (3 * layers, layers, 0)
    assert (linears, fused, normed) == want
    plan = json.loads((tmp_path / "g" / "manifest.json").read_text())["kernel_choices"]["gemv_plan"]
    assert plan == ({"attn": 1} if roles == "attn:1" else {"attn": 8, "mlp": 8, "router": 8, "latent": 8})
    runner = DirectRunner(str(tmp_path / "g"), device="cpu", num_slots=512)
    check_against_hf(runner, hf, [list(range(3, 20))], decode_steps=3)
