"""EAGLE-3 speculative decoding in the engine (``kiln compile --eagle3``; runtime/spec_eagle.py),
float32 on CPU.

The target is a successor checkpoint (compiler/synth.py: every layer adds nothing, so each residual
stream at position p is ``embed[x_p]`` and greedy decoding emits ``next(t)`` after ``t``). The head
is a published-layout checkpoint (tests/eagle3_checkpoints.py) made to predict two tokens ahead from
the target's streams: ``fc`` picks the first stream, its LM head row ``next(next(t))`` is
``embed[t]``, and its attention and MLP outputs are small random matrices, so every input of the
head (its token, position, K/V history and hidden state) moves its logits. A head position ``p``
that reads the target's stream at ``p`` predicts ``x[p + 2]`` right: every verify step's first
draft must be accepted, and a slip of one position in the head's bookkeeping shows at once. The
drafts the engine proposes must equal a from-scratch reference: the target run over the whole
sequence for its streams, the head run over positions ``0 .. s - 2`` with tokens ``1 .. s - 1``,
then its chain of decode steps on its own outputs.
"""

from __future__ import annotations

import pytest
import torch
from draft_spy import spy_drafts, spy_tree_steps
from tiny_models import SUCCESSOR_NEXT, SUCCESSOR_SEED, make_successor, successor_config, walk

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.compiler.synth_eagle3 import successor_eagle3_head
from kiln.manifest import Manifest
from kiln.runtime.direct import DirectRunner
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_model

LAYERS = 4
CONFIG = successor_config(LAYERS)
VOCAB = CONFIG["vocab_size"]
NEXT = SUCCESSOR_NEXT
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
OPTS = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)


