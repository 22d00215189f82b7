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
        log.append((seqs, drafts.lists(), [[x[b] for x in rows] for b in range(len(reqs))]))
        return drafts

    eng.drafter.propose, eng.drafter._picker = logged, logged_picker
    return log


def spy_tree_steps(eng, vocab: int) -> list:
    """Wrap ``eng.drafter``'s ``propose_tree`` and ``_tree_step`` (an EAGLE-3 head's draft trees):
    the returned list gets, per request of every head tree step, ``(sequence, paths, logits)``: the
    request's tokens, each node the step ran as its path of tokens from the root, and the head's
    logits there (``[:vocab]``, float32)."""
    log: list = []
    propose_tree, tree_step = eng.drafter.propose_tree, eng.drafter._tree_step
    seqs: list[list[int]] = []

    def logged_propose(reqs, limits, sched):
        seqs[:] = [list(r.token_view[: r.seq_len]) for r in reqs]
        return propose_tree(reqs, limits, sched)

    def logged_step(reqs, searches, live, roots, prev):
        logits, out, frontier = tree_step(reqs, searches, live, roots, prev)
        at = 0
        for i in live:
            toks, parents, _ = searches[i].chunk()
            paths: list[list[int]] = []
            for t, p in zip(toks, parents):
                paths.append([*(paths[p] if p >= 0 else []), t])
            log.append((seqs[i], paths, logits[at : at + len(toks), :vocab].float().clone()))
            at += len(toks)
        return logits, out, frontier

    eng.drafter.propose_tree, eng.drafter._tree_step = logged_propose, logged_step
    return log
