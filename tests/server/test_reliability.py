"""What keeps one request, or a stuck engine, from hanging the server or its clients: requests
sized to the KV pool (capped or refused with the limit named), the watchdog, the default queue
limit, the bound on sequences per request, and the length check before tokenization."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from serve_harness import LiveServer, assert_error

from kiln.manifest import Manifest


@pytest.fixture(scope="module")
def small(demo_artifact):
    """A server whose KV pool (512 tokens, one more page for the sink) is smaller than the context,
    with 2 running slots."""
    kv = Manifest.load(demo_artifact).kv
    s = LiveServer(
        demo_artifact, kv_memory_gib=(512 + kv.page_size) * kv.bytes_per_token / 2**30, max_running=2
    )
    assert 500 < s.kiln.max_request_tokens == s.engine.pool.capacity_tokens < s.kiln.context
    yield s
    s.stop()


def test_max_tokens_not_given_is_capped_to_the_pool(small):
    """Chat without max_tokens would run to the end of the context, past what the pool holds:
    it is capped to what fits and ends with finish_reason "length"."""
    msgs = [{"role": "user", "content": "tell me everything"}]
    prompt_len = len(small.kiln._chat_ids(_chat(msgs), None)[0])
    r = small.client().chat.completions.create(
        model=small.model, messages=msgs, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == small.kiln.max_request_tokens - prompt_len
    card = small.client().models.retrieve(small.model)
    assert card.model_extra["max_model_len"] == small.kiln.context  # the card still says the context
    small.check_clean()


def test_completion_default_max_tokens_is_capped(small):
    """/v1/completions without max_tokens: OpenAI's 16, or fewer when only fewer fit (not a 400
    about a max_tokens the client never sent)."""
    pool = small.kiln.max_request_tokens
    for prompt_len, want in ((5, 16), (pool - 4, 4)):
        r = small.post("/v1/completions", json={"prompt": [7] * prompt_len, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == want
        assert r.json()["choices"][0]["finish_reason"] == "length"
    err = assert_error(
        small.post("/v1/completions", json={"prompt": "x", "min_tokens": 20}), 400, "min_tokens"
    )
    assert "default max_tokens is 16" in err["message"], err
    small.check_clean()


def test_max_tokens_past_the_pool_is_refused(small):
    pool = small.kiln.max_request_tokens
    for path, body in [
        ("/v1/completions", {"prompt": [7] * 10, "max_tokens": pool - 9}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": pool}),
    ]:
        err = assert_error(small.post(path, json=body), 400, "max_tokens", "context_length_exceeded")
        assert f"KV pool holds {pool} tokens" in err["message"], err
        assert "--kv-memory" in err["message"], err
    ok = small.post("/v1/completions", json={"prompt": [7] * 10, "max_tokens": pool - 10})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    # a prompt under the context but over the pool
    err = assert_error(
        small.post("/v1/completions", json={"prompt": [7] * 600, "max_tokens": 1}), 400, "prompt"
    )
    assert f"KV pool holds {pool} tokens" in err["message"] and "--kv-memory" in err["message"]
    small.check_clean()


def test_default_queue_limit(small):
    """No --max-queue: 8 waiting sequences per running slot (2 slots: 18 sequences in all). While
    two run, 17 more are a 429; more than 18 can never be admitted: a 400 naming n."""
    cap = small.kiln.max_running * 9
    err = assert_error(
        small.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": cap + 1}), 400, "n"
    )
    assert f"at most {cap} at once" in err["message"], err
    c = small.client()
    stream = c.completions.create(
        model=small.model, prompt="x", max_tokens=400, n=2, stream=True, extra_body={"ignore_eos": True}
    )
    assert next(iter(stream)).choices  # two sequences in flight
    assert_error(
        small.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": cap - 1}),
        429,
        code="queue_full",
    )
    stream.close()
    small.wait_idle()
    r = small.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": cap})
    assert r.status_code == 200 and len(r.json()["choices"]) == cap
    small.check_clean()


@pytest.fixture(scope="module")
def wide(demo_artifact):
    """A server with a long queue (512), so that the per-request bound is the one that binds."""
    s = LiveServer(demo_artifact, max_queue=512)
    yield s
    s.stop()


def test_sequences_per_request_bound(wide):
    """prompts x n past 256 is a 400 naming n (or prompt), before anything is tokenized or queued."""
    server = wide
    assert server.kiln.opts.max_sequences_per_request == 256  # the default
    before = server.call(lambda e: e.status())["prompt_tokens"]
    err = assert_error(server.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 100}), 400, "n")
    assert "300 sequences" in err["message"] and "--max-sequences-per-request" in err["message"], err
    many = [f"prompt {i} " * 50 for i in range(1024)]
    assert_error(
        server.post("/v1/completions", json={"prompt": many, "n": 128, "max_tokens": 1}), 400, "prompt"
    )
    assert_error(server.post("/v1/completions", json={"prompt": [[5]] * 257, "max_tokens": 1}), 400, "prompt")
    assert server.call(lambda e: e.status())["prompt_tokens"] == before  # nothing reached the engine
    r = server.post("/v1/completions", json={"prompt": [[5]] * 64, "n": 4, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 256
    server.check_clean()


def test_huge_prompt_refused_before_tokenizing(server, monkeypatch):
    """A 5 MB prompt is refused from its length alone: the tokenizer never sees it. A prompt just
    under the bound is tokenized and served (the bound never refuses a prompt that fits)."""
    L, limit = server.kiln.chars_per_token, server.kiln.max_request_tokens
    assert L is not None
    seen: list[int] = []
    tok = server.kiln.tokenizer
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: seen.append(len(text)) or real(text, **kw))
    huge = "the kiln is hot " * (5 << 16)  # 5 MiB
    err = assert_error(
        server.post("/v1/completions", json={"prompt": huge, "max_tokens": 1}),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert "at least" in err["message"] and "characters" in err["message"], err
    err = assert_error(
        server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]}),
        400,
        "messages",
        "context_length_exceeded",
    )
    assert seen == []  # refused without tokenizing
    fits = "aa " * ((limit - 1) * L // 3 - 1)  # longer than the context in characters, few tokens
    assert len(fits) > limit
    r = server.post("/v1/completions", json={"prompt": fits, "max_tokens": 1})
    assert seen == [len(fits)]
    n_tokens = len(real(fits))
    if n_tokens < limit:  # it fits: served
        assert r.status_code == 200, r.text
    else:  # it did not fit after all: refused with its exact count
        assert_error(r, 400, "prompt")
    server.check_clean()


def test_watchdog_ends_requests_of_a_stuck_engine(demo_artifact):
    """The engine hangs inside a step (a hung device): after --watchdog-seconds the streaming
    client gets an error event, the non-streaming one a 503, /health a 503 naming the watchdog,
    new requests a 503. Once the step returns, the engine is aborted clean."""
    s = LiveServer(demo_artifact, watchdog_seconds=1.0)
    release = threading.Event()
    try:
        time.sleep(1.5)  # idle longer than the limit: no progress needed while there is no work
        assert httpx.get(s.url + "/health").status_code == 200
        c = s.client().with_options(timeout=20)
        stream = c.completions.create(
            model=s.model, prompt="x", max_tokens=500, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(stream)
        assert next(it).choices
        pending: dict = {}

        def long_request() -> None:
            body = {"prompt": "y", "max_tokens": 500, "ignore_eos": True}
            pending["r"] = httpx.post(s.url + "/v1/completions", json=body, timeout=20)

        t = threading.Thread(target=long_request)
        t.start()
        s.wait_running(2)
        real_step = s.engine.step

        def stuck_step():
            release.wait()
            return real_step()

        s.call(lambda e: setattr(e, "step", stuck_step))
        with pytest.raises(openai.APIError) as e:
            list(it)
        assert "no progress" in str(e.value) and "--watchdog-seconds" in str(e.value)
        t.join(30)
        err = assert_error(pending["r"], 503)
        assert "no progress" in err["message"] and err["type"] == "server_error"
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and "no progress" in h.json()["error"]
        assert_error(s.post("/v1/completions", json={"prompt": "z", "max_tokens": 1}), 503)
        release.set()  # the step returns: the worker aborts everything and stops
        s.kiln.worker._thread.join(10)
        assert not s.kiln.worker._thread.is_alive()
        del s.engine.step
        st = s.engine.status()
        assert not s.engine.requests and st["running"] == st["waiting"] == 0, st
        s.engine.check_integrity()
    finally:
        release.set()
        s.stop()


def _chat(messages: list[dict]):
    from kiln.runtime.server_protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=messages)


def test_idle_graph_captures_count_as_progress_for_the_watchdog():
    """After a step the worker runs the engine's idle work (``Engine.idle``: the pending decode
    graphs of ``startup_graphs`` smallest) one capture at a time: each counts as progress, so a
    few slow captures in a row do not read as a stalled engine."""
    from kiln.runtime.server_worker import EngineWorker

    class Stub:
        steps = idles = 0

        def has_work(self) -> bool:
            return self.steps == 0

        def step(self) -> list:
            self.steps += 1
            return []

        def idle(self) -> bool:
            if self.idles == 5:
                return False
            self.idles += 1
            time.sleep(0.2)
            return True

    engine = Stub()
    worker = EngineWorker(engine)
    worker.start()
    seen = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        seen.append(worker.stalled_for())
        time.sleep(0.02)
    worker.stop()
    assert engine.steps == 1 and engine.idles >= 4
    assert max(seen) < 0.7, max(seen)  # one capture's 0.2 s (without the beat: 1.0 s and rising)
