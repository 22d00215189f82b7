"""On a GPU: ``kiln serve`` over the demo model compiled for CUDA (bf16, decode buckets up to 64,
CUDA graphs, overlapped decoding): the official client gets the offline engine's greedy text, and
the 64-client load test with disconnects leaves the engine clean."""

from __future__ import annotations

import pytest
from serve_harness import LiveServer
from test_load import run_load

from kiln.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    from kiln.demo import build_demo

    art = build_demo(tmp_path_factory.mktemp("serve-gpu"), "cuda")
    s = LiveServer(art, device="cuda", kv_memory_gib=2)
    yield s
    s.stop()


def test_gpu_completion_matches_offline(gpu_server):
    from kiln import LLM

    llm = LLM(str(gpu_server.engine.artifact.root), device="cuda", kv_memory_gib=1)
    ref = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0))[0]
    del llm
    r = gpu_server.client().completions.create(
        model=gpu_server.model, prompt="Once upon a time", max_tokens=16, temperature=0
    )
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)


def test_gpu_load_with_disconnects(gpu_server):
    run_load(gpu_server)
