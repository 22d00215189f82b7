"""N-gram draft trees in the engine (issue 30; docs/speculative.md section 4 "Trees"), float32 on CPU.

``draft_branches`` > 1 drafts each request's tree from the distinct continuations of its suffix's
earlier occurrences (runtime/spec_tree.py ``ngram_tree``), verifies it in one step on the artifact's
token-tree graph (``verify_tree``, compiled beside the verify graphs), then moves the accepted
path's K/V into place (``compact_moves`` + ``move_kv``). Checked here:

* the compile records the tree graph; branches 1 drafts today's chains exactly;
* a successor checkpoint (``compiler/synth.py``: greedy ``next(t)`` after ``t``) on prompts where
  every 4-gram of a stretch of the cycle also appears later followed by a wrong token: chains
  draft the latest (wrong) continuation and accept nothing, trees accept the earlier one's, so
  more tokens per step and fewer steps, at batch 1 and 3, with the tokens of plain decoding;
* after tree steps whose accepted nodes were not the first ones, the pool's K/V of every computed
  position equal plain decoding's (a skipped move, or RoPE by node index instead of depth, fails);
* a random tiny model (attention matters for its tokens): greedy and seeded-sampled tokens equal
  plain decoding's at batch 1 and 4, with prefix-cache hits, chunked prefill and a retraction;
* fallbacks: an artifact without the tree graph runs chains (with a warning); bad values refused.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tiny_models import SUCCESSOR_NEXT, make_successor, successor_config, walk
from tiny_models import make_checkpoint as make_tiny

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.errors import KilnError
from kiln.manifest import Manifest
from kiln.runtime.spec_tree import TreeDraft, branching, ngram_tree
from kiln.runtime.speculative import propose_ngram

CONFIG = successor_config(2)
NEXT = SUCCESSOR_NEXT
NEW = 20
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
K = 6  # draft nodes per request and step


@pytest.fixture(scope="module")
def succ(tmp_path_factory):
    """The successor checkpoint's artifact, with verify graphs (so the tree graph)."""
    root = tmp_path_factory.mktemp("tree-succ")
    make_successor(root / "hf", 2)
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=4, max_seq_len=256, chunk_size=64, verify_lengths="4,6"
    )
    compile_model(root / "hf", root / "art", opts, verbose=False)
    return root / "art"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Qwen3 (qk-norm) artifact with verify graphs, and four prompts that repeat
    patterns with different continuations."""
    root = tmp_path_factory.mktemp("tree-tiny")
    make_tiny(root / "hf", "qwen3-qknorm", seed=5, eos=None)
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=4, max_seq_len=160, chunk_size=64, verify_lengths="6"
    )
    compile_model(root / "hf", root / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(7)
    pat = torch.randint(3, 300, (4,), generator=g).tolist()
    x = torch.randint(3, 300, (8,), generator=g).tolist()
    prompts = [
        pat + x[:2] + pat + x[2:4] + pat + x[4:6] + pat,
        torch.randint(3, 300, (23,), generator=g).tolist(),
        (pat[:2] + x[:1]) * 3 + pat[:2] + x[1:2] + pat[:2],
        pat * 4,
    ]
    return root / "art", prompts


def branchy_prompt(start: int, length: int, m: int, rng: random.Random) -> list[int]:
    """A stretch C of the cycle from ``start``, then every 4-gram of C followed by a token that is
    not its successor, then C's first ``m`` tokens: the greedy output goes on along C, whose every
    suffix 4-gram occurs twice before, latest followed by the wrong token."""
    c = [start, *walk(start, length - 1)]
    d: list[int] = []
    for i in range(3, length):
        r = rng.randrange(300)
        while r == NEXT[c[i]]:
            r = rng.randrange(300)
        d += [*c[i - 3 : i + 1], r]
    return c + d + c[:m]


def _llm(art, spec: str, **opts) -> LLM:
    return LLM(str(art), device="cpu", speculative=spec, num_draft_tokens=K, **opts)


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    return outs


# ---------------------------------------------------------------------------------- compile, drafts


def test_compile_records_the_tree_graph(succ):
    m = Manifest.load(succ)
    tree = m.graphs[Manifest.TREE_GRAPH]
    assert tree.inputs[-1] == "tree_mask" and tree.inputs[:-1] == m.graphs["model"].inputs
    assert tree.batch is None and tree.python is not None  # dynamic shapes; loads from its source


def test_ngram_tree_with_one_branch_is_the_chain():
    rng = np.random.default_rng(0)
    for trial in range(300):
        seq = rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 40)))
        k, nmax = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        t = ngram_tree(seq, k, nmax, 1, 1)
        assert t == TreeDraft.chain(propose_ngram(seq, k, nmax, 1).tolist()), (trial, seq)


def test_ngram_tree_merges_distinct_continuations():
    seq = np.array([5, 1, 2, 3, 9, 5, 1, 7, 8, 5, 1])  # "5 1" followed by 2 3 .. and by 7 8 ..
    assert ngram_tree(seq, 4, 4, 1, 2) == TreeDraft((7, 2, 8, 3), (0, 0, 1, 2))  # depth by depth
    assert ngram_tree(seq, 3, 4, 1, 2) == TreeDraft((7, 2, 8), (0, 0, 1))  # the node budget
    # continuations sharing a first token share its node
    seq = np.array([4, 6, 1, 4, 6, 2, 4])
    assert ngram_tree(seq, 4, 1, 1, 2) == TreeDraft((6, 2, 1, 4), (0, 1, 1, 2))
    assert branching(ngram_tree(seq, 4, 1, 1, 2)) and not branching(TreeDraft.chain([1, 2, 3]))
    # one distinct continuation (or none): the chain whatever the branches
    seq = np.array([3, 8, 9, 3, 8, 9, 3])
    assert ngram_tree(seq, 4, 2, 1, 3) == TreeDraft.chain(propose_ngram(seq, 4, 2, 1).tolist())
    assert ngram_tree(np.array([1, 2, 3]), 4, 2, 1, 3) == TreeDraft((), ())


# ------------------------------------------------------------------------ successor: trees win


@pytest.mark.parametrize("batch", [1, 3])
def test_trees_accept_what_chains_miss(succ, batch):
    rng = random.Random(batch)
    prompts = [branchy_prompt(s, 26, 4, rng) for s in (17, 120, 250)[:batch]]
    want = [walk(p[-1], NEW) for p in prompts]
    runs = {}
    for name, spec, br in (("off", "off", 1), ("chain", "ngram", 1), ("tree", "ngram", 2)):
        llm = _llm(succ, spec, draft_branches=br)
        assert _generate(llm, prompts) == want, name
        runs[name] = (llm.engine.spec_stats, llm.engine.stepper.tree_stats, llm.engine.status()["steps"])
    (chain, chain_tree, chain_steps), (tree, ts, tree_steps) = runs["chain"], runs["tree"]
    assert chain_tree["steps"] == 0 and chain.proposed > 0 and chain.accepted <= chain.verified // 4, chain
    assert ts["steps"] > 0 and ts["branching"] == ts["steps"] and ts["moved"] > 0, ts
    assert tree.emitted > 2.5 * tree.verified, tree  # K 6 in two branches of depth 3: up to 4 a step
    assert tree.emitted / tree.verified > 2 * chain.emitted / chain.verified
    assert tree_steps < chain_steps and tree_steps < runs["off"][2]


def _kv(eng, req) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V of ``req``'s computed positions ``0 .. kv_len - 1``, every layer."""
    slots = torch.tensor(eng.bt.slots(req.row, 0, req.kv_len))
    return eng.pool.k_cache[:, slots], eng.pool.v_cache[:, slots]


