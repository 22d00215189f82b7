"""Speculative token trees (runtime/spec_tree.py): the tree structure, the greedy walk, equality with
the chain core on chain-shaped trees, lossless sampled verification (chi-square on a Markov target
over V = 8, as tests/runtime/test_speculative.py), the seed promise of point-mass trees, and the
compacting K/V move in a real pool.
"""

from __future__ import annotations

import math

import pytest
import torch
from markov_oracle import PROMPT, V, chi2_pvalue, plain_seeded_tokens, tables, target_probs

from kiln.ops.attention import paged  # noqa: F401  (registers the attention ops)
from kiln.runtime.kv_pool import BlockTable, KVPool
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams as SP
from kiln.runtime.spec_tree import (
    TreeBatch,
    TreeDraft,
    TreeSampling,
    TreeSearch,
    compact_moves,
    move_kv,
    verify_tree,
    walk_matches,
)
from kiln.runtime.speculative import DraftBatch, SpecSampling, SpeculativeError, verify

N = 12000
ALPHA = 1e-3
# the statistical tests' tree: three children of the root, two under the first, one under the
# second, one more level under node 4; requests keep its first ``lens`` nodes (still a tree)
SHAPE = (0, 0, 0, 1, 1, 2, 4)
K = len(SHAPE)


# ---- structure -------------------------------------------------------------------------------------


def test_tree_draft_depths_ranks_masks():
    t = TreeDraft((10, 11, 12, 13, 14), (0, 0, 1, 1, 3))
    assert t.size == 6
    assert t.depths() == [0, 1, 1, 2, 2, 3]
    assert t.ranks() == [0, 0, 1, 0, 1, 0]
    assert t.masks() == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b101011]
    chain = TreeDraft.chain([4, 5, 6])
    assert chain.parents == (0, 1, 2) and chain.masks() == [1, 3, 7, 15]
    deep = TreeDraft.chain(list(range(63)))  # 64 nodes: the last mask has the sign bit
    assert deep.masks()[-1] == -1


@pytest.mark.parametrize(
    "tokens, parents, match",
    [
        ((1, 2), (0, 2), "node 2's parent is 2"),
        ((1, 2), (0,), "2 tokens but 1 parents"),
        (tuple(range(64)), tuple(range(64)), "at most 64"),
    ],
)
def test_tree_draft_errors(tokens, parents, match):
    with pytest.raises(SpeculativeError, match=match):
        TreeDraft(tokens, parents)


def test_tree_batch_pads_and_gives_attention_inputs():
    trees = [TreeDraft((7, 8, 9), (0, 0, 1)), TreeDraft((), ())]
    tb = TreeBatch.from_trees(trees, "cpu", max_len=4)
    assert tb.ids.tolist() == [[7, 8, 9, 0], [0, 0, 0, 0]]
    assert tb.parents.tolist() == [[0, 0, 1, -1], [-1, -1, -1, -1]]
    assert tb.lens.tolist() == [3, 0]
    assert tb.depth.tolist() == [[0, 1, 1, 2, 0], [0, 0, 0, 0, 0]]
    # real nodes: ancestor-or-self; padding nodes: their own bit
    assert tb.tree_mask().tolist() == [1, 3, 5, 11, 16, 1, 2, 4, 8, 16]
    assert tb.positions(torch.tensor([100, 7])).tolist() == [[100, 101, 101, 102, 100], [7, 7, 7, 7, 7]]
    with pytest.raises(SpeculativeError, match="more than max_len 1"):
        TreeBatch.from_trees(trees, "cpu", max_len=1)


# ---- greedy walk -----------------------------------------------------------------------------------

# one tree: root -> 1 (tok 5), 2 (tok 6), 3 (tok 6); 1 -> 4 (tok 7); 2 -> 5 (tok 8), 6 (tok 9); 6 -> 7 (tok 1)
TREE = TreeDraft((5, 6, 6, 7, 8, 9, 1), (0, 0, 0, 1, 2, 2, 6))

