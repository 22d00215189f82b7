"""Speculative decoding over token trees: the tree draft, lossless tree verification, the K/V move.

The chain core (runtime/speculative.py) verifies one line of drafts per request; a tree offers
several candidates per position (siblings), so more tokens are accepted per target step. The
protocol of one tree step for B requests, K = the padded number of draft nodes:

1. Drafts. Each request brings a :class:`TreeDraft`: ``n - 1 <= K`` draft nodes, node ``i``'s token
   and its parent (an earlier node; node 0, the root, is the request's newest accepted token). They
   travel padded as a :class:`TreeBatch` (``ids [B, K]``, ``parents [B, K]``, ``lens [B]``,
   ``depth [B, K + 1]``, optional ``probs [B, K, V]``: the distribution each node's token was
   drawn from).
2. Target forward. The request's chunk is its ``K + 1`` nodes in index order: node ``i``'s K/V are
   written to the slot of position ``kv_len + i`` (by index), RoPE at position ``kv_len + depth[i]``
   (:meth:`TreeBatch.positions`), and attention takes ``tree_mask`` (:meth:`TreeBatch.tree_mask`,
   ops/attention/extend.py): a node sees the prefix, its ancestors and itself. ``logits [B, K + 1,
   V]``, row ``i`` the target's next-token distribution after the request's sequence plus node
   ``i``'s path.
3. :func:`verify_tree` walks each tree from the root and returns the emitted tokens
   (``token_ids [B, K + 1]``, -1 past ``num_emitted``), ``num_emitted`` = accepted nodes + 1, and
   ``path [B, K + 1]``: the accepted nodes by depth (``path[b, 0] = 0``, -1 past ``num_emitted``).
   All on the device, no host sync.
4. :func:`compact_moves` + :func:`move_kv`: the accepted nodes are not a prefix of the written slots,
   so node ``path[d]``'s K/V moves from position ``kv_len + path[d]`` to ``kv_len + d``; then
   ``kv_len += num_emitted`` as for chains (the last emitted token's K/V is written next step).

Acceptance, walking from the root (at node ``c``, the children of ``c`` in index order):

* Greedy rows and point-mass drafts (``probs`` None: n-gram trees, argmax draft trees): the target's
  token at ``c`` is its argmax (greedy) or its sample with the plain sampler's noise for token
  number ``step + depth(c)`` (Gumbel keys ``row_keys(seed, step + depth)``); the walk moves to the
  first child carrying that token, else stops and emits it. For sampled rows this is recursive
  rejection sampling with point masses: child ``x1`` is accepted with probability ``p(x1)``; given
  a rejection the sample is ``p`` without ``x1``, renormalized, so ``x2`` is accepted with that
  residual's probability, and so on; when every child is rejected the emitted token is the sample
  from the final residual. As for chains, it emits exactly the tokens the plain sampler emits for
  the same seed and logits (whatever the tree).
* Drafts with distributions (``probs``: node ``j``'s token drawn from ``q_j``, siblings drawn
  independently given their parent, e.g. i.i.d. from the draft's distribution at the parent):
  SpecInfer's multi-draft rule. ``r = p_c``; for each child ``j`` in order: accept ``x_j`` if
  ``u_j * q_j(x_j) < r(x_j)`` (probability ``min(1, r/q)``), else ``r = normalize(max(0, r -
  q_j))`` (kept as it was when that is all zero: a rounding corner) and try the next; no child
  accepted: draw from ``r`` (the bonus token from ``p_c`` when ``c`` has no children). A one-hot
  ``q`` makes this the point-mass rule above (in law). Each step is standard rejection sampling of
  ``r`` by a proposal independent of the earlier ones, so the emitted token at each depth has the
  target's law (lossless). Siblings chosen *without* replacement (the draft's top-k, as EAGLE's
  trees) are not independent draws of the draft's distribution: pass them as point masses
  (``probs`` None or one-hot), which is lossless for any choice of distinct or repeated tokens.
  Uniforms: ``ACCEPT_STREAM``, counter ``step + depth - 1 + (rank << 32)`` (``rank``: the node's
  place among its siblings), so a chain-shaped tree uses the chain's uniforms and
  :func:`verify_tree` equals :func:`~kiln.runtime.speculative.verify` on it exactly.

``p`` goes through the sampler's transforms as in :func:`~kiln.runtime.speculative.verify`
(min_tokens bans per depth, temperature, top-k, top-p, min-p); penalties and structured outputs are
refused (``speculation_blocker``). The walk is one pass over the node index (a child's index is
above its parent's, so the children of the node reached are always still ahead): K vectorized
iterations per step, ``[B, V]`` work each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.ops.sampling.gumbel import argmax_rows, gumbel_argmax
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import (
    ACCEPT_STREAM,
    SpecSampling,
    SpeculativeError,
    counter_keys,
    h2d,
    ngram_continuation,
    ngram_occurrences,
    stream_seeds,
    uniforms_from_keys,
)

MAX_TREE_NODES = 64  # nodes per request's chunk (root included): the attention's int64 bitmask

# ---- the tree --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeDraft:
    """One request's draft tree of ``n`` nodes. tokens: the tokens of nodes ``1..n-1``. parents:
    ``parents[i - 1]`` is node ``i``'s parent, in ``0..i-1`` (node 0 is the root: the request's
    newest accepted token, not a draft)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if len(self.tokens) != len(self.parents):
            raise SpeculativeError(
                f"TreeDraft: {len(self.tokens)} tokens but {len(self.parents)} parents (one per draft node)"
            )
        if len(self.tokens) + 1 > MAX_TREE_NODES:
            raise SpeculativeError(
                f"TreeDraft: {len(self.tokens) + 1} nodes, at most {MAX_TREE_NODES} (the attention bitmask)"
            )
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise SpeculativeError(
                    f"TreeDraft: node {i}'s parent is {p}; it must be an earlier node (0..{i - 1})"
                )

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TreeDraft:
        """A chain of drafts: node ``i``'s parent is node ``i - 1``."""
        return cls(tuple(tokens), tuple(range(len(tokens))))

    @property
    def size(self) -> int:
        """Nodes, root included."""
        return len(self.tokens) + 1

    def depths(self) -> list[int]:
        """Each node's depth (the root 0)."""
        d = [0]
        for p in self.parents:
            d.append(d[p] + 1)
        return d

    def ranks(self) -> list[int]:
        """Each node's place among its parent's children, in index order (the root 0)."""
        seen: dict[int, int] = {}
        r = [0]
        for p in self.parents:
            r.append(seen.get(p, 0))
            seen[p] = r[-1] + 1
        return r

    def masks(self) -> list[int]:
        """Each node's ancestor-or-self bitmask (bit ``j``: node ``j``), as signed int64 values."""
        m = [1]
        for i, p in enumerate(self.parents, start=1):
            m.append(m[p] | (1 << i))
        return [x - (1 << 64) if x >= 1 << 63 else x for x in m]


