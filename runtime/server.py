"""``kiln serve``: an OpenAI-compatible HTTP server over one :class:`Engine`.

    app = create_app(engine, ServerOptions(api_key="sk-..."))   # then run it with uvicorn

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming with
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus). The engine runs on its own thread (:mod:`kiln.runtime.server_worker`); handlers
tokenize off the event loop, submit, then stream or collect the outputs. A client that
disconnects aborts its requests and frees their KV. Errors use OpenAI's shape with status 400
(bad parameters, bad JSON, wrong types, prompt too long, prompt plus ``max_tokens`` past what one
request may hold, more than ``max_sequences_per_request`` sequences), 401 (``api_key`` set and the
bearer token missing or wrong), 404 (unknown model or path), 413 (body over ``max_body_bytes``),
429 (``max_queue`` full) and 503 (the engine failed or is stuck, or the server is shutting down).

Reliability: a watchdog on the event loop fails every open request and turns ``/health`` to 503
when the engine makes no progress for ``watchdog_seconds`` while holding work. Shutdown
(:meth:`OpenAIServer.begin_shutdown`, which :mod:`kiln.runtime.server_run` calls on SIGTERM or
SIGINT) admits nothing new, gives the requests in flight ``shutdown_timeout`` seconds to finish,
then ends the rest with an error (an error event in a stream, a 503 otherwise).

Tests reach the engine through ``app.state.kiln.worker.call(fn)`` (runs ``fn(engine)`` between
steps); no HTTP endpoint exposes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.runtime.reasoning import OPEN
from kiln.runtime.server_limits import chars_per_token_bound, min_tokens
from kiln.runtime.server_protocol import (
    DEFAULT_COMPLETION_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Reply,
    bad_request,
    error_body,
    prompt_too_long,
    resolve_max_tokens,
    sampling_params,
)
from kiln.runtime.server_tools import ToolPlan
from kiln.runtime.server_worker import EngineWorker, ServerMetrics, Sink, WorkerUnavailable

QUEUE_PER_SLOT = 8  # default max_queue: this many waiting sequences per running slot


@dataclass(frozen=True)
class ServerOptions:
    model_name: str | None = None  # default: the artifact directory's name
    api_key: str | None = None  # bearer token required on /v1/* when set
    # Sequences allowed to wait for a running slot; past it a request gets 429.
    # None: QUEUE_PER_SLOT x the engine's max_running.
    max_queue: int | None = None
    max_sequences_per_request: int = 256  # prompts x n of one request; past it a 400
    max_body_bytes: int = 16 << 20
    watchdog_seconds: float = 60.0  # no engine progress this long while holding work: fail (0: off)
    shutdown_timeout: float = 30.0  # SIGTERM/SIGINT: seconds in-flight requests get to finish


class OpenAIServer:
    """What the handlers share: the worker, the model's facts, the admission count."""

    def __init__(self, engine: Any, opts: ServerOptions):
        self.opts = opts
        self.model_name = (
            opts.model_name or Path(getattr(engine, "source", engine.artifact.root)).resolve().name
        )
        self.architecture = str(engine.artifact.manifest.model.get("architecture", ""))  # tool-call format
        self.tokenizer = engine.tokenizer
        # a chat template that marks thinking: replies split it into reasoning_content (runtime/reasoning.py)
        self.reasoning = OPEN in (getattr(self.tokenizer, "chat_template", None) or "")
        self.context = engine.max_seq_len
        # prompt + max_tokens of one request: the context or, when smaller, the KV pool
        self.max_request_tokens = min(engine.max_request_tokens, self.context)
        self._chars_per_token: tuple[int | None] | None = None  # (chars_per_token,) once computed
        self._bound_lock = threading.Lock()
        self.vocab_size = engine.vocab_size
        self.max_running = engine.max_running
        self.max_queue = QUEUE_PER_SLOT * self.max_running if opts.max_queue is None else opts.max_queue
        self.metrics = ServerMetrics()
        self.worker = EngineWorker(engine, self.metrics)
        self.inflight = 0  # accepted sequences not yet finished (event loop only)
        self.shutting_down = False  # set once SIGTERM/SIGINT arrived: nothing new is admitted
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ helpers
    @property
    def chars_per_token(self) -> int | None:
        """The most characters of text one token covers (server_limits.py), None without a
        bound. Computed on first use, not at start-up: it reads the whole tokenizer (0.5 s for a
        128k vocabulary on a 2-core CPU), and only a text of at least ``max_request_tokens``
        characters needs it (``ceil(len / L) <= len``: the bound never refuses a shorter one)."""
        with self._bound_lock:
            if self._chars_per_token is None:
                tok = self.tokenizer
                self._chars_per_token = (chars_per_token_bound(tok) if tok is not None else None,)
            return self._chars_per_token[0]

    def token_text(self, tid: int) -> str:
        s = self._token_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            self._token_text[tid] = s
        return s

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _encode(self, prompts: list[str | list[int]]) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, list):
                out.append(p)
                continue
            if self.tokenizer is None:
                raise bad_request("prompt", "this model has no tokenizer; send token ids")
            out.append(self._tokenize(p, True, "prompt"))
        return out

    def _tokenize(self, text: str, special: bool, param: str) -> list[int]:
        """``text``'s token ids; a text whose length alone proves it cannot fit (server_limits.py)
        is refused before it is tokenized."""
        bound = self.chars_per_token if len(text) >= self.max_request_tokens else None
        at_least = min_tokens(text, bound)
        if at_least >= self.max_request_tokens:
            has = (
                f"the prompt has at least {at_least} tokens ({len(text)} characters, at most "
                f"{bound} per token for this tokenizer)"
            )
            raise prompt_too_long(param, has, self.context, self.max_request_tokens)
        return _tokenize(self.tokenizer, text, special, param)

    def _chat_ids(self, req: ChatCompletionRequest, tools: ToolPlan | None) -> tuple[list[int], bool]:
        """The rendered conversation's token ids, and whether it ends inside a thinking block."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request("messages", "this model has no chat template; use /v1/completions")
        messages = [m.to_template() for m in req.messages]
        extra = {"tools": tools.tools} if tools is not None else {}
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as e:  # the template rejected the conversation
            raise bad_request("messages", f"the chat template rejected these messages: {e}") from None
        return self._tokenize(text, False, "messages"), text.rstrip().endswith(OPEN)

    # ------------------------------------------------------------------ requests
    async def generate(self, req: CompletionRequest | ChatCompletionRequest, http: Request) -> Response:
        chat = isinstance(req, ChatCompletionRequest)
        self.check_model(req.model)
        tools = req.tool_plan(self.architecture) if isinstance(req, ChatCompletionRequest) else None
        params = sampling_params(req, self.vocab_size, tools)
        raw = None if chat else req.prompts()
        self.check_sequences(1 if raw is None else len(raw), params.n)
        reasoning: bool | None = None  # chat with a thinking template: whether the output starts inside
        if raw is None:
            assert isinstance(req, ChatCompletionRequest)
            ids, inside = await asyncio.to_thread(self._chat_ids, req, tools)
            prompts = [ids]
            if self.reasoning:
                reasoning = inside
        else:
            prompts = await asyncio.to_thread(self._encode, raw)
        pparam = "messages" if chat else "prompt"
        per_prompt = []
        for ids in prompts:
            if not ids:
                raise bad_request(pparam, "the prompt is empty")
            if any(isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
                raise bad_request(pparam, f"token ids must be in [0, {self.vocab_size})")
            default = None if chat else DEFAULT_COMPLETION_TOKENS
            mt = resolve_max_tokens(params, len(ids), self.context, pparam, self.max_request_tokens, default)
            per_prompt.append(dataclasses.replace(params, max_tokens=mt))
        if self.shutting_down:
            raise APIError(503, "the server is shutting down; retry on another server", "server_error")
        if not self.worker.alive:
            raise APIError(503, f"the server cannot take requests: {self.worker.error}", "server_error")
        n, nseq = params.n, len(prompts) * params.n
        if self.inflight + nseq > self.max_running + self.max_queue:
            raise APIError(
                429,
                f"the server queue is full ({self.inflight} sequences in flight, {self.max_running} "
                f"running at most and {self.max_queue} queued); retry later",
                "rate_limit_error",
                code="queue_full",
            )
        base = uuid.uuid4().hex[:24]
        loop = asyncio.get_running_loop()
        sink = Sink(loop, {f"{base}-{i}-{k}": i * n + k for i in range(len(prompts)) for k in range(n)})
        seqs = [(rid, prompts[i // n], per_prompt[i // n], i % n) for rid, i in sink.rids.items()]
        reply = Reply(
            self, chat, ("chatcmpl-" if chat else "cmpl-") + base, req, prompts, n, tools, reasoning
        )
        self.inflight += nseq
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= nseq
                self.worker.release(sink, abort=not reply.done)

        try:
            await self.worker.submit(sink, seqs)
        except WorkerUnavailable as e:
            release()
            raise APIError(503, f"the server cannot take requests: {e}", "server_error") from None
        except ValueError as e:  # RequestError / InvalidSamplingParams from add_request
            release()
            raise bad_request(getattr(e, "param", pparam), str(e)) from None
        except BaseException:
            release()
            raise
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _Stream(reply.events(sink, include_usage), on_close=release)
        try:
            body = await _unless_disconnected(reply.collect(sink), http)
        finally:
            release()
        return JSON(body) if body is not None else Response(status_code=499)  # 499: client closed

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """A 400 naming ``n`` (or ``prompt``) when one request asks for more sequences (prompts x
        n) than ``max_sequences_per_request``, or than the server can ever hold at once (running
        slots plus queue: a 429 would ask the client to retry what can never be admitted). Checked
        before anything is tokenized."""
        nseq, per_request = num_prompts * n, self.opts.max_sequences_per_request
        capacity = self.max_running + self.max_queue
        if nseq <= min(per_request, capacity):
            limit = None
        elif per_request <= capacity:
            limit, why = per_request, "per request (--max-sequences-per-request)"
        else:
            limit = capacity
            why = f"at once ({self.max_running} running and --max-queue {self.max_queue} waiting)"
        if limit is not None:
            raise bad_request(
                "prompt" if num_prompts > limit or n == 1 else "n",
                f"this request asks for {num_prompts} prompt(s) x n={n} = {nseq} sequences; this server "
                f"takes at most {limit} {why}: send fewer prompts or a smaller n",
            )

    # ------------------------------------------------------------------ shutdown
    def begin_shutdown(self) -> None:
        """On the event loop, once: admit nothing new, give the requests in flight
        ``shutdown_timeout`` seconds, then end the rest with an error (see :meth:`_drain`)."""
        if not self.shutting_down:
            self.shutting_down = True
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.opts.shutdown_timeout
        if self.inflight:
            _log.info(f"kiln: shutting down: {self.inflight} sequence(s) in flight get up to {timeout:g} s")
        deadline = loop.time() + timeout
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            _log.warning(f"kiln: shutdown: aborting {self.inflight} sequence(s) still in flight")
            self.worker.fail(
                f"the server is shutting down and this request did not finish within {timeout:g} s "
                "(--shutdown-timeout)"
            )


_log = logging.getLogger("uvicorn.error")  # the server's log, configured by uvicorn


def _tokenize(tok: Any, text: str, special: bool, param: str) -> list[int]:
    try:
        return tok.encode(text, add_special_tokens=special)
    except Exception as e:  # e.g. lone surrogates, which JSON can carry but UTF-8 cannot
        raise bad_request(param, f"the text could not be tokenized: {e}") from None


class JSON(JSONResponse):
    """JSON with non-ASCII escaped: any string a client sent (lone surrogates included) renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