# (target's argmax at nodes 0..7, draft nodes kept) -> (emitted tokens, accepted path)
WALK_CASES = [
    ([5, 7, 0, 0, 3, 0, 0, 0], 7, [5, 7, 3], [0, 1, 4]),  # first child, its child, bonus
    ([6, 0, 9, 0, 0, 0, 1, 4], 7, [6, 9, 1, 4], [0, 2, 6, 7]),  # second child, its second child, deep
    ([6, 0, 2, 0, 0, 0, 0, 0], 7, [6, 2], [0, 2]),  # 2's children do not match: the target's token
    ([3, 0, 0, 0, 0, 0, 0, 0], 7, [3], [0]),  # no child of the root matches
    ([6, 0, 9, 0, 0, 0, 1, 4], 5, [6, 9], [0, 2]),  # node 6 is past the kept nodes
    ([6, 0, 9, 4, 0, 0, 1, 4], 7, [6, 9, 1, 4], [0, 2, 6, 7]),  # duplicate sibling 3: the first wins
    ([5, 7, 0, 0, 3, 0, 0, 0], 0, [5], [0]),  # no drafts: a plain decode step
]


def _walk_batch() -> TreeBatch:
    trees = [TreeDraft(TREE.tokens[:n], TREE.parents[:n]) for _, n, _, _ in WALK_CASES]
    return TreeBatch.from_trees(trees, "cpu", max_len=K)


def test_walk_matches_cases():
    tb = _walk_batch()
    target = torch.tensor([c[0] for c in WALK_CASES])
    ids, n, path = walk_matches(target, tb.ids, tb.parents, tb.lens)
    for b, (_, _, want, want_path) in enumerate(WALK_CASES):
        assert n[b].item() == len(want), b
        assert ids[b].tolist() == want + [-1] * (K + 1 - len(want)), b
        assert path[b].tolist() == want_path + [-1] * (K + 1 - len(want_path)), b


def test_greedy_verify_tree_through_the_sampling_batch():
    B = len(WALK_CASES)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, K + 1, 16, generator=g)
    for b, (target, n, _, _) in enumerate(WALK_CASES):
        for i, t in enumerate(target):
            logits[b, i, t] = logits[b, i, :12].max() + 10.0
        logits[b, n + 1 :] = float("nan")  # padding nodes' rows are never read
    logits[:, :, 12:] = 1e4  # vocabulary padding
    tb = _walk_batch()
    spec = TreeSampling.build([SP(temperature=0)] * B, list(range(1, B + 1)), [0] * B, [0] * B, tb, "cpu")
    out = verify_tree(logits, tb, spec, Sampler(12, B + 1, "cpu"))
    for b, (_, _, want, want_path) in enumerate(WALK_CASES):
        assert out.token_ids[b, : len(want)].tolist() == want and out.num_emitted[b] == len(want)
        assert out.path[b, : len(want_path)].tolist() == want_path