def test_kv_after_tree_steps_equals_plain_decoding(succ):
    """Tree steps whose accepted nodes lie past the first ones leave every computed position's K/V
    as plain decoding writes them (the successor model's K/V depend on the token and its position
    only): the accepted path was moved, and its keys rotated by depth."""
    prompts = [branchy_prompt(s, 26, 4, random.Random(s)) for s in (17, 120)]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    on = _llm(succ, "ngram", draft_branches=2).engine
    reqs = [on.add_request(p, params) for p in prompts]
    while on.stepper.tree_stats["moved"] < 4 or min(len(r.output_ids) for r in reqs) < NEW:
        on.step()
    off = _llm(succ, "off", overlap=False).engine  # no placeholder tokens in flight
    plain = [off.add_request(p, params) for p in prompts]
    while any(len(b.output_ids) < len(a.output_ids) for a, b in zip(reqs, plain)):
        off.step()
    for a, b in zip(reqs, plain):
        assert b.output_ids[: len(a.output_ids)] == a.output_ids == walk(a.prompt_ids[-1], len(a.output_ids))
        assert a.kv_len == len(a.prompt_ids) + len(a.output_ids) - 1
        ka, va = _kv(on, a)
        kb, vb = _kv(off, b)
        kb, vb = kb[:, : a.kv_len], vb[:, : a.kv_len]
        torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)


