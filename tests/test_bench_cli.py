"""`kiln bench` on the demo model (CPU smoke test): every subcommand runs and reports its figures."""

import json

import pytest
from click.testing import CliRunner

from kiln.cli import cli
from kiln.errors import KilnError


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
    assert all(r["extra"]["masked_rows"] == 0 for r in rows)
    schema = '{"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}}'
    run("latency", demo_artifact, "--batch-sizes", "2", "--input-len", "12", "--output-len", "5",
        "--json-schema", schema, "--json", lat, "--device", "cpu")  # fmt: skip
    rows = json.loads(lat.read_text())["kiln"]
    assert (
        rows[0]["extra"]["masked_rows"] >= 2 * 5
    )  # every sampled row of both requests (and overlap's extra step)
    out = run(
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
    check_step_figures(t, out, num_prompts=6)
    run("startup", demo_artifact, "--runs", "1", "--json", st)
    s = json.loads(st.read_text())["startup"]
    assert 0 < s["ready_s"] <= s["first_token_s"] and "graphs" in s["phases"]
    cmp = tmp_path / "verify.json"
    out = run("startup", demo_artifact, "--compare-verify", "--runs", "1", "--json", cmp)
    c = json.loads(cmp.read_text())["startup_verify_cost"]
    assert [r["verify"] for r in c["runs"]] == [True, False] and c["ready_ratio"] > 0 and c["load_ratio"] > 0
    assert "ready with the check / without" in out
    png, rep = tmp_path / "p.png", tmp_path / "rep.json"
    run("report", "--latency", lat, "--throughput", tp, "--startup", st, "--json", rep, "--plot", png)
    assert png.stat().st_size > 10_000 and set(json.loads(rep.read_text())) >= {
        "latency",
        "throughput",
        "startup",
    }


def check_step_figures(t, out, num_prompts):
    """The step figures of a `kiln bench throughput` run (runtime/step_stats.py) in its JSON and its
    printed table."""
    kinds = ("prefill", "decode", "mixed")
    per_kind = ("steps", "mean_batch", "tokens_per_step", "step_ms", "host_ms_per_step", "frac_wall")
    want = {"steps", "mean_running_batch", "tokens_per_step", "host_ms_per_step", "frac_wall_outside_steps"}
    assert set(t) >= want | {f"{k}_{f}" for k in kinds for f in per_kind} | {"step_stats"}
    raw = t["step_stats"]
    assert t["preemptions"] == 0 and t["mixed_steps"] == 0 and t["mixed_step_ms"] is None
    assert t["steps"] == t["prefill_steps"] + t["decode_steps"] > t["prefill_steps"] > 0
    # the measured run only (the bench resets the figures first): its prompts fed once, less any
    # prefix the radix cache held; every token but each prompt's first sampled by a decode row
    assert 0 < raw["prefill"]["prefill_tokens"] <= t["input_tokens"]
    assert raw["decode"]["decode_tokens"] == t["output_tokens"] - num_prompts + raw["discarded_tokens"]
    assert 1 <= t["decode_mean_batch"] <= num_prompts and 1 <= t["mean_running_batch"] <= num_prompts
    tokens = raw["all"]["prefill_tokens"] + raw["all"]["decode_tokens"]
    assert (
        t["tokens_per_step"] == tokens / t["steps"] and t["decode_tokens_per_step"] == t["decode_mean_batch"]
    )
    assert t["host_ms_per_step"] > 0 and all(t[f"{k}_step_ms"] > 0 for k in kinds[:2])
    fracs = [t[f"{k}_frac_wall"] for k in kinds] + [t["frac_wall_outside_steps"]]
    assert all(0 <= f <= 1 for f in fracs) and sum(fracs) == pytest.approx(1.0)
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("step kind"))
    rows = {x.split()[0]: x.split() for x in lines[head + 1 : head + 5]}
    assert list(rows) == [*kinds, "all"]
    assert int(rows["decode"][1]) == t["decode_steps"] and rows["mixed"][2:6] == ["-"] * 4
    assert float(rows["all"][2]) == pytest.approx(t["mean_running_batch"], abs=0.006)


def test_throughput_beside_hf_on_the_same_workload(demo_artifact, tmp_path, monkeypatch):
    """--compare-hf: HF generates the same prompts (first N) with their output lengths, in sorted,
    left-padded batches; only the requested tokens count."""
    import torch

    from kiln.runtime import benchmark
    from kiln.runtime.artifact import open_artifact

    calls = []
    real = benchmark.hf_throughput
    monkeypatch.setattr(benchmark, "hf_throughput", lambda *a: calls.append(a) or real(*a))
    tp = tmp_path / "tp.json"
    ckpt = demo_artifact.parent / "checkpoint"
    out = run("throughput", demo_artifact, "--num-prompts", 5, "--input-len", "3:9", "--output-len", "2:5",
              "--compare-hf", ckpt, "--hf-batch-size", 2, "--hf-num-prompts", 4, "--json", tp,
              "--device", "cpu")  # fmt: skip
    rep = json.loads(tp.read_text())
    prompts, outs, batch, device, dtype = calls[0][1:]
    vocab = open_artifact(demo_artifact).manifest.vocab_size
    want_p, want_o = benchmark.throughput_workload(5, (3, 9), (2, 5), vocab)
    assert (len(prompts), batch, device, dtype) == (4, 2, "cpu", torch.float32)
    assert prompts == want_p[:4] and outs == want_o[:4]
    h = rep["hf"]
    assert h["output_tokens"] == sum(outs) <= h["generated_tokens"] and h["input_tokens"] == sum(
        map(len, prompts)
    )
    assert h["output_tok_s"] > 0 and rep["kiln"]["output_tokens"] == sum(want_o) and "kiln / HF" in out


