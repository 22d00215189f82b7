"""Per-step host fast paths of the decode loop: the one-pass overlapped decode schedule, the
reused plain-greedy sampling batch, and the positional RequestOutput construction."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import hf_greedy, make_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.request import RequestOutput

NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    hf = make_checkpoint(root / "hf", "llama-tied", seed=5, eos=None)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=8, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 9, 30, 6, 12)]
    return hf, root / "art", prompts


def test_request_output_field_order():
    # Engine._finish builds RequestOutput positionally in this order.
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "rid",
        "new_text",
        "new_token_ids",
        "token_ids",
        "text",
        "finished",
        "finish_reason",
        "num_output_tokens",
        "num_prompt_tokens",
        "num_cached_tokens",
        "new_logprobs",
        "ttft",
        "latency",
    ]


def test_greedy_batch_reused_and_tokens_match(setup):
    hf, art, prompts = setup
    expect = hf_greedy(hf, prompts, NEW)
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(str(art), device="cpu", overlap=True)
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, greedy)
    batches, outs = [], {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
            assert o.num_prompt_tokens == len(prompts[int(o.rid.split("-")[1])])
            assert o.finished == (o.finish_reason is not None) == (o.latency is not None)
            if o.finished:
                assert o.token_ids == outs[o.rid] and o.num_output_tokens == NEW
        if eng.stepper.inflight is not None and eng.stepper.inflight.greedy is not None:
            batches.append(eng.stepper.inflight.greedy)
    assert [outs[f"req-{i}"] for i in range(len(prompts))] == expect
    assert eng.stepper.overlapped > 0
    assert len({id(b) for b in batches}) < len(batches)  # the steady state reused the batch
    eng.check_integrity()


def test_mixed_params_overlap_matches_sequential(setup):
    """Greedy requests that finish at different steps beside penalties and logprobs: the greedy
    batch must not be reused once the batch changes, nor for batches that are not plain greedy."""
    _, art, prompts = setup
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 7, NEW, 11)]
    params.append(SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3))
    params.append(SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2))
    runs = []
    for overlap in (False, True):
        llm = LLM(str(art), device="cpu", overlap=overlap)
        outs = llm.generate(prompts, params)
        runs.append([(o.token_ids, o.finish_reason) for o in outs])
        llm.engine.check_integrity()
    assert runs[0] == runs[1]
    assert [len(t) for t, _ in runs[0]] == [3, 7, NEW, 11, NEW, 9]
    # The penalized request and the plain greedy ones in a batch of their own agree as well.
    llm = LLM(str(art), device="cpu", overlap=True)
    alone = llm.generate(prompts[4:5], params[4:5])[0].token_ids
    assert alone == runs[0][4][0]