# ---- chain-shaped trees are chains -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["greedy", "point_mass", "q"])
def test_a_chain_shaped_tree_gives_verifys_results(kind):
    g = torch.Generator().manual_seed(5)
    B, Kc, Vb = 48, 4, 12
    logits = torch.randn(B, Kc + 1, Vb, generator=g) * 2
    lens = torch.randint(0, Kc + 1, (B,), generator=g)
    q = torch.softmax(torch.randn(B, Kc, Vb, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, Vb), 1, generator=g).view(B, Kc)
    drafts[: B // 2] = logits[: B // 2, :Kc].argmax(-1)  # half the drafts the target's argmax: accepted often
    if kind == "greedy":
        params = [SP(temperature=0, logprobs=2)] * B
    else:  # a mix: min_tokens bans per position, top-k / top-p, a greedy row, logprobs
        params = [
            SP(temperature=0.9, top_k=6, top_p=0.95, min_tokens=3, seed=b, logprobs=2) for b in range(B)
        ]
        params[3] = SP(temperature=0)
    seeds, steps, rows = list(range(B)), [b % 4 for b in range(B)], list(range(1, B + 1))
    probs = q if kind == "q" else None
    lists = [drafts[b, : lens[b]].tolist() for b in range(B)]
    chain = verify(
        logits,
        DraftBatch(drafts, lens, probs),
        SpecSampling.build(params, rows, seeds, steps, Kc + 1, "cpu", eos_token_ids=[1], with_uniforms=True),
        Sampler(Vb, B + 1, "cpu"),
    )
    tb = TreeBatch.from_trees([TreeDraft.chain(x) for x in lists], "cpu", max_len=Kc)
    tb.probs = probs
    spec = TreeSampling.build(params, rows, seeds, steps, tb, "cpu", eos_token_ids=[1], with_uniforms=True)
    tree = verify_tree(logits, tb, spec, Sampler(Vb, B + 1, "cpu"))
    assert torch.equal(tree.token_ids, chain.token_ids)
    assert torch.equal(tree.num_emitted, chain.num_emitted)
    assert 0 < int(chain.num_accepted.sum()) < int(lens.sum())  # accepted some drafts, not all
    j = torch.arange(Kc + 1)[None, :]
    assert torch.equal(tree.path, torch.where(j < chain.num_emitted[:, None], j, -1))
    valid = j < chain.num_emitted[:, None]
    assert tree.logprobs is not None and chain.logprobs is not None
    assert torch.equal(tree.logprobs[valid], chain.logprobs[valid])


# ---- lossless sampling: chi-square -----------------------------------------------------------------


def _speculate(params: SP, source: str, rule: str, n: int = N, length: int = 2):
    """[n, length] tokens of n requests (seeds 1000 + i) decoding with trees of SHAPE (their first
    ``lens`` nodes, random per step) from the Markov target after PROMPT. source: "point" (a node's
    children are the top tokens of the draft table's row at its token, distinct: point masses, as
    an n-gram tree) or "q" (children drawn i.i.d. from the draft's distribution at the parent).
    rule: "match" (point masses, probs None), "reject" (with q; one-hot for "point"), "accept_any"
    (u = 0: wrong). Returns the tokens, accepted nodes and accepted nodes of sibling rank > 0."""
    target, draft = tables(0)
    q_rows = torch.softmax(draft, -1)
    order = draft.argsort(dim=-1, descending=True)
    g = torch.Generator().manual_seed(1)
    sampler = Sampler(V, 2, "cpu")
    proto = TreeDraft(tuple(range(K)), SHAPE)
    rank = torch.tensor(proto.ranks())
    out = torch.full((n, length), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    accepted = side = 0
    while (count < length).any():
        act = torch.nonzero(count < length).squeeze(1)
        m = act.numel()
        prev = out[act, (count[act] - 1).clamp_min(0)]
        prev = torch.where(count[act] == 0, PROMPT[-1], prev)
        tok = torch.zeros(m, K + 1, dtype=torch.int64)
        tok[:, 0] = prev
        q = torch.zeros(m, K, V)
        for i, p in enumerate(SHAPE, start=1):
            ctx = tok[:, p]
            q[:, i - 1] = q_rows[ctx]
            if source == "point":
                tok[:, i] = order[ctx, rank[i]]
                q[:, i - 1] = torch.nn.functional.one_hot(tok[:, i], V).float()
            else:
                tok[:, i] = torch.multinomial(q_rows[ctx], 1, generator=g).squeeze(1)
        lens = torch.randint(0, K + 1, (m,), generator=g).tolist()
        trees = [TreeDraft(tok[r, 1 : 1 + k].tolist(), SHAPE[:k]) for r, k in enumerate(lens)]
        tb = TreeBatch.from_trees(trees, "cpu", max_len=K)
        tb.probs = None if rule == "match" else q
        spec = TreeSampling.build(
            [params] * m, [1] * m, (act + 1000).tolist(), count[act].tolist(), tb, "cpu", with_uniforms=True
        )
        if rule == "accept_any":
            assert spec.uniforms is not None
            spec.uniforms.zero_()
        res = verify_tree(target[tok], tb, spec, sampler)
        accepted += int(res.num_accepted.sum())
        side += int((rank[res.path.clamp_min(0)] > 0).logical_and(res.path > 0).sum())
        for r, i in enumerate(act.tolist()):
            c = int(count[i])
            take = min(int(res.num_emitted[r]), length - c)
            out[i, c : c + take] = res.token_ids[r, :take]
            count[i] = c + take
    return out, accepted, side


def _pvalues(tokens: torch.Tensor, params: SP) -> tuple[float, float]:
    p = target_probs(tables(0)[0], params)
    first = p[PROMPT[-1]]
    pair = first[:, None] * p
    c1 = torch.bincount(tokens[:, 0], minlength=V)
    c2 = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    return chi2_pvalue(c1, first), chi2_pvalue(c2, pair)


PARAMS = {"t0.8": SP(temperature=0.8), "t1.3_topk5_topp0.9": SP(temperature=1.3, top_k=5, top_p=0.9)}


@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
@pytest.mark.parametrize(
    "source,rule", [("point", "match"), ("point", "reject"), ("q", "reject")], ids=["point", "point_q", "q"]
)
def test_tree_sampling_keeps_the_target_distribution(params, source, rule):
    """N = 12000 requests, 2 tokens each, significance ALPHA = 0.001; the trees' later siblings must
    be accepted often (the sibling rule is exercised, not only first children)."""
    tokens, accepted, side = _speculate(params, source, rule)
    p_first, p_pair = _pvalues(tokens, params)
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)
    assert accepted > 0.3 * N and side > 0.1 * N, (accepted, side)


@pytest.mark.parametrize("source", ["point", "q"])
def test_a_wrong_rule_fails_the_same_check(source):
    params = PARAMS["t0.8"]
    tokens, _, _ = _speculate(params, source, "accept_any")
    p_first, p_pair = _pvalues(tokens, params)
    assert p_first < ALPHA and p_pair < ALPHA, (p_first, p_pair)


def test_point_mass_trees_emit_the_plain_samplers_seeded_tokens():
    """Point-mass trees verified by matching the target's own seeded samples emit exactly what plain
    decoding emits (min_tokens bans per depth included), whatever the trees."""
    target, draft = tables(5)
    eos = 2
    target[:, eos] += 2.0
    params = SP(temperature=1.1, top_k=6, top_p=0.95, min_tokens=4)
    R, length = 24, 14
    sampler = Sampler(V, 2, "cpu")
    plain = plain_seeded_tokens(target, params, R, length, PROMPT[-1], eos)
    order = draft.argsort(dim=-1, descending=True)
    rank = TreeDraft(tuple(range(K)), SHAPE).ranks()
    got: list[list[int]] = [[] for _ in range(R)]
    accepted = 0
    while any(len(s) < length for s in got):
        act = [r for r in range(R) if len(got[r]) < length]
        trees, toks = [], []
        for r in act:
            t = [got[r][-1] if got[r] else PROMPT[-1]]
            for i, p in enumerate(SHAPE, start=1):
                t.append(int(order[t[p], rank[i]]))
            k = min(K, length - len(got[r]) - 1)
            trees.append(TreeDraft(t[1 : 1 + k], SHAPE[:k]))
            toks.append(t)
        tb = TreeBatch.from_trees(trees, "cpu", max_len=K)
        steps = [len(got[r]) for r in act]
        spec = TreeSampling.build(
            [params] * len(act), [1] * len(act), act, steps, tb, "cpu", eos_token_ids=[eos]
        )
        res = verify_tree(target[torch.tensor(toks)], tb, spec, sampler)
        accepted += int(res.num_accepted.sum())
        for i, r in enumerate(act):
            got[r] += res.token_ids[i, : int(res.num_emitted[i])].tolist()
    assert got == plain
    assert accepted > 0
    assert all(eos not in s[:4] for s in plain) and any(eos in s for s in plain)


# ---- the K/V move ----------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_compacting_move_puts_the_accepted_path_first(page_size):
    """After a tree step, positions kv_len..kv_len+a of each request hold the K/V its accepted nodes
    were written with; every other slot is unchanged."""
    g = torch.Generator().manual_seed(page_size)
    pool = KVPool(2, 64 * page_size, 2, 4, 4, torch.float32, "cpu", page_size)
    table = BlockTable(4, 40, "cpu", page_size)
    kv_lens, sizes = [5, 0, 9], [8, 4, 7]
    rows = []
    for kv, n in zip(kv_lens, sizes):
        row = table.alloc_row()
        assert table.cover(row, kv + n, pool)
        rows.append(row)
    table.flush()
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    k0, v0 = pool.k_cache.clone(), pool.v_cache.clone()
    paths = [[0, 2, 3, 7], [0, 1], [0, 3, 4, 5, 6]]  # the second: a chain's (nothing to move)
    Kp = max(sizes) - 1
    path = torch.full((3, Kp + 1), -1, dtype=torch.int64)
    for b, p in enumerate(paths):
        path[b, : len(p)] = torch.tensor(p)
    num_emitted = torch.tensor([len(p) for p in paths])
    src, dst = compact_moves(
        table.table, torch.tensor(rows), torch.tensor(kv_lens), path, num_emitted, page_size
    )
    assert src.shape == dst.shape == (3 * Kp,)
    move_kv([pool.k_cache, pool.v_cache], src, dst)
    written = set()
    for b, (row, kv, p) in enumerate(zip(rows, kv_lens, paths)):
        slots = table.slots(row, 0, kv + sizes[b])
        for d, node in enumerate(p):
            assert torch.equal(pool.k_cache[:, slots[kv + d]], k0[:, slots[kv + node]]), (b, d)
            assert torch.equal(pool.v_cache[:, slots[kv + d]], v0[:, slots[kv + node]]), (b, d)
            written.add(slots[kv + d])
    rest = torch.ones(pool.num_slots, dtype=torch.bool)
    rest[list(written)] = False
    assert torch.equal(pool.k_cache[:, rest], k0[:, rest]) and torch.equal(pool.v_cache[:, rest], v0[:, rest])


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query ``[Hq, D]`` over keys ``[L, Hkv, D]``: plain softmax attention, ``[Hq, Dv]``."""
    group = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(group, 1)) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v.repeat_interleave(group, 1))


def test_a_tree_step_end_to_end():
    """The protocol on the CPU ops: tree attention with TreeBatch's mask sees each node's path; the
    walk picks a path; after the compacting move, attention over ``kv_len + accepted + 1`` keys (the
    next step's view) is attention over the prefix plus the accepted path."""
    g = torch.Generator().manual_seed(9)
    page, Hq, Hkv, D = 4, 4, 2, 16
    pool = KVPool(1, 256, Hkv, D, D, torch.float32, "cpu", page)
    table = BlockTable(4, 64, "cpu", page)
    kv_lens = [6, 0, 11]
    trees = [
        TreeDraft((3, 4, 5, 6, 7), (0, 0, 1, 2, 2)),
        TreeDraft((1, 2), (0, 1)),
        TreeDraft((9,) * 6, SHAPE[:6]),
    ]
    tb = TreeBatch.from_trees(trees, "cpu")
    P = tb.max_len + 1
    rows = []
    for kv in kv_lens:
        rows.append(table.alloc_row())
        assert table.cover(rows[-1], kv + P, pool)
    table.flush()
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    k, v = pool.k_cache[0], pool.v_cache[0]
    k0, v0 = k.clone(), v.clone()
    q = torch.randn(len(trees) * P, Hq, D, generator=g)
    meta = (
        table.table,
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor([kv + P for kv in kv_lens], dtype=torch.int32),
    )
    indptr = torch.arange(len(trees) + 1, dtype=torch.int32) * P
    out = torch.ops.kiln.extend_attention(
        q, k, v, *meta, indptr, D**-0.5, page, -1, 0.0, None, None, tb.tree_mask()
    )
    slots = [table.slots(r, 0, kv + P) for r, kv in zip(rows, kv_lens)]
    for b, (t, kv) in enumerate(zip(trees, kv_lens)):
        parents = [-1, *t.parents]
        for i in range(t.size):
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            keys = slots[b][:kv] + [slots[b][kv + j] for j in reversed(path)]
            want = _dense(q[b * P + i], k[keys], v[keys], D**-0.5)
            torch.testing.assert_close(out[b * P + i], want, rtol=1e-5, atol=1e-5)
    # the target follows node 2 then node 4 in tree 0, node 1 in tree 1, nothing in tree 2
    target = torch.full((len(trees), P), 0)
    target[0, [0, 2, 4]] = torch.tensor([4, 6, 8])
    target[1, [0, 1]] = torch.tensor([1, 7])
    _, n, path = walk_matches(target, tb.ids, tb.parents, tb.lens)
    assert n.tolist() == [3, 2, 1] and path[0, :3].tolist() == [0, 2, 4] and path[1, :2].tolist() == [0, 1]
    move_kv(
        [pool.k_cache, pool.v_cache],
        *compact_moves(table.table, meta[1], torch.tensor(kv_lens), path, n, page),
    )
    qn = torch.randn(len(trees), Hq, D, generator=g)
    seq = torch.tensor([kv + a for kv, a in zip(kv_lens, n.tolist())], dtype=torch.int32)
    nxt = torch.ops.kiln.extend_attention(
        qn,
        k,
        v,
        meta[0],
        meta[1],
        seq,
        torch.arange(len(trees) + 1, dtype=torch.int32),
        D**-0.5,
        page,
        -1,
        0.0,
    )
    for b, kv in enumerate(kv_lens):
        keys = slots[b][:kv] + [slots[b][kv + j] for j in path[b, : int(n[b])].tolist()]
        torch.testing.assert_close(nxt[b], _dense(qn[b], k0[keys], v0[keys], D**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_verify_tree_runs_on_cuda_without_host_syncs():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    B, Vb = 8, 1000
    trees = [TreeDraft(torch.randint(0, Vb, (k,), generator=g).tolist(), SHAPE[:k]) for k in range(B)]
    tb = TreeBatch.from_trees(trees, dev, max_len=K)
    logits = torch.randn(B, K + 1, Vb, generator=g).to(dev)
    params = [SP(temperature=0.8, top_k=50, top_p=0.9, min_tokens=2, seed=b) for b in range(B)]
    q = torch.softmax(torch.randn(B, K, Vb, generator=g), -1).to(dev)
    sampler = Sampler(Vb, B + 1, dev)
    for probs in (None, q):
        tb.probs = probs
        spec = TreeSampling.build(
            params,
            list(range(1, B + 1)),
            list(range(B)),
            [0] * B,
            tb,
            dev,
            eos_token_ids=[0],
            with_uniforms=True,
        )
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = verify_tree(logits, tb, spec, sampler)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ((out.num_emitted >= 1) & (out.num_emitted <= tb.lens + 1)).all()


def test_tree_search_keeps_the_best_paths():
    """EAGLE-2's search: both root candidates expanded (width 2), the two best of the four at depth
    2 expanded, the tree the five best candidates of all depths by path probability."""
    t = TreeSearch(5, 2)
    assert t.depth == 3
    t.offer([[10, 11]], [[math.log(0.6), math.log(0.3)]])
    assert t.chunk() == ([10, 11], [-1, -1], [1, 1]) and t.frontier == [0, 1]
    t.offer([[20, 21], [30, 31]], [[math.log(0.9), math.log(0.05)], [math.log(0.5), math.log(0.4)]])
    # 20: .54, 21: .03, 30: .15, 31: .12 -> 20 and 30 expanded
    assert t.chunk() == ([10, 11, 20, 30], [-1, -1, 0, 1], [1, 1, 2, 2]) and t.frontier == [2, 3]
    t.offer([[40, 41], [50, 51]], [[math.log(0.9), math.log(0.05)], [math.log(0.5), math.log(0.4)]])
    assert t.frontier == []  # depth 3 is the last
    # 10 .6, 20 .54, 40 .486, 11 .3, 30 .15 (then 31 .12, 50 .075)
    assert t.tree() == TreeDraft((10, 11, 20, 30, 40), (0, 0, 1, 2, 3))


def test_tree_search_of_width_one_is_the_chain_and_ties_keep_parents():
    t = TreeSearch(3, 1)
    for tok in (7, 8, 9):
        t.offer([[tok]], [[0.0]])  # probability 1: every score ties with its parent's
    assert t.tree() == TreeDraft.chain([7, 8, 9])
    u = TreeSearch(3, 2)
    u.offer([[5, 6]], [[0.0, float("-inf")]])  # an id the head cannot draft is no candidate
    assert u.frontier == [0]
    u.offer([[7, 8]], [[-1.0, -2.0]])
    assert u.tree() == TreeDraft((5, 7, 8), (0, 1, 1))
    with pytest.raises(ValueError, match="nothing to expand"):
        u.offer([[9]], [[0.0]])
