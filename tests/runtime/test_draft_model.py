"""A draft model compiled into the artifact (``kiln compile --draft-model``; runtime/spec_draft.py),
float32 on CPU. A draft that is the target itself must have nearly every draft accepted (any slip in
the draft's KV bookkeeping shows as rejections); a random draft of another architecture accepts
little; with either, greedy and seeded outputs are plain decoding's, at batch 1 and 3 (a padding
request in the verify graphs), with prefix-cache hits and chunked prefill. The compile refuses a
draft of another vocabulary, the load a draft swapped after the compile."""

from __future__ import annotations

import shutil

import pytest
import torch
from tiny_models import make_checkpoint

from kiln import LLM, SamplingParams
from kiln.artifact_format import ArtifactError
from kiln.compiler.build import CompileError, CompileOptions, compile_model
from kiln.compiler.synth_tokenizer import build_tokenizer
from kiln.errors import KilnError
from kiln.manifest import Manifest

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
OPTS = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=32)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    make_checkpoint(root / "target", "qwen3-qknorm", seed=5, eos=None)
    build_tokenizer(root / "target", vocab_size=300)
    shutil.copytree(root / "target", root / "same")
    make_checkpoint(root / "other", "llama-untied", seed=3, eos=None)
    build_tokenizer(root / "other", vocab_size=300)
    for name in ("same", "other"):
        opts = CompileOptions(**OPTS, draft_model=str(root / name))
        compile_model(root / "target", root / f"art-{name}", opts, verbose=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (23, 40, 9)]
    return root, prompts


def _tokens(art, prompts, params, **kw):
    llm = LLM(str(art), device="cpu", **kw)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs], llm.engine


def test_the_artifact_holds_the_draft(setup):
    root, _ = setup
    m = Manifest.load(root / "art-same")
    assert m.draft is not None and m.draft.path == "draft" and m.draft.vocab_size == 300
    assert m.verify is not None and m.verify.lengths == (4,)  # implied by --draft-model
    assert not any(f.startswith("draft/") for f in m.files)  # the draft's own manifest lists them
    inner = Manifest.load(root / "art-same" / "draft")
    assert inner.kv.page_size == m.kv.page_size and inner.max_seq_len == m.max_seq_len
    assert inner.draft is None and inner.verify is not None and inner.verify.lengths == (1,)  # catch-ups
    assert Manifest.TREE_GRAPH not in inner.graphs  # a draft model drafts chains


@pytest.mark.parametrize("batch", [1, 3])
def test_the_target_as_its_own_draft_is_accepted(setup, batch):
    root, prompts = setup
    plain, _ = _tokens(root / "art-same", prompts[:batch], GREEDY, speculative="off")
    on, eng = _tokens(root / "art-same", prompts[:batch], GREEDY)  # auto: the artifact's draft
    assert on == plain
    s = eng.step_metrics()["speculative"]
    assert s["proposed"] > 0 and s["accepted"] >= 0.9 * s["proposed"], s
    assert eng.runner.verify_steps["graph"] > 0
    assert eng.step_metrics()["decode"]["steps"] <= (NEW - 1) // 4 + 3
    # the draft saw the prompts in the target's prefill; each verify step caught up 1-2 tokens, two
    # (every draft accepted) on the draft's verify graph instead of its extend graph
    assert eng.drafter.caught_up <= 2 * s["verified"], (eng.drafter.caught_up, s)
    assert eng.drafter.runner.verify_steps["graph"] > 0 and eng.drafter.runner.verify_steps["eager"] == 0


def test_a_draft_model_drafts_chains_with_a_warning(setup):
    """--draft-branches > 1 with a draft model: one line says it drafts chains; outputs unchanged."""
    root, prompts = setup
    plain, _ = _tokens(root / "art-same", prompts[:1], GREEDY, speculative="off")
    with pytest.warns(UserWarning, match="--draft-branches 2: a draft model drafts chains"):
        on, eng = _tokens(root / "art-same", prompts[:1], GREEDY, draft_branches=2)
    assert on == plain and not eng.stepper.spec.trees and eng.stepper.tree_stats["steps"] == 0


def test_a_random_draft_changes_nothing(setup):
    root, prompts = setup
    art = root / "art-other"
    plain, _ = _tokens(art, prompts, GREEDY, speculative="off")
    on, eng = _tokens(art, prompts, GREEDY, speculative="draft", speculative_policy="measured")
    assert on == plain
    s = eng.step_metrics()["speculative"]
    assert s["proposed"] > 0 and s["accepted"] < 0.5 * s["proposed"], s
    # a draft model must see every token: the measured policy is for n-gram drafts only (else it
    # would decode plainly here, where no draft is accepted, and the draft would fall behind)
    assert eng.spec_policy is None and eng.stepper.spec.policy is None


