"""kiln/settings.py: one declaration per switch, read through one function, set by options and flags
(compile: recorded in the manifest, never the environment; run: the engine's options, then the
environment), and docs/settings.md generated from it."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import make_checkpoint

from kiln import settings
from kiln.cli import cli
from kiln.compiler.build import CompileOptions
from kiln.errors import KilnError
from kiln.manifest import Manifest
from kiln.runtime.engine import EngineOptions

ROOT = Path(__file__).resolve().parents[1]
RUN = [s.name for s in settings.of_stage("run")]


def test_docs_table_is_the_generated_one():
    r = CliRunner().invoke(cli, ["settings", "--markdown"])
    assert r.exit_code == 0, r.output
    assert (ROOT / "docs" / "settings.md").read_text() == r.output, (
        "docs/settings.md is stale: regenerate it with `.venv/bin/kiln settings --markdown > docs/settings.md`"
    )
    text = CliRunner().invoke(cli, ["settings"], env={"KILN_PDL": "0"}).output
    for s in settings.SETTINGS.values():
        assert s.name in text and s.name in r.output
    assert "now: KILN_PDL='0'" in text  # the table says what the environment sets now


def test_options_are_the_declared_settings():
    """One name from the flag to the option field: each run-time setting is an EngineOptions field
    (None: the environment) and a flag of serve, generate and bench; each compile flag a
    CompileOptions field whose default is the declared one."""
    engine = {f.name: f.default for f in fields(EngineOptions)}
    assert all(engine[name] is None for name in RUN)
    assert set(EngineOptions().setting_values()) == set(RUN)
    for cmd in (["serve"], ["generate"], ["bench", "latency"], ["bench", "throughput"]):
        out = CliRunner().invoke(cli, [*cmd, "--help"]).output
        assert all(settings.SETTINGS[name].option.split("/")[0] in out for name in RUN), cmd
    compile_help = CliRunner().invoke(cli, ["compile", "--help"]).output
    assert "--gemv-plan" in compile_help and "--no-fold-norms" in compile_help
    opts = CompileOptions()
    for s in settings.of_stage("compile"):
        if s.flag:
            assert getattr(opts, s.name) == s.parse(s.default), s.name


def test_value_precedence_and_one_line_errors(monkeypatch):
    monkeypatch.delenv("KILN_PREWAIT", raising=False)
    assert settings.value("prewait") == frozenset(settings.SETTINGS["prewait"].choices)  # default: all
    monkeypatch.setenv("KILN_PREWAIT", "gemv, rope")
    assert settings.value("prewait") == {"gemv", "rope"}
    with settings.overridden(prewait="none"):  # an option beats the environment
        assert settings.value("prewait") == frozenset()
    assert settings.value("prewait") == {"gemv", "rope"}
    monkeypatch.setenv("KILN_PDL", "off")
    assert settings.value("pdl") is False
    monkeypatch.setenv("KILN_PDL", "2")
    with pytest.raises(settings.SettingError) as e:
        settings.value("pdl")
    assert isinstance(e.value, KilnError) and "\n" not in str(e.value)
    assert str(e.value).startswith("KILN_PDL is '2'; it takes on, off")
    with pytest.raises(settings.SettingError, match=r"EngineOptions.fp8_gemm \(--fp8-gemm\) is 'fast'"):
        settings.apply("run", {"fp8_gemm": "fast"})


def test_int_settings_have_their_minimum(monkeypatch):
    # a draft count of 0 once ran an engine that loaded its draft model and never drafted
    with pytest.raises(settings.SettingError, match=r"--num-draft-tokens\) is '0'; it takes an integer >= 1"):
        settings.apply("run", {"num_draft_tokens": 0})
    monkeypatch.setenv("KILN_DRAFT_BRANCHES", "0")
    with pytest.raises(settings.SettingError, match=r"KILN_DRAFT_BRANCHES is '0'; it takes an integer >= 1"):
        settings.value("draft_branches")
    monkeypatch.delenv("KILN_DRAFT_BRANCHES")
    assert settings.apply("run", {"num_draft_tokens": 1})["num_draft_tokens"] == 1
    assert settings.SETTINGS["soak_seed"].parse("0") == 0  # the default minimum stays 0


def test_an_environment_value_is_parsed_once(monkeypatch):
    """The ops ask on every call: the parse runs again only when the variable's string changes."""
    parsed = []
    real = settings.Setting.parse
    monkeypatch.setattr(
        settings.Setting, "parse", lambda s, raw, where=None: parsed.append(raw) or real(s, raw)
    )
    monkeypatch.delenv("KILN_FP8_GEMM", raising=False)
    assert settings.value("fp8_gemm") == "auto"
    parsed.clear()
    monkeypatch.setenv("KILN_FP8_GEMM", "triton")
    assert [settings.value("fp8_gemm") for _ in range(100)] == ["triton"] * 100
    monkeypatch.setenv("KILN_FP8_GEMM", "cublas")
    assert settings.value("fp8_gemm") == settings.value("fp8_gemm") == "cublas"
    assert parsed == ["triton", "cublas"]


