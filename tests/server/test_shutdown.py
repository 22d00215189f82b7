"""Graceful shutdown of a real ``kiln serve`` process: SIGTERM while 32 streaming clients are in
flight (and SIGINT, which takes the same path, on an idle server). The server stops listening,
lets the requests in flight finish within ``--shutdown-timeout``, ends the rest with an error
event, and exits 0: every client gets either a complete response (a finish_reason, then
``[DONE]``) or a clean error, never a cut stream.

Bounded: 4 short requests run first (24 tokens: they finish, before or during the drain), 28 long
ones (1000 tokens, ``ignore_eos``: 7 waves of 1000 steps on 4 running slots) are still running or
waiting at the 2 s deadline, keep streaming until it, and are then ended with an error event.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kiln import settings

SHORT, LONG = 4, 28
# a tensor-parallel server (KILN_TEST_TP, tests/server/conftest.py) steps slower on CPU
SHUTDOWN_TIMEOUT = 2.0 * settings.value("test_tp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(artifact: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kiln", "serve", str(artifact), "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        # a shell's background job ignores SIGINT, and a child inherits that: give the server
        # Python's own SIGINT handling, as in a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"kiln serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "kiln serve did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


async def _in_engine(http: httpx.AsyncClient) -> int:
    """Sequences running or waiting in the engine (from /metrics)."""
    text = (await http.get("/metrics")).text
    total = 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("kiln_num_requests_running", "kiln_num_requests_waiting"):
            total += int(float(value))
    return total


async def _stream(url: str, i: int, max_tokens: int, marks: dict) -> dict:
    """One streaming client: 'complete' (finish_reason and [DONE]), 'error' (an error event, then
    [DONE]; or a 503 JSON error) or 'broken' (anything else). ``late``: tokens
    received after ``marks["signal"]``."""
    body = {
        "prompt": f"client {i} says",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    finish, done, error, tokens, late = None, False, None, 0, 0
    try:
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            marks["started"] = marks.get("started", 0) + 1
            if r.status_code != 200:
                err = json.loads(await r.aread())["error"]
                return {"state": "error" if r.status_code == 503 else "broken", "error": err}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                assert not done, "data after [DONE]"
                if line == "data: [DONE]":
                    done = True
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    error, t_error = ev["error"], time.monotonic()
                    continue
                assert error is None, "data after an error event"
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                for c in ev["choices"]:
                    late += marks.get("signal") is not None
                    finish = c["finish_reason"] or finish
    except Exception as e:  # a cut stream, a reset connection: what must not happen
        return {"state": "broken", "error": f"{type(e).__name__}: {e}"}
    if done and finish is not None and error is None:
        return {"state": "complete", "finish": finish, "tokens": tokens}
    if error is not None and done and error.get("type") == "server_error" and error.get("message"):
        return {"state": "error", "error": error, "t": t_error, "late": late}
    return {"state": "broken", "error": f"done={done} finish={finish} error={error} tokens={tokens}"}


async def _scenario(url: str, proc: subprocess.Popen, sig: int) -> tuple[list[dict], dict]:
    marks: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:

        async def until_in_engine(n: int) -> None:
            deadline = time.monotonic() + 30
            while await _in_engine(http) < n:
                assert time.monotonic() < deadline, f"fewer than {n} sequences reached the engine"
                await asyncio.sleep(0.02)

        short = [asyncio.ensure_future(_stream(url, i, 24, marks)) for i in range(SHORT)]
        await until_in_engine(SHORT)  # the short ones take the running slots first
        long = [asyncio.ensure_future(_stream(url, SHORT + i, 1000, marks)) for i in range(LONG)]
    deadline = time.monotonic() + 30
    while marks.get("started", 0) < SHORT + LONG:  # every client has its response headers
        assert time.monotonic() < deadline, marks
        await asyncio.sleep(0.02)
    marks["signal"] = time.monotonic()
    proc.send_signal(sig)
    await asyncio.sleep(0.5)
    try:  # a new request meanwhile: refused (the listener is closed, or a 503)
        r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=5)
        marks["late_request"] = r.status_code
    except httpx.TransportError as e:
        marks["late_request"] = type(e).__name__
    results = await asyncio.wait_for(asyncio.gather(*short, *long), timeout=60)
    return results, marks


def test_sigterm_during_32_streams(demo_artifact, tmp_path):
    log = tmp_path / "serve.log"
    proc, url = _start(demo_artifact, log, "--max-running", "4", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    try:
        results, marks = asyncio.run(_scenario(url, proc, signal.SIGTERM))
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    states = [r["state"] for r in results]
    assert "broken" not in states, [r for r in results if r["state"] == "broken"]
    assert code == 0, (code, out[-3000:])
    assert marks["late_request"] in ("ConnectError", 503), marks
    assert all(r["state"] == "complete" and r["tokens"] == 24 for r in results[:SHORT]), results[:SHORT]
    # the long ones could not finish by the deadline: they kept streaming until it (the running
    # ones), then were ended with the shutdown error, not before the deadline
    errors = [r for r in results[SHORT:] if r["state"] == "error"]
    assert errors, results[SHORT:]
    for r in errors:
        assert "shutting down" in r["error"]["message"], r
        assert r["t"] - marks["signal"] >= SHUTDOWN_TIMEOUT, r
    assert any(r["late"] > 0 for r in errors), "nothing was generated during the drain"
    assert "Traceback" not in out, out[-3000:]


def test_sigint_when_idle_exits_0(demo_artifact, tmp_path):
    """SIGINT (Ctrl+C) on an idle server: the same clean exit, status 0, no traceback."""
    log = tmp_path / "serve.log"
    proc, url = _start(demo_artifact, log)
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert code == 0, (code, out[-3000:])
    assert "Traceback" not in out and "Aborted" not in out, out[-3000:]
