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
