"""The engine never hangs on its own work (issue 25): a request that cannot fit the KV pool alone is
refused when added; while requests run or wait every ``schedule()`` returns a step (running
requests that block each other are retracted until one can go on); a request that finds nothing
in the prefix cache is not starved by a stream of requests that do. Greedy tokens under forced
retraction still equal Hugging Face's."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import hf_greedy, make_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.engine import RequestError
from kiln.runtime.kv_pool import BlockTable, KVPool, KVPoolError
from kiln.runtime.radix_cache import RadixCache
from kiln.runtime.request import Req
from kiln.runtime.scheduler import Scheduler, SchedulerConfig

STEP_BOUND = 3000  # far more steps than any workload here needs; a livelock runs into it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    hf = make_checkpoint(root / "hf", "llama-untied", seed=5, eos=None)
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64, page_size=1
    )
    compile_model(root / "hf", root / "art", opts, verbose=False)
    return hf, root / "art"


def small_pool_llm(art, tokens: int, **kw) -> LLM:
    """An LLM whose KV pool holds ``tokens`` slots (plus the sink page)."""
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K+V) x kv heads x head_dim x float32
    llm = LLM(str(art), device="cpu", kv_memory_gib=(tokens + 1) * per_token / 2**30, **kw)
    assert llm.engine.pool.capacity_tokens == tokens
    return llm


def run_bounded(engine, rids: set[str]) -> dict[str, list[int]]:
    """Step until every request of ``rids`` finished (their tokens), at most STEP_BOUND steps."""
    done: dict[str, list[int]] = {}
    for _ in range(STEP_BOUND):
        if rids <= done.keys():
            return done
        for out in engine.step():
            if out.finished:
                done[out.rid] = out.token_ids
    raise AssertionError(f"not finished after {STEP_BOUND} steps: {sorted(rids - done.keys())}")


def test_request_larger_than_the_pool_is_refused(tiny):
    """prompt + max_tokens beyond the pool (but within the context) once filled the pool and then
    scheduled nothing forever; now add_request refuses it, naming max_tokens and the limit."""
    _, art = tiny
    llm = small_pool_llm(art, 60)
    eng = llm.engine
    assert eng.max_request_tokens == 60
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        req = eng.add_request([7] * 30, params)
    except RequestError as e:
        assert e.param == "max_tokens"
        assert "KV pool holds 60 tokens" in str(e) and "at most 30" in str(e)
    else:
        run_bounded(eng, {req.rid})  # without the check: runs into the bound
    # LLM.generate adds all or nothing: the refusal withdraws the prompt added before it
    with pytest.raises(RequestError, match="max_tokens"):
        llm.generate([[7] * 10, [7] * 30], params)
    assert not eng.requests and not eng.has_work()
    # what fits exactly is accepted and runs to the end
    fits = eng.add_request([7] * 30, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert len(run_bounded(eng, {fits.rid})[fits.rid]) == 30
    eng.check_integrity()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("radix", [True, False])
def test_mixed_requests_under_retraction_match_hf(tiny, overlap, radix):
    """Long and short requests in a pool that holds about one long one: retraction and
    recomputation give HF's greedy tokens; one request too large for the pool is refused without
    disturbing the others."""
    hf, art = tiny
    g = torch.Generator().manual_seed(9)
    lens = (50, 6, 41, 9, 33, 3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]
    new = 20
    expect = hf_greedy(hf, prompts, new)
    llm = small_pool_llm(art, 80, overlap=overlap, radix_cache=radix)
    eng = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    rids = []
    for i, p in enumerate(prompts):
        rids.append(eng.add_request(p, params).rid)
        if i == 2:
            with pytest.raises(RequestError, match="max_tokens"):
                eng.add_request(prompts[0], SamplingParams(max_tokens=40, temperature=0.0))
    done = run_bounded(eng, set(rids))
    assert [done[r] for r in rids] == expect
    assert eng.scheduler.num_preemptions > 0
    eng.check_integrity()


def test_retraction_keeps_penalized_sampling_exact(tiny):
    """Penalties count each request's own tokens: a request retracted and resumed, perhaps into a
    row another request used meanwhile, samples exactly as it does in a pool large enough that
    nothing is retracted."""
    _, art = tiny
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (44, 8, 37, 12, 29, 5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5)
    outs = []
    for tokens in (80, 2000):
        llm = small_pool_llm(art, tokens, overlap=False)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        retracted = llm.engine.scheduler.num_preemptions
        assert (retracted > 0) == (tokens == 80), retracted
    assert outs[0] == outs[1]


def test_no_hit_request_is_not_starved(tiny):
    """With one running slot, a request with no cached prefix waits while requests that hit the
    cache keep arriving; it is admitted after at most ``max_overtakes`` of them."""
    _, art = tiny
    llm = LLM(str(art), device="cpu", max_running=1)
    eng = llm.engine
    limit = eng.scheduler.cfg.max_overtakes
    prefix = list(range(10, 42))
    hit = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run_bounded(eng, {eng.add_request(prefix + [5], hit).rid})  # the prefix is cached now
    blocker = eng.add_request(prefix + [6], hit)  # holds the one running slot
    eng.step()
    lonely = eng.add_request(list(range(200, 240)), SamplingParams(max_tokens=2, temperature=0.0))
    admitted_before = 0
    for i in range(STEP_BOUND):
        if lonely.finished:
            break
        eng.add_request(prefix + [7 + i % 50], hit)  # a newcomer every step
        for out in eng.step():
            if out.finished and out.rid not in (lonely.rid, blocker.rid):
                admitted_before += 1
    assert lonely.finished, f"the no-hit request still waits after {STEP_BOUND} steps"
    assert admitted_before <= limit + 2, admitted_before


# ------------------------------------------------------------------------------ scheduler alone
def make_scheduler(pages: int, page_size: int = 1, chunk: int = 8, max_running: int = 4, radix: bool = True):
    pool = KVPool(1, (pages + 1) * page_size, 1, 4, 4, torch.float32, "cpu", page_size)
    bt = BlockTable(max_running, -(-64 // page_size), "cpu", page_size)
    cfg = SchedulerConfig(max_running=max_running, chunk_size=chunk, max_seq_len=64)
    return Scheduler(cfg, pool, bt, RadixCache(page_size, disabled=not radix))


def fake_step(sched: Scheduler, rng: random.Random) -> None:
    """Run one scheduled step as the engine would, with a made-up next token."""
    batch = sched.schedule()
    assert batch is not None, "a step scheduled nothing while requests run or wait"
    done = (
        range(len(batch.reqs))
        if batch.mode == "decode"
        else [i for i in range(len(batch.reqs)) if batch.completes(i)]
    )
    sched.after_step(batch)
    for i in done:
        req = batch.reqs[i]
        req.output_ids.append(rng.randint(0, 3))
        if len(req.output_ids) >= req.params.max_tokens:
            sched.finish(req)
    sched.check_integrity()


def test_scheduler_refuses_a_request_that_cannot_fit_alone():
    sched = make_scheduler(pages=20)
    with pytest.raises(KVPoolError, match="cannot run even alone"):
        sched.add(Req(rid="big", prompt_ids=[1] * 15, params=SamplingParams(max_tokens=6)))
    sched.add(Req(rid="fits", prompt_ids=[1] * 15, params=SamplingParams(max_tokens=5)))


@pytest.mark.parametrize("radix", [True, False])
def test_blocked_prefills_retract_and_go_on(radix):
    """Two running requests both mid-prefill and neither able to take its next chunk (no request
    decodes): the newest is retracted and the other continues, where schedule() once returned
    None for ever."""
    sched = make_scheduler(pages=14, chunk=8, radix=radix)
    a = Req(rid="a", prompt_ids=list(range(12)), params=SamplingParams(max_tokens=1))
    b = Req(rid="b", prompt_ids=list(range(20, 32)), params=SamplingParams(max_tokens=1))
    for r in (a, b):
        sched.add(r)
        sched.waiting.popleft()
        assert sched._admit(r, budget=5) == 5
        r.kv_len += 5
    assert sched.pool.num_free_pages == 4 and all(r.prefilling for r in sched.running)
    b.sampler_row = b.row  # as the stepper leaves it
    batch = sched.schedule()
    assert batch is not None and batch.reqs == [a] and batch.extend_lens == [7]
    assert b in sched.waiting and sched.num_preemptions == 1
    # resumed, possibly into the same row after another request used it: its sampler row restarts
    assert b.row == -1 and b.sampler_row == -1
    rng = random.Random(0)
    sched.after_step(batch)
    a.output_ids.append(1)
    sched.finish(a)
    while sched.has_work():
        fake_step(sched, rng)
    assert b.finished and len(b.output_ids) == 1


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("radix", [True, False])
def test_random_workloads_always_progress(page_size, radix):
    """Random prompts and lengths, each fitting the pool alone: every step schedules something
    and every request finishes within a bound, at several chunk sizes and running limits."""
    pages = 24 if page_size == 1 else 8
    for seed in range(12):
        rng = random.Random(seed)
        sched = make_scheduler(
            pages, page_size, chunk=rng.choice((3, 8, 32)), max_running=rng.choice((2, 4)), radix=radix
        )
        cap = sched.pool.capacity_tokens
        for i in range(8):
            n = rng.randint(1, cap - 1)
            prompt = [rng.randint(0, 3) for _ in range(n)]  # few distinct ids: many shared prefixes
            sched.add(
                Req(rid=f"r{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=rng.randint(1, cap - n)))
            )
        for _ in range(STEP_BOUND):
            if not sched.has_work():
                break
            fake_step(sched, rng)
        assert not sched.has_work(), f"seed {seed}: unfinished after {STEP_BOUND} steps"
