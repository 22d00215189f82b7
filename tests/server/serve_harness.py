"""Test harness: a real ``kiln serve`` on a loopback port, in this process: uvicorn on its own thread, over an
engine on an artifact (the tests use the built-in demo model).

``LiveServer.call(fn)`` runs ``fn(engine)`` on the engine thread between steps (the test hook;
no HTTP endpoint exposes the engine).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest


class LiveServer:
    def __init__(self, artifact: Path, **opts: Any):
        import torch.distributed as dist

        from kiln.runtime.engine import Engine, EngineOptions
        from kiln.runtime.server import ServerOptions, create_app
        from kiln.runtime.server_run import uvicorn_server

        if dist.is_initialized():  # KILN_TEST_TP mode (tests/server/conftest.py)
            pytest.skip("a tensor-parallel engine already runs in this process (one group per process)")
        engine_keys = {"max_running", "kv_memory_gib"}
        eng_opts = {k: opts.pop(k) for k in list(opts) if k in engine_keys}
        device = opts.pop("device", "cpu")
        self.engine = Engine(str(artifact), EngineOptions(device=device, log=False, **eng_opts))
        self.app = create_app(self.engine, ServerOptions(**opts))
        self.kiln = self.app.state.kiln
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn_server(
            self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=2
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    @property
    def model(self) -> str:
        return self.kiln.model_name

    def call(self, fn: Any, timeout: float = 30.0) -> Any:
        return self.kiln.worker.call(fn).result(timeout)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no request is queued or running and every HTTP request was released."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.call(lambda e: e.status())
            if s["running"] == 0 and s["waiting"] == 0 and self.kiln.inflight == 0:
                return s
            assert time.monotonic() < deadline, f"server not idle after {timeout} s: {s}"
            time.sleep(0.05)

    def wait_running(self, n: int, timeout: float = 30.0) -> None:
        """Wait until ``n`` sequences are running."""
        deadline = time.monotonic() + timeout
        while self.kiln.worker.alive and self.call(lambda e: e.status())["running"] < n:
            assert time.monotonic() < deadline, f"fewer than {n} requests running after {timeout} s"
            time.sleep(0.02)

    def check_clean(self) -> dict[str, Any]:
        """Idle, KV integrity clean, no leaked request or sink, every used slot in the prefix cache."""
        s = self.wait_idle()
        self.call(lambda e: e.check_integrity())
        assert self.call(lambda e: len(e.requests)) == 0
        assert self.call(lambda e: len(self.kiln.worker._sinks)) == 0
        assert s["kv_free_tokens"] + s["kv_cached_tokens"] == s["kv_capacity_tokens"], s
        return s

    def client(self, **kw: Any):
        import openai

        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kw)

    def async_client(self, **kw: Any):
        import openai

        kw.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def assert_error(r: httpx.Response, status: int, param: str | None = "-", code: str | None = "-") -> dict:
    """``r`` is an OpenAI-shaped error with ``status`` (and ``param``/``code`` unless "-")."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param != "-":
        assert err["param"] == param, err
    if code != "-":
        assert err["code"] == code, err
    return err
