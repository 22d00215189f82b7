"""Serving benchmark: random prompts with Poisson arrivals against ``kiln serve``; reports TTFT,
inter-token latency (ITL), time per output token (TPOT) and end-to-end latency (mean, p50, p90,
p99) and request/token throughput.

    # start a server on ART (loopback, a free port), replay, stop it:
    python bench/serve.py --artifact ART --num-prompts 500 --rate 16 --json bench/results/serve.json
    # or against a running server (token ids need the vocabulary size):
    python bench/serve.py --url http://127.0.0.1:8000 --vocab-size 128256 --num-prompts 200 --rate inf

Each request is a streamed ``/v1/completions`` call on random token ids (``--input-len``, spread
by ``--range-ratio``) with ``ignore_eos`` and ``max_tokens = --output-len`` (so every request
generates exactly that many tokens) and ``stream_options.include_usage`` (token counts come from
the server). TTFT is send -> first text chunk; ITL is the gap between text chunks (a chunk can
span several tokens: the detokenizer held back an incomplete character, or tokens decoded to no
text and sent no event; ``chunks_per_token`` says how many; ``--logprobs 0`` puts every token in an
event); TPOT is
(end-to-end - TTFT) / (output tokens - 1). ``--rate inf`` sends everything at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Result:
    ok: bool
    prompt_len: int
    requested: int  # max_tokens (with ignore_eos: exactly what the server must generate)
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def percentiles(xs: list[float]) -> dict[str, float]:
    """Mean, p50, p90, p99 and max in milliseconds (NaN when empty)."""
    if not xs:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99", "max")}
    s = sorted(xs)

    def q(p: float) -> float:  # linear interpolation between closest ranks
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    ms = {"mean": statistics.fmean(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}
    return {k: v * 1e3 for k, v in ms.items()}


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: list[int], args: argparse.Namespace, out_len: int
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.logprobs is not None:  # every token then comes in an event, text or not
        body["logprobs"] = args.logprobs
    res = Result(ok=False, prompt_len=len(prompt), requested=out_len)
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"])
                    return res
                now = time.perf_counter()
                if ev.get("usage"):
                    res.output_tokens = ev["usage"]["completion_tokens"]
                if any(c.get("text") or c.get("logprobs") for c in ev.get("choices", ())):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_tokens > 0 and last is not None
        if not res.ok:
            res.error = "no tokens"
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def replay(args: argparse.Namespace, url: str, vocab: int) -> dict[str, Any]:
    rng = random.Random(args.seed)

    def length(n: int) -> int:
        lo, hi = max(1, int(n * (1 - args.range_ratio))), max(1, int(n * (1 + args.range_ratio)))
        return rng.randint(lo, hi)

    prompts = [
        [rng.randrange(10, vocab) for _ in range(length(args.input_len))] for _ in range(args.num_prompts)
    ]
    out_lens = [length(args.output_len) for _ in range(args.num_prompts)]
    limits = httpx.Limits(
        max_connections=args.max_concurrency or args.num_prompts + 8, max_keepalive_connections=64
    )
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        models = (await http.get("/v1/models")).json()["data"]
        model = models[0]["id"]
        await wait_captured(http, args.startup_timeout)
        for i in range(args.warmup):  # first-request effects stay out of the figures
            await one_request(http, model, prompts[i % len(prompts)][:16], args, 4)
        metrics_before = (await http.get("/metrics")).text  # the run's step figures are differences
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(p: list[int], n: int) -> Result:
            if sem is None:
                return await one_request(http, model, p, args, n)
            async with sem:
                return await one_request(http, model, p, args, n)

        tasks = []
        t_start = time.perf_counter()
        for p, n in zip(prompts, out_lens):
            tasks.append(asyncio.ensure_future(limited(p, n)))
            if args.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
        metrics = (await http.get("/metrics")).text
    before, after = parse_metrics(metrics_before), parse_metrics(metrics)
    gc = labelled_histograms(before, after, "kiln_python_gc_pause_seconds", "generation")
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:10],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "requested_output_tokens": sum(r.requested for r in ok),
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "tpot_ms": percentiles(tpot),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "server_metrics": _server_figures(after),
        "steps": step_figures(before, after),
        # text chunks a client received per token: below 1 when the server sent several tokens in
        # one event (its queue held them: the HTTP side fell behind the engine)
        "chunks_per_token": sum(len(r.itl) + 1 for r in ok) / max(out_tok, 1),
        "server_itl_ms": server_itl(before, after),
        # the engine's step() calls by kind, and the garbage collector's pauses by generation
        "step_duration_ms": labelled_histograms(before, after, "kiln_engine_step_duration_seconds", "kind"),
        "gc_pauses": {
            g: {"count": h["count"], "seconds": h["seconds"], "max_ms": h["max"]} for g, h in gc.items()
        },
        "graph_captures": graph_captures(before, after),
    }


_PENDING = "kiln_engine_graph_captures_pending"

Metrics = dict[str, float]  # a /metrics page, parsed (parse_metrics)


async def wait_captured(http: httpx.AsyncClient, timeout: float) -> None:
    """Wait until the idle server has made the CUDA-graph captures it makes ahead (decode buckets,
    prompt shapes), so that the run measures steady state; a server without the gauge: at once."""
    deadline = time.monotonic() + timeout
    while parse_metrics((await http.get("/metrics")).text).get(_PENDING, 0.0) > 0:
        if time.monotonic() > deadline:
            print(f"[bench serve] captures still pending after {timeout:g} s; measuring anyway")
            return
        await asyncio.sleep(0.25)


def parse_metrics(text: str) -> Metrics:
    """A Prometheus text page as ``{sample: value}``, each sample as the page writes it, labels
    included (``kiln_engine_steps_total{kind="decode"}``)."""
    out = {}
    for line in text.splitlines():
        if line and line[0] != "#":
            sample, _, value = line.rpartition(" ")
            out[sample] = float(value)
    return out


def _server_figures(m: Metrics) -> dict[str, float]:
    keep = ("kiln_prefix_cache_hit_rate", "kiln_preemptions_total", "kiln_kv_cache_capacity_tokens")
    return {k: m[k] for k in keep if k in m}


def graph_captures(b: Metrics, a: Metrics) -> dict[str, float]:
    """CUDA-graph captures the server made during the run (a new shape's first step; each stalls
    every stream once) and their seconds."""
    keys = {"count": "kiln_engine_graph_captures_total", "seconds": "kiln_engine_graph_capture_seconds_total"}
    return {k: a.get(m, 0.0) - b.get(m, 0.0) for k, m in keys.items()}


_STEP_SUMS = {  # /metrics family -> key of the per-kind sums
    "kiln_engine_steps_total": "steps",
    "kiln_engine_step_requests_total": "requests",
    "kiln_engine_step_seconds_total": "wall_s",
    "kiln_engine_step_host_seconds_total": "host_s",
    "kiln_engine_step_prefill_tokens_total": "prefill_tokens",
    "kiln_engine_step_decode_tokens_total": "decode_tokens",
}


def _labelled(m: Metrics, family: str, label: str) -> dict[str, float]:
    """``{label value: sample value}`` of one family's samples that carry that one label only (a
    histogram's buckets, which also carry ``le``, go through :func:`_buckets`)."""
    head = f'{family}{{{label}="'
    out = {}
    for k, v in m.items():
        value = k[len(head) : -2]
        if k.startswith(head) and k.endswith('"}') and '"' not in value:
            out[value] = v
    return out


