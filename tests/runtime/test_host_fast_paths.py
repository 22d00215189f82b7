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
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=8, max_seq_len=128, chunk_size=64, page_size=1
    )
    compile_model(root / "hf", root / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 9, 30, 6, 12)]
    return hf, root / "art", prompts


def test_request_output_field_order():
    # Engine._outputs builds RequestOutput positionally in this order.
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


def _decode_samples(monkeypatch, eng) -> list[int]:
    """A list that grows by one per ``Sampler.sample`` call made for a decode step."""
    calls: list[int] = []
    real = eng.sampler.sample

    def spy(logits, batch):
        if eng.last_step_mode == "decode":
            calls.append(batch.size)
        return real(logits, batch)

    monkeypatch.setattr(eng.sampler, "sample", spy)
    return calls


def test_graph_greedy_ids_stay_in_place(setup, monkeypatch):
    """``KILN_GRAPH_GREEDY=1``: plain-greedy decode steps take the graph's argmax (no sampler call)
    and the next step finds its input ids in place; tokens equal Hugging Face's."""
    monkeypatch.setenv("KILN_GRAPH_GREEDY", "1")
    hf, art, prompts = setup
    expect = hf_greedy(hf, prompts, NEW)
    llm = LLM(str(art), device="cpu", overlap=True)
    eng = llm.engine
    calls = _decode_samples(monkeypatch, eng)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expect
    assert calls == []  # every decode step took the graph's ids
    assert eng.runner.ids_in_place > NEW // 2  # and most found them in place
    eng.check_integrity()


def test_graph_greedy_mixed_params_match(setup, monkeypatch):
    """With ``KILN_GRAPH_GREEDY=1``, batches that are not plain greedy (penalties, logprobs, a
    sampled request) still go through the sampler, and every request's tokens match the run
    without it, overlapped or not."""
    _, art, prompts = setup
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 7, NEW)]
    params.append(SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3))
    params.append(SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2))
    params.append(SamplingParams(max_tokens=NEW, temperature=0.8, seed=3, ignore_eos=True))
    runs, sampled = [], []
    for flag, overlap in (("0", True), ("1", False), ("1", True)):
        monkeypatch.setenv("KILN_GRAPH_GREEDY", flag)
        llm = LLM(str(art), device="cpu", overlap=overlap)
        calls = _decode_samples(monkeypatch, llm.engine)
        runs.append([(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)])
        sampled.append(len(calls))
        llm.engine.check_integrity()
    assert runs[0] == runs[1] == runs[2]
    assert min(sampled) > 0  # the sampled and penalized requests kept the sampler


def test_one_token_extends_run_as_decode_steps(setup, monkeypatch):
    """An extend step that brings one token per request (one-token prompts; a prompt the prefix
    cache holds but for its last token) runs on the decode path (runtime/model_runner.py), and
    greedy tokens still match Hugging Face."""
    hf, art, prompts = setup
    llm = LLM(str(art), device="cpu", overlap=False)
    runner = llm.engine.runner
    modes = []
    real_decode, real_forward = runner.decode, runner.forward

    def forward(step, subst=None):
        modes.append([step.mode, False])
        return real_forward(step, subst)

    def decode(step, subst=None):
        modes[-1][1] = True
        return real_decode(step, subst)

    monkeypatch.setattr(runner, "forward", forward)
    monkeypatch.setattr(runner, "decode", decode)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    one = [p[:1] for p in prompts[:3]]
    outs = llm.generate(one, greedy)
    assert [o.token_ids for o in outs] == hf_greedy(hf, one, 6)
    assert modes[0] == ["extend", True]  # the three one-token prompts: one decode-path step
    assert all(on_decode for _, on_decode in modes)
    expect = hf_greedy(hf, prompts[3:4], 6)
    modes.clear()
    assert [o.token_ids for o in llm.generate(prompts[3:4], greedy)] == expect
    assert modes[0] == ["extend", False]  # a 30-token prefill: the extend graph
    modes.clear()
    assert [o.token_ids for o in llm.generate(prompts[3:4], greedy)] == expect
    assert modes[0] == ["extend", True]  # the same prompt, cached but for its last token


def test_one_token_chunks_of_unfinished_prompts(setup, monkeypatch):
    """A two-token chunk budget: the first step brings one token of a one-token prompt and the
    first of a four-token prompt, so it runs on the decode path with only one of its two rows
    finished; the unfinished prompt's key goes into the cache, no token is taken for it, and
    both match Hugging Face."""
    hf, art, prompts = setup
    llm = LLM(str(art), device="cpu", overlap=False, chunk_size=2)
    runner, steps = llm.engine.runner, []
    real = runner.forward
    monkeypatch.setattr(runner, "forward", lambda step, subst=None: steps.append(step) or real(step, subst))
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    batch = [prompts[0][:1], prompts[2][:4]]
    assert [o.token_ids for o in llm.generate(batch, greedy)] == hf_greedy(hf, batch, 5)
    assert (steps[0].mode, steps[0].extend_lens, steps[0].seq_lens) == ("extend", [1, 1], [1, 1])
