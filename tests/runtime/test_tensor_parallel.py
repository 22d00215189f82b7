"""Tensor parallelism on CPU: a ``kiln compile --tp N`` artifact run by N processes over gloo
(torch.distributed), each with its rank's pack and the same graph, gives the logits and greedy tokens
of the tp=1 artifact of the same checkpoint (float32). MoE checkpoints also with expert parallelism
(``--ep M``): each rank computes its experts' share (ops/moe/expert_map.py), one all-reduce sums them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mtp_checkpoints import V as MTP_VOCAB
from mtp_checkpoints import make_mtp_checkpoint
from tiny_models import make_checkpoint
from tiny_moe_models import make_moe_checkpoint

from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.direct import DirectRunner
from kiln.runtime.loader import load_model

BASE = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=64, chunk_size=32)
PROMPTS = [[5, 17, 33, 9, 120, 7], [250, 3, 3, 41], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
STEPS = 5


def run_greedy(runner: DirectRunner) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill PROMPTS, then STEPS greedy decode steps: (the prefill logits, each prompt's tokens)."""
    first = runner.prefill(PROMPTS).float()
    logits, tokens = first, [[] for _ in PROMPTS]
    for _ in range(STEPS):
        ids = logits.argmax(-1).tolist()
        for seq, t in zip(tokens, ids, strict=True):
            seq.append(t)
        logits = runner.decode(ids).float()
    return first, tokens


