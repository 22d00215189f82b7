"""Sampler: device time of one sampling step at Llama-3's vocabulary, and host time of building
the step's ``SamplingBatch``.

``gumbel`` is the fused seeded Gumbel-max kernel alone (reads the logits once: ``frac_bw`` says
how close it is to the read bandwidth); ``gumbel_torch`` is its plain-torch reference for
comparison. ``argmax`` is the greedy pick, the Triton kernels (``argmax_rows``) against
``torch.argmax``, each in a CUDA graph as a decode step runs it. The ``sample_*`` cases are a whole ``Sampler.sample`` call: all greedy, all
temperature-only, a mix with top-k/top-p, and penalties on top. ``build`` is host-only.
"""

import time

import pytest
import torch
from conftest import SMOKE, graphed, pick

from kiln.ops.sampling.gumbel import argmax_rows, gumbel_argmax, gumbel_argmax_ref, row_keys
from kiln.runtime.sampler import Sampler, SamplingBatch
from kiln.runtime.sampling_params import SamplingParams as SP

V = pick(128256, 512)
BATCH = pick([1, 64, 256], [4])
DEV = "cpu" if SMOKE else "cuda"
MIXES = {
    "greedy": lambda i: SP(temperature=0),
    "temperature": lambda i: SP(temperature=0.8, seed=i),
    "topk_topp": lambda i: SP(temperature=0.8, top_k=50, top_p=0.9, seed=i) if i % 2 else SP(temperature=0),
    "penalties": lambda i: SP(
        temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5, seed=i
    ),
}


@pytest.mark.parametrize("impl", ["gumbel", "gumbel_torch"])
@pytest.mark.parametrize("batch", BATCH)
def test_gumbel_argmax(measure, batch, impl):
    x = torch.randn(batch, V, device=DEV)
    keys = torch.tensor([row_keys(i, 3) for i in range(batch)], dtype=torch.int64, device=DEV)
    fn = gumbel_argmax if impl == "gumbel" else gumbel_argmax_ref
    measure(lambda: fn(x, keys), bytes=x.numel() * 4, batch=batch, vocab=V)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("batch", BATCH)
def test_argmax(measure, batch, impl):
    x = torch.randn(batch, V, device=DEV)
    fn = (lambda: argmax_rows(x)) if impl == "triton" else (lambda: x.argmax(dim=-1))
    assert torch.equal(fn(), x.argmax(dim=-1))
    measure(graphed(fn), bytes=x.numel() * 4, batch=batch, vocab=V, impl=impl)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("batch", BATCH)
def test_sample_step(measure, batch, mix):
    sampler = Sampler(V, batch + 1, DEV)
    rows = list(range(1, batch + 1))
    for r in rows:
        sampler.reset_row(r, list(range(r, r + 64)))
    batch_t = SamplingBatch.build([MIXES[mix](i) for i in range(batch)], rows, DEV, steps=[5] * batch)
    logits = torch.randn(batch, V, device=DEV)
    out = sampler.sample(logits, batch_t)  # materializes penalty rows outside the timing
    assert out.next_ids.shape == (batch,)
    measure(lambda: sampler.sample(logits, batch_t), bytes=logits.numel() * 4, batch=batch, mix=mix)


@pytest.mark.parametrize("batch", BATCH)
def test_build_host_time(benchmark, batch):
    params = [MIXES["topk_topp"](i) for i in range(batch)]
    rows = list(range(1, batch + 1))
    SamplingBatch.build(params, rows, DEV, steps=[5] * batch)
    t0 = time.perf_counter()
    rounds = 1 if SMOKE else 200
    for _ in range(rounds):
        SamplingBatch.build(params, rows, DEV, steps=[5] * batch)
    benchmark.extra_info.update(host_us=(time.perf_counter() - t0) / rounds * 1e6, batch=batch)
    benchmark.pedantic(
        lambda: SamplingBatch.build(params, rows, DEV, steps=[5] * batch), rounds=1 if SMOKE else 20
    )