def _compare_tree_paths(art, prompts, device: str, tol: float) -> None:
    """One tree verify step of three requests (a branching tree, no drafts, a chain: the (4, 6)
    shape with padding nodes and a padding request) on the tree graph's (B, k) verify graph (a
    CUDA-graph replay on a GPU) and on the tree graph run eagerly: the same logits at every node."""
    llm = LLM(
        str(art), device=device, speculative="ngram", num_draft_tokens=K, draft_branches=3, kv_memory_gib=0.25
    )
    eng = llm.engine
    assert eng.runner._vtree  # tree steps take the (B, k) graphs
    for i, p in enumerate(prompts[:3]):
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), rid=f"r{i}")
    while not all(r.output_ids for r in eng.scheduler.running) or len(eng.scheduler.running) < 3:
        eng.step()
    reqs = list(eng.scheduler.running)
    trees = [TreeDraft((11, 12, 13, 14), (0, 0, 1, 2)), TreeDraft((), ()), TreeDraft((15,), (0,))]
    eng.scheduler.reserve_drafts(reqs, [list(t.tokens) for t in trees])
    step = eng.scheduler.tree_verify_inputs(reqs, trees)
    runner = eng.runner
    assert runner.verify_shape(step) == (4, 6)
    assert (4, 6) in runner.tgraphs or device == "cpu"
    graph = runner.verify(step).clone()
    runner._vtree = False  # the tree graph eagerly, as for a step no verify graph holds
    eager = runner.verify(step)
    assert graph.shape == eager.shape == (3, 5, eng.vocab_size)
    for b, t in enumerate(trees):
        torch.testing.assert_close(graph[b, : t.size], eager[b, : t.size], rtol=tol, atol=tol)
    assert runner.verify_steps == {"graph": 1, "eager": 1} and runner.tree_verify_steps == 2


def test_tree_step_on_its_verify_graph_equals_the_eager_tree_graph(tiny):
    art, prompts = tiny
    _compare_tree_paths(art, prompts, "cpu", 1e-5)


