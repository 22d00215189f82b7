"""Speculative decoding's verify graphs (``kiln compile --verify-lengths``; docs/speculative.md
section 2), float32 on CPU: the compile records them (the shared graph warmed up at their shapes),
a verify step on them gives the extend graph's logits (padded chunks, padding
requests), and the engine's tokens with speculation on them equal plain decoding's, at batches that
need padding requests, with requests that asked for no speculation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileError, CompileOptions, compile_model
from kiln.errors import KilnError
from kiln.manifest import Manifest, VerifySpec

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-graphs")
    make_checkpoint(root / "hf", "qwen3-qknorm", seed=5, eos=None)
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64, verify_lengths="4,2"
    )
    compile_model(root / "hf", root / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(7)
    pat = torch.randint(3, 300, (6,), generator=g).tolist()
    prompts = [pat * 4, torch.randint(3, 300, (23,), generator=g).tolist(), pat[:3] * 5]
    return root, prompts


def test_manifest_records_the_verify_graphs(setup):
    root, _ = setup
    m = Manifest.load(root / "art")
    assert m.verify == VerifySpec(lengths=(2, 4), buckets=(1, 2, 4))
    # every chain verify step runs the shared graph (captured per (B, k)); token trees their own
    assert set(m.graphs) == {"model", "decode_b1", "verify_tree"}


@pytest.mark.parametrize(("lengths", "why"), [("0,4", "1..32"), ("4,x", "1..32"), ("33", "1..32")])
def test_bad_verify_lengths_are_refused(lengths, why):
    with pytest.raises(CompileError, match=rf"--verify-lengths.*{why}"):
        _ = CompileOptions(verify_lengths=lengths).verify


def _compare_verify_paths(art, prompts, device: str, tol: float) -> None:
    """One verify step of three requests (2, 0 and 1 drafts: bucket (4, 2) with a padding request and
    padded chunks) run on the verify graph (a CUDA-graph replay on a GPU) and on the extend graph:
    the same logits."""
    # a bounded pool: engines of earlier tests in the process may still hold GPU memory
    llm = LLM(str(art), device=device, speculative="ngram", kv_memory_gib=0.25)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), rid=f"r{i}")
    while not all(r.output_ids for r in eng.scheduler.running) or len(eng.scheduler.running) < 3:
        eng.step()
    reqs = list(eng.scheduler.running)
    drafts = eng.scheduler.reserve_drafts(reqs, [[11, 12], [], [13]])
    step = eng.scheduler.verify_inputs(reqs, drafts)
    runner = eng.runner
    assert runner.verify_shape(step) == (4, 2)
    assert (4, 2) in runner.vgraphs or device == "cpu"
    graph = runner.verify(step).clone()
    runner._vshapes = ()  # no verify graphs: the eager extend graph
    eager = runner.verify(step)
    assert graph.shape == eager.shape == (3, 3, eng.vocab_size)
    for b, d in enumerate(drafts):  # the rows verify reads: each request's own tokens
        torch.testing.assert_close(graph[b, : len(d) + 1], eager[b, : len(d) + 1], rtol=tol, atol=tol)
    assert runner.verify_steps == {"graph": 1, "eager": 1}


def test_verify_step_on_the_graph_equals_the_extend_graph(setup):
    root, prompts = setup
    _compare_verify_paths(root / "art", prompts, "cpu", 1e-5)


@pytest.mark.gpu
def test_gpu_verify_replay_equals_the_extend_graph(setup, tmp_path):
    """The same on the GPU: the captured verify graphs (static ones on the GEMV, the shared graph at
    (4, 4)) replayed, against the extend graph run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none (run on the H200)")
    root, prompts = setup
    opts = CompileOptions(
        device="cuda", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64, verify_lengths="2,4"
    )
    compile_model(root / "hf", tmp_path / "art", opts, verbose=False)
    _compare_verify_paths(tmp_path / "art", prompts, "cuda", 1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identical_on_verify_graphs(setup, batch):
    root, prompts = setup
    art = str(root / "art")
    off = [o.token_ids for o in LLM(art, device="cpu").generate(prompts[:batch], GREEDY)]
    llm = LLM(art, device="cpu", speculative="ngram", num_draft_tokens=4)
    on = [o.token_ids for o in llm.generate(prompts[:batch], GREEDY)]
    llm.engine.check_integrity()
    assert on == off
    s = llm.engine.step_metrics()["speculative"]
    assert 0 < s["accepted"] < s["proposed"], s
    steps = llm.engine.runner.verify_steps
    assert steps["graph"] > 0 and steps["eager"] == 0, steps


def test_a_request_without_speculation_joins_with_no_drafts(setup):
    """``SamplingParams.speculative=False``: the request is verified with no drafts while the others
    speculate, and its tokens are plain decoding's."""
    root, prompts = setup
    art = str(root / "art")
    plain = [o.token_ids for o in LLM(art, device="cpu").generate(prompts, GREEDY)]
    no_spec = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, speculative=False)
    llm = LLM(art, device="cpu", speculative="ngram")
    outs = llm.generate(prompts, [GREEDY, no_spec, no_spec])
    assert [o.token_ids for o in outs] == plain
    s = llm.engine.step_metrics()["speculative"]
    # request 0 drafted exactly as it does alone (its drafts depend on its own tokens only); the
    # others (prompt 2 repeats itself, so it would draft) proposed nothing
    solo = LLM(art, device="cpu", speculative="ngram")
    solo.generate(prompts[:1], GREEDY)
    alone = solo.engine.step_metrics()["speculative"]
    assert s["proposed"] == alone["proposed"] > 0 and s["accepted"] == alone["accepted"], (s, alone)
    assert s["verified"] > alone["verified"]  # the others rode along in the verify steps


