"""The engine end to end on tiny MoE checkpoints (CPU, float32): greedy tokens identical to Hugging
Face `generate` for 32 new tokens through `kiln.LLM`, with whole and forced-small prefill chunks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy
from tiny_moe_models import MOE_CONFIGS, make_moe_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model

NEW = 32


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("eng-" + request.param)
    hf = make_moe_checkpoint(root / "hf", request.param, seed=3, eos=None)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 23, 40, 12)]
    expect = hf_greedy(hf, prompts, NEW)
    return root / "art", prompts, expect


@pytest.mark.parametrize("radix,chunk", [(True, 64), (False, 7)])
def test_greedy_matches_hf(setup, radix, chunk):
    art, prompts, expect = setup
    llm = LLM(str(art), device="cpu", radix_cache=radix, chunk_size=chunk)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expect
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.check_integrity()