@pytest.mark.gpu
def test_gpu_tree_step_replay_equals_the_eager_tree_graph(tmp_path):
    """The same on the GPU: the tree graph captured per (B, k) and replayed."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none (run on the H200)")
    make_tiny(tmp_path / "hf", "qwen3-qknorm", seed=5, eos=None)
    opts = CompileOptions(
        device="cuda", dtype="float32", max_batch_size=4, max_seq_len=160, chunk_size=64, verify_lengths="6"
    )
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (21, 9, 30)]
    _compare_tree_paths(tmp_path / "art", prompts, "cuda", 1e-4)


# ----------------------------------------------------------------- random model: exact outputs


def _same(art, prompts, params, **opts):
    """The tokens with speculation off and with n-gram trees (asserted equal), and that engine."""
    off = _generate(LLM(str(art), device="cpu", speculative="off", **opts), prompts, params)
    llm = _llm(art, "ngram", draft_branches=3, **opts)
    on = _generate(llm, prompts, params)
    assert on == off
    return on, llm.engine


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identical(tiny, batch):
    art, prompts = tiny
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _, eng = _same(art, prompts[:batch], params)
    ts = eng.stepper.tree_stats
    assert ts["steps"] > 0 and ts["branching"] > 0 and eng.spec_stats.accepted > 0, ts
    assert eng.runner.tree_verify_steps == ts["steps"]
    assert eng.runner.verify_steps["eager"] == 0  # tree and chain steps on the (B, k) graphs
    m = eng.step_metrics()
    assert m["all"]["prefill_tokens"] == sum(len(p) for p in prompts[:batch])  # no token prefilled twice


def test_prefix_cache_chunked_prefill_and_retraction(tiny):
    art, prompts = tiny
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # prefix-cache hits: a shared prefix, then a turn holding the first output
    g = torch.Generator().manual_seed(11)
    first = prompts[0] + torch.randint(3, 300, (8,), generator=g).tolist()
    second = first[:20] + torch.randint(3, 300, (5,), generator=g).tolist()
    runs = []
    for spec, br in (("off", 1), ("ngram", 3)):
        llm = _llm(art, spec, draft_branches=br)
        a = llm.generate([first], params)[0]
        b = llm.generate([second], params)[0]
        c = llm.generate([first + a.token_ids[:30] + [7, 8]], params)[0]
        assert b.num_cached_tokens >= 16 and c.num_cached_tokens >= len(first) + 16
        llm.engine.check_integrity()
        runs.append([a.token_ids, b.token_ids, c.token_ids])
    assert runs[0] == runs[1]
    assert llm.engine.stepper.tree_stats["branching"] > 0
    # chunked prefill
    _, eng = _same(art, prompts, params, chunk_size=7)
    assert eng.stepper.tree_stats["branching"] > 0
    # a pool small enough to retract (layers x (K+V) x kv heads x head_dim x 4 bytes per token)
    per_token = 2 * 2 * 2 * 32 * 4
    _, eng = _same(art, prompts, params, kv_memory_gib=120 * per_token / 2**30)
    assert eng.scheduler.num_preemptions > 0 and eng.stepper.tree_stats["steps"] > 0


def test_seeded_sampling_identical(tiny):
    """Point-mass trees: a seeded request emits the plain sampler's tokens for its seed."""
    art, prompts = tiny
    params = SamplingParams(max_tokens=40, temperature=0.3, top_p=0.9, seed=4, ignore_eos=True)
    _, eng = _same(art, prompts, params)
    assert eng.stepper.tree_stats["branching"] > 0 and eng.spec_stats.accepted > 0
    params = SamplingParams(max_tokens=40, temperature=1.5, top_k=20, seed=9, ignore_eos=True)
    _same(art, prompts[:2], params)


def test_logprobs_and_a_request_that_cannot_speculate(tiny):
    """Tree steps with a penalized request beside (no drafts, sampled as a decode step samples it)
    and requests asking for logprobs: the tokens and logprobs of plain decoding."""
    art, prompts = tiny
    pen = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, logprobs=2)
    lp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    params = [lp, pen, greedy, lp]
    off = LLM(str(art), device="cpu", speculative="off").generate(prompts, params)
    llm = _llm(art, "ngram", draft_branches=3)
    on = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    for a, b in (x for i, x in enumerate(zip(on, off)) if i != 2):  # the three asking for logprobs
        assert [e["token_id"] for e in a.logprobs] == [e["token_id"] for e in b.logprobs]
        got, want = [e["logprob"] for e in a.logprobs], [e["logprob"] for e in b.logprobs]
        assert got == pytest.approx(want, abs=1e-4)
        assert [[t for t, _ in e["top"]] for e in a.logprobs] == [
            [t for t, _ in e["top"]] for e in b.logprobs
        ]
    assert llm.engine.stepper.tree_stats["branching"] > 0 and llm.engine.spec_stats.accepted > 0


# ----------------------------------------------------------------------------------- fallbacks


def test_fallbacks_and_refusals(tiny, tmp_path):
    art, prompts = tiny
    with pytest.raises(
        KilnError, match=r"draft_branches \(--draft-branches\) is '0'; it takes an integer >= 1"
    ):
        _llm(art, "ngram", draft_branches=0)
    make_tiny(tmp_path / "hf", "qwen3-qknorm", seed=5, eos=None)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=160, chunk_size=64)
    m = compile_model(tmp_path / "hf", tmp_path / "plain", opts, verbose=False)
    assert Manifest.TREE_GRAPH not in m.graphs  # no verify graphs, no tree graph
    with pytest.warns(UserWarning, match="no verify_tree graph.*chains"):
        llm = _llm(tmp_path / "plain", "ngram", draft_branches=2)
    assert llm.engine.drafter.cfg.branches == 1
    out = _generate(llm, prompts[:2])
    assert out == _generate(LLM(str(art), device="cpu", speculative="off"), prompts[:2])
    assert llm.engine.stepper.tree_stats["steps"] == 0 and llm.engine.spec_stats.verified > 0