def _rank_main(rank: int, world: int, arts: list[str], init: str, out: str) -> None:
    """One rank of a group of ``world``: each artifact of ``arts`` in turn (one group, one process
    start for all of them), its prefill logits and greedy tokens saved as ``{out}/{i}-rank{rank}.pt``."""
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tiny_models for the spawned interpreter
    from kiln.ops.common.collective import set_tp_group

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        set_tp_group(dist.group.WORLD)
        for i, art in enumerate(arts):
            runner = DirectRunner(art, device="cpu", model=load_model(art, "cpu", rank=rank))
            first, tokens = run_greedy(runner)
            torch.save({"logits": first, "tokens": tokens}, f"{out}/{i}-rank{rank}.pt")
        dist.barrier()  # every rank's results are saved
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without closing the group: gloo's teardown at exit aborted a rank now and then
    # ("terminate called without an active exception") after every result was saved.
    os._exit(0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    for name in ("llama-untied", "qwen3-qknorm", "llama-tied"):
        make_checkpoint(root / name, name, seed=3)
    for name in ("qwen3-moe", "mixtral"):  # 16 experts top-4 with a dense layer; 8 experts top-2
        make_moe_checkpoint(root / name, name, seed=3)
    return root


# (checkpoint, tp, ep) per world size, each world's artifacts run by one group of processes. Qwen3
# (QK-norm) at tp 2 and Qwen3-MoE at tp 2, ep 2 also run through the engine below. MoE: ep 1 splits
# each expert's intermediate dim over the ranks (router replicated, one all-reduce after the block);
# ep 2 gives each half of the ranks half of the experts (at tp 4 split over two ranks each).
LAYOUTS = {
    2: [("llama-untied", 2, 1), ("qwen3-moe", 2, 1), ("qwen3-moe", 2, 2), ("mixtral", 2, 2)],
    4: [("llama-tied", 4, 1), ("qwen3-moe", 4, 2)],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_tp_ranks_match_one_rank(checkpoints, tmp_path, world):
    arts, refs = [], {}
    for name, tp, ep in LAYOUTS[world]:
        if name not in refs:
            compile_model(checkpoints / name, tmp_path / f"{name}-tp1", CompileOptions(**BASE), verbose=False)
            refs[name] = run_greedy(DirectRunner(str(tmp_path / f"{name}-tp1"), device="cpu"))
        art = tmp_path / f"{name}-tp{tp}-ep{ep}"
        compile_model(checkpoints / name, art, CompileOptions(**BASE, tp=tp, ep=ep), verbose=False)
        arts.append(str(art))
    mp.spawn(_rank_main, args=(world, arts, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    for i, (name, tp, ep) in enumerate(LAYOUTS[world]):
        ref_logits, ref_tokens = refs[name]
        where = f"{name} at tp {tp}, ep {ep}"
        for rank in range(world):  # every rank ends with the whole logits
            got = torch.load(tmp_path / f"{i}-rank{rank}.pt")
            assert got["tokens"] == ref_tokens, f"{where}, rank {rank}"
            torch.testing.assert_close(
                got["logits"], ref_logits, rtol=1e-4, atol=1e-4, msg=lambda m, w=where: f"{w}: {m}"
            )


@pytest.fixture(scope="module")
def tp2_arts(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-engine")
    compile_model(checkpoints / "qwen3-qknorm", root / "tp1", CompileOptions(**BASE), verbose=False)
    compile_model(checkpoints / "qwen3-qknorm", root / "tp2", CompileOptions(**BASE, tp=2), verbose=False)
    return root / "tp1", root / "tp2"


def test_engine_runs_a_tp_artifact_on_follower_ranks(tp2_arts):
    """``LLM(ART)`` of a --tp 2 artifact starts the second rank as a process that mirrors each step
    (runtime/tensor_parallel.py): greedy and seeded sampled tokens equal the tp=1 engine's, with
    chunked prefill (prompts past the chunk) and the prefix cache. With overlap (the default), the
    greedy decode steps take their ids from each rank's own argmax (the step wire's flag) and the
    sampled ones from the host."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    tp1, tp2 = tp2_arts
    prompts = [p * 6 for p in PROMPTS] + [PROMPTS[0] * 6 + [8, 9]]  # past the 32-token chunk; a shared prefix
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
    ]
    ref_llm = LLM(str(tp1), device="cpu")
    expect = [[o.token_ids for o in ref_llm.generate(prompts, p)] for p in params]
    llm = LLM(str(tp2), device="cpu")
    try:
        assert llm.engine.ranks is not None and len(llm.engine.ranks.procs) == 1
        assert llm.engine.opts.overlap
        got = [[o.token_ids for o in llm.generate(prompts, p)] for p in params]
        assert got == expect
        assert llm.engine.runner.ids_in_place > 0  # greedy steps sent as the argmax flag
        llm.engine.check_integrity()
    finally:
        llm.engine.close()
    assert not llm.engine.ranks.procs[0].is_alive()


def test_engine_runs_an_expert_parallel_moe_artifact(checkpoints, tmp_path):
    """``LLM(ART)`` of a Qwen3-MoE ``--tp 2 --ep 2`` artifact (each rank holds 8 of the 16 experts):
    greedy tokens equal the tp=1 engine's, prompts past the chunk and a shared prefix included."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    ckpt = checkpoints / "qwen3-moe"
    compile_model(ckpt, tmp_path / "tp1", CompileOptions(**BASE), verbose=False)
    compile_model(ckpt, tmp_path / "ep2", CompileOptions(**BASE, tp=2, ep=2), verbose=False)
    prompts = [p * 6 for p in PROMPTS] + [PROMPTS[0] * 6 + [8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expect = [o.token_ids for o in LLM(str(tmp_path / "tp1"), device="cpu").generate(prompts, params)]
    llm = LLM(str(tmp_path / "ep2"), device="cpu")
    try:
        assert llm.engine.ranks is not None and len(llm.engine.ranks.procs) == 1
        assert [o.token_ids for o in llm.generate(prompts, params)] == expect
    finally:
        llm.engine.close()


def test_a_dead_rank_ends_the_run_with_an_error(tp2_arts):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.runtime.tensor_parallel import TensorParallelError

    llm = LLM(str(tp2_arts[1]), device="cpu")
    try:
        follower = llm.engine.ranks.procs[0]
        follower.kill()
        follower.join(timeout=30)
        with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] exited"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        llm.engine.close()


def test_a_hung_rank_fails_the_step_after_the_group_timeout(tp2_arts):
    """A follower that stops answering (SIGSTOP: alive, silent) fails rank 0's next collective
    after ``tp_timeout`` seconds with a TensorParallelError, instead of waiting forever."""
    import os
    import signal
    import time

    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.runtime.tensor_parallel import TensorParallelError

    llm = LLM(str(tp2_arts[1]), device="cpu", tp_timeout=3)
    follower = llm.engine.ranks.procs[0]
    try:
        os.kill(follower.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor-parallel"):
            llm.generate([PROMPTS[0] * 4], SamplingParams(max_tokens=4, temperature=0.0))
        assert time.monotonic() - t0 < 60  # the 3 s group timeout, not a hang
    finally:
        follower.kill()
        llm.engine.close()


def test_compile_warms_up_as_one_rank_beside_a_live_group(checkpoints, tmp_path):
    """A compile in a process whose tensor-parallel group is set (one that serves a --tp engine)
    warms its graphs up as one rank: they never touch that group."""
    from kiln.ops.common.collective import set_tp_group, tp_world

    class Untouchable:  # a group any collective or rank query fails on
        def __getattr__(self, name):
            raise AssertionError(f"the compile's warm-up used the serving group ({name})")

    group = Untouchable()
    set_tp_group(group)
    try:
        compile_model(
            checkpoints / "llama-untied", tmp_path / "art", CompileOptions(**BASE, tp=2), verbose=False
        )
        with pytest.raises(ValueError, match="process group"):
            tp_world()  # the group is back in place after the compile (without one: (0, 1))
    finally:
        set_tp_group(None)


def test_speculative_verify_steps_run_on_every_rank(checkpoints, tmp_path):
    """n-gram speculation on a --tp 2 artifact with verify graphs: each verify step goes to the
    follower on the step wire (kind VERIFY) and runs there too; greedy and seeded tokens equal the
    tp=1 engine's without speculation."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    name = "qwen3-qknorm"
    compile_model(checkpoints / name, tmp_path / "tp1", CompileOptions(**BASE), verbose=False)
    opts = CompileOptions(**BASE, tp=2, verify_lengths="2,4")
    compile_model(checkpoints / name, tmp_path / "tp2", opts, verbose=False)
    prompts = [p * 4 for p in PROMPTS]  # they repeat: the n-gram drafts hit
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
    ]
    ref = LLM(str(tmp_path / "tp1"), device="cpu", speculative="off")
    expect = [[o.token_ids for o in ref.generate(prompts, p)] for p in params]
    llm = LLM(str(tmp_path / "tp2"), device="cpu", speculative="ngram")
    try:
        got = [[o.token_ids for o in llm.generate(prompts, p)] for p in params]
        assert got == expect
        s = llm.engine.step_metrics()["speculative"]
        assert s["accepted"] > 0 and llm.engine.runner.verify_steps["graph"] > 0, s
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


def test_a_draft_models_pages_reach_every_rank(tmp_path):
    """A draft model beside a --tp 2 target whose attention reads its pages (a random Qwen3 drafting
    for itself): the pages reserved for the drafts reach the follower's block table, though the
    draft's own steps on rank 0 flush them before the verify step is sent
    (``BlockTable.take_changes``). Greedy tokens equal plain decoding's and nearly every draft is
    accepted; without the tracked changes the follower attends to other pages and they differ."""
    from kiln.compiler.synth_tokenizer import build_tokenizer
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    ck = tmp_path / "qwen3"
    make_checkpoint(ck, "qwen3-qknorm", seed=5, eos=None)
    build_tokenizer(ck, vocab_size=300)  # the draft's vocabulary is checked against the target's
    compile_model(ck, tmp_path / "tp1", CompileOptions(**BASE), verbose=False)
    opts = CompileOptions(**BASE, tp=2, verify_lengths="2,4", draft_model=str(ck))
    compile_model(ck, tmp_path / "tp2", opts, verbose=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expect = [o.token_ids for o in LLM(str(tmp_path / "tp1"), device="cpu").generate(PROMPTS, greedy)]
    llm = LLM(str(tmp_path / "tp2"), device="cpu", speculative="draft", num_draft_tokens=4)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expect
        s = llm.engine.step_metrics()["speculative"]
        assert s["proposed"] > 0 and s["accepted"] >= 0.9 * s["proposed"], s
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


@pytest.mark.parametrize("source", ["eagle3", "draft", "mtp"])
def test_draft_sources_run_beside_a_tp_target(tmp_path, source):
    """A --tp 2 artifact with an EAGLE-3 head or a draft model: the draft is compiled for one rank
    and runs on rank 0 beside its share of the target (a head reads rank 0's streams, which hold the
    whole residual after each all-reduce), while each verify step runs on every rank; likewise a
    DeepSeek-V3 MTP layer beside an MLA + MoE target. Greedy and seeded tokens equal the tp=1
    artifact's with the same draft token for token (chains sample their drafts from the draft's
    distribution, lossless in law, not in tokens, so seeded runs compare like with like; MTP's
    random MoE target greedy only), greedy tokens equal the tp=1 engine's without speculation, and
    drafts are accepted (the head drafts a successor checkpoint's next token right; the draft model
    is the target itself; the random MTP layer accepts few)."""
    from tiny_models import SUCCESSOR_SEED, make_successor, successor_config, walk

    from kiln.compiler.synth_eagle3 import successor_eagle3_head
    from kiln.compiler.synth_tokenizer import build_tokenizer
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    target = make_successor(tmp_path / "target", 4)
    prompts = [[5, *walk(5, 20)], [40, *walk(40, 11)], [200, *walk(200, 30)]]
    if source == "mtp":  # a tiny DeepSeek-V3 (MLA, MoE) with its MTP layer: random, few accepted
        target = tmp_path / "mtp"
        make_mtp_checkpoint(target, seed=5)
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, MTP_VOCAB, (n,), generator=g).tolist() for n in (23, 40, 9)]
        drafted: dict = dict(mtp=True)
    elif source == "eagle3":
        successor_eagle3_head(tmp_path / "head", target, SUCCESSOR_SEED)
        drafted = dict(eagle3=str(tmp_path / "head"))
    else:  # a draft model must share the target's tokenizer
        build_tokenizer(target, vocab_size=successor_config(4)["vocab_size"])
        drafted = dict(draft_model=str(target))
    compile_model(target, tmp_path / "plain", CompileOptions(**BASE), verbose=False)
    for tp in (1, 2):
        opts = CompileOptions(**BASE, tp=tp, verify_lengths="2,4", **drafted)
        compile_model(target, tmp_path / f"tp{tp}", opts, verbose=False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True)

    def run(name: str, spec: str) -> list[list[list[int]]]:
        llm = LLM(str(tmp_path / name), device="cpu", speculative=spec, num_draft_tokens=4)
        try:
            out = [[o.token_ids for o in llm.generate(prompts, p)] for p in (greedy, seeded)]
            if spec == "draft":
                s = llm.engine.step_metrics()["speculative"]
                assert s["proposed"] > 0 and llm.engine.runner.verify_steps["graph"] > 0, s
                assert s["accepted"] > 0 or source == "mtp", s
            llm.engine.check_integrity()
            return out
        finally:
            llm.engine.close()

    got = run("tp2", "draft")
    if source == "mtp":  # sampled MoE rows: float32 rounding of another rank layout moves q, so
        # the sampled drafts (and with them the emitted tokens, alike in law) part after a few steps
        assert got[0] == run("tp1", "draft")[0]
    else:
        assert got == run("tp1", "draft")
    assert got[0] == run("plain", "off")[0]


def test_head_trees_beside_a_tp_target(tmp_path):
    """Token trees at --tp 2 (the tree graph traced per rank, tree steps sent to the followers on the
    step wire): an EAGLE-3 head whose best draft is wrong and second right (``decoy``) drafts trees
    of width 2 on rank 0; greedy and seeded tokens equal plain decoding (tree drafts are point
    masses), and the steps branched, accepted and moved K/V."""
    from tiny_models import SUCCESSOR_SEED, make_successor, walk

    from kiln.compiler.synth_eagle3 import successor_eagle3_head
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    target = make_successor(tmp_path / "target", 4)
    successor_eagle3_head(tmp_path / "head", target, SUCCESSOR_SEED, decoy=1.2)
    compile_model(target, tmp_path / "plain", CompileOptions(**BASE), verbose=False)
    opts = CompileOptions(**BASE, tp=2, verify_lengths="4,6", eagle3=str(tmp_path / "head"))
    compile_model(target, tmp_path / "tp2", opts, verbose=False)
    prompts = [[5, *walk(5, 20)], [40, *walk(40, 11)], [200, *walk(200, 30)]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
    ]
    ref = LLM(str(tmp_path / "plain"), device="cpu", speculative="off")
    expect = [[o.token_ids for o in ref.generate(prompts, p)] for p in params]
    llm = LLM(str(tmp_path / "tp2"), device="cpu", speculative="draft", num_draft_tokens=4, draft_branches=2)
    try:
        assert [[o.token_ids for o in llm.generate(prompts, p)] for p in params] == expect
        ts, s = llm.engine.stepper.tree_stats, llm.engine.step_metrics()["speculative"]
        assert ts["branching"] > 0 and ts["moved"] > 0 and s["accepted"] > 0, (ts, s)
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


def test_ngram_trees_move_kv_on_every_rank(tmp_path):
    """n-gram trees at --tp 2 on a random Qwen3 (its attention reads the K/V, unlike a successor
    checkpoint's): after each tree step the accepted nodes' K/V moves run on the followers too
    (``BroadcastRunner.move_kv``); greedy tokens equal plain decoding. Without the followers' moves
    their stale K/V change the tokens within 30."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    make_checkpoint(tmp_path / "hf", "qwen3-qknorm", seed=5, eos=None)
    base = BASE | dict(max_seq_len=160, chunk_size=64)
    compile_model(tmp_path / "hf", tmp_path / "plain", CompileOptions(**base), verbose=False)
    compile_model(
        tmp_path / "hf", tmp_path / "tp2", CompileOptions(**base, tp=2, verify_lengths="6"), verbose=False
    )
    g = torch.Generator().manual_seed(7)
    pat = torch.randint(3, 300, (4,), generator=g).tolist()
    x = torch.randint(3, 300, (8,), generator=g).tolist()
    prompts = [  # patterns repeated with different continuations: trees
        pat + x[:2] + pat + x[2:4] + pat + x[4:6] + pat,
        torch.randint(3, 300, (23,), generator=g).tolist(),
        (pat[:2] + x[:1]) * 3 + pat[:2] + x[1:2] + pat[:2],
        pat * 4,
    ]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expect = [
        o.token_ids
        for o in LLM(str(tmp_path / "plain"), device="cpu", speculative="off").generate(prompts, greedy)
    ]
    llm = LLM(str(tmp_path / "tp2"), device="cpu", speculative="ngram", num_draft_tokens=6, draft_branches=3)
    try:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expect
        ts = llm.engine.stepper.tree_stats
        assert ts["branching"] > 0 and ts["moved"] > 0, ts
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


def test_a_collective_failing_inside_rank_0s_step_is_a_tensor_parallel_error():
    """A hung follower can meet rank 0 in the step's broadcast or, when the transport buffered the
    broadcast, in an all-reduce inside rank 0's forward: both fail as TensorParallelError (the
    gloo timeout text as the hung-rank test saw it); other errors of the forward pass through."""
    from kiln.runtime.tensor_parallel import TensorParallelError, _in_step

    def gloo_timeout():
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")

    def bad_shape():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(TensorParallelError, match=r"tensor-parallel collective failed: .*Timed out"):
        _in_step(gloo_timeout)
    with pytest.raises(RuntimeError, match="shapes") as err:
        _in_step(bad_shape)
    assert not isinstance(err.value, TensorParallelError)
    assert _in_step(lambda x: x + 1, torch.ones(1)).item() == 2
