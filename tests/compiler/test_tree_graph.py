"""Token trees through an exported graph (speculative tree verification, docs/speculative.md section 4):
a tiny Llama traced with the ``tree_mask`` input (compiler/context.py ``graph_inputs(tree=True)``)
verifies two requests' different draft trees over prefixes in a paged KV cache in one step; every
node's logits must equal those of its root-to-node path run as a plain chain (a graph traced
without the tree input, each path a separate prefill). CPU, float32, the reference ops.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import TINY

from kiln.compiler.build import _rope_spec
from kiln.compiler.config import load_config
from kiln.compiler.context import GRAPH_INPUTS, graph_inputs
from kiln.compiler.registry import model_class
from kiln.compiler.trace import CacheSpec, GraphModule, example_inputs, export_graph
from kiln.ops.attention.rope import rope_cos_sin_cache
from kiln.runtime.spec_tree import TreeBatch, TreeDraft

PAGE, MAX_BLOCKS, MAX_POS = 4, 8, 64
i32, i64 = torch.int32, torch.int64


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """(tree graph, plain graph, weights, cos_sin, cache spec, vocab) of a tiny random Llama."""
    root = tmp_path_factory.mktemp("tree_graph")
    transformers.LlamaConfig(
        **TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]
    ).save_pretrained(root)
    cfg = load_config(root)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32)
    gen = torch.Generator().manual_seed(7)
    # tiny_models.py's random draw: norms 1 +- 0.2, the rest std 0.08
    weights = {
        name: torch.randn(p.shape, generator=gen) * (0.2 if "norm" in name else 0.08) + ("norm" in name)
        for name, p in model.named_parameters()
    }
    hd = cfg.hidden_size // cfg.num_heads
    cache = CacheSpec(cfg.num_layers, cfg.num_kv_heads, hd, hd, torch.float32, PAGE)
    ex = example_inputs(
        2, 8, cache, cfg.rotary_dim, "cpu", max_blocks=MAX_BLOCKS, every_token=True, tree=True
    )
    assert ex["tree_mask"].tolist() == [1, 3, 7, 15] * 2  # the chain masks of two 4-token chunks
    tree = export_graph(model, weights, ex, PAGE).module()
    del ex["tree_mask"]
    plain = export_graph(model, weights, ex, PAGE).module()
    r = _rope_spec(cfg)
    cos_sin = rope_cos_sin_cache(r.rotary_dim, MAX_POS, r.base, r.scaling)
    return tree, plain, weights, cos_sin, cache, cfg.vocab_size


def test_graph_inputs_order():
    fp8 = torch.float8_e4m3fn
    assert graph_inputs(torch.float32) == GRAPH_INPUTS
    assert graph_inputs(torch.float32, aux=True, tree=True)[len(GRAPH_INPUTS) :] == (
        "tree_mask",
        "aux_hidden",
    )
    assert graph_inputs(fp8, aux=True, tree=True)[len(GRAPH_INPUTS) :] == (
        "k_scale",
        "v_scale",
        "tree_mask",
        "aux_hidden",
    )
    assert graph_inputs(fp8, True) == graph_inputs(fp8, aux=True, tree=False)  # build.py's call


class Pool:
    """A paged KV pool: request ``b`` owns block-table row ``rows[b]`` and ``MAX_BLOCKS`` pages of
    its own, scattered (slot 0, the padding sink, never used)."""

    def __init__(self, cache: CacheSpec, num_reqs: int, gen: torch.Generator):
        pages = 1 + torch.randperm(num_reqs * MAX_BLOCKS, generator=gen)
        self.block_table = pages.view(num_reqs, MAX_BLOCKS).to(i32)
        shape = (cache.num_layers, (num_reqs * MAX_BLOCKS + 1) * PAGE, cache.num_kv_heads)
        self.k = torch.zeros(*shape, cache.head_dim)
        self.v = torch.zeros(*shape, cache.v_head_dim)

    def slots(self, b: int, pos: torch.Tensor) -> torch.Tensor:
        return self.block_table[b, pos // PAGE].long() * PAGE + pos % PAGE

    def run(self, graph, weights, cos_sin, ids, positions, slots, lens, chunk, every, tree_mask=None):
        """One step of requests 0..B-1 with ``chunk[b]`` new tokens and KV lengths ``lens[b]``:
        the logits of every token (``every``) or of each request's last."""
        indptr = torch.tensor([0, *chunk], dtype=i32).cumsum(0).to(i32)
        logits_at = torch.arange(len(ids)) if every else indptr[1:].long() - 1
        args = [cos_sin, self.k, self.v, torch.tensor(ids, dtype=i64), positions, slots, self.block_table]
        args += [torch.arange(len(chunk), dtype=i32), torch.tensor(lens, dtype=i32), indptr, logits_at]
        args += [] if tree_mask is None else [tree_mask]
        with torch.no_grad():
            return graph(weights, *args)