def _step_sums(m: Metrics) -> dict[str, dict[str, float]]:
    """``{kind: {steps, requests, wall_s, ...}}`` from the server's per-kind step counters."""
    out: dict[str, dict[str, float]] = {}
    for family, key in _STEP_SUMS.items():
        for kind, v in _labelled(m, family, "kind").items():
            out.setdefault(kind, {})[key] = v
    return out


def _buckets(m: Metrics, family: str, where: str = "") -> dict[float, float]:
    """One histogram's cumulative buckets ``{upper bound: count}``; ``where``: its other labels,
    as the page writes them before ``le`` (``kind="decode",``)."""
    head = f'{family}_bucket{{{where}le="'
    return {float(k[len(head) : -2]): v for k, v in m.items() if k.startswith(head)}


def bucket_quantiles(b: dict[float, float], a: dict[float, float]) -> dict[str, float]:
    """Of the samples a histogram gained between ``b`` and ``a`` (cumulative buckets): the upper
    bucket bound, in ms, that holds p50, p90, p99 and the largest (nan when none)."""
    cum = sorted((le, a[le] - b.get(le, 0.0)) for le in a)
    total = cum[-1][1] if cum else 0.0
    out = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)):
        out[name] = next((le * 1e3 for le, n in cum if total and n >= q * total), float("nan"))
    return out


