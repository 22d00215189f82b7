"""The OpenAI server on a tensor-parallel artifact: the demo model compiled with ``--tp 2`` and served
by two processes over gloo (runtime/tensor_parallel.py) answers as the one-rank engine does, through
the official client, streaming included; /health stays 200. A rank that dies ends the request in
flight with an error and turns /health to 503, never a hang."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from serve_harness import LiveServer

from kiln import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The sky"]
MSGS = [{"role": "user", "content": "Hi there!"}]


@pytest.fixture(scope="module")
def tp2(demo_tp2):
    """A LiveServer on the demo checkpoint compiled for two ranks (as ``kiln demo`` compiles it)."""
    s = LiveServer(demo_tp2)
    yield s
    s.stop()
    s.engine.close()


def test_tp2_server_answers_as_one_rank(tp2, demo_one_rank):
    assert tp2.engine.ranks is not None and httpx.get(tp2.url + "/health", timeout=30).status_code == 200
    one = LLM(str(demo_one_rank), device="cpu")  # a one-rank artifact loads beside the group
    greedy = SamplingParams(max_tokens=12, temperature=0)
    c = tp2.client()
    r = c.completions.create(model=tp2.model, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [ch.text for ch in r.choices] == [o.text for o in one.generate(PROMPTS, greedy)]
    stream = c.chat.completions.create(
        model=tp2.model, messages=MSGS, max_tokens=10, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == one.chat(MSGS, SamplingParams(max_tokens=10, temperature=0))[0].text
    tp2.wait_idle()


def test_a_dead_rank_fails_requests_and_health(tp2):
    # runs after the answers above (the module's server is left unusable)
    follower = tp2.engine.ranks.procs[0]
    follower.kill()
    follower.join(timeout=30)
    c = tp2.client()
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="rank"):
        c.completions.create(model=tp2.model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert time.monotonic() - t0 < 60  # the broadcast to the dead rank fails, it does not hang
    h = httpx.get(tp2.url + "/health", timeout=30)
    assert h.status_code == 503 and "TensorParallelError" in h.json()["error"], h.text
    with pytest.raises(openai.APIStatusError) as info:  # nothing new is accepted
        c.completions.create(model=tp2.model, prompt=PROMPTS[1], max_tokens=4)
    assert info.value.status_code == 503
