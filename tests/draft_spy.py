"""Record what a draft head proposes in the engine, for tests that check every draft against a
from-scratch reference (tests/runtime/test_eagle3_engine.py, test_mtp_engine.py)."""

from __future__ import annotations

import torch


def spy_drafts(eng, vocab: int) -> list:
    """Wrap ``eng.drafter``'s ``propose`` and ``_picker``: the returned list gets, per verify step,
    ``(sequences, drafts, logits)``: each request's tokens, its drafts, and the head's logits
    (``[:vocab]``, float32) of every draft."""
    log: list = []
    propose, picker = eng.drafter.propose, eng.drafter._picker
    rows: list[torch.Tensor] = []

    def logged_picker(reqs, n):
        pick = picker(reqs, n)
        return lambda i, logits: (rows.append(logits[:, :vocab].float().clone()), pick(i, logits))[1]

    def logged(reqs, limits, sched):
        rows.clear()
        drafts = propose(reqs, limits, sched)
        seqs = [list(r.token_view[: r.seq_len]) for r in reqs]
        log.append((seqs, drafts, [[x[b] for x in rows] for b in range(len(reqs))]))
        return drafts

    eng.drafter.propose, eng.drafter._picker = logged, logged_picker
    return log