def _build(root, device: str, decoy: float = 0.0, verify_lengths: str = "") -> None:
    make_successor(root / "target", LAYERS)
    successor_eagle3_head(root / "head", root / "target", SUCCESSOR_SEED, decoy)
    opts = CompileOptions(
        **OPTS | {"device": device}, eagle3=str(root / "head"), verify_lengths=verify_lengths
    )
    compile_model(root / "target", root / "art", opts, verbose=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    _build(root, "cpu")
    return root


def prompts() -> list[list[int]]:
    """Stretches of the cycle (the target continues them) with a few random tokens inside."""
    g = torch.Generator().manual_seed(7)
    out = []
    for start, n in ((5, 23), (40, 40), (200, 9)):
        p = [start, *walk(start, n - 1)]
        for i in torch.randint(0, n, (2,), generator=g).tolist():
            p[i] = int(torch.randint(3, 300, (1,), generator=g))
        out.append(p)
    return out


def _no_syncs(obj, name: str) -> None:
    """``obj.name`` raises on any host sync with the GPU (torch's sync debug mode)."""
    fn = getattr(obj, name)

    def strict(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    setattr(obj, name, strict)


def _run(art, ps, params=GREEDY, spy=False, device="cpu", strict=False, **kw):
    """``strict``: the head's drafting and the verify step's launch must not sync with the GPU."""
    llm = LLM(str(art), device=device, **kw)
    eng = llm.engine
    if strict:
        _no_syncs(eng.drafter, "propose")
        _no_syncs(eng.runner, "verify")
    # each verify step's sequences, drafts and the head's logits of every draft
    log = spy_drafts(eng, VOCAB) if spy else []
    outs = [o.token_ids for o in llm.generate(ps, params)]
    eng.check_integrity()
    return outs, eng, log


def test_the_artifact_holds_the_head(root):
    m = Manifest.load(root / "art")
    assert m.draft is not None and m.draft.kind == "eagle3"
    assert m.aux_layers == (1, 2, 3)  # the head config's eagle_aux_hidden_state_layer_ids, plus one
    assert m.verify is not None
    head = Manifest.load(root / "art" / m.draft.path)
    assert head.kv.num_layers == 1 and head.aux_width == 3 * CONFIG["hidden_size"]
    assert Manifest.TREE_GRAPH in head.graphs  # its draft trees' steps
    assert head.verify == m.verify  # its catch-up's (B, k) graphs


@pytest.mark.parametrize("batch", [1, 3])
def test_first_drafts_are_accepted_and_outputs_are_plain_decodings(root, batch):
    ps = prompts()[:batch]
    plain, _, _ = _run(root / "art", ps, speculative="off")
    on, eng, _ = _run(root / "art", ps, chunk_size=16)  # auto: the artifact's head; prompts in chunks
    assert on == plain
    s = eng.step_metrics()["speculative"]
    assert s["verified"] > 0 and s["accepted"] >= 0.9 * s["verified"], s  # draft 1 every step
    assert eng.runner.verify_steps["graph"] > 0
    assert eng.drafter.runner.verify_steps["graph"] > 0  # the head's catch-ups on its verify graphs


@pytest.mark.gpu
def test_gpu_drafts_on_cuda_graphs(tmp_path, compiled_gpu):
    """On the GPU: the head's catch-ups replay its verify graphs and its chain steps its decode
    graphs, verify steps the target's verify graphs, and nothing from the head's catch-up to the
    verify step's launch waits for the GPU (the drafts reach the verify graph on the device); the
    first drafts are accepted and the tokens are plain decoding's."""
    _build(tmp_path, "cuda")
    ps = prompts()
    # a bounded pool each: the first engine is still alive when the second sizes its pool from free memory
    plain, _, _ = _run(tmp_path / "art", ps, device="cuda", speculative="off", kv_memory_gib=0.25)
    on, eng, _ = _run(tmp_path / "art", ps, device="cuda", chunk_size=16, kv_memory_gib=0.25, strict=True)
    assert on == plain
    s = eng.step_metrics()["speculative"]
    assert s["verified"] > 0 and s["accepted"] >= 0.9 * s["verified"], s
    assert eng.runner.verify_steps["graph"] > 0 and eng.drafter.runner.graphs
    head = eng.drafter.runner
    assert head.vgraphs and head.verify_steps["graph"] > 0 and head.verify_steps["eager"] == 0


@pytest.fixture(scope="module")
def decoy_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-decoy")
    _build(root, "cpu", decoy=1.2, verify_lengths="4,6")  # 6 nodes of width 2: three depths
    return root


def test_head_trees_take_the_heads_second_token(decoy_root):
    """A head whose best token is always wrong and whose second is right: its chains have next to
    nothing accepted; its trees of width 2 (--draft-branches 2: both of its best two expanded)
    take the second at depth 1 on every verify step, verified on the tree graph; the tokens are
    plain decoding's, at batch 3 with chunked prefill. If the head got the streams of the verified
    chain's rows instead of the accepted path's, its next best two would both be wrong."""
    ps = prompts()
    plain, _, _ = _run(decoy_root / "art", ps, speculative="off")
    chains, ceng, _ = _run(decoy_root / "art", ps, chunk_size=16)
    trees, teng, _ = _run(decoy_root / "art", ps, chunk_size=16, draft_branches=2)
    assert chains == plain and trees == plain
    c, t = (e.step_metrics()["speculative"] for e in (ceng, teng))
    assert c["verified"] > 0 and c["accepted"] <= 0.1 * c["verified"], c
    assert t["verified"] > 0 and t["accepted"] >= 0.9 * t["verified"], t
    assert teng.stepper.tree_stats["branching"] > 0 and teng.runner.verify_steps["graph"] > 0
    assert teng.drafter.tree_rows > 0  # the head's own tree steps ran


@pytest.mark.gpu
def test_gpu_head_trees_on_cuda_graphs(tmp_path, compiled_gpu):
    """On the GPU: the decoy head's trees replay the target's tree graphs and take the second
    token at depth 1 on every verify step; the tokens are plain decoding's."""
    _build(tmp_path, "cuda", decoy=1.2)
    ps = prompts()
    plain, _, _ = _run(tmp_path / "art", ps, device="cuda", speculative="off", kv_memory_gib=0.25)
    on, eng, _ = _run(
        tmp_path / "art", ps, device="cuda", chunk_size=16, draft_branches=2, kv_memory_gib=0.25
    )
    assert on == plain
    s = eng.step_metrics()["speculative"]
    assert s["verified"] > 0 and s["accepted"] >= 0.9 * s["verified"], s
    assert eng.runner.verify_steps["graph"] > 0 and eng.runner.tgraphs


def test_tree_steps_equal_a_from_scratch_reference(decoy_root):
    """Every node of every head tree step (three depths: nodes of depth 2 on their parents' outputs,
    beside their parents' siblings) has the head's logits of a from-scratch chain along its path:
    the tree mask, the positions by depth, the slots and the inputs from the parents."""
    ps = prompts()
    llm = LLM(str(decoy_root / "art"), device="cpu", chunk_size=16, draft_branches=2, num_draft_tokens=6)
    log = spy_tree_steps(llm.engine, VOCAB)
    llm.generate(ps, GREEDY)
    assert any(len(p) == 2 for _, paths, _ in log for p in paths)  # depth 2 ran
    target = load_model(str(decoy_root / "art"), "cpu")
    head = load_model(str(decoy_root / "art" / "eagle3"), "cpu")
    for tokens, paths, logits in log:
        for path, row in zip(paths, logits):
            _, want = reference_drafts(target, head, tokens, len(path) + 1, path=path)
            torch.testing.assert_close(row, want[-1], rtol=1e-4, atol=1e-4)


def test_head_trees_beside_requests_without_drafts_at_a_full_batch(decoy_root):
    """A full batch (4) at the longest verify length (6 nodes a tree): two requests speculate
    through the head's trees, one penalized request cannot (it rides along, sampled as a decode step
    samples it), one asked for no speculation; every output equals plain decoding's."""
    ps = [*prompts(), [9, *walk(9, 14)]]
    pen = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    off = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, speculative=False)
    params = [GREEDY, pen, off, GREEDY]
    plain, _, _ = _run(decoy_root / "art", ps, params, speculative="off")
    on, eng, _ = _run(decoy_root / "art", ps, params, chunk_size=16, draft_branches=2, num_draft_tokens=6)
    assert on == plain
    assert eng.stepper.tree_stats["branching"] > 0 and eng.drafter.tree_rows > 0
    assert eng.step_metrics()["speculative"]["accepted"] > 0


def test_a_head_without_the_tree_graph_drafts_chains(decoy_root):
    eng = LLM(str(decoy_root / "art"), device="cpu", draft_branches=2).engine
    head = eng.drafter.runner.m
    assert Manifest.TREE_GRAPH in head.graphs and eng.stepper.spec.trees
    del head.graphs[Manifest.TREE_GRAPH]  # a head compiled before heads had one
    with pytest.warns(UserWarning, match="EAGLE-3 head has no verify_tree graph.*chains"):
        assert not Engine._trees_possible(eng, head)


def test_head_trees_keep_seeded_samples(decoy_root):
    """Seeded sampling through the head's trees emits plain decoding's very tokens: tree drafts go
    as point masses (runtime/spec_tree.py), unlike the head's sampled chains (their ``q`` rule draws
    other uniforms: the same law, other tokens)."""
    ps = prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.7, seed=3, ignore_eos=True)
    plain, _, _ = _run(decoy_root / "art", ps, params, speculative="off")
    trees, eng, _ = _run(decoy_root / "art", ps, params, chunk_size=16, draft_branches=3)
    assert trees == plain
    s = eng.step_metrics()["speculative"]
    assert s["accepted"] > 0 and eng.stepper.tree_stats["branching"] > 0, s


