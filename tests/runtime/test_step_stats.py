"""The engine's per-step figures (runtime/step_stats.py): exact step, request and token counts for a
known workload, with and without overlapped decoding and chunked prefill, and their reset."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.step_stats import (
    BATCH_BUCKETS,
    DECODE,
    KINDS,
    MIXED,
    PREFILL,
    WALL_BUCKETS_MS,
    StepStats,
    step_kind,
)

# Three prompts with distinct first tokens (no radix-cache hit between them) and their output lengths.
PROMPTS = [[3 + i, *range(20 + 7 * i, 20 + 7 * i + n - 1)] for i, n in enumerate((5, 23, 12))]
MAX_TOKENS = (4, 9, 6)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-stats")
    make_checkpoint(root / "hf", "llama-tied", seed=3, eos=None)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    return str(root / "art")


def _params():
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]


def _counts(m: dict) -> dict:
    """The figures of a step_metrics() dict that do not depend on timing."""
    keys = ("steps", "requests", "prefill_tokens", "decode_tokens", "calls", "batch_hist")
    return {k: {f: m[k][f] for f in keys} for k in (*KINDS, "all")} | {"discarded": m["discarded_tokens"]}


@pytest.mark.parametrize(("overlap", "chunk"), [(False, 64), (True, 64), (True, 7)])
def test_counts_are_exact_for_a_known_workload(artifact, overlap, chunk):
    llm = LLM(artifact, device="cpu", overlap=overlap, chunk_size=chunk)
    eng = llm.engine
    outs = llm.generate(PROMPTS, _params())
    assert [len(o.token_ids) for o in outs] == list(MAX_TOKENS)
    # with overlap, generate returns with the step launched after the last request's last token in
    # flight (it is counted when launched, its discarded tokens when finished): finish it
    assert (eng.stepper.inflight is not None) == overlap
    eng.run_until_done()
    m = eng.step_metrics()
    json.dumps(m)  # plain numbers only
    pre, dec, mix, tot = m["prefill"], m["decode"], m["mixed"], m["all"]
    st = eng.status()
    assert st["cached_tokens"] == 0 and st["preemptions"] == 0
    # every prompt token is fed once, by prefill steps only
    assert pre["prefill_tokens"] == sum(map(len, PROMPTS)) and dec["prefill_tokens"] == 0
    # every token but the one each request samples at the end of its prefill comes from a decode
    # row; with overlap, plus the tokens sampled for requests that finished while in flight
    discarded = m["discarded_tokens"]
    assert dec["decode_tokens"] == st["generated_tokens"] - len(PROMPTS) + discarded
    assert pre["decode_tokens"] == 0 and dec["requests"] == dec["decode_tokens"]
    assert (discarded > 0) == overlap  # the 4-token request finishes while a step is in flight
    assert mix["steps"] == 0 and mix["mean_batch"] is None
    assert pre["steps"] + dec["steps"] == tot["steps"] == st["steps"]
    assert {k: v["steps"] for k, v in st["step_kinds"].items()} == {
        k: m[k]["steps"] for k in st["step_kinds"]
    }
    if chunk == 64:  # every prompt in one extend step, then all decode together until each ends
        assert pre["steps"] == 1 and pre["requests"] == 3
        assert dec["steps"] == max(MAX_TOKENS) - 1 + (1 if overlap else 0)
        assert dec["calls"] == dec["steps"] + overlap  # one unbroken run: its first call only launches
    else:  # chunks of 7: at least ceil(40 / 7) prefill steps, one request or more each
        assert pre["steps"] >= 6 and pre["requests"] >= pre["steps"]
    # each step() call's time goes to one kind: every step is finished (or, sampling nothing,
    # launched) by a call of its own; an overlapped decode step may take a second call
    assert pre["calls"] == pre["steps"] and dec["calls"] >= dec["steps"]
    assert dec["calls"] == dec["steps"] or overlap
    assert 1 <= tot["mean_batch"] <= 3 and tot["mean_batch"] == tot["requests"] / tot["steps"]
    assert tot["tokens_per_step"] == (tot["prefill_tokens"] + tot["decode_tokens"]) / tot["steps"]
    for k in (pre, dec, tot):
        assert sum(k["batch_hist"].values()) == k["steps"] and list(k["batch_hist"]) == list(BATCH_BUCKETS)
        assert sum(k["wall_hist"].values()) == k["calls"]  # every step() call in one wall-time bucket
        assert 0 < k["host_s"] <= k["wall_s"]  # the host time is a part of the step calls' time
        assert k["step_ms"] == pytest.approx(1e3 * k["wall_s"] / k["steps"])
    assert list(dec["batch_hist"].values())[3:] == [0] * (len(BATCH_BUCKETS) - 3)  # never over 3


def test_reset_zeroes_and_a_second_run_counts_the_same(artifact):
    llm = LLM(artifact, device="cpu")
    eng = llm.engine
    llm.generate(PROMPTS, _params())
    eng.run_until_done()  # the step overlap leaves in flight
    first = _counts(eng.step_metrics())
    assert first["all"]["steps"] > 0
    eng.reset_step_stats()
    m = eng.step_metrics()
    assert m["all"]["steps"] == m["all"]["decode_tokens"] == m["discarded_tokens"] == 0
    assert m["all"]["wall_s"] == m["all"]["host_s"] == 0 and m["decode"]["mean_batch"] is None
    eng.reset_prefix_cache()  # as the bench does: the second run starts cold too
    llm.generate(PROMPTS, _params())
    eng.run_until_done()
    assert _counts(eng.step_metrics()) == first


def test_bench_throughput_counts_only_its_run(artifact):
    """`kiln bench throughput`'s figures (benchmark.kiln_throughput) cover its own run: a second
    run on the same engine reports the same counts, not their sum."""
    from kiln.runtime.benchmark import kiln_throughput

    llm = LLM(artifact, device="cpu")
    outs = list(MAX_TOKENS)
    first, second = (kiln_throughput(llm, PROMPTS, outs) for _ in range(2))
    assert _counts(second["step_stats"]) == _counts(first["step_stats"])
    assert second["steps"] == first["steps"] == first["prefill_steps"] + first["decode_steps"]
    assert first["step_stats"]["prefill"]["prefill_tokens"] == first["input_tokens"] == sum(map(len, PROMPTS))


def test_accumulator_kinds_buckets_and_totals():
    assert [step_kind(5, 0), step_kind(0, 3), step_kind(5, 3), step_kind(0, 0)] == [PREFILL, DECODE, MIXED, 0]
    s = StepStats()
    for n in (1, 2, 3, 4, 5, 512, 513, 4000):
        assert s.count(n, 0, n) == DECODE
    assert s.count(2, 30, 0) == PREFILL and s.count(3, 10, 2) == MIXED
    s.time(DECODE, 0.5, 0.1)
    s.time(DECODE, 0.3, 0.1)
    s.time(MIXED, 0.2, 0.05)
    snap = s.snapshot()
    dec = snap.kind("decode")
    assert dec.batch_hist == (1, 1, 2, 1, 0, 0, 0, 0, 0, 1, 2)  # 1 | 2 | 3-4 | 5-8 | ... | 257-512 | 513+
    assert dec.steps == 8 and dec.requests == dec.decode_tokens == sum((1, 2, 3, 4, 5, 512, 513, 4000))
    assert dec.step_ms == pytest.approx(100.0) and dec.host_ms_per_step == pytest.approx(25.0)
    assert (dec.calls, snap.kind("mixed").calls, snap.kind("prefill").calls, snap.total.calls) == (2, 1, 0, 3)
    mix = snap.kind("mixed")
    assert (mix.prefill_tokens, mix.decode_tokens, mix.tokens_per_step, mix.mean_batch) == (10, 2, 12.0, 3.0)
    tot = snap.total
    assert (tot.steps, tot.prefill_tokens, tot.decode_tokens) == (10, 40, dec.decode_tokens + 2)
    assert tot.wall_s == pytest.approx(1.0) and sum(tot.batch_hist) == 10
    # step() calls by wall time: 500 ms and 300 ms in the <= 500 and <= 300 buckets, 200 ms <= 200
    assert dec.wall_hist == (0,) * 11 + (1, 1, 0, 0) and mix.wall_hist == (0,) * 10 + (1, 0, 0, 0, 0)
    s.time(PREFILL, 0.005, 0.0)  # on a bound: that bucket (Prometheus' le)
    s.time(PREFILL, 2.0, 0.0)  # past the last bound: the open bucket
    assert s.snapshot().kind("prefill").wall_hist == (1,) + (0,) * 13 + (1,)
    assert s.as_dict()["all"]["wall_hist"] == dict(
        zip((*map(str, WALL_BUCKETS_MS), "inf"), s.snapshot().total.wall_hist)
    )
    assert snap.kind("prefill").host_ms_per_step == 0.0 and snap.kind("prefill").step_ms == 0.0
    s.reset()
    assert s.snapshot().total.steps == 0 and s.snapshot().total.batch_hist == (0,) * len(BATCH_BUCKETS)