def test_throughput_rejects_bad_hf_options(demo_artifact):
    r = CliRunner().invoke(cli, ["bench", "throughput", str(demo_artifact), "--num-prompts", "3",
                                 "--hf-num-prompts", "4", "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 2 and "--hf-num-prompts" in r.output and "1..--num-prompts (3)" in r.output
    r = CliRunner().invoke(cli, ["bench", "throughput", str(demo_artifact), "--hf-batch-size", "0"])
    assert r.exit_code == 2 and "--hf-batch-size" in r.output


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
    manifest = SimpleNamespace(routed_experts=(k, E))  # (top_k, num_experts): Manifest.routed_experts
    llm = SimpleNamespace(
        engine=SimpleNamespace(model=SimpleNamespace(weights=w), artifact=SimpleNamespace(manifest=manifest))
    )
    per_expert = (6 * 4 + 4 * 3) * 4
    dense = (10 * 4 + 12 * 4) * 4
    for b in (1, 3, 64):
        hit = 1 - (1 - k / E) ** b
        assert weight_bytes_per_step(llm, b) == int(dense + per_expert * (E * hit + 1))
    assert weight_bytes_per_step(llm, 1) == dense + per_expert * (k + 1)
    manifest.routed_experts = None  # dense model: every weight
    assert weight_bytes_per_step(llm, 5) == dense + per_expert * (E + 1)


def test_accuracy_of_an_artifact_against_itself(demo_artifact, tmp_path):
    """`kiln bench accuracy` end to end (runtime/accuracy.py has the FP8-vs-bf16 figures): an artifact
    against itself agrees at every position, and a folder that is no artifact is a KilnError (which
    `kiln` prints as one line)."""
    path = tmp_path / "acc.json"
    out = run("accuracy", demo_artifact, "--reference", demo_artifact, "--num-seqs", "2", "--seq-len", "16",
              "--device", "cpu", "--json", path)  # fmt: skip
    r = json.loads(path.read_text())["accuracy"]
    assert r["positions"] == 32 and r["top1_agreement"] == 1.0 and r["mean_kl"] == 0.0, r
    assert "agree" in out.lower()
    bad = CliRunner().invoke(cli, ["bench", "accuracy", str(tmp_path), "--reference", demo_artifact])
    assert bad.exit_code != 0 and isinstance(bad.exception, KilnError), bad.exception
    assert "is not a kiln artifact" in str(bad.exception)


def test_in_child_runs_in_another_process_and_raises_its_errors():
    """--compare-hf's HF side runs through benchmark.in_child on a GPU: a spawned process whose
    result comes back and whose exception is raised in the caller."""
    import os

    from kiln.runtime.benchmark import in_child

    assert in_child(os.getpid) != os.getpid()
    assert in_child(divmod, 17, 5) == (3, 2)
    with pytest.raises(ZeroDivisionError):
        in_child(divmod, 1, 0)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["latency", "--batch-sizes", "abc"], "--batch-sizes"),
        (["latency", "--batch-sizes", "1,,2"], "--batch-sizes"),
        (["latency", "--batch-sizes", "0"], "--batch-sizes"),
        (["latency", "--input-len", "0"], "--input-len"),
        (["throughput", "--input-len", "a:b"], "--input-len"),
        (["throughput", "--output-len", "1:2:3"], "--output-len"),
        (["throughput", "--num-prompts", "0"], "--num-prompts"),
        (["startup", "--runs", "0"], "--runs"),
        (["latency", "--batch-sizes", "1,9"], "--batch-sizes"),  # the demo runs at most 8 at once
    ],
)
def test_bad_flag_values_are_usage_errors_before_loading(demo_artifact, args, flag):
    device = [] if args[0] == "startup" else ["--device", "cpu"]
    r = CliRunner().invoke(cli, ["bench", args[0], str(demo_artifact), *args[1:], *device])
    assert r.exit_code == 2 and flag in r.output, r.output  # click's usage error, nothing loaded


def test_a_cpu_latency_report_is_strict_json(demo_artifact, tmp_path):
    """No read roofline on a CPU: null in the JSON (NaN is not JSON), n/a in the table."""
    lat = tmp_path / "lat.json"
    out = run("latency", demo_artifact, "--batch-sizes", "1", "--input-len", "8", "--output-len", "3",
              "--json", lat, "--device", "cpu")  # fmt: skip
    rep = json.loads(lat.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert rep["read_gbps"] is None and rep["kiln"][0]["frac_roofline"] is None
    assert "read bandwidth n/a" in out and "nan" not in out


def test_a_startup_child_that_fails_says_why_in_one_line(demo_artifact, tmp_path):
    import shutil

    from kiln.runtime.benchmark import StartupError, startup

    art = tmp_path / "art"
    shutil.copytree(demo_artifact, art)
    (art / "manifest.json").write_text("{")
    with pytest.raises(StartupError, match=r"the start-up child failed: .*manifest") as e:
        startup(str(art), runs=1)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)