def test_product_code_reads_no_kiln_variable():
    """Only kiln/settings.py reads the environment for kiln's switches; the other reads are
    process-level variables (Triton's, the CUDA toolkit's, a child's environment)."""
    allowed = ("TRITON_INTERPRET", "CUDA_HOME", "CUDA_PATH", "TOKENIZERS_PARALLELISM", "TRITON_CACHE_DIR")
    for pkg in ("ops", "runtime", "compiler", "weights", "kiln"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path == ROOT / "kiln" / "settings.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "os.environ" in line:
                    where = f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                    assert "KILN_" not in line, where
                    names = re.findall(r"os\.environ(?:\.get\(|\[|\.setdefault\()\s*\"(\w+)\"", line)
                    assert all(v in allowed or v == "CC" for v in names), where


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A tiny Llama compiled through the CLI with a GEMV plan flag, while the environment holds the
    variables that used to change a compile."""
    root = tmp_path_factory.mktemp("settings")
    make_checkpoint(root / "hf", "llama-tied")
    env = {"KILN_FOLD_NORMS": "0", "KILN_GEMV": "0"}
    args = ["compile", str(root / "hf"), "-o", str(root / "art"), "--device", "cpu", "--dtype", "float32"]
    args += ["--max-batch-size", "2", "--max-seq-len", "64", "--chunk-size", "16", "--gemv-plan", "attn:1"]
    with pytest.warns(UserWarning) as caught:
        r = CliRunner().invoke(cli, args, env=env)
    assert r.exit_code == 0, r.output
    return root / "art", [str(w.message) for w in caught]


def test_compile_flags_not_the_environment_decide_the_graph(art):
    path, warned = art
    m = Manifest.load(path)
    assert m.kernel_choices.gemv_plan == {"attn": 1}  # the flag, not KILN_GEMV=0
    assert m.norm_folds and m.graphs["decode_b1"].layout == "residual_stream"  # not KILN_FOLD_NORMS=0
    src = (path / "graphs" / "model.py").read_text()
    assert src.count("torch.ops.kiln.linear.default(") == 2 * 2  # qkv and o of 2 layers; mlp on cuBLAS
    assert any("KILN_FOLD_NORMS='0' is ignored" in w and "--no-fold-norms" in w for w in warned)
    assert any("KILN_GEMV='0' is ignored" in w and "--gemv-plan" in w for w in warned)


def test_compile_flags_reach_the_options(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("kiln.compiler.cli_compile.compile_model", lambda src, out, opts: seen.append(opts))
    base = ["compile", str(tmp_path), "-o", str(tmp_path / "a"), "--device", "cpu"]
    for extra in ([], ["--no-fold-norms", "--gemv-plan", "0"]):
        assert CliRunner().invoke(cli, base + extra).exit_code == 0
    assert (seen[0].fold_norms, seen[0].gemv_plan) == (True, "attn:1,mlp:1,router:1")
    assert (seen[1].fold_norms, seen[1].gemv_plan) == (False, "0")
    monkeypatch.undo()  # the real compile refuses a bad plan before any work, in one line
    r = CliRunner().invoke(cli, ["compile", str(tmp_path), "-o", str(tmp_path / "b"), "--gemv-plan", "qkv"])
    assert isinstance(r.exception, KilnError) and str(r.exception).startswith("--gemv-plan: bad entry 'qkv'")


def test_engine_applies_its_options_then_the_environment(art, monkeypatch):
    from kiln import LLM, SamplingParams

    path, _ = art
    monkeypatch.setenv("KILN_PDL", "1")
    monkeypatch.setenv("KILN_GRAPH_GREEDY", "1")
    llm = LLM(str(path), device="cpu", pdl=False, graph_greedy=False, graph_format="pt2", prewait="gemv")
    eng = llm.engine
    assert eng.runner.graph_greedy is False  # read when the runner was built
    assert type(eng.model.graphs["model"]).__name__ != "CodeGraph"  # read at load: the .pt2
    assert settings.value("pdl") is False and settings.value("prewait") == {"gemv"}  # the ops' view
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    again = LLM(str(path), device="cpu")  # no options: the environment, then the defaults
    assert (
        again.engine.runner.graph_greedy is True
        and type(again.engine.model.graphs["model"]).__name__ == "CodeGraph"
    )
    assert settings.value("pdl") is True and settings.value("prewait") == frozenset(
        settings.SETTINGS["prewait"].choices
    )
    same = again.generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == same[0].token_ids
    monkeypatch.setenv("KILN_FP8_GEMM", "cutlas")
    with pytest.raises(settings.SettingError, match="KILN_FP8_GEMM is 'cutlas'"):
        LLM(str(path), device="cpu")  # at start, before anything loads


def test_cli_flag_reaches_the_engine(art):
    path, _ = art
    r = CliRunner().invoke(cli, ["generate", str(path), "hi", "--device", "cpu", "--prewait", "gemv,atn"])
    assert isinstance(r.exception, settings.SettingError)
    assert str(r.exception).startswith(
        "EngineOptions.prewait (--prewait) is 'gemv,atn'; it takes a comma list"
    )


def test_models_take_the_plan_from_their_build(monkeypatch, tmp_path):
    from kiln.compiler.config import load_config
    from kiln.compiler.registry import model_class

    make_checkpoint(tmp_path / "hf", "llama-tied")
    cfg = load_config(tmp_path / "hf")
    monkeypatch.setenv("KILN_GEMV", "0")  # a run-time switch: no effect on a model build
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32, gemv_plan={"mlp": 2})
        default = model_class(cfg.architecture)(cfg, torch.float32)
    layer = model.layers[0]
    assert (layer.attn.qkv.max_m, layer.attn.o.max_m, layer.mlp.gate_up.max_m, layer.mlp.down.max_m) == (
        0,
        0,
        2,
        2,
    )
    assert default.layers[1].attn.o.max_m == 1 and default.gemv_plan == {"attn": 1, "mlp": 1, "router": 1}
