"""`kiln bench` on the demo model (CPU smoke test): every subcommand runs and reports its figures."""

import json

from click.testing import CliRunner

from kiln.cli import cli


def run(*args):
    r = CliRunner().invoke(cli, ["bench", *map(str, args)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def test_bench_commands(demo_artifact, tmp_path):
    lat, tp, st = tmp_path / "lat.json", tmp_path / "tp.json", tmp_path / "st.json"
    out = run(
        "latency",
        demo_artifact,
        "--batch-sizes",
        "1,2",
        "--input-len",
        "12",
        "--output-len",
        "5",
        "--json",
        lat,
        "--device",
        "cpu",
    )
    assert "tok/s" in out
    rows = json.loads(lat.read_text())["kiln"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["decode_tok_s"] > 0 for r in rows)
    assert set(rows[0]["extra"]["ms_per_step_by_part"]) == {"schedule", "launch", "sample", "wait", "outputs"}
    run(
        "throughput",
        demo_artifact,
        "--num-prompts",
        "6",
        "--input-len",
        "3:20",
        "--output-len",
        "2:6",
        "--json",
        tp,
        "--device",
        "cpu",
    )
    t = json.loads(tp.read_text())["kiln"]
    assert t["output_tokens"] >= 6 * 2 and t["input_tokens"] >= 6 * 3 and t["output_tok_s"] > 0
    run("startup", demo_artifact, "--runs", "1", "--json", st)
    s = json.loads(st.read_text())["startup"]
    assert 0 < s["ready_s"] <= s["first_token_s"] and "graphs" in s["phases"]
    png, rep = tmp_path / "p.png", tmp_path / "rep.json"
    run("report", "--latency", lat, "--throughput", tp, "--startup", st, "--json", rep, "--plot", png)
    assert png.stat().st_size > 10_000 and set(json.loads(rep.read_text())) >= {
        "latency",
        "throughput",
        "startup",
    }


def test_roofline_counts_only_the_experts_a_batch_hits():
    from types import SimpleNamespace

    import torch

    from kiln.runtime.benchmark import weight_bytes_per_step

    E, k = 8, 2
    w = {
        "embed.weight": torch.zeros(10, 4),  # tied: read as the LM head
        "layers.0.attn.qkv.weight": torch.zeros(12, 4),
        "layers.0.moe.w13": torch.zeros(E + 1, 6, 4),  # one shared expert fused as expert E
        "layers.0.moe.w2": torch.zeros(E + 1, 4, 3),
    }
    manifest = {"model": {"moe": {"num_experts": E, "top_k": k}}}
    llm = SimpleNamespace(
        engine=SimpleNamespace(model=SimpleNamespace(weights=w), artifact=SimpleNamespace(manifest=manifest))
    )
    per_expert = (6 * 4 + 4 * 3) * 4
    dense = (10 * 4 + 12 * 4) * 4
    for b in (1, 3, 64):
        hit = 1 - (1 - k / E) ** b
        assert weight_bytes_per_step(llm, b) == int(dense + per_expert * (E * hit + 1))
    assert weight_bytes_per_step(llm, 1) == dense + per_expert * (k + 1)
    manifest["model"]["moe"] = None  # dense model: every weight
    assert weight_bytes_per_step(llm, 5) == dense + per_expert * (E + 1)