def server_itl(b: Metrics, a: Metrics) -> dict[str, float]:
    """The engine's inter-token gaps during the run (the server's histogram, stamped as each step's
    tokens leave the engine thread, before the HTTP side sends them): :func:`bucket_quantiles`."""
    family = "kiln_inter_token_latency_seconds"
    return bucket_quantiles(_buckets(b, family), _buckets(a, family))


def labelled_histograms(b: Metrics, a: Metrics, family: str, label: str) -> dict[str, dict[str, float]]:
    """The samples a histogram with one label gained during the run, per label value that gained
    any: ``count``, ``seconds`` (their sum) and :func:`bucket_quantiles`."""
    out = {}
    for value in _labelled(a, family + "_count", label):
        where = f'{label}="{value}"'
        count, total = (f"{family}{part}{{{where}}}" for part in ("_count", "_sum"))
        if a[count] > b.get(count, 0.0):
            out[value] = {
                "count": a[count] - b.get(count, 0.0),
                "seconds": a[total] - b.get(total, 0.0),
                **bucket_quantiles(_buckets(b, family, where + ","), _buckets(a, family, where + ",")),
            }
    return out


def step_figures(before: Metrics, after: Metrics) -> dict[str, dict[str, float | None]]:
    """The engine's steps during the run, by kind: steps, mean batch (requests per step), mean step
    and host time (ms), tokens fed per step. The decode step at the mean running batch and one
    chunk's prefill (a prefill step, or a mixed step with mixed steps on) are what TPOT and the
    inter-token gaps are judged against."""
    b, a = _step_sums(before), _step_sums(after)
    out: dict[str, dict[str, float | None]] = {}
    for kind, sums in a.items():
        d = {k: v - b.get(kind, {}).get(k, 0.0) for k, v in sums.items()}
        n = d.get("steps", 0.0)

        def per(key: str, scale: float = 1.0, d=d, n=n) -> float | None:
            return scale * d.get(key, 0.0) / n if n else None

        out[kind] = {
            "steps": n,
            "mean_batch": per("requests"),
            "step_ms": per("wall_s", 1e3),
            "host_ms": per("host_s", 1e3),
            "prefill_tokens_per_step": per("prefill_tokens"),
            "decode_tokens_per_step": per("decode_tokens"),
        }
    return out


