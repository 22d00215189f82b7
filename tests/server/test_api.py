"""The OpenAI API of ``kiln serve`` through the official ``openai`` client, against the offline
engine (``kiln.LLM``) on the same artifact as the reference."""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(demo_one_rank):
    from kiln import LLM

    return LLM(str(demo_one_rank), device="cpu")


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model] == [server.kiln.model_name]
    assert server.client().models.retrieve(server.model).id == server.model
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_matches_offline_engine(server, llm):
    """Greedy text and token counts equal the offline engine's, for a string prompt, a token-id
    prompt and a batch of strings; usage adds up."""
    c = server.client()
    ref = llm.generate(["Once upon a time", "The sky"], SamplingParams(max_tokens=12, temperature=0))
    r = c.completions.create(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref[0].text and r.choices[0].finish_reason == ref[0].finish_reason
    n_prompt = len(ref[0].prompt_token_ids)
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(ref[0].token_ids)
    assert r.usage.total_tokens == n_prompt + len(ref[0].token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens <= n_prompt

    ids = ref[1].prompt_token_ids
    r = c.completions.create(model=server.model, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref[1].text and r.usage.prompt_tokens == len(ids)

    r = c.completions.create(
        model=server.model, prompt=["Once upon a time", "The sky"], max_tokens=12, temperature=0
    )
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.text for ch in r.choices] == [o.text for o in ref]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    # The same prompt again reuses its prefix from the radix cache (whole pages of it: a long one).
    long = (ids * 40)[:40]
    c.completions.create(model=server.model, prompt=long, max_tokens=2, temperature=0)
    r = c.completions.create(model=server.model, prompt=long, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_uses_the_chat_template(server, llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    ref = llm.chat(msgs, SamplingParams(max_tokens=10, temperature=0))[0]
    r = server.client().chat.completions.create(
        model=server.model, messages=msgs, max_tokens=10, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    # Content as a list of text parts is the same conversation; max_completion_tokens wins.
    parts = [
        msgs[0],
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there!"}]},
    ]
    r2 = server.client().chat.completions.create(
        model=server.model, messages=parts, max_tokens=3, max_completion_tokens=10, temperature=0
    )
    assert r2.choices[0].message.content == ref.text


def test_streaming_with_usage(server, llm):
    """Streamed deltas concatenate to the non-streamed text; the usage chunk comes last."""
    c = server.client()
    ref = llm.generate("In a hole in the ground", SamplingParams(max_tokens=16, temperature=0))[0]
    chunks = list(
        c.completions.create(
            model=server.model,
            prompt="In a hole in the ground",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [ch for ch in chunks if ch.choices]
    assert len(text_chunks) >= 4  # tokens arrive as they are made, not in one piece
    assert "".join(ch.choices[0].text for ch in text_chunks) == ref.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)

    msgs = [{"role": "user", "content": "Tell me"}]
    ref = llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0))[0]
    chunks = list(
        c.chat.completions.create(
            model=server.model,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].object == "chat.completion.chunk"
    # Without include_usage no usage chunk is sent.
    plain = list(c.completions.create(model=server.model, prompt="x", max_tokens=3, stream=True))
    assert all(ch.choices for ch in plain) and all(ch.usage is None for ch in plain)


def test_stop_strings(server, llm):
    """The text ends just before the first stop string, streamed or not; finish_reason stop."""
    ref = llm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0))[0].text
    assert len(ref) > 8
    stop = ref[5:8]  # a string the greedy continuation produces
    cut = ref[: ref.find(stop)]
    c = server.client()
    r = c.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop
    )
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(
        c.completions.create(
            model=server.model,
            prompt="Once upon a time",
            max_tokens=24,
            temperature=0,
            stop=["zzzz-never", stop],
            stream=True,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    r = c.completions.create(  # vLLM's extension: the text ends after the stop string
        model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert r.choices[0].text == cut + stop and r.choices[0].finish_reason == "stop"


def test_n_and_seed(server):
    """n=2 gives two distinct seeded samples; the same seed reproduces them, streamed or not."""
    c = server.client()
    kw = dict(model=server.model, prompt="Seeds", max_tokens=10, temperature=1.0, seed=1234, n=2)
    a = c.completions.create(**kw)
    b = c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 20 and a.usage.prompt_tokens == b.usage.prompt_tokens
    texts = {0: "", 1: ""}
    for ch in c.completions.create(**kw, stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [ch.text for ch in a.choices]
    other = c.completions.create(**{**kw, "seed": 99})
    assert [ch.text for ch in other.choices] != [ch.text for ch in a.choices]
    chat = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "x"}], max_tokens=4, n=2, seed=5
    )
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_logprobs(server, llm):
    """Completions: logprobs=k gives the chosen token's logprob and the top k, equal to the
    offline engine's; chat: logprobs + top_logprobs in the chat shape."""
    ref = llm.generate("Logprobs", SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    c = server.client()
    r = c.completions.create(model=server.model, prompt="Logprobs", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for got, want, top in zip(lp.token_logprobs, ref.logprobs, lp.top_logprobs):
        assert got == pytest.approx(want["logprob"], abs=1e-4)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(want["top"][0][1], abs=1e-4)
    # Greedy: the chosen token is the most likely one.
    assert all(
        t == pytest.approx(max(top.values()), abs=1e-5) for t, top in zip(lp.token_logprobs, lp.top_logprobs)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert "".join(lp.tokens) == r.choices[0].text
    # Sampled: each top_logprobs holds the chosen token too (OpenAI's up to logprobs + 1 entries).
    r = c.completions.create(
        model=server.model, prompt="Logprobs", max_tokens=8, temperature=2.0, seed=5, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some token other than the most likely
    for tok, got, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == got and len(top) <= 2

    r = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode())
    r = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert r.choices[0].logprobs is None


def test_chat_default_max_tokens_fills_the_context(server):
    """Chat without max_tokens may generate up to the end of the context (ignore_eos: exactly)."""
    tok, ctx = server.kiln.tokenizer, server.kiln.context

    def prompt_len(words: int) -> int:
        msgs = [{"role": "user", "content": "go " * words}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return len(tok.encode(text, add_special_tokens=False))

    words = 1
    while prompt_len(words * 2) < ctx - 8:
        words *= 2
    step = words
    while step > 0:  # the largest word count leaving at least 4 tokens of room
        if prompt_len(words + step) <= ctx - 4:
            words += step
        step //= 2
    n_prompt = prompt_len(words)
    assert ctx - 12 < n_prompt <= ctx - 4
    r = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "go " * words}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == ctx - n_prompt and r.choices[0].finish_reason == "length"


def test_metrics(server):
    server.client().completions.create(model=server.model, prompt="metrics", max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    for name in (
        "kiln_time_to_first_token_seconds",
        "kiln_inter_token_latency_seconds",
        "kiln_e2e_request_latency_seconds",
        "kiln_generation_tokens",
        "kiln_prompt_tokens",
        "kiln_num_requests_running",
        "kiln_num_requests_waiting",
        "kiln_kv_cache_usage_ratio",
        "kiln_prefix_cache_hit_rate",
        "kiln_http_requests",
        "kiln_spec_draft_tokens",  # speculative decoding's counters (zero: the setting is off here)
        "kiln_spec_accepted_tokens",
    ):
        assert name in families or name + "_total" in families, name
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"
    }
    assert values["kiln_time_to_first_token_seconds_count"] >= 1
    assert values["kiln_inter_token_latency_seconds_count"] >= 3
    assert values["kiln_generation_tokens_total"] >= 4
    assert values["kiln_spec_draft_tokens_total"] == 0 == values["kiln_spec_accepted_tokens_total"]
    assert values["kiln_num_requests_running"] == 0
    assert 0.0 <= values["kiln_prefix_cache_hit_rate"] <= 1.0
    assert values['kiln_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    # the engine's steps by kind: this request's prefill, then its decode steps
    assert values['kiln_engine_steps_total{kind="prefill"}'] >= 1
    assert values['kiln_engine_steps_total{kind="decode"}'] >= 2
    assert values['kiln_engine_step_prefill_tokens_total{kind="prefill"}'] >= 1
    assert values['kiln_engine_step_prefill_tokens_total{kind="decode"}'] == 0
    assert values['kiln_engine_step_seconds_total{kind="decode"}'] > 0
    # CUDA-graph captures (none on a CPU engine) and those still pending, which a benchmark waits for
    assert values["kiln_engine_graph_captures_total"] == 0 == values["kiln_engine_graph_captures_pending"]
    assert values["kiln_engine_graph_capture_seconds_total"] == 0
    # step() calls by wall time, per kind: the open bucket counts them all
    assert values['kiln_engine_step_duration_seconds_count{kind="decode"}'] >= 2
    assert (
        values['kiln_engine_step_duration_seconds_bucket{kind="decode",le="+Inf"}']
        == values['kiln_engine_step_duration_seconds_count{kind="decode"}']
    )
    decode_requests = values['kiln_engine_step_requests_total{kind="decode"}']
    assert decode_requests == values['kiln_engine_step_decode_tokens_total{kind="decode"}']  # a row each


def test_raw_sse_format(server):
    """The wire format: ``data: {json}`` events, a blank line after each, ``data: [DONE]`` last."""
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 3, "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        assert json.loads(ev[6:])["object"] == "text_completion"
