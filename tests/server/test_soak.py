"""Soak: rounds of 64 concurrent clients against one server on the demo model, with a KV pool of
640 tokens (under one 1024-token context), so that requests wait for memory, the prefix cache
evicts and running requests are retracted. Each round a
quarter of the clients leave at random points (before the reply, after the headers, mid-stream),
about a fifth of the others send invalid parameters, the rest random valid requests (completions
and chat, streaming or not, n, stop strings, logprobs, penalties, seeds, short and long prompts,
token-id prompts); a client told the queue is full (429) retries after a pause. After every round: no answer was a 5xx, every staying client got a complete
response (invalid ones a 4xx in OpenAI's shape), nothing is left running, the KV pool and radix
cache pass their integrity checks, and the process memory (RSS) has not grown past a margin over
what it was after the first round.

In CI: 3 rounds (about 15 s). Longer, by hand (the seed varies the traffic):

    KILN_SOAK_ROUNDS=200 KILN_SOAK_SEED=7 .venv/bin/python -m pytest -q tests/server/test_soak.py
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
from pathlib import Path

import httpx
import pytest
from serve_harness import LiveServer

from kiln import settings
from kiln.manifest import Manifest

ROUNDS = settings.value("soak_rounds")  # KILN_SOAK_ROUNDS
SEED = settings.value("soak_seed")  # KILN_SOAK_SEED
N_CLIENTS = 64
KV_TOKENS = 640  # under the 1024-token context: running requests outgrow it and are retracted
RSS_MARGIN = 64 << 20
LEAVER_TOKENS = 200  # what a client that leaves asks for
WORDS = ["the", "kiln", "fires", "clay", "into", "stone", "while", "the", "potter", "waits", "and", "glaze"]


@pytest.fixture(scope="module")
def soak(demo_artifact):
    bytes_per_token = Manifest.load(demo_artifact).kv.bytes_per_token
    s = LiveServer(demo_artifact, kv_memory_gib=KV_TOKENS * bytes_per_token / 2**30)
    yield s
    s.stop()


def _text(rng: random.Random) -> str:
    n = rng.choice([3, 8, 20, 150])  # long prompts fill the pool: the prefix cache evicts
    prefix = "Once upon a time in the workshop, " if rng.random() < 0.4 else ""  # shared: cache hits
    return prefix + " ".join(rng.choice(WORDS) for _ in range(n))


def _valid(rng: random.Random, chat: bool) -> dict:
    body: dict = {"temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
    mt = rng.randint(1, 16)
    if chat:
        msgs = [{"role": "user", "content": _text(rng)}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "Be brief."})
        body["messages"] = msgs
        body["max_completion_tokens" if rng.random() < 0.5 else "max_tokens"] = mt
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
    else:
        if rng.random() < 0.2:
            body["prompt"] = [rng.randrange(300, 4000) for _ in range(rng.randint(1, 40))]
        elif rng.random() < 0.2:
            body["prompt"] = [_text(rng) for _ in range(rng.randint(2, 3))]
        else:
            body["prompt"] = _text(rng)
        body["max_tokens"] = mt
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
    optional = {
        "n": lambda: rng.choice([1, 2]),
        "top_p": lambda: rng.choice([0.5, 0.9, 1.0]),
        "top_k": lambda: rng.choice([-1, 1, 20]),
        "min_p": lambda: rng.choice([0.0, 0.05]),
        "seed": lambda: rng.randrange(1 << 30),
        "stop": lambda: rng.choice(["the", ["\n", "kiln"], "é"]),
        "presence_penalty": lambda: rng.uniform(-1, 1),
        "frequency_penalty": lambda: rng.uniform(-1, 1),
        "repetition_penalty": lambda: rng.choice([1.0, 1.2]),
        "ignore_eos": lambda: rng.random() < 0.5,
        "min_tokens": lambda: rng.randint(0, mt),
    }
    for key, value in optional.items():
        if rng.random() < 0.25:
            body[key] = value()
    return body


# (field, value, status): one bad field on an otherwise valid request
INVALID = [
    ("temperature", -1, 400),
    ("top_p", 0, 400),
    ("n", 0, 400),
    ("n", 1000, 400),
    ("max_tokens", 0, 400),
    ("max_tokens", 5000, 400),
    ("stop", [""], 400),
    ("model", "no-such-model", 404),
    ("top_k", -2, 400),
    ("min_p", 2.0, 400),
    ("seed", 1 << 70, 400),
    ("presence_penalty", 5, 400),
    ("stream", "yes", 400),
    ("stop_token_ids", [1 << 40], 400),
    ("logit_bias", {"5": 1.0}, 400),
]


def _request(rng: random.Random, role: str) -> tuple[str, dict | bytes, int]:
    """(path, body, expected status) for one client."""
    chat = rng.random() < 0.4
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _valid(rng, chat)
    body["stream"] = rng.random() < 0.5
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if role == "leave":
        body.update(max_tokens=LEAVER_TOKENS, ignore_eos=True, n=1)
        body.pop("max_completion_tokens", None)
        body.pop("stop", None)
        return path, body, 200
    if role == "valid":
        return path, body, 200
    k = rng.randrange(len(INVALID) + 3)
    if k == len(INVALID):
        return path, b'{"prompt": "x", ', 400  # not JSON
    if k == len(INVALID) + 1:
        body["messages" if chat else "prompt"] = []
        return path, body, 400
    if k == len(INVALID) + 2:  # far past the context: refused from its length alone
        body["messages" if chat else "prompt"] = (
            [{"role": "user", "content": "kiln " * 40000}] if chat else "kiln " * 40000
        )
        return path, body, 400
    field, value, status = INVALID[k]
    if field == "max_tokens":
        body.pop("max_completion_tokens", None)  # chat: it would win over max_tokens
    body[field] = value
    return path, body, status


async def _client(url: str, rng: random.Random, role: str) -> dict:
    path, body, expect = _request(rng, role)
    stream = isinstance(body, dict) and body.get("stream") is True
    leave_at = rng.choice([-1, 0, 1, 3, 8]) if role == "leave" else None  # -1: before the reply
    await asyncio.sleep(rng.random() * 0.3)  # staggered arrivals
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        if kw.get("content") is not None:
            kw["headers"] = {"content-type": "application/json"}
        if leave_at == -1 or (leave_at is not None and not stream):
            task = asyncio.ensure_future(http.post(path, **kw))
            await asyncio.sleep(rng.random() * 0.2)
            task.cancel()
            return {"role": role, "left": True}
        for _ in range(100):  # a full queue (429) is retried after a pause, as clients do
            async with http.stream("POST", path, **kw) as r:
                if r.status_code == 429:
                    await r.aread()
                    await asyncio.sleep(0.1 + rng.random() * 0.3)
                    continue
                if leave_at == 0:
                    return {"role": role, "left": True, "status": r.status_code}
                lines, events = [], 0
                async for line in r.aiter_lines():
                    lines.append(line)
                    events += line.startswith("data: ")
                    if leave_at is not None and events >= leave_at:
                        return {"role": role, "left": True, "status": r.status_code}
                return {"role": role, "status": r.status_code, "expect": expect, "body": body, "lines": lines}
        raise AssertionError(f"still 429 after 100 tries: {str(body)[:200]}")


def _check(res: dict) -> int:
    """A staying client's answer is complete (valid) or an error in OpenAI's shape (invalid);
    returns the most tokens it may have generated."""
    status, body, lines = res["status"], res["body"], res["lines"]
    assert status == res["expect"], (status, "\n".join(lines)[:300], str(body)[-300:])
    if status != 200:
        err = json.loads("\n".join(lines))["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return 0
    chat = "messages" in body
    p = None if chat else body["prompt"]
    nprompts = len(p) if isinstance(p, list) and isinstance(p[0], str) else 1
    nchoices = nprompts * body.get("n", 1)
    mt = body.get("max_completion_tokens") or body["max_tokens"]
    if body["stream"]:
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert data and data[-1] == "[DONE]", data[-3:]
        finishes: dict[int, str] = {}
        for d in data[:-1]:
            ev = json.loads(d)
            assert "error" not in ev, ev
            for c in ev["choices"]:
                if c["finish_reason"] is not None:
                    assert c["index"] not in finishes, ev
                    finishes[c["index"]] = c["finish_reason"]
        assert sorted(finishes) == list(range(nchoices)), finishes
        reasons = set(finishes.values())
    else:
        out = json.loads("\n".join(lines))
        assert len(out["choices"]) == nchoices, out
        reasons = {c["finish_reason"] for c in out["choices"]}
        assert nchoices <= out["usage"]["completion_tokens"] <= nchoices * mt, out["usage"]
    assert reasons <= {"stop", "length"}, reasons
    return nchoices * mt


def _rss() -> int | None:
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return None
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _round(url: str, rng: random.Random) -> list[dict]:
    roles = []
    for i in range(N_CLIENTS):
        roles.append("leave" if i % 4 == 3 else "invalid" if rng.random() < 0.2 else "valid")
    clients = [_client(url, random.Random(rng.random()), role) for role in roles]
    return await asyncio.wait_for(asyncio.gather(*clients), timeout=120)


def test_soak(soak):
    rng = random.Random(SEED)
    rss: list[int] = []
    counts = {"valid": 0, "invalid": 0, "leave": 0}
    for rnd in range(ROUNDS):
        before = soak.call(lambda e: e.status())["generated_tokens"]
        results = asyncio.run(_round(soak.url, rng))
        assert len(results) == N_CLIENTS
        most = 0  # tokens the round may have generated
        for res in results:
            counts[res["role"]] += 1
            assert res.get("status", 200) < 500, res  # leavers that saw a status, too
            if res.get("left"):
                most += LEAVER_TOKENS // 2  # aborted after at most 8 events, long before 200 tokens
            else:
                most += _check(res)
        after = soak.check_clean()  # idle, KV pool and radix cache intact, nothing leaked
        assert after["generated_tokens"] - before <= most, "a client left but its request ran on"
        gc.collect()
        mem = _rss()
        if mem is not None:
            rss.append(mem)
            assert mem - rss[0] < RSS_MARGIN, f"round {rnd}: RSS grew {(mem - rss[0]) >> 20} MiB: {rss}"
    assert counts["valid"] >= ROUNDS * 30 and counts["invalid"] >= ROUNDS * 3, counts
    preempted = soak.call(lambda e: e.status())["preemptions"]
    assert preempted > 0, "the pool never forced a retraction: the soak misses that path"
    print(f"soak: {ROUNDS} rounds, {counts}, {preempted} preemptions, RSS MiB {[m >> 20 for m in rss]}")
