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
from draft_spy import spy_drafts
from mtp_checkpoints import H, V, make_mtp_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.direct import DirectRunner
from kiln.runtime.loader import LoadedModel, load_model

OPTS = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-engine")
    make_mtp_checkpoint(root / "ckpt", seed=5)
    compile_model(root / "ckpt", root / "art", CompileOptions(**OPTS, mtp=True), verbose=False)
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
