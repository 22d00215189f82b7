"""Prefill and mixed steps on padded shapes (runtime/prefill_graphs.py): the shape rule, and on CPU
the padded extend graph run eagerly (``capture=False``) against the unpadded one: the same
logits and greedy tokens, with the padding's K/V only in the sink page."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.prefill_graphs import TOKEN_BUCKETS, PrefillGraphs


class _Runner:  # what PrefillGraphs reads of a runner to plan shapes
    device = torch.device("cpu")
    vocab_size = 1000


def test_shapes_hold_the_step_and_never_meet_the_decode_kernel():
    g = PrefillGraphs(_Runner(), max_tokens=1024, max_requests=200)  # type: ignore[arg-type]
    assert g.max_requests == 256 and g.tokens == TOKEN_BUCKETS
    for t in range(2, 1100):
        for b in range(1, min(t, 300)):
            shape = g.shape(t, b)
            if shape is None:
                assert t > 1016 or b >= 128, (t, b)  # past the buckets, or the padded batch past 256
                continue
            tp, bp = shape
            assert tp in TOKEN_BUCKETS and tp >= t and bp & (bp - 1) == 0
            assert bp >= b + (tp > t)  # room for the padding request
            assert tp > bp  # never T == B: paged attention's decode kernel
            assert bp <= 256
    assert g.shape(600, 3) == (768, 4) and g.shape(512, 1) == (512, 1) and g.shape(15, 14) == (24, 16)
    small = PrefillGraphs(_Runner(), max_tokens=100, max_requests=4)  # type: ignore[arg-type]
    assert small.tokens[-1] == 96 and small.shape(97, 1) is None and small.shape(40, 7) is None


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill-graphs")
    make_checkpoint(root / "hf", "llama-tied", seed=5, eos=None)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=160, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    return str(root / "art")


# prompts of several lengths (distinct first tokens: no prefix-cache hits), more than the chunk
PROMPTS = [[3 + i, *range(20 + 5 * i, 20 + 5 * i + n - 1)] for i, n in enumerate((5, 70, 12, 33, 1, 47))]


@pytest.mark.parametrize("mixed", [False, True])
def test_padded_steps_match_unpadded(artifact, mixed):
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1) for _ in PROMPTS]
    ref = LLM(artifact, device="cpu", mixed_steps=mixed, max_running=3)
    want = ref.generate(PROMPTS, params)
    llm = LLM(artifact, device="cpu", mixed_steps=mixed, max_running=3)
    runner = llm.engine.runner
    runner.prefill = padded = PrefillGraphs(runner, 1024, llm.engine.bt.num_rows, capture=False)
    sink = llm.engine.pool.page_size  # slots of the sink page
    got = llm.generate(PROMPTS, params)
    assert padded.steps["graph"] >= 4 and padded.steps["eager"] == 0  # every extend step padded
    assert {B for _, B in padded.graphs} >= {2, 4}  # batches of one and more requests
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        lw = [lp["logprob"] for lp in w.logprobs]
        lg = [lp["logprob"] for lp in g.logprobs]
        assert lg == pytest.approx(lw, abs=1e-4)
    llm.engine.check_integrity()
    # the padding wrote K/V only into the sink page: a real slot holds what the reference wrote
    pool, ref_pool = llm.engine.pool, ref.engine.pool
    used = (ref_pool.k_cache[:, sink:] != 0).flatten(2).any(-1)  # [L, S - sink]: written slots
    assert used.any()
    torch.testing.assert_close(pool.k_cache[:, sink:][used], ref_pool.k_cache[:, sink:][used])


def test_idle_engine_captures_prompt_shapes_ahead(artifact):
    """An idle engine captures the prefill shapes of one to three prompts ahead (every token bucket
    at 1, 2 and 4 padded requests), one per ``idle()`` call; the benchmarks' ``finish_captures`` takes
    them all; then a lone prompt's chunk needs no new capture."""
    llm = LLM(artifact, device="cpu", max_running=3)
    eng = llm.engine
    eng.runner.prefill = padded = PrefillGraphs(eng.runner, 1024, eng.bt.num_rows, capture=False)
    ahead = padded.pending()
    assert ahead[:4] == [(16, 1), (16, 2), (16, 4), (24, 1)] and len(ahead) == 3 * len(TOKEN_BUCKETS)
    assert eng.captures_pending() == len(ahead) == eng.status()["graph_captures_pending"]
    assert eng.idle() and list(padded.graphs) == [(16, 1)]  # one shape a call
    assert eng.captures_pending() == len(ahead) - 1
    assert eng.finish_captures() == len(ahead) - 1 and padded.pending() == [] and not eng.idle()
    assert eng.captures_pending() == 0 == eng.status()["graph_captures_pending"]
    eng.add_request(PROMPTS[3], SamplingParams(max_tokens=2, temperature=0.0))
    assert not eng.idle()  # work waits: no capture
    eng.run_until_done()
    assert padded.steps["graph"] == 1 and set(padded.graphs) == set(ahead)  # (48, 2): captured ahead
