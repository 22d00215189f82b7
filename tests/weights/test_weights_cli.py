"""`kiln pack`: packs, summarizes, verifies, refuses a non-empty OUT without --force."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kiln.cli import cli
from kiln.compiler.config import ConfigError
from kiln.weights import load_pack


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_pack_verify_and_summary(checkpoint, tmp_path):
    d, out = checkpoint("qwen3_moe"), tmp_path / "pack"
    r = run("pack", d, "-o", out, "--tp", 2, "--ep", 2, "--verify", "-q")
    assert r.exit_code == 0, r.output
    assert "packed" in r.output and "rank 1:" in r.output and "verified" in r.output
    doc = json.loads((out / "pack.json").read_text())
    assert (doc["tp"], doc["ep"], doc["model"]["architecture"]) == (2, 2, "Qwen3MoeForCausalLM")
    assert load_pack(out, 1)["layers.0.moe.w13"].shape == (4, 2 * 32, 64)  # 4 local experts, whole ones


def test_non_empty_out_needs_force(checkpoint, tmp_path):
    d, out = checkpoint("qwen3"), tmp_path / "pack"
    out.mkdir()
    (out / "something").write_text("x")
    r = run("pack", d, "-o", out, "-q")
    assert r.exit_code == 2 and "--force" in r.output
    r = run("pack", d, "-o", out, "-q", "--force", "--quant", "fp8", "--dtype", "float16")
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "pack.json").read_text())
    assert (doc["dtype"], doc["quant"]) == ("float16", "fp8")
    assert (out / "something").exists()  # --force replaces the pack, nothing else


def test_bad_tp_names_the_field(checkpoint, tmp_path):
    r = run("pack", checkpoint("qwen3"), "-o", tmp_path / "p", "--tp", 3, "-q")
    assert isinstance(r.exception, ConfigError) and "num_attention_heads" in str(r.exception)
