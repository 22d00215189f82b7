"""``kiln serve`` from the command line, and ``bench/serve.py``, which starts ``kiln serve`` as a
subprocess on a free loopback port and replays Poisson-timed requests against it."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

from click.testing import CliRunner

from kiln.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def test_serve_options(demo_one_rank, monkeypatch):
    """Loopback by default; the key comes from KILN_API_KEY; queue, name, body limit, sequences per
    request, watchdog and shutdown timeout pass through; each new option has its --help line."""
    import kiln.runtime.server_run as server

    seen = {}
    monkeypatch.setattr(
        server,
        "serve",
        lambda engine, host, port, opts, **kw: seen.update(
            host=host, port=port, opts=opts, engine=engine, **kw
        ),
    )
    r = CliRunner().invoke(
        cli,
        [
            "serve",
            str(demo_one_rank),
            "--max-queue",
            "3",
            "--served-model-name",
            "demo",
            "--max-body-mb",
            "1",
            "--max-sequences-per-request",
            "64",
            "--watchdog-seconds",
            "0",
            "--shutdown-timeout",
            "7.5",
            "--device",
            "cpu",
        ],
        env={"KILN_API_KEY": "sk-env"},
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8000
    o = seen["opts"]
    assert (o.api_key, o.max_queue, o.model_name, o.max_body_bytes) == ("sk-env", 3, "demo", 1 << 20)
    assert (o.max_sequences_per_request, o.watchdog_seconds, o.shutdown_timeout) == (64, 0.0, 7.5)
    r = CliRunner().invoke(cli, ["serve", str(demo_one_rank), "--device", "cpu"], catch_exceptions=False)
    o = seen["opts"]  # the defaults
    assert (o.max_queue, o.max_sequences_per_request, o.watchdog_seconds, o.shutdown_timeout) == (
        None,
        256,
        60.0,
        30.0,
    )
    help_text = " ".join(CliRunner().invoke(cli, ["serve", "--help"]).output.split())
    for flag in ("--max-queue", "--max-sequences-per-request", "--watchdog-seconds", "--shutdown-timeout"):
        assert flag in help_text
    assert "8 x the engine's --max-running" in help_text
    assert seen["engine"].device.type == "cpu"
    for flag in ("--max-queue", "--max-sequences-per-request", "--watchdog-seconds", "--shutdown-timeout"):
        r = CliRunner().invoke(cli, ["serve", str(demo_one_rank), flag, "-1"])
        assert r.exit_code != 0 and flag in r.output, (flag, r.output)


def _bench_serve():
    """bench/serve.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_bench_waits_for_the_servers_captures(monkeypatch):
    """Before sending load, bench/serve.py polls /metrics until the idle server's pending captures
    reach 0 (a server without the gauge: at once), and gives up at its timeout."""
    import asyncio
    import types

    bench = _bench_serve()
    real_sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda s: real_sleep(0))  # no real waits

    class Server:
        def __init__(self, pending):
            self.pending, self.scrapes = list(pending), 0

        async def get(self, path):
            assert path == "/metrics"
            self.scrapes += 1
            n = self.pending.pop(0) if len(self.pending) > 1 else self.pending[0]
            page = (
                ""
                if n is None
                else f"# TYPE kiln_engine_graph_captures_pending gauge\nkiln_engine_graph_captures_pending {n}\n"
            )
            return types.SimpleNamespace(text=page)

    for pending, scrapes in (([3, 2, 0], 3), ([None], 1)):
        s = Server(pending)
        asyncio.run(bench.wait_captured(s, timeout=60))
        assert s.scrapes == scrapes
    stuck = Server([1])
    asyncio.run(bench.wait_captured(stuck, timeout=0.05))  # returns at the timeout
    assert stuck.scrapes >= 1


def test_bench_serve_smoke(demo_artifact, tmp_path):
    bench = _bench_serve()
    out = tmp_path / "serve.json"
    report = bench.main(
        [
            "--artifact", str(demo_artifact),
            "--num-prompts", "8",
            "--rate", "40",
            "--input-len", "24",
            "--range-ratio", "0.5",
            "--output-len", "6",
            "--warmup", "1",
            "--logprobs", "0",  # every token in an event of its own
            "--server-args", "--device cpu --max-running 4",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert out.exists() and report["completed"] == 8 and report["failed"] == 0, report["errors"]
    assert report["output_tokens"] == report["requested_output_tokens"]
    assert 8 * 3 <= report["output_tokens"] <= 8 * 9
    assert 8 * 12 <= report["input_tokens"] <= 8 * 36
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        p = report[key]
        assert all(math.isfinite(p[q]) and p[q] > 0 for q in ("mean", "p50", "p90", "p99")), (key, p)
        assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"], (key, p)
    # the engine's steps during the run, from the per-kind /metrics counters (differences)
    steps = report["steps"]
    fed = {
        k: sum(steps[kind]["steps"] * (steps[kind][f"{k}_tokens_per_step"] or 0) for kind in steps)
        for k in ("prefill", "decode")
    }
    # every prompt token is fed once, but the warm-up's 16-token prefix of prompt 0 (radix cache)
    assert report["input_tokens"] - 16 <= round(fed["prefill"]) <= report["input_tokens"]
    # each request's first token comes from its prefill, every other from a decode row
    assert round(fed["decode"]) >= report["output_tokens"] - 8
    # every token of 8 requests passed the engine-side histogram; chunks carry one token or more
    sv = report["server_itl_ms"]
    assert 0 < sv["p50"] <= sv["p99"] <= sv["max"]
    assert report["chunks_per_token"] == 1  # --logprobs: an event per token, text or not
    dec = steps["decode"]
    assert dec["steps"] > 0 and 1 <= dec["mean_batch"] <= 4 and dec["step_ms"] > 0
    assert 0 < dec["host_ms"] <= dec["step_ms"]
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]
    assert report["graph_captures"] == {"count": 0, "seconds": 0}  # read from /metrics (none on a CPU)
    young = report["gc_pauses"]["0"]  # the server's young collections during the run
    assert young["count"] >= 1 and young["seconds"] > 0 and young["max_ms"] > 0
    walls = report["step_duration_ms"]  # the step-duration histogram's run: both kinds ran
    assert set(walls) == {"prefill", "decode"}
    assert all(0 < w["p50"] <= w["p99"] <= w["max"] for w in walls.values()), walls
    assert report["output_throughput"] > 0 and report["server_startup_s"] > 0
    assert "kiln_prefix_cache_hit_rate" in report["server_metrics"]
    assert "Finished server process" in (tmp_path / "serve.json.server.log").read_text()  # stopped cleanly


def test_serve_freezes_the_startup_heap(demo_one_rank, monkeypatch):
    """``kiln serve`` freezes what start-up made in the garbage collector before it serves (the
    ``gc_freeze`` setting, on by default: runtime/gc_pauses.py); ``--no-gc-freeze`` leaves it."""
    import gc

    import uvicorn

    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: frozen.append(gc.get_freeze_count()))
    try:
        for flags in ([], ["--no-gc-freeze"]):
            gc.unfreeze()
            r = CliRunner().invoke(
                cli, ["serve", str(demo_one_rank), "--device", "cpu", *flags], catch_exceptions=False
            )
            assert r.exit_code == 0, r.output
    finally:
        gc.unfreeze()
    assert frozen[0] > 10_000 and frozen[1] == 0, frozen  # torch's and the engine's objects, then none
