"""DeepSeek-V3 MTP speculative decoding in the engine (``kiln compile --mtp``; the drafter is
runtime/spec_eagle.py's, shared with EAGLE-3), float32 on CPU.

A tiny random DeepSeek-V3 checkpoint with its MTP layer (compiler/synth.py), compiled with ``--mtp``
(tests/compiler/test_mtp.py checks the layer against transformers). Through ``kiln.LLM`` with
chunked prefill: greedy outputs equal plain decoding's at batch 1 and 3, the verify steps ran, the
caches are intact, and every draft's logits equal a from-scratch reference: the target run over
the sequence for its last layer's outputs, the MTP layer run over positions ``0 .. s - 2`` with
tokens ``1 .. s - 1`` on them, then its chain of decode steps on its own outputs (the random layer
accepts few drafts: the reference, not the acceptance, shows its inputs are right).
"""

from __future__ import annotations

import pytest
import torch
from draft_spy import spy_drafts, spy_tree_steps
from mtp_checkpoints import H, V, make_mtp_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.direct import DirectRunner
from kiln.runtime.loader import LoadedModel, load_model
from kiln.runtime.spec_tree import TreeDraft

OPTS = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-engine")
    make_mtp_checkpoint(root / "ckpt", seed=5)
    opts = CompileOptions(**OPTS, mtp=True, verify_lengths="4,6")  # 6: trees of width 2 three deep
    compile_model(root / "ckpt", root / "art", opts, verbose=False)
    return root / "art"


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in (23, 40, 9)]


def _run(art, ps, spy=False, **kw):
    """Greedy outputs, the engine and (``spy``) each verify step's sequences, drafts and the
    head's logits of every draft."""
    llm = LLM(str(art), device="cpu", **kw)
    eng = llm.engine
    log = spy_drafts(eng, V) if spy else []
    outs = [o.token_ids for o in llm.generate(ps, GREEDY)]
    eng.check_integrity()
    return outs, eng, log


@pytest.mark.parametrize("batch", [1, 3])
def test_outputs_are_plain_decodings_and_drafts_equal_a_reference(art, batch):
    ps = prompts()[:batch]
    plain, _, _ = _run(art, ps, speculative="off")
    on, eng, log = _run(art, ps, spy=True, chunk_size=16)  # auto: the artifact's MTP layer
    assert on == plain
    s = eng.step_metrics()["speculative"]
    assert s["verified"] > 0 and s["proposed"] > 0, s
    target, head = load_model(str(art), "cpu"), load_model(str(art / "mtp"), "cpu")
    checked = 0
    for seqs, drafts, logits in log:
        for tokens, got, rows in zip(seqs, drafts, logits):
            if got:
                for x, y in zip(rows, reference_rows(target, head, tokens, got)):
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked >= len(log) - 1 > 0  # the last step may leave no room for drafts


def test_trees_are_plain_decodings_and_their_steps_equal_a_reference(art):
    """--draft-branches 2 with the MTP layer: the DeepSeek target verifies token trees (MLA
    attention's tree path) and the layer runs its own tree steps; outputs equal plain decoding at
    batch 3 with chunked prefill, and every node of every head tree step has the logits of a
    from-scratch chain along its path (three depths: 6 nodes of width 2)."""
    ps = prompts()
    plain, _, _ = _run(art, ps, speculative="off")
    llm = LLM(str(art), device="cpu", chunk_size=16, draft_branches=2, num_draft_tokens=6)
    eng = llm.engine
    log = spy_tree_steps(eng, V)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    eng.check_integrity()
    assert eng.stepper.tree_stats["branching"] > 0 and eng.drafter.tree_rows > 0
    assert any(len(p) == 2 for _, paths, _ in log for p in paths)  # depth 2 ran
    target, head = load_model(str(art), "cpu"), load_model(str(art / "mtp"), "cpu")
    for tokens, paths, logits in log:
        for path, row in zip(paths, logits):
            want = reference_rows(target, head, tokens, [*path, 0])[-1]
            torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)


def test_the_mla_target_verifies_a_tree_as_chains_along_its_paths(art):
    """One tree verify step of the DeepSeek target (MLA attention's tree path through the tree graph:
    node ``j`` in the slot of ``kv_len + j``, at position ``kv_len + depth``, seeing its ancestors):
    each node's logits equal a plain prefill of the sequence followed by the node's path."""
    eng = LLM(str(art), device="cpu", speculative="ngram", draft_branches=2, num_draft_tokens=6).engine
    req = eng.add_request(prompts()[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while not req.output_ids:
        eng.step()
    tree = TreeDraft((11, 12, 13, 14, 15), (0, 0, 1, 2, 2))
    eng.scheduler.reserve_drafts([req], [list(tree.tokens)])
    logits = eng.runner.verify(eng.scheduler.tree_verify_inputs([req], [tree]))[0, :, :V]
    seq = list(req.token_view[: req.seq_len])
    t = DirectRunner("", model=load_model(str(art), "cpu"))
    t.runner.aux_args = (torch.zeros(2 * (len(seq) + 3), H),)
    nodes = [[]] + [[]] * len(tree.tokens)  # each node's path of draft tokens
    for j, (tok, parent) in enumerate(zip(tree.tokens, tree.parents), start=1):
        nodes[j] = [*nodes[parent], tok]
    for j, path in enumerate(nodes):
        want = t.prefill([seq + path])[0, :V].float()
        torch.testing.assert_close(logits[j].float(), want, rtol=1e-4, atol=1e-4)


def reference_rows(
    target: LoadedModel, head: LoadedModel, tokens: list[int], drafts: list[int]
) -> list[torch.Tensor]:
    """The MTP layer's logits of each draft after ``tokens`` from scratch (module docstring), the
    chain fed the engine's drafts (an argmax near a tie may differ; the logits may not)."""
    s = len(tokens)
    t = DirectRunner("", model=target)
    (streams,) = t.runner.aux_args = (torch.zeros(2 * s, H),)
    t.prefill([tokens[:-1]])  # the last layer's outputs at positions 0 .. s - 2
    d = DirectRunner("", model=head)
    (buf,) = d.runner.aux_args = (torch.zeros(2 * s, H),)
    buf[: s - 1] = streams[: s - 1]
    rows = [d.prefill([tokens[1:]])[0, :V].float()]
    buf[0] = buf[s - 2].clone()  # the last position's output starts the chain
    for x in drafts[:-1]:
        rows.append(d.decode([x])[0, :V].float())
    return rows