@dataclass
class TreeBatch:
    """Draft trees of B requests padded to ``K`` draft nodes, on the device.

    ids, parents: [B, K] int64: node ``j + 1``'s token and parent (padding: token 0, parent -1).
    lens: [B] int64 draft nodes. depth: [B, K + 1] int64 (padding nodes: depth 0). mask: [B, K + 1]
    int64 ancestor bitmasks (padding nodes: their own bit). probs: [B, K, >= V] float32 or None,
    as :class:`~kiln.runtime.speculative.DraftBatch`'s. depth_host, rank_host: the same on the host
    ([B, K + 1] numpy; rank for the acceptance uniforms)."""

    ids: torch.Tensor
    parents: torch.Tensor
    lens: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    depth_host: np.ndarray
    rank_host: np.ndarray
    probs: torch.Tensor | None = None

    @property
    def max_len(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def from_trees(
        cls,
        trees: Sequence[TreeDraft],
        device: torch.device | str,
        max_len: int | None = None,
        stager: Any = None,
    ) -> TreeBatch:
        """From host trees, in one copy; ``max_len`` pads further (a graph bucket's K)."""
        k = max((t.size - 1 for t in trees), default=0) if max_len is None else max_len
        if k + 1 > MAX_TREE_NODES:
            raise SpeculativeError(f"TreeBatch: max_len {k} + 1 nodes exceeds {MAX_TREE_NODES}")
        B = len(trees)
        host = torch.zeros(5, B, k + 1, dtype=torch.int64)  # ids, parents, depth, mask, lens
        host[1] = -1
        depth = np.zeros((B, k + 1), dtype=np.int64)
        rank = np.zeros((B, k + 1), dtype=np.int64)
        for b, t in enumerate(trees):
            n = t.size
            if n - 1 > k:
                raise SpeculativeError(f"drafts: request {b} has {n - 1} draft nodes, more than max_len {k}")
            depth[b, :n] = t.depths()
            rank[b, :n] = t.ranks()
            host[0, b, : n - 1] = torch.tensor(t.tokens, dtype=torch.int64)
            host[1, b, : n - 1] = torch.tensor(t.parents, dtype=torch.int64)
            host[3, b, :n] = torch.tensor(t.masks(), dtype=torch.int64)
            host[4, b, 0] = n - 1
        host[2] = torch.from_numpy(depth)
        pad = torch.arange(k + 1, dtype=torch.int64)
        host[3] = torch.where(pad[None, :] < host[4, :, :1] + 1, host[3], _bit(pad)[None, :])
        dev = h2d(host, torch.device(device), stager)
        return cls(
            ids=dev[0, :, :k],
            parents=dev[1, :, :k],
            lens=dev[4, :, 0],
            depth=dev[2],
            mask=dev[3],
            depth_host=depth,
            rank_host=rank,
        )

    def tree_mask(self) -> torch.Tensor:
        """``[B (K + 1)]`` int64: extend attention's ``tree_mask`` for chunks of ``K + 1`` tokens."""
        return self.mask.reshape(-1)

    def positions(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """``[B, K + 1]``: each node's RoPE position, ``kv_lens[b] + depth`` (its K/V slot is that of
        position ``kv_lens[b] + node``)."""
        return kv_lens.long()[:, None] + self.depth


def _bit(j: torch.Tensor) -> torch.Tensor:
    """``1 << j`` as int64 for ``j`` in 0..63 (bit 63: the sign bit)."""
    return torch.where(j == 63, torch.tensor(-(1 << 63)), torch.ones_like(j) << j.clamp(max=62))


# ---- n-gram trees ----------------------------------------------------------------------------------

NGRAM_TREE_SCAN = 64  # occurrences looked at (latest first) for a tree's distinct continuations


def ngram_tree(
    tokens: np.ndarray, num_nodes: int, ngram_max: int, ngram_min: int, branches: int
) -> TreeDraft:
    """An n-gram draft tree for the sequence ``tokens`` (prompt and output so far): the
    continuations of the occurrences of its longest matching suffix (the lookup of
    :func:`~kiln.runtime.speculative.propose_ngram`), latest occurrence first, up to ``branches``
    distinct ones (of the latest :data:`NGRAM_TREE_SCAN` occurrences), merged into a trie of at most
    ``num_nodes`` draft nodes. The trie is filled depth by depth, each depth's nodes in the order of
    preference of the continuations that reach them (siblings in order of preference; shared
    prefixes cost one node), so every branch gets about the same depth. With ``branches`` 1 (or a
    single distinct continuation) it is :func:`~kiln.runtime.speculative.propose_ngram`'s chain."""
    seq = np.asarray(tokens)
    if num_nodes <= 0:
        return TreeDraft((), ())
    ends = ngram_occurrences(seq, ngram_max, ngram_min)
    conts: list[list[int]] = []
    for end in ends[::-1][:NGRAM_TREE_SCAN]:
        c = ngram_continuation(seq, int(end), num_nodes).tolist()
        if c not in conts:
            conts.append(c)
            if len(conts) == branches:
                break
    toks: list[int] = []
    parents: list[int] = []
    at = [0] * len(conts)  # each continuation's node so far (-1: out of room)
    child: dict[tuple[int, int], int] = {}
    for d in range(num_nodes):
        for i, c in enumerate(conts):
            if at[i] < 0:
                continue
            node = child.get((at[i], c[d]))
            if node is None:
                if len(toks) == num_nodes:
                    at[i] = -1
                    continue
                toks.append(c[d])
                parents.append(at[i])
                node = child[(at[i], c[d])] = len(toks)
            at[i] = node
    return TreeDraft(tuple(toks), tuple(parents))


class TreeSearch:
    """A draft head's tree for one request, searched as EAGLE-2 does (on the host): ``width``
    candidates per expanded node, the ``width`` best candidates of each depth expanded, and the tree
    the ``num_nodes`` best candidates of all depths, scored by their path's summed log-probability.

    Protocol: :meth:`offer` the head's top ``width`` tokens and log-probabilities at the root (the
    catch-up's logits), then at each node of :attr:`frontier` (the head's tree step over
    :meth:`chunk`), until :attr:`frontier` is empty (after ``depth = ceil(num_nodes / width)``
    depths); :meth:`tree` is the draft. A candidate's score is at most its parent's and ties go to
    the shallower one, so the best ``num_nodes`` hold every selected node's parent (a tree). With
    ``width`` 1 it is the head's greedy chain."""

    def __init__(self, num_nodes: int, width: int):
        self.num_nodes, self.width = num_nodes, width
        self.depth = -(-num_nodes // width) if num_nodes > 0 else 0
        # candidates: (score, depth, token, parent candidate or -1 for the root)
        self.cands: list[tuple[float, int, int, int]] = []
        self.expanded: list[int] = []  # the candidates the head runs (:meth:`chunk`), in order
        self.frontier: list[int] = []  # positions in ``expanded`` whose children are wanted next

    def offer(self, tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]) -> None:
        """Candidates: ``tokens[i]`` with ``logprobs[i]`` under the ``i``-th node of
        :attr:`frontier` (the root when nothing is expanded yet); then the next frontier."""
        if self.cands and not self.frontier:
            raise ValueError("TreeSearch.offer: nothing to expand (the search is over: call tree())")
        parents = [self.expanded[f] for f in self.frontier] if self.expanded else [-1]
        new: list[int] = []
        for parent, toks, lps in zip(parents, tokens, logprobs, strict=True):
            base, depth = (0.0, 1) if parent < 0 else (self.cands[parent][0], self.cands[parent][1] + 1)
            for t, lp in zip(toks, lps):
                if lp > float("-inf"):  # not an id the head cannot draft (nor a NaN row)
                    new.append(len(self.cands))
                    self.cands.append((base + lp, depth, int(t), parent))
        self.frontier = []
        if new and self.cands[new[0]][1] < self.depth:
            best = sorted(new, key=lambda c: -self.cands[c][0])[: self.width]
            self.frontier = list(range(len(self.expanded), len(self.expanded) + len(best)))
            self.expanded += best

    def chunk(self) -> tuple[list[int], list[int], list[int]]:
        """The expanded nodes as the head's tree step runs them: tokens, each one's parent (a
        position in this list, -1 for the root) and depth (1 under the root)."""
        where = {c: i for i, c in enumerate(self.expanded)}
        cs = [self.cands[c] for c in self.expanded]
        return [c[2] for c in cs], [where.get(c[3], -1) for c in cs], [c[1] for c in cs]

    def tree(self) -> TreeDraft:
        """The ``num_nodes`` best candidates as a draft tree (by depth, best first in a depth)."""
        ranked = sorted(range(len(self.cands)), key=lambda c: (-self.cands[c][0], self.cands[c][1], c))
        chosen = sorted(ranked[: self.num_nodes], key=lambda c: (self.cands[c][1], -self.cands[c][0], c))
        node = {c: i + 1 for i, c in enumerate(chosen)}
        parents = [0 if self.cands[c][3] < 0 else node[self.cands[c][3]] for c in chosen]
        return TreeDraft(tuple(self.cands[c][2] for c in chosen), tuple(parents))


def branching(tree: TreeDraft) -> bool:
    """Whether some node of ``tree`` has two children or more (not a chain)."""
    return len(set(tree.parents)) < len(tree.parents)


# ---- sampling inputs -------------------------------------------------------------------------------


def tree_uniforms(
    seeds: Sequence[int], steps: Sequence[int], depth: np.ndarray, rank: np.ndarray
) -> np.ndarray:
    """``[B, K]`` float32: the acceptance uniform of draft node ``j + 1`` of each request, from the
    ``ACCEPT_STREAM`` keys at counter ``step + depth - 1 + (rank << 32)`` (rank-0 nodes: the chain's
    uniform of the same position). ``depth``/``rank``: ``[B, K + 1]`` (:class:`TreeBatch`'s)."""
    st = np.array(steps, dtype=np.uint64)[:, None]
    counters = (
        st
        + (depth[:, 1:].astype(np.uint64) - np.uint64(1))
        + (rank[:, 1:].astype(np.uint64) << np.uint64(32))
    )
    return uniforms_from_keys(counter_keys(stream_seeds(seeds, ACCEPT_STREAM), counters))


@dataclass
class TreeSampling:
    """The sampling tensors of a tree verify step: ``spec`` is the chain's :class:`SpecSampling` over
    ``K + 1`` positions (depths), ``keys`` [B, K + 1, 2] each node's Gumbel keys (its depth's) or
    None when every row is greedy, ``uniforms`` [B, K] each draft node's acceptance uniform or None."""

    spec: SpecSampling
    keys: torch.Tensor | None
    uniforms: torch.Tensor | None

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        rows: Sequence[int],
        seeds: Sequence[int],
        steps: Sequence[int],
        trees: TreeBatch,
        device: torch.device | str,
        *,
        eos_token_ids: Sequence[int] = (),
        with_uniforms: bool = False,
        stager: Any = None,
    ) -> TreeSampling:
        """Host work of one tree verify step (arguments as ``SpecSampling.build``'s; the trees
        give K and the depths)."""
        P = trees.max_len + 1
        spec = SpecSampling.build(
            params_list, rows, seeds, steps, P, device, eos_token_ids=eos_token_ids, stager=stager
        )
        B = spec.size
        keys = None
        if not spec.batch.all_greedy:
            idx = trees.depth[:, :, None].expand(B, P, 2)
            keys = spec.batch.keys.view(B, P, 2).gather(1, idx)
        uniforms = None
        if with_uniforms:
            u = tree_uniforms(seeds, steps, trees.depth_host, trees.rank_host)
            uniforms = h2d(torch.from_numpy(u), torch.device(device), stager)
        return cls(spec, keys, uniforms)


@dataclass
class TreeVerifyOutput:
    """token_ids: [B, K + 1] int64, emitted tokens then -1. num_emitted: [B] int64, accepted nodes
    + 1. path: [B, K + 1] int64, the accepted nodes by depth (``path[:, 0] = 0``), then -1. With
    logprobs asked: logprobs [B, K + 1], top_ids / top_logprobs [B, K + 1, N] of the emitted tokens
    (each from its node's row: emitted token ``d`` is predicted by node ``path[d]``); junk past
    num_emitted."""

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    path: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_emitted - 1


# ---- acceptance ------------------------------------------------------------------------------------


def _finish(
    hits: torch.Tensor, ids: torch.Tensor, final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the accepted nodes ``hits [B, K]`` (node ``j + 1`` accepted; they form a root path) and
    the final token ``final [B]``: (token_ids, num_emitted, path), each ``[B, K + 1]`` but the count."""
    B, K = ids.shape
    dev = ids.device
    a = hits.long().sum(dim=1)  # [B]
    node = torch.arange(1, K + 1, device=dev).expand(B, K)
    order = torch.where(hits, node, K + 1).sort(dim=1).values  # accepted nodes first, by index = depth
    d = torch.arange(K + 1, device=dev)[None, :]
    path = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=dev), order], dim=1)
    path = path.masked_fill(d > a[:, None], -1)
    toks = ids.gather(1, (order - 1).clamp(max=K - 1)) if K else ids  # [B, K]
    toks = torch.cat([toks, toks.new_zeros(B, 1)], dim=1)
    token_ids = torch.where(d < a[:, None], toks, final[:, None])
    return token_ids.masked_fill(d > a[:, None], -1), a + 1, path


def walk_matches(
    target_ids: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact-match walk (greedy rows; point-mass drafts against the target's own samples).

    target_ids: [B, K + 1] the target's token at each node. ids, parents: [B, K] (node ``j + 1``'s).
    lens: [B]. From the root, move to the first child whose token is the target's token at the
    current node; stop where none is. Returns (token_ids, num_emitted, path) as
    :class:`TreeVerifyOutput`'s: the accepted nodes' tokens, then the target's token at the last."""
    B, K = ids.shape
    cur = torch.zeros(B, dtype=torch.int64, device=ids.device)
    want = target_ids[:, 0]
    hits = []
    for j in range(K):
        hit = (parents[:, j] == cur) & (lens > j) & (ids[:, j] == want)
        cur = torch.where(hit, j + 1, cur)
        want = torch.where(hit, target_ids[:, j + 1], want)
        hits.append(hit)
    hit_t = torch.stack(hits, 1) if hits else torch.zeros(B, 0, dtype=torch.bool, device=ids.device)
    return _finish(hit_t, ids, want)


def tree_rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    ids: torch.Tensor,
    parents: torch.Tensor,
    lens: torch.Tensor,
    uniforms: torch.Tensor,
    keys: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over siblings (the module docstring).

    p: [B, K + 1, V] target probabilities at each node. q: [B, K, V], node ``j + 1``'s token drawn
    from ``q[:, j]``. ids, parents: [B, K]. lens: [B]. uniforms: [B, K] in (0, 1). keys: [B, K + 1, 2]
    each node's Gumbel keys (the final draw uses the last accepted node's). Returns (token_ids,
    num_emitted, path) as :func:`walk_matches`."""
    B, K1 = p.shape[:2]
    cur = torch.zeros(B, dtype=torch.int64, device=p.device)
    r = p[:, 0]  # [B, V] the residual at the current node
    hits = []
    for j in range(K1 - 1):
        child = (parents[:, j] == cur) & (lens > j)
        x = ids[:, j : j + 1]
        qj = q[:, j]
        acc = child & (uniforms[:, j] * qj.gather(1, x).squeeze(1) < r.gather(1, x).squeeze(1))
        res = (r - qj).clamp_min(0.0)
        total = res.sum(dim=1, keepdim=True)
        res = torch.where(total > 0, res / total.clamp_min(1e-30), r)
        r = torch.where((child & ~acc)[:, None], res, r)
        r = torch.where(acc[:, None], p[:, j + 1], r)
        cur = torch.where(acc, j + 1, cur)
        hits.append(acc)
    kc = keys.gather(1, cur[:, None, None].expand(B, 1, 2)).squeeze(1)  # [B, 2]
    final = gumbel_argmax(torch.log(r).contiguous(), kc)
    hit_t = torch.stack(hits, 1) if hits else torch.zeros(B, 0, dtype=torch.bool, device=p.device)
    return _finish(hit_t, ids, final)


def verify_tree(
    logits: torch.Tensor, trees: TreeBatch, spec: TreeSampling, sampler: Sampler
) -> TreeVerifyOutput:
    """The emitted tokens of a tree verify step (module docstring).

    logits: [>= B, >= K + 1, >= V], row ``i`` node ``i``'s (float32 or cast to it; columns past the
    sampler's vocabulary ignored). trees: the step's :class:`TreeBatch`. spec: built for the same
    requests and trees. sampler: the engine's (its ``filter_logits``)."""
    ss = spec.spec
    B, P, V = ss.size, ss.positions, sampler.vocab_size
    K = P - 1
    if tuple(trees.ids.shape) != (B, K):
        raise SpeculativeError(
            f"verify_tree: trees are {tuple(trees.ids.shape)}, the sampling batch ({B}, {K})"
        )
    sb = ss.batch
    raw = logits[:B, :P, :V].reshape(B * P, V)
    if raw.dtype != torch.float32:
        raw = raw.float()
    x = raw
    if sb.ban is not None:  # bans by position (depth) -> by node
        banned = torch.zeros(B * P, V, dtype=torch.bool, device=x.device)
        banned = banned.index_put(sb.ban, torch.ones(1, dtype=torch.bool, device=x.device))
        banned = banned.view(B, P, V).gather(1, trees.depth[:, :, None].expand(B, P, V)).view(B * P, V)
        x = x.masked_fill(banned, float("-inf"))
    greedy_ids = argmax_rows(x.contiguous()) if sb.any_greedy else None
    if sb.all_greedy:
        assert greedy_ids is not None
        token_ids, n, path = walk_matches(greedy_ids.view(B, P), trees.ids, trees.parents, trees.lens)
    else:
        assert spec.keys is not None
        nb = dataclasses.replace(sb, keys=spec.keys.reshape(B * P, 2), ban=None)
        filt = sampler.filter_logits(x, nb)
        if trees.probs is None:
            sampled = gumbel_argmax(filt, nb.keys)
            if greedy_ids is not None:
                sampled = torch.where(sb.greedy, greedy_ids, sampled)
            token_ids, n, path = walk_matches(sampled.view(B, P), trees.ids, trees.parents, trees.lens)
        else:
            if spec.uniforms is None:
                raise SpeculativeError(
                    "verify_tree: trees with probabilities need TreeSampling built with_uniforms"
                )
            probs = torch.softmax(filt, dim=-1)
            if greedy_ids is not None:
                hot = torch.zeros_like(probs).scatter_(1, greedy_ids[:, None], 1.0)
                probs = torch.where(sb.greedy[:, None], hot, probs)
            token_ids, n, path = tree_rejection_sample(
                probs.view(B, P, V),
                trees.probs[:, :, :V].float(),
                trees.ids,
                trees.parents,
                trees.lens,
                spec.uniforms,
                spec.keys,
            )
    out = TreeVerifyOutput(token_ids=token_ids, num_emitted=n, path=path)
    if sb.num_logprobs is not None:
        lp = torch.log_softmax(raw, dim=-1).view(B, P, V)
        lp = lp.gather(1, path.clamp_min(0)[:, :, None].expand(B, P, V))  # [B, P, V] by emitted index
        top = lp.topk(min(sb.num_logprobs, V), dim=-1)
        out.logprobs = lp.gather(2, token_ids.clamp_min(0)[:, :, None]).squeeze(2)
        out.top_logprobs, out.top_ids = top.values, top.indices
    return out


# ---- the K/V move ----------------------------------------------------------------------------------


def compact_moves(
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    path: torch.Tensor,
    num_emitted: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of the compacting move after a tree step: ``(src, dst)`` ``[B * K]`` int64, entry
    ``(b, d - 1)`` moving request ``b``'s accepted node ``path[b, d]`` from the slot of position
    ``kv_lens[b] + path[b, d]`` to that of ``kv_lens[b] + d``, for ``1 <= d < num_emitted[b]``;
    entries with nothing to move (past the accepted nodes, or a node already in place) are
    ``0 -> 0``, the pool's sink slot. Fixed shapes, no host sync. block_table ``[R, M]``, req_rows,
    kv_lens, num_emitted ``[B]``, path ``[B, K + 1]`` (:class:`TreeVerifyOutput`'s)."""
    B, K1 = path.shape
    dev = path.device
    d = torch.arange(1, K1, device=dev)[None, :]  # [1, K]
    node = path[:, 1:]
    move = (d < num_emitted[:, None]) & (node != d)
    base = kv_lens.long()[:, None]
    rows = req_rows.long()[:, None].expand(B, K1 - 1)

    def slot(pos: torch.Tensor) -> torch.Tensor:
        pos = torch.where(move, pos, 0)
        page = block_table[rows, pos // page_size].long()
        return torch.where(move, page * page_size + pos % page_size, 0)

    return slot(base + node.clamp_min(0)).reshape(-1), slot(base + d).reshape(-1)


def move_kv(caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slot ``src[i]`` to slot ``dst[i]`` in each cache, in place: the pool's ``[L, S, ...]``
    tensors (runtime/kv_pool.py: ``k_cache``, ``v_cache`` and, with FP8, their scales), every layer
    at once. All sources are read before any destination is written (a slot may be both)."""
    for cache in caches:
        cache.index_copy_(1, dst, cache.index_select(1, src))