def flat(lists: list[list[int]]) -> list[int]:
    return [x for xs in lists for x in xs]


def random_tree(n: int, vocab: int, gen: torch.Generator) -> TreeDraft:
    parents = [int(torch.randint(max(0, i - 3), i, (1,), generator=gen)) for i in range(1, n)]
    return TreeDraft(tuple(torch.randint(1, vocab, (n - 1,), generator=gen).tolist()), tuple(parents))


def path(tree: TreeDraft, i: int) -> list[int]:
    nodes = [i]
    while nodes[-1]:
        nodes.append(tree.parents[nodes[-1] - 1])
    return nodes[::-1]


def test_tree_step_equals_each_path_as_a_chain(graphs):
    tree_graph, plain_graph, weights, cos_sin, cache, vocab = graphs
    gen = torch.Generator().manual_seed(11)
    prefix = [5, 9]
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in prefix]
    roots = torch.randint(1, vocab, (2,), generator=gen).tolist()  # each request's newest accepted token
    trees = [random_tree(7, vocab, gen), random_tree(4, vocab, gen)]
    trees[0] = TreeDraft(trees[0].tokens, (0, 0, 1, 1, 2, 3))  # request 0 certainly branches
    batch = TreeBatch.from_trees(trees, "cpu")
    k1 = batch.max_len + 1  # nodes per chunk, padded (request 1's tail: padding nodes)

    # the tree step: prefill the prefixes (a plain step), then every node of both trees at once
    pool = Pool(cache, 2, gen)
    pos = [torch.arange(n) for n in prefix]
    slots = torch.cat([pool.slots(b, p) for b, p in enumerate(pos)])
    pool.run(plain_graph, weights, cos_sin, flat(prompts), torch.cat(pos), slots, prefix, prefix, False)
    ids = [[r, *t.tokens] + [0] * (k1 - t.size) for r, t in zip(roots, trees)]
    positions = batch.positions(torch.tensor(prefix)).reshape(-1)  # RoPE: prefix + depth
    slots = torch.cat([pool.slots(b, n + torch.arange(k1)) for b, n in enumerate(prefix)])  # by index
    lens = [n + k1 for n in prefix]
    step = (weights, cos_sin, flat(ids), positions, slots, lens, [k1, k1], True)
    logits = pool.run(tree_graph, *step, batch.tree_mask())  # [2 (K + 1), V]

    # the oracle: each node's path as a plain chain, every path a request of one prefill
    chains = [
        prompts[b] + [ids[b][j] for j in path(t, i)] for b, t in enumerate(trees) for i in range(t.size)
    ]
    oracle = Pool(cache, len(chains), gen)
    pos = [torch.arange(len(c)) for c in chains]
    slots = torch.cat([oracle.slots(b, p) for b, p in enumerate(pos)])
    n = [len(c) for c in chains]
    want = oracle.run(plain_graph, weights, cos_sin, flat(chains), torch.cat(pos), slots, n, n, False)
    got = torch.cat([logits[b * k1 : b * k1 + t.size] for b, t in enumerate(trees)])
    assert got.shape == want.shape == (sum(t.size for t in trees), vocab)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    # mutation: causal chunks (chain masks) give a branching node the wrong context
    chain = torch.tensor([(1 << (j + 1)) - 1 for _ in trees for j in range(k1)], dtype=i64)
    wrong = pool.run(tree_graph, *step, chain)
    bad = (wrong[:k1] - logits[:k1]).abs().amax(-1)  # request 0: node 2 (parent 0) sees node 1
    assert bad[0] == 0 and bad[2] > 1e-3, bad


def test_graph_module_binds_the_tail_by_name():
    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, input_ids, ctx):
            seen.update(tree=ctx.tree_mask, aux=ctx.aux_hidden)
            return input_ids

    gm = GraphModule(Probe(), 1, tail=("tree_mask", "aux_hidden"))
    mask, aux = torch.ones(3, dtype=i64), torch.zeros(3, 4)
    gm({}, *[torch.empty(0)] * 11, mask, aux)
    assert seen["tree"] is mask and seen["aux"] is aux
