"""N-gram speculative decoding in the engine (docs/speculative.md sections 2-3), float32 on CPU:
the tokens with ``speculative="ngram"`` are the tokens without it, greedy and seeded sampling, at
batch 1 and 4, with prompts that repeat themselves and ones that do not, prefix-cache hits, chunked
prefill, a KV pool small enough to retract, a stop token inside an accepted run, and requests that
cannot speculate (penalties) in the batch. The tiny model (qwen3-qknorm, seed 5) drifts between
loops and fresh tokens, so verify steps both accept drafts and reject them."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.compiler.synth_tokenizer import build_tokenizer
from kiln.errors import KilnError

NEW = 40
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-eng")
    make_checkpoint(root / "hf", "qwen3-qknorm", seed=5, eos=None)
    build_tokenizer(root / "hf", vocab_size=300)  # for stop strings (prompts stay token ids)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(7)
    pat = torch.randint(3, 300, (6,), generator=g).tolist()
    prompts = [  # two that repeat themselves, two that do not
        pat * 4,
        torch.randint(3, 300, (23,), generator=g).tolist(),
        pat[:3] * 5,
        torch.randint(3, 300, (9,), generator=g).tolist(),
    ]
    return root / "art", prompts


def _run(art, prompts, params, spec: str, **opts):
    llm = LLM(str(art), device="cpu", speculative=spec, **opts)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs], llm.engine


def _same(art, prompts, params, **opts):
    """The tokens with speculation off and on (asserted equal) and the speculating engine."""
    off, eng_off = _run(art, prompts, params, "off", **opts)
    on, eng = _run(art, prompts, params, "ngram", **opts)
    assert on == off
    assert eng_off.status()["spec_verified"] == 0 and "speculative" not in eng_off.step_metrics()
    return on, eng


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identical(setup, batch):
    art, prompts = setup
    toks, eng = _same(art, prompts[:batch], GREEDY)
    s = eng.step_metrics()["speculative"]
    # drafts accepted and rejected; fewer steps than tokens
    assert 0 < s["accepted"] < s["proposed"], s
    assert s["emitted"] == s["verified"] + s["accepted"]
    st = eng.status()
    assert st["spec_accepted"] == s["accepted"] and st["generated_tokens"] == batch * NEW
    m = eng.step_metrics()
    assert m["decode"]["steps"] < NEW - 1
    # each verify step left kv_len == seq_len - 1: no accepted token was prefilled again
    assert m["all"]["prefill_tokens"] == sum(len(p) for p in prompts[:batch])
    assert all(len(t) == NEW for t in toks)


def test_prefix_cache_hit(setup):
    """Prompts that hit the cache: a shared prompt prefix, and a follow-up turn whose prompt holds
    the first request's output (pages the radix cache took from verify steps' accepted tokens)."""
    art, prompts = setup
    g = torch.Generator().manual_seed(11)
    first = prompts[0] + torch.randint(3, 300, (8,), generator=g).tolist()
    second = first[:24] + torch.randint(3, 300, (5,), generator=g).tolist()
    runs = []
    for spec in ("off", "ngram"):
        llm = LLM(str(art), device="cpu", speculative=spec)
        a = llm.generate([first], GREEDY)[0]
        b = llm.generate([second], GREEDY)[0]
        turn = first + a.token_ids[:30] + [7, 8]
        c = llm.generate([turn], GREEDY)[0]
        assert b.num_cached_tokens >= 16 and c.num_cached_tokens >= len(first) + 16
        llm.engine.check_integrity()
        runs.append([a.token_ids, b.token_ids, c.token_ids])
    assert runs[0] == runs[1]
    assert llm.engine.spec_stats.accepted > 0


def test_chunked_prefill_and_retraction(setup):
    art, prompts = setup
    _, eng = _same(art, prompts, GREEDY, chunk_size=7)
    assert eng.spec_stats.accepted > 0
    per_token = 2 * 2 * 2 * 32 * 4  # layers x (K+V) x kv heads x head_dim x 4 bytes
    _, eng = _same(art, prompts, GREEDY, kv_memory_gib=120 * per_token / 2**30)
    assert eng.scheduler.num_preemptions > 0 and eng.spec_stats.accepted > 0


def _stop_string_inside_a_run(eng, prompts) -> tuple[int, str, int]:
    """(prompt index, stop string, output index): a printable stop string whose first occurrence in
    the greedy output ends with an accepted draft that is not its verify step's last token."""
    tok = eng.tokenizer
    for k, p in enumerate(prompts):
        req = eng.add_request(p, GREEDY)
        steps: list[list[int]] = []
        while eng.has_work():
            steps += [o.new_token_ids for o in eng.step()]
        full, pos = req.output_ids, 0
        for new in steps:
            for i in range(len(new) - 1):  # new[i] for i < len(new) - 1: an accepted draft
                before = tok.decode(full[: pos + i], skip_special_tokens=True)
                after = tok.decode(full[: pos + i + 1], skip_special_tokens=True)
                if not after.startswith(before) or len(after) == len(before):
                    continue
                cut = next(n for n in range(1, len(after) + 1) if after[-n:] not in before)
                stop = after[-cut:]
                if stop.isascii() and stop.isprintable() and stop.strip():
                    return k, stop, pos + i
            pos += len(new)
    raise AssertionError("no verify step accepted a draft that could end a stop string")