def test_drafts_equal_a_from_scratch_reference(root):
    ps = prompts()
    _, _, log = _run(root / "art", ps, spy=True, chunk_size=16)
    assert log
    target = load_model(str(root / "art"), "cpu")
    head = load_model(str(root / "art" / "eagle3"), "cpu")
    checked = 0
    for seqs, drafts, logits in log:
        for tokens, got, rows in zip(seqs, drafts, logits):
            if got:
                want, want_rows = reference_drafts(target, head, tokens, len(got))
                assert got == want, (tokens, got)
                for x, y in zip(rows, want_rows):  # every input of the head moves them
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked >= len(log)


def reference_drafts(
    target, head, tokens: list[int], n: int, path: list[int] | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """The head's ``n`` greedy drafts after ``tokens`` and its logits of each, from scratch (module
    docstring); with ``path`` its chain on those tokens instead of its own (``n = len(path) + 1``)."""
    s = len(tokens)
    t = DirectRunner("", model=target)
    width = 3 * CONFIG["hidden_size"]
    (streams,) = t.runner.aux_args = (torch.zeros(2 * s, width),)
    t.prefill([tokens[:-1]])  # the streams at positions 0 .. s - 2
    d = DirectRunner("", model=head)
    (buf,) = d.runner.aux_args = (torch.zeros(2 * s, head.artifact.manifest.aux_width),)
    buf[: s - 1, :width] = streams[: s - 1]
    rows = [d.prefill([tokens[1:]])[0, :VOCAB].float()]
    h = CONFIG["hidden_size"]
    buf[0, :h] = buf[s - 2, :h].clone()  # the last position's output starts the chain
    while len(rows) < n:
        fed = int(rows[-1].argmax()) if path is None else path[len(rows) - 1]
        rows.append(d.decode([fed])[0, :VOCAB].float())
    return [int(x.argmax()) for x in rows], rows