def test_only_the_lengths_a_step_can_use_are_captured(setup):
    """A step carries at most --num-draft-tokens drafts, so lengths past the first that holds them are
    never used: not captured (start-up time and memory)."""
    root, _ = setup
    art = str(root / "art")
    got = {
        n: LLM(art, device="cpu", speculative="ngram", num_draft_tokens=n).engine.runner.verify_lengths
        for n in (1, 2, 3)
    }
    assert got == {1: (2,), 2: (2,), 3: (2, 4)}
    assert LLM(art, device="cpu", speculative="off").engine.runner.verify_lengths == ()


def test_too_many_drafts_for_the_graphs_is_refused(setup):
    root, _ = setup
    with pytest.raises(KilnError, match=r"num-draft-tokens is 6.*at most 4"):
        LLM(str(root / "art"), device="cpu", speculative="ngram", num_draft_tokens=6)


def test_the_server_field_reaches_the_request():
    from kiln.runtime.server_protocol import CompletionRequest, sampling_params

    off = sampling_params(CompletionRequest(prompt="x", max_tokens=4, speculative=False), 300)
    assert off.speculative is False
    assert sampling_params(CompletionRequest(prompt="x", max_tokens=4), 300).speculative is None


def test_large_batches_overlap_and_small_ones_speculate(tmp_path):
    """Above the verify graphs' batches (32) decode steps run plainly and overlapped; once the batch
    shrinks to 32 they verify drafts again; the tokens are plain decoding's throughout."""
    make_checkpoint(tmp_path / "hf", "qwen3-qknorm", seed=5, eos=None)
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=64, max_seq_len=128, chunk_size=64, verify_lengths="2"
    )
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (3,), generator=g).tolist() * 4 for _ in range(40)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)  # the prefill staggers them
    art = str(tmp_path / "art")
    off = [o.token_ids for o in LLM(art, device="cpu").generate(prompts, params)]
    llm = LLM(art, device="cpu", speculative="ngram", num_draft_tokens=2)
    on = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    assert on == off
    assert llm.engine.stepper.overlapped > 0  # the 40-request steps
    assert llm.engine.spec_stats.accepted > 0  # the 32-request ones