async def _unless_disconnected(coro: Any, http: Request) -> Any:
    """Await ``coro``; if the client disconnects first, cancel it (the caller aborts)."""
    work = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # a server that reports more than the disconnect: no busy loop

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        return None  # the client left
    return work.result()


class _Stream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (done, client gone)."""

    def __init__(self, content: Any, on_close: Any):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ---------------------------------------------------------------------------------- the app
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: Any) -> str:
    """A validation error's location as the request's fields (``messages.0.content``): without
    "body" and the tags pydantic adds for the branch of a union it tried (``str``,
    ``list[int]``, ``literal[...]``, ``TextPart``)."""
    keep = [
        str(x)
        for x in loc
        if isinstance(x, int)
        or (x != "body" and x not in _TYPE_TAGS and re.fullmatch(r"[a-z_][a-z0-9_]*", str(x)))
    ]
    return ".".join(keep) or "body"


def _validation_message(errors: Any) -> str:
    """One line for a request that failed validation: each way the first field failed (a union's
    branches each say what they expected), e.g. ``messages.0.content: Input should be a valid
    string; or messages.0.content.0.type: Input should be 'text'``."""
    if not errors:
        return "body: invalid request"
    first = _field_path(errors[0].get("loc", ()))
    seen: list[str] = []
    for err in errors:
        path = _field_path(err.get("loc", ()))
        line = f"{path}: {err.get('msg', 'invalid')}"
        if (path == first or path.startswith(first + ".")) and line not in seen:
            seen.append(line)
    return "; or ".join(seen[:4])


def create_app(engine: Any, opts: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app over ``engine``. Its lifespan starts and stops the engine thread."""
    import contextlib

    st = OpenAIServer(engine, opts or ServerOptions())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        st.worker.start()
        limit = st.opts.watchdog_seconds
        watchdog = asyncio.get_running_loop().create_task(_watchdog(st.worker, limit)) if limit > 0 else None
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await asyncio.to_thread(st.worker.stop, 10.0 if st.worker.error is None else 1.0)

    app = FastAPI(title="kiln", version="1", lifespan=lifespan)
    app.state.kiln = st

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSON(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err: dict[str, Any] = dict(e.errors()[0]) if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            msg = f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
            return JSON(error_body(msg, "invalid_request_error"), status_code=400)
        param = loc[0] if loc else None
        return JSON(error_body(_validation_message(e.errors()), "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSON(error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await st.generate(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await st.generate(body, request)

    def model_card() -> dict[str, Any]:
        return {
            "id": st.model_name,
            "object": "model",
            "created": st.created,
            "owned_by": "kiln",
            "max_model_len": st.context,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        st.check_model(model or None)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        if st.shutting_down:
            return JSONResponse({"status": "error", "error": "the server is shutting down"}, 503)
        if st.worker.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": st.worker.error}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        if st.worker.alive:
            try:
                fut = st.worker.call(lambda e: e.status())
                st.metrics.status = await asyncio.wait_for(asyncio.wrap_future(fut), 10.0)
            except (WorkerUnavailable, TimeoutError):
                pass
        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_Gate, st=st)
    return app


async def _watchdog(worker: EngineWorker, limit_s: float) -> None:
    """Check the engine's progress a few times per ``limit_s``, from the event loop (not the
    engine thread, which may be the one stuck); stops once it fired."""
    while not worker.watchdog(limit_s):
        await asyncio.sleep(min(1.0, limit_s / 4))


_ENDPOINTS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"))


class _Gate:
    """ASGI middleware: bearer-token check on /v1/*, the body-size limit (413), HTTP counts."""

    def __init__(self, app: Any, st: OpenAIServer):
        self.app, self.st = app, st

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counted_send(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self._gate(scope, receive, counted_send)
        finally:
            path = scope["path"]
            endpoint = path if path in _ENDPOINTS else "other"  # bounded label values
            self.st.metrics.http.labels(endpoint, str(status[0])).inc()

    async def _gate(self, scope: dict, receive: Any, send: Any) -> None:
        key = self.st.opts.api_key
        if key and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                msg = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                return await _send_json(
                    send, 401, error_body(msg, "invalid_request_error", None, "invalid_api_key")
                )
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, too_big = await _read_body(receive, self.st.opts.max_body_bytes)
            if body is None:  # the client left
                return
            if too_big:
                limit = self.st.opts.max_body_bytes
                msg = f"the request body is larger than {limit} bytes"
                return await _send_json(
                    send, 413, error_body(msg, "invalid_request_error", None, "request_too_large")
                )
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


async def _read_body(receive: Any, limit: int) -> tuple[bytes | None, bool]:
    """The whole body (None if the client disconnected), and whether it passed ``limit`` bytes.
    An oversized body is read to the end but not kept (so the 413 reaches the client), up to
    64 MiB past the limit; beyond that the connection is closed after the reply."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None, False
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size <= limit:
            parts.append(chunk)
        if not msg.get("more_body", False) or size > limit + (64 << 20):
            break
    return (b"" if size > limit else b"".join(parts)), size > limit


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then wait for the disconnect, as the server reports it

    return again


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
