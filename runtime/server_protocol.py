"""The OpenAI wire format of ``kiln serve``: request models, their checks, errors, logprobs.

Request bodies are pydantic models in strict mode (``"5"`` is not an integer, ``1`` is not a
boolean), so wrong types fail validation; the server maps every validation failure to a 400 in
OpenAI's error shape. Fields the API defines but kiln does not implement (``logit_bias``,
``echo``, ``suffix``) are rejected when set, never silently ignored. Tools: runtime/server_tools.py. Structured outputs:
``response_format`` (``text``, ``json_object``, ``json_schema``) and the extensions ``regex``,
``ebnf`` and ``choice`` (one of them per request; runtime/grammar.py).
Unknown fields are ignored, as OpenAI's own server does.

Range checks beyond ``SamplingParams.validate()`` keep every value the engine sees safe on the
device (float32 and int64 tensors): ``top_k`` past the vocabulary means off, temperatures
below 1e-5 mean greedy (as vLLM does), stop token ids must be in the vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.runtime.grammar import StructuredOutputs
from kiln.runtime.reasoning import ReasoningSplit, split_reasoning
from kiln.runtime.request import RequestOutput
from kiln.runtime.sampling_params import InvalidSamplingParams, SamplingParams
from kiln.runtime.server_tools import (
    ToolChoice,
    ToolDef,
    ToolPlan,
    ToolRequestError,
    ToolStream,
    tool_message,
    tool_plan,
)
from kiln.runtime.server_worker import EngineFailure

MAX_N = 128  # completions per prompt (OpenAI's cap)
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default)
MAX_PROMPTS = 1024  # prompts in one /v1/completions batch
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# ----------------------------------------------------------------------------------- models
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions (``top_k``, ``min_p``, ``ignore_eos``,
    ``min_tokens``, ``repetition_penalty``, ``stop_token_ids`` and ``skip_special_tokens`` are
    extensions, as in vLLM; ``speculative: false`` turns the server's speculative decoding off for
    the request)."""

    model: str | None = None
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    seed: int | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None
    speculative: bool | None = None

    def unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias", "logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream: true")

    def structured(self) -> StructuredOutputs | None:
        """The request's structure (``response_format`` or one extension), or None; 400 naming
        the field when it is malformed or when two are given."""
        given: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                given.append(("response_format", StructuredOutputs(json_object=True)))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request(
                        "response_format",
                        "response_format json_schema needs {'json_schema': {'schema': {...}}}",
                    )
                given.append(("response_format", StructuredOutputs(json_schema=json.dumps(schema))))
            elif kind not in (None, "text"):
                raise bad_request(
                    "response_format",
                    f"response_format type must be text, json_object or json_schema, got {kind!r}",
                )
        if self.regex is not None:
            given.append(("regex", StructuredOutputs(regex=self.regex)))
        if self.ebnf is not None:
            given.append(("ebnf", StructuredOutputs(ebnf=self.ebnf)))
        if self.choice is not None:
            if not self.choice:
                raise bad_request("choice", "choice must be a non-empty list of strings")
            given.append(("choice", StructuredOutputs(choice=tuple(self.choice))))
        if len(given) > 1:
            raise bad_request(
                given[1][0], f"give one structure per request, not {' and '.join(g[0] for g in given)}"
            )
        return given[0][1] if given else None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or
    a list of token-id lists; ``logprobs``: how many top alternatives to report per token."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise bad_request("echo", "echo is not supported by this server")
        if self.suffix:
            raise bad_request("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of", "best_of other than n is not supported by this server")

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: strings (to tokenize) or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out:
            raise bad_request("prompt", "the prompt is empty")
        if len(out) > MAX_PROMPTS:
            raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(out)}")
        return out


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: content flattened to one string; an
        assistant's calls as ``{"name", "arguments"}`` with the arguments as an object (as Hugging
        Face templates expect), also under ``function``."""
        c = self.content
        text = "".join(p.text for p in c) if isinstance(c, list) else (c or "")
        msg: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request("messages", "a tool call needs {'function': {'name', 'arguments'}}")
                args = fn.get("arguments", "{}")
                with contextlib.suppress(json.JSONDecodeError):  # else the template gets the text
                    args = json.loads(args) if isinstance(args, str) else args
                f = {"name": fn["name"], "arguments": args}
                calls.append({"id": call.get("id"), "type": "function", "function": f, **f})
            msg["tool_calls"] = calls
        return msg


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``logprobs``: report the chosen tokens' logprobs;
    ``top_logprobs``: and this many alternatives. ``max_completion_tokens`` is the newer name of
    ``max_tokens`` (it wins when both are given); without either, the rest of the context (or of
    the KV pool, when that is smaller)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    def tool_plan(self, architecture: str) -> ToolPlan | None:
        """The request's tools as the server uses them (runtime/server_tools.py); 400 naming the
        field when they are inconsistent."""
        try:
            return tool_plan(self.tools, self.tool_choice, architecture)
        except ToolRequestError as e:
            raise bad_request(e.param, str(e)) from None


# ------------------------------------------------------------------------- sampling params
def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, vocab_size: int, tools: ToolPlan | None = None
) -> SamplingParams:
    """The request's :class:`SamplingParams`; ``max_tokens`` 0 means "not given" (completions:
    16, chat: the rest of the context; either capped to what fits, see :func:`resolve_max_tokens`).
    ``tools``: a chat request's tool plan (a forced call is its structure).
    Raises ``APIError`` (400) naming the first
    bad parameter."""
    req.unsupported()
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        mt_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        lp_name = "top_logprobs"
    else:
        max_tokens, mt_name = req.max_tokens, "max_tokens"
        logprobs, lp_name = req.logprobs, "logprobs"
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request("n", f"n must be an integer in [1, {MAX_N}], got {n}")
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature > MAX_TEMPERATURE:
        raise bad_request(
            "temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}"
        )
    if 0 <= temperature < GREEDY_BELOW:
        temperature = 0.0
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    lo, hi = REPETITION_PENALTY_RANGE
    if not lo <= rep <= hi:
        raise bad_request("repetition_penalty", f"repetition_penalty must be in [{lo:g}, {hi:g}], got {rep}")
    top_k = -1 if req.top_k is None else req.top_k
    if top_k >= vocab_size:
        top_k = -1  # keeps every token anyway
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise bad_request("seed", "seed must be a 64-bit integer")
    for t in req.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise bad_request("stop_token_ids", f"stop token ids must be in [0, {vocab_size}), got {t}")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(mt_name, f"{mt_name} must be an integer >= 1, got {max_tokens}")
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 2**31 - 1,  # resolved per prompt
        min_tokens=req.min_tokens or 0,
        temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        repetition_penalty=rep,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        seed=req.seed,
        stop=req.stop if req.stop else None,
        stop_token_ids=req.stop_token_ids or None,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens is not False,
        n=n,
        structured=_structure(req, tools),
        speculative=req.speculative,
    )
    try:
        params.validate()
    except InvalidSamplingParams as e:
        param = {"max_tokens": mt_name, "logprobs": lp_name}.get(e.param, e.param)
        raise bad_request(param, f"{param}: {e.message}") from None
    if max_tokens is None:
        params.max_tokens = 0  # 0 = "not given", resolved per prompt
    return params


def _structure(
    req: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None
) -> StructuredOutputs | None:
    given = req.structured()
    if tools is None or tools.grammar is None:
        return given
    if given is not None:
        raise bad_request(
            "tool_choice", "a forced tool call (tool_choice) and a structured output cannot be combined"
        )
    return StructuredOutputs(tool_call=tools.grammar)


def resolve_max_tokens(
    params: SamplingParams,
    prompt_len: int,
    context: int,
    param: str,
    max_request_tokens: int | None = None,
    default: int | None = None,
) -> int:
    """``max_tokens`` for one prompt of ``prompt_len`` tokens. A request's prompt plus its
    generated tokens must fit ``max_request_tokens`` (the engine's limit: the ``context`` or, when
    smaller, the KV pool, which one request must fit alone). ``max_tokens`` 0 ("not given") becomes
    ``default`` (None: no default), capped to what fits (such a request ends with
    ``finish_reason="length"``); a prompt, or an explicit ``max_tokens``, that does not fit is a
    400 naming the limit and its cause."""
    limit = context if max_request_tokens is None else min(context, max_request_tokens)
    if prompt_len >= limit:
        raise prompt_too_long(param, f"the prompt has {prompt_len} tokens", context, limit)
    room = limit - prompt_len
    if params.max_tokens == 0:
        want = room if default is None else min(default, room)
        if want < params.min_tokens:
            why = limit_reason(context, limit) if want == room else f"the default max_tokens is {default}"
            raise bad_request(
                "min_tokens",
                f"min_tokens is {params.min_tokens} but only {want} tokens can be generated ({why})",
                "context_length_exceeded" if want == room else None,
            )
        return want
    if params.max_tokens > room:
        raise bad_request(
            "max_tokens",
            f"{limit_reason(context, limit)}: the prompt has {prompt_len} tokens, so at most "
            f"{room} can be generated, but max_tokens is {params.max_tokens}; lower max_tokens"
            + ("" if limit == context else " or raise --kv-memory"),
            "context_length_exceeded",
        )
    return params.max_tokens


def limit_reason(context: int, limit: int) -> str:
    """Why a request may hold at most ``limit`` tokens (prompt plus generated)."""
    if limit >= context:
        return f"this model's context is {context} tokens"
    return (
        f"this server's KV pool holds {limit} tokens, less than the model's context of {context}, "
        "and one request must fit it alone"
    )


def prompt_too_long(param: str, has: str, context: int, limit: int) -> APIError:
    """The 400 for a prompt that leaves no room to generate (``has``: "the prompt has N tokens")."""
    fix = "shorten the prompt" if limit >= context else "shorten the prompt or raise --kv-memory"
    return bad_request(param, f"{limit_reason(context, limit)}, but {has}; {fix}", "context_length_exceeded")


# --------------------------------------------------------------------------------- replies
class Reply:
    """One request's answer, built from its engine outputs: the JSON body (:meth:`collect`) or
    the server-sent events (:meth:`events`). Choice ``i * n + k`` is completion ``k`` of prompt
    ``i``. ``server`` provides ``model_name`` and ``token_text(id) -> str``."""

    def __init__(
        self,
        server: Any,
        chat: bool,
        rid: str,
        req: Any,
        prompts: list[list[int]],
        n: int,
        tools: ToolPlan | None = None,
        reasoning: bool | None = None,
    ):
        self.server, self.chat, self.id, self.n = server, chat, rid, n
        self.tools = tools if tools is not None and tools.parse else None  # outputs parsed for calls
        self.reasoning = reasoning  # None: no split; else whether the output starts in the thinking
        self.created = int(time.time())
        self.prompt_lens = [len(p) for p in prompts]
        self.nseq = len(prompts) * n
        self.want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        self.finals: dict[int, RequestOutput] = {}
        self.offsets = [0] * self.nseq  # completions logprobs: text offset per choice
        self.done = False  # every sequence finished

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.model_name}

    def _logprobs(self, i: int, entries: list[dict], text: str) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tt = self.server.token_text
        if self.chat:
            return chat_logprobs(entries, tt)
        lp = completion_logprobs(entries, tt, self.offsets[i])
        self.offsets[i] += len(text)
        return lp

    def _take(self, i: int, out: RequestOutput) -> None:
        if out.finished:
            self.finals[i] = out
            self.done = len(self.finals) == self.nseq

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_lens)
        completion = sum(o.num_output_tokens for o in self.finals.values())
        cached = 0
        for p in range(len(self.prompt_lens)):  # per prompt: the least any of its copies reused
            got = [
                self.finals[i].num_cached_tokens
                for i in range(p * self.n, (p + 1) * self.n)
                if i in self.finals
            ]
            cached += min(got, default=0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def collect(self, sink: Any) -> dict[str, Any]:
        """Wait for every sequence; the response body."""
        texts: list[list[str]] = [[] for _ in range(self.nseq)]
        lps: list[list[dict]] = [[] for _ in range(self.nseq)]
        while not self.done:
            out = await sink.queue.get()
            if isinstance(out, EngineFailure):
                raise APIError(503, out.message, "server_error")
            i = sink.rids[out.rid]
            texts[i].append(out.new_text)
            lps[i] += out.new_logprobs
            self._take(i, out)
        choices = []
        for i in range(self.nseq):
            text, fin = "".join(texts[i]), self.finals[i]
            c: dict[str, Any] = {"index": i}
            reason = fin.finish_reason
            if self.chat:
                thought, answer = (
                    (None, text) if self.reasoning is None else split_reasoning(text, self.reasoning)
                )
                if self.tools is not None:
                    c["message"], reason = tool_message(answer, self.tools, reason)
                else:
                    c["message"] = {"role": "assistant", "content": answer}
                if self.reasoning is not None:
                    c["message"]["reasoning_content"] = thought
            else:
                c["text"] = text
            c["logprobs"] = self._logprobs(i, lps[i], text)
            c["finish_reason"] = reason
            choices.append(c)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": self.usage(), "system_fingerprint": None}

    async def events(self, sink: Any, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per sequence per step as tokens arrive, a usage chunk when
        asked for, then ``[DONE]``. Outputs that queued up meanwhile go out in one write."""
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if include_usage:
            head["usage"] = None

        def chunk(choice: dict[str, Any]) -> str:
            return sse({**head, "choices": [choice]})

        streams: dict[int, ToolStream] = {}  # per choice, with tools
        thinking: dict[int, ReasoningSplit] = {}  # per choice, with a thinking template
        if self.chat:  # the role first, as OpenAI does
            first = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield "".join(chunk({"index": i, **first}) for i in range(self.nseq)).encode()
        while not self.done:
            batch = [await sink.queue.get()]
            while not sink.queue.empty():
                batch.append(sink.queue.get_nowait())
            parts = []
            for out in batch:
                if isinstance(out, EngineFailure):  # the error, then the end marker clients wait for
                    parts += [sse(error_body(out.message, "server_error")), "data: [DONE]\n\n"]
                    yield "".join(parts).encode()
                    return
                i = sink.rids[out.rid]
                self._take(i, out)
                if not (out.new_text or out.finished or (self.want_logprobs and out.new_logprobs)):
                    continue
                c: dict[str, Any] = {"index": i}
                reason = out.finish_reason if out.finished else None
                if self.chat:
                    delta: dict[str, Any] = {}
                    text = out.new_text
                    if self.reasoning is not None:  # the thinking apart (runtime/reasoning.py)
                        split = thinking.setdefault(i, ReasoningSplit(self.reasoning))
                        thought, text = split.feed(text, final=out.finished)
                        if thought:
                            delta["reasoning_content"] = thought
                    if self.tools is not None:  # content held where a call may begin
                        stream = streams.setdefault(i, ToolStream(self.tools))
                        text = stream.feed(text)
                        if out.finished:
                            rest, calls, reason = stream.finish(reason)
                            text += rest
                            if calls:
                                delta["tool_calls"] = calls
                    c["delta"] = {"content": text, **delta} if text else delta
                    if not c["delta"] and not out.finished and not (self.want_logprobs and out.new_logprobs):
                        continue  # nothing to say yet (text held back where a tool call may begin)
                else:
                    c["text"] = out.new_text
                c["logprobs"] = self._logprobs(i, out.new_logprobs, out.new_text)
                c["finish_reason"] = reason
                parts.append(chunk(c))
            if parts:
                yield "".join(parts).encode()
        tail = ""
        if include_usage:
            tail = sse({**head, "choices": [], "usage": self.usage()})
        yield (tail + "data: [DONE]\n\n").encode()


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON (non-ASCII escaped)."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ------------------------------------------------------------------------------- logprobs
def completion_logprobs(entries: list[dict], token_text: Any, offset: int) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object for ``entries`` (the engine's per-token
    ``{token_id, logprob, top: [(id, logprob)]}``); ``offset``: text offset of the first token.
    As OpenAI's, each ``top_logprobs`` entry holds the chosen token beside the top ones (up to
    ``logprobs + 1`` entries)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = token_text(e["token_id"])
        tokens.append(s)
        lps.append(e["logprob"])
        tops.append({**{token_text(i): lp for i, lp in e["top"]}, s: e["logprob"]})  # the chosen too
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[dict], token_text: Any) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def item(tid: int, lp: float) -> dict[str, Any]:
        s = token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**item(e["token_id"], e["logprob"]), "top_logprobs": [item(i, lp) for i, lp in e["top"]]}
            for e in entries
        ]
    }