def test_stop_inside_accepted_run(setup):
    """A stop string completed by an accepted draft in the middle of a verify step's tokens ends the
    request there: the tokens after it are discarded, the KV length follows the tokens kept, and
    the tokens are those without speculation."""
    art, prompts = setup
    k, stop, at = _stop_string_inside_a_run(LLM(str(art), device="cpu", speculative="ngram").engine, prompts)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, stop=[stop])
    off, _ = _run(art, [prompts[k]], params, "off")
    assert len(off[0]) == at + 1
    eng = LLM(str(art), device="cpu", speculative="ngram").engine
    req = eng.add_request(prompts[k], params)
    dropped = 0
    while eng.has_work():
        emitted = eng.spec_stats.emitted
        for o in eng.step():
            if o.finished:
                assert o.finish_reason == "stop" and stop not in o.text
                dropped = eng.spec_stats.emitted - emitted - len(o.new_token_ids)
    assert req.output_ids == off[0]
    assert dropped > 0  # the verify step that stopped it emitted tokens after the stop
    eng.check_integrity()
    assert not eng.scheduler.running and eng.radix.total_size > 0


def test_seeded_sampling_identical(setup):
    """Point-mass drafts accepted while they equal the target's own sample with the plain sampler's
    noise: a seeded request gives the same tokens (the CPU extend and decode graphs' float32 logits
    agree closely enough here that the samples are equal, not merely equally distributed)."""
    art, prompts = setup
    params = SamplingParams(max_tokens=NEW, temperature=0.3, top_p=0.9, seed=4, ignore_eos=True)
    _, eng = _same(art, prompts, params)
    assert eng.spec_stats.accepted > 0


def test_requests_that_cannot_speculate(setup):
    """A request that cannot speculate in the batch rides along with no drafts, sampled as a decode
    step samples it: a repetition penalty with logprobs, beside speculating requests with logprobs;
    the others keep speculating."""
    art, prompts = setup
    pen = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, logprobs=2)
    lp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=3)
    params = [lp, pen, GREEDY, GREEDY]
    off = LLM(str(art), device="cpu", speculative="off").generate(prompts, params)
    llm = LLM(str(art), device="cpu", speculative="ngram")
    on = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert on[1].token_ids != _run(art, prompts[1:2], GREEDY, "off")[0][0]  # the penalty mattered
    for a, b in zip(on[:2], off[:2]):  # logprobs of both kinds of rows
        assert [e["token_id"] for e in a.logprobs] == [e["token_id"] for e in b.logprobs]
        got, want = [e["logprob"] for e in a.logprobs], [e["logprob"] for e in b.logprobs]
        assert got == pytest.approx(want, abs=1e-4)
        assert [len(e["top"]) for e in a.logprobs] == [len(e["top"]) for e in b.logprobs]
    # the penalized request ran all along, yet drafts were verified and accepted
    assert llm.engine.spec_stats.accepted > 0


def test_a_structured_request_rides_along(tmp_path):
    """A regex-constrained request (the grammar's mask on its row of the verify step) beside
    speculating ones: every output is plain decoding's, and drafts are still accepted."""
    from kiln.runtime.grammar import StructuredOutputs

    make_checkpoint(tmp_path / "hf", "qwen3-qknorm", seed=5)  # an EOS id: grammars need one
    build_tokenizer(tmp_path / "hf", vocab_size=300)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    pat = list(range(40, 46))
    prompts = [pat * 4, pat[:3] * 5, [7, 8, 9, 10]]
    rx = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutputs(regex="[a-z ]{4,12}"))
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    params = [greedy, greedy, rx]
    off = _run(tmp_path / "art", prompts, params, "off")[0]
    on, eng = _run(tmp_path / "art", prompts, params, "ngram")
    assert on == off
    assert eng.spec_stats.accepted > 0 and eng.stats["masked_rows"] > 0


def test_bad_settings_are_one_line_errors(setup):
    art, _ = setup
    with pytest.raises(
        KilnError, match=r"num_draft_tokens \(--num-draft-tokens\) is '0'; it takes an integer >= 1"
    ):
        LLM(str(art), device="cpu", speculative="ngram", num_draft_tokens=0)
    with pytest.raises(KilnError, match="speculative"):
        LLM(str(art), device="cpu", speculative="eagle")
