"""Every bad input gets its status and OpenAI's error shape, never a 5xx; keys, body limits and the
queue bound are enforced; the server is clean afterwards."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from serve_harness import LiveServer, assert_error

KEY = "sk-kiln-test"


@pytest.fixture(scope="module")
def gated(demo_artifact):
    """A server with a key, one running slot, no queue and a 64 KiB body limit."""
    s = LiveServer(demo_artifact, api_key=KEY, max_queue=0, max_running=1, max_body_bytes=64 << 10)
    yield s
    s.stop()


BAD_COMPLETIONS = [
    # (body, param) -> 400
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [1 << 40]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 1 << 70}, "seed"),
    ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [[]], "max_tokens": 2}, "prompt"),
    ({"prompt": [5, 999999]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    # wrong types
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": "x", "stop": 7}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": "no"}}, "stream_options"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"max_tokens": 3}, "prompt"),
]

BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {}},
        },
        "response_format",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "regex": "a+", "choice": ["a"]}, "choice"),
    ({"messages": [{"role": "user", "content": "x"}], "choice": []}, "choice"),
    ({"messages": [{"role": "user", "content": "x"}], "regex": "(unclosed"}, "structured"),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
        },
        "structured",
    ),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[str(b) for b, _ in BAD_COMPLETIONS])
def test_bad_completion_parameters(server, body, param):
    assert_error(server.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[str(b)[:60] for b, _ in BAD_CHAT])
def test_bad_chat_parameters(server, body, param):
    assert_error(server.post("/v1/chat/completions", json=body), 400, param)


def test_bad_bodies(server):
    for content, ctype in [
        (b'{"prompt": "x", ', "application/json"),
        (b"\xff\xfe not json", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'"prompt"', "application/json"),
        (b"null", "application/json"),
        (b"", "application/json"),
        (b"prompt=x", "application/x-www-form-urlencoded"),
        (b"[" * 100000 + b"]" * 100000, "application/json"),
    ]:
        for path in ("/v1/completions", "/v1/chat/completions"):
            err = assert_error(server.post(path, content=content, headers={"content-type": ctype}), 400)
            assert err["type"] == "invalid_request_error"


def test_prompt_longer_than_the_context(server):
    ctx = server.kiln.context
    c = server.client()
    for prompt in ([7] * ctx, "hello " * (2 * ctx)):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=server.model, prompt=prompt, max_tokens=1)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi " * (2 * ctx)}]
        )
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    # prompt + max_tokens past the context
    err = assert_error(server.post("/v1/completions", json={"prompt": [7] * (ctx - 4), "max_tokens": 5}), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    server.client().completions.create(model=server.model, prompt=[7] * (ctx - 4), max_tokens=4)


def test_unknown_model_and_path(server):
    c = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-17")
    assert_error(server.post("/v1/nope", json={}), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)


def test_api_key(gated):
    r = gated.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert_error(r, 401, code="invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_error(gated.post("/v1/completions", json={}, headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.get(gated.url + "/v1/models", headers={"Authorization": KEY}), 401)
    with pytest.raises(openai.AuthenticationError):
        gated.client(api_key="wrong").models.list()
    ok = gated.client(api_key=KEY).completions.create(model=gated.model, prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens == 2
    assert httpx.get(gated.url + "/health").status_code == 200  # probes need no key


def test_body_limit(gated):
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({"prompt": "x" * (70 << 10), "max_tokens": 1}).encode()
    assert_error(
        httpx.post(gated.url + "/v1/completions", content=big, headers=auth), 413, code="request_too_large"
    )

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(gated.url + "/v1/completions", content=chunked(), headers=auth)
    assert_error(r, 413)
    with pytest.raises(openai.APIStatusError) as e:
        gated.client(api_key=KEY).completions.create(model=gated.model, prompt="x" * (70 << 10), max_tokens=1)
    assert e.value.status_code == 413


def test_queue_full(gated):
    """One running slot and no queue: a second request while one runs gets 429; n=2 can never be
    admitted, so it gets a 400 naming n (a 429 would ask the client to retry it forever)."""
    c = gated.client(api_key=KEY)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=gated.model, prompt="x", max_tokens=1, n=2)
    assert e.value.param == "n" and "at most 1 at once" in e.value.message
    before = gated.call(lambda e: e.status())["generated_tokens"]
    stream = c.completions.create(
        model=gated.model, prompt="x", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))  # the long request is running
    assert first.choices
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=gated.model, prompt="y", max_tokens=1)
    assert e.value.code == "queue_full"
    stream.close()  # the client leaves: its request is aborted and the slot frees
    s = gated.wait_idle(timeout=5)
    assert s["generated_tokens"] - before < 1000
    assert c.completions.create(model=gated.model, prompt="y", max_tokens=1).usage.completion_tokens == 1
    gated.check_clean()


def test_disconnect_aborts_a_non_streaming_request(gated):
    """A client that times out on a long non-streaming request: the request is aborted long before
    its 1000 tokens would be done."""
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    before = gated.call(lambda e: e.status())["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gated.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5
        )
    s = gated.wait_idle(timeout=5)
    assert 0 < s["generated_tokens"] - before < 1000
    gated.check_clean()


def test_server_stays_clean(server):
    """After all of the above, nothing leaked and concurrent bad requests still get 400s."""
    results = []

    def hit():
        results.append(server.post("/v1/completions", json={"prompt": "x", "temperature": -1}).status_code)

    threads = [threading.Thread(target=hit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [400] * 8
    server.check_clean()


def test_engine_failure_answers_every_request(demo_artifact):
    """If the engine raises mid-generation, every accepted request still gets an answer (an error
    event in its stream, a 503 otherwise), /health turns 503 and new requests get 503."""
    s = LiveServer(demo_artifact)
    try:
        c = s.client()
        stream = c.completions.create(
            model=s.model, prompt="x", max_tokens=500, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(stream)
        assert next(it).choices
        pending = {}

        def long_request():
            pending["r"] = s.post(
                "/v1/completions", json={"prompt": "y", "max_tokens": 500, "ignore_eos": True}
            )

        t = threading.Thread(target=long_request)
        t.start()
        s.wait_running(2)

        def boom():
            raise RuntimeError("injected device failure")

        s.call(lambda e: setattr(e, "step", boom))
        with pytest.raises(openai.APIError) as e:
            list(it)
        assert "injected device failure" in str(e.value)
        t.join(30)
        err = assert_error(pending["r"], 503)
        assert "injected device failure" in err["message"] and err["type"] == "server_error"
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "injected device failure" in r.json()["error"]
        assert_error(s.post("/v1/completions", json={"prompt": "z", "max_tokens": 1}), 503)
        assert_error(
            s.post("/v1/completions", json={"prompt": "z", "temperature": -1}), 400
        )  # still validated
    finally:
        s.stop()


def test_validation_messages_name_the_fields_not_the_union_branches(server):
    """A field that fails every branch of its type says what each branch expected, in the
    request's own terms (no pydantic branch tags such as ``.str`` or ``.literal[...]``)."""
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]},
         "messages.0.content: Input should be a valid string; or messages.0.content.0.type: Input should be 'text'"),
        ("/v1/completions", {"prompt": ["hi", 5]}, "prompt: Input should be a valid string"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
         "tool_choice: Input should be 'none', 'auto' or 'required'"),
    ]  # fmt: skip
    for path, body, want in cases:
        err = assert_error(server.post(path, json=body), 400)
        assert err["message"].startswith(want), err
        assert ".str" not in err["message"] and "literal[" not in err["message"], err
