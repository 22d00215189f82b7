"""The `kiln` command line: help, version, inspect (text and JSON), and error reporting."""

import json
import subprocess
import sys

from click.testing import CliRunner

from kiln.cli import COMMANDS, cli


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_help_lists_only_existing_commands():
    r = run("--help")
    assert r.exit_code == 0
    for name in COMMANDS:
        assert name in r.output
        assert cli.get_command(None, name) is not None  # every listed command imports


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and "kiln, version" in r.output


def test_inspect_json_keys():
    r = run("inspect", "llama-3.1-8b", "--json", "--kv-memory", "8")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["architecture"] == "LlamaForCausalLM" and d["attention"] == "GQA"
    assert d["num_layers"] == 32 and d["num_params"] == 8_030_261_248
    assert d["weight_bytes"] == 2 * 8_030_261_248 and d["kv_bytes_per_token"] == 131072
    assert d["moe"] is None and d["kv_capacity_tokens"] == 8 * 1024**3 // 131072


def test_inspect_moe_json():
    d = json.loads(run("inspect", "qwen3-30b-a3b", "--json", "--tp", "2").output)
    assert d["moe"]["num_experts"] == 128 and d["moe"]["top_k"] == 8
    assert d["per_rank_shapes"]["moe.w13"] == [128, 768, 2048]
    assert d["kv_bytes_per_token"] == 2 * 2 * 128 * 2 * 48


def test_inspect_fp8_weight_bytes_smaller():
    bf16 = json.loads(run("inspect", "llama-3.1-8b", "--json").output)["weight_bytes"]
    fp8 = json.loads(run("inspect", "llama-3.1-8b", "--json", "--dtype", "fp8").output)
    assert fp8["weight_bytes"] < 0.6 * bf16 and fp8["kv_dtype"] == "bfloat16"


def test_inspect_directory(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 100,
                "intermediate_size": 128,
            }
        )
    )
    r = run("inspect", str(tmp_path))
    assert r.exit_code == 0 and "Qwen3ForCausalLM" in r.output and "GQA" in r.output


def test_inspect_bad_tp_is_a_clean_error():
    p = subprocess.run(
        [sys.executable, "-m", "kiln", "inspect", "llama-3.1-8b", "--tp", "3"], capture_output=True, text=True
    )
    assert p.returncode == 2
    assert "num_attention_heads (32) is not divisible by tp=3" in p.stderr
    assert "Traceback" not in p.stderr


def test_inspect_unknown_name():
    p = subprocess.run(
        [sys.executable, "-m", "kiln", "inspect", "no-such-model"], capture_output=True, text=True
    )
    assert p.returncode == 2 and "Bundled:" in p.stderr and "llama-3.1-8b" in p.stderr


def test_kiln_warnings_are_one_line(capsys):
    """The CLI shows kiln's own warnings as one line (no source line of the code that warned);
    another package's the way Python does."""
    import io
    import warnings

    from kiln.cli import _show_warning

    buf = io.StringIO()
    _show_warning(
        UserWarning("kiln: --draft-branches 2: a draft model drafts chains"), UserWarning, "x.py", 7, buf
    )
    assert buf.getvalue() == "warning: kiln: --draft-branches 2: a draft model drafts chains\n"
    buf = io.StringIO()
    _show_warning(DeprecationWarning("old api"), DeprecationWarning, "pkg.py", 3, buf, "call()")
    assert buf.getvalue() == warnings.formatwarning("old api", DeprecationWarning, "pkg.py", 3, "call()")