# ------------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kiln", "serve", args.artifact, "--host", "127.0.0.1", "--port", str(port)]
    extra = shlex.split(args.server_args)
    if "--max-queue" not in extra:  # the default queue limit could refuse a burst (--rate inf) with 429s
        extra += ["--max-queue", str(args.num_prompts + args.warmup)]
    cmd += extra
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, args.startup_timeout, proc, log_path)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def wait_healthy(
    url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Poll ``url``/health until it answers 200 (fail early if ``proc`` exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server at {url} did not become healthy in {timeout} s (log: {log})")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # our own process group; uvicorn shuts down gracefully
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", help="Start `kiln serve ARTIFACT` on a free loopback port for the run.")
    src.add_argument("--url", help="A running server, e.g. http://127.0.0.1:8000.")
    ap.add_argument("--server-args", default="", help="Extra `kiln serve` options, e.g. '--max-running 128'.")
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="With --url: token ids are drawn below this."
    )
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument(
        "--rate", type=float, default=float("inf"), help="Requests per second (Poisson); inf = all at once."
    )
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="Lengths uniform in [L(1-r), L(1+r)].")
    ap.add_argument("--max-concurrency", type=int, default=None, help="Requests in flight at most.")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="Ask for N top logprobs (0: the chosen token's): every token then arrives in an event, "
        "so ITL is per token even where tokens decode to no text (random ids over a synthetic "
        "tokenizer's reserved special tokens).",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="Per-request timeout (s).")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--json", dest="json_path", default=None, help="Write the report here.")
    args = ap.parse_args(argv)

    proc = None
    if args.artifact:
        from kiln.manifest import Manifest

        vocab = Manifest.load(args.artifact).vocab_size
        log_path = Path(args.json_path + ".server.log" if args.json_path else "serve-bench.server.log")
        t = time.perf_counter()
        proc, url = start_server(args, log_path)
        startup = time.perf_counter() - t
    else:
        if not args.vocab_size:
            ap.error("--url needs --vocab-size (token ids are drawn below it)")
        vocab, url, startup = args.vocab_size, args.url.rstrip("/"), None
        wait_healthy(url, args.startup_timeout)
    try:
        report = asyncio.run(replay(args, url, vocab))
    finally:
        if proc is not None:
            stop_server(proc)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "json_path"},
        "server_startup_s": startup,
        **report,
    }
    report["config"]["rate"] = str(args.rate)
    try:
        from kiln.runtime.benchmark import environment

        report["env"] = environment()
    except Exception:  # the client may run without kiln installed
        pass
    print_report(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench serve] wrote {args.json_path}")
    return report


def print_report(r: dict[str, Any]) -> None:
    c = r["config"]
    print(
        f"[bench serve] {r['completed']} ok, {r['failed']} failed in {r['duration_s']:.2f} s "
        f"(rate {c['rate']}/s, in {c['input_len']}, out {c['output_len']})"
    )
    print(
        f"  throughput: {r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s, "
        f"{r['total_token_throughput']:.1f} total tok/s"
    )
    qs = ("mean", "p50", "p90", "p99", "max")
    print(f"  {'ms':<6}" + "".join(f"{q:>10}" for q in qs))
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        p = r[key]
        print(f"  {key[:-3]:<6}" + "".join(f"{p[q]:>10.2f}" for q in qs))
    steps = r.get("steps") or {}
    for kind, f in steps.items():
        if f["steps"]:
            print(
                f"  {kind} steps: {f['steps']:.0f}, mean batch {f['mean_batch']:.1f}, "
                f"{f['step_ms']:.2f} ms a step ({f['host_ms']:.2f} ms host), "
                f"{f['prefill_tokens_per_step']:.0f} prompt tokens a step"
            )
    sv = r.get("server_itl_ms")
    if sv:
        print(
            "  engine-side gaps (bucket bounds, ms): "
            + ", ".join(f"{k} <= {v:g}" for k, v in sv.items())
            + f"; text chunks per token {r['chunks_per_token']:.2f}"
        )
    for kind, h in (r.get("step_duration_ms") or {}).items():
        print(
            f"  {kind} step durations (bucket bounds, ms): "
            + ", ".join(f"{k} <= {h[k]:g}" for k in ("p50", "p90", "p99", "max"))
        )
    gcs = r.get("gc_pauses") or {}
    if gcs:
        print(
            "  gc pauses: "
            + ", ".join(
                f"gen {g} {v['count']:.0f} ({v['seconds'] * 1e3:.0f} ms, max <= {v['max_ms']:g})"
                for g, v in gcs.items()
            )
        )
    cap = r.get("graph_captures")
    if cap:
        print(f"  graph captures during the run: {cap['count']:.0f} ({cap['seconds'] * 1e3:.0f} ms)")
    dec = steps.get("decode", {}).get("step_ms")
    if dec:
        print(f"  TPOT p99 / decode step: {r['tpot_ms']['p99'] / dec:.2f}x")
    chunk = max((steps.get(k, {}).get("step_ms") or 0.0) for k in ("prefill", "mixed"))
    if chunk:
        print(
            f"  longest gap / longest mean chunk step (prefill or mixed): {r['itl_ms']['max'] / chunk:.2f}x"
        )
    for e in r["errors"]:
        print(f"  error: {e}")


if __name__ == "__main__":
    main()