def test_sampled_drafts_carry_their_distribution(setup):
    """A sampling request drafts from the draft's q: with the target as its own draft, q is the
    target's p, so nearly every draft is accepted (by the point-mass rule only drafts that hit the
    target's own sample would be: a few percent at temperature 1 over 300 tokens); the same seed
    gives the same tokens again."""
    root, prompts = setup
    seeded = SamplingParams(max_tokens=NEW, temperature=1.0, seed=1, ignore_eos=True)
    first, eng = _tokens(root / "art-same", prompts, seeded)
    s = eng.step_metrics()["speculative"]
    assert s["proposed"] > 0 and s["accepted"] >= 0.9 * s["proposed"], s
    assert _tokens(root / "art-same", prompts, seeded)[0] == first
    # min_tokens: the draft's sampling batch is rebuilt per position (its bans move with it)
    banned = SamplingParams(max_tokens=NEW, temperature=1.0, seed=1, min_tokens=NEW, ignore_eos=True)
    _, eng = _tokens(root / "art-same", prompts, banned)
    s = eng.step_metrics()["speculative"]
    assert s["proposed"] > 0 and s["accepted"] >= 0.9 * s["proposed"], s


def test_a_penalized_request_beside_sampled_drafts(setup):
    """A request with a repetition penalty rides along with no drafts (sampled as a decode step
    samples it) while sampling requests verify the draft's q: its tokens are plain decoding's and
    the others' drafts are still nearly all accepted (q rows picked for the speculating requests)."""
    root, prompts = setup
    art = root / "art-same"
    pen = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    hot = SamplingParams(max_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True)
    params = [hot, pen, hot]
    plain, _ = _tokens(art, prompts, params, speculative="off")
    on, eng = _tokens(art, prompts, params)
    assert on[1] == plain[1]
    s = eng.step_metrics()["speculative"]
    assert s["proposed"] > 0 and s["accepted"] >= 0.9 * s["proposed"], s


def test_prefix_cache_hits_and_chunks(setup):
    """A long prompt in two chunks (chunk size 32), then a second request sharing its first 32
    tokens (a prefix-cache hit: the draft trusts its pool's pages there)."""
    root, _ = setup
    art = root / "art-same"
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, 300, (50,), generator=g).tolist()
    second = first[:32] + torch.randint(3, 300, (6,), generator=g).tolist()
    llm = LLM(str(art), device="cpu")
    got = [llm.generate([p], GREEDY)[0].token_ids for p in (first, second)]
    llm.engine.check_integrity()
    assert llm.engine.status()["cached_tokens"] >= 32
    want = _tokens(art, [first, second], GREEDY, speculative="off")[0]
    assert got == want
    s = llm.engine.step_metrics()["speculative"]
    assert s["accepted"] >= 0.9 * s["proposed"], s


def test_retraction(setup):
    """A KV pool too small for the batch (both pools share its page count): requests are retracted
    and resumed, the draft catches up on what it lost, outputs are plain decoding's."""
    root, prompts = setup
    art = root / "art-same"
    per_token = Manifest.load(art).kv.bytes_per_token + Manifest.load(art / "draft").kv.bytes_per_token
    kv = 100 * per_token / 2**30  # about 100 tokens
    plain, _ = _tokens(art, prompts, GREEDY, speculative="off", kv_memory_gib=kv)
    on, eng = _tokens(art, prompts, GREEDY, kv_memory_gib=kv)
    assert on == plain
    assert eng.scheduler.num_preemptions > 0
    s = eng.step_metrics()["speculative"]
    assert s["accepted"] >= 0.9 * s["proposed"] > 0, s


def test_a_draft_of_another_vocabulary_is_refused(setup, tmp_path):
    root, _ = setup
    make_checkpoint(tmp_path / "d", "llama-untied", seed=3, eos=None)
    build_tokenizer(tmp_path / "d", vocab_size=280)
    opts = CompileOptions(**OPTS, draft_model=str(tmp_path / "d"))
    with pytest.raises(CompileError, match=r"tokenizer\.json differ"):
        compile_model(root / "target", tmp_path / "art", opts, verbose=False)


def test_a_swapped_draft_is_refused(setup, tmp_path):
    root, _ = setup
    art = tmp_path / "art"
    shutil.copytree(root / "art-same", art)
    shutil.rmtree(art / "draft")
    shutil.copytree(root / "art-other" / "draft", art / "draft")  # a valid draft, not this one
    with pytest.raises(ArtifactError, match="not the one this artifact was compiled with"):
        LLM(str(art), device="cpu")
    assert LLM(str(art), device="cpu", speculative="off").generate([[5, 6, 7]], GREEDY)[0].token_ids


def test_draft_mode_needs_a_draft(setup):
    root, _ = setup
    with pytest.raises(KilnError, match="no draft model"):
        LLM(str(root / "art-same" / "draft"), device="cpu", speculative="draft")
