"""Tool calling in ``kiln serve``'s chat completions: the request's ``tools`` and ``tool_choice``,
what the chat template sees, the grammar that forces a call, and the reply's ``tool_calls``.

Protocol (OpenAI's). ``tools`` lists functions ``{"type": "function", "function": {"name",
"description", "parameters"}}`` (``parameters``: a JSON schema of the arguments object).
``tool_choice``:

* ``"none"``: the answer is text (the template still sees the tools; the output is not parsed);
* ``"auto"`` (the default with tools): the model may call; its output is parsed in the format of
  its architecture (runtime/tool_parsers.py) and calls become ``tool_calls`` with
  ``finish_reason`` ``"tool_calls"``; output that does not parse is text content, never an error;
* ``"required"``, or ``{"type": "function", "function": {"name": N}}``: one call of one of the
  tools (of N), forced by a grammar (runtime/grammar.py ``ToolCallGrammar``), so it always parses
  and its arguments validate against the tool's ``parameters``.

Streaming (:class:`ToolStream`): text goes out as content deltas until a call could begin (a
format's marker, or a prefix of one, or trailing whitespace that would be stripped before it);
from there the text is held to the end and goes out as one ``tool_calls`` delta per call or, when it
does not parse, as content. The streamed content and calls equal the non-streamed message's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.runtime.grammar import ToolCallGrammar
from kiln.runtime.tool_parsers import CALL_MARKERS, FORMATS, ToolCall, format_for, parse_tool_calls


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools as the server uses them: ``tools`` for the chat template (OpenAI's
    dicts), ``parse`` whether the output is parsed for calls (auto, forced), ``fmt`` the tool-call
    format, ``grammar`` the forced call (required, named) or None."""

    tools: list[dict[str, Any]]
    parse: bool
    fmt: str | None
    grammar: ToolCallGrammar | None


class ToolRequestError(ValueError):
    """A bad ``tools`` / ``tool_choice`` (``param`` names the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def tool_plan(tools: list[ToolDef] | None, choice: ToolChoice | None, architecture: str) -> ToolPlan | None:
    """The plan for a request's ``tools`` and ``tool_choice`` on a model of ``architecture``; None
    when the request has no tools (and its choice allows that). Raises :class:`ToolRequestError`."""
    if not tools:
        if choice is None or choice in ("none", "auto"):
            return None
        raise ToolRequestError("tool_choice", "tool_choice 'required' or a named function needs tools")
    names = [t.function.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ToolRequestError("tools", f"tool names must be unique; repeated: {', '.join(dup)}")
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ToolRequestError(
                "tool_choice",
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})",
            )
    choice = choice or "auto"
    fmt = format_for(architecture)
    if fmt is None and choice != "none":
        raise ToolRequestError(
            "tools",
            f"kiln knows no tool-call format for {architecture} (it parses {', '.join(FORMATS)}); "
            "send tool_choice 'none' or leave the tools out",
        )
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    grammar = None
    if forced:
        assert fmt is not None
        grammar = ToolCallGrammar(
            fmt,
            tuple(
                (t.function.name, json.dumps(t.function.parameters) if t.function.parameters else None)
                for t in chosen
            ),
        )
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    return ToolPlan(as_dicts, choice != "none", fmt, grammar)


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries (each with a fresh ``call_`` id)."""
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def tool_message(text: str, plan: ToolPlan, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message for a whole output and its finish reason (``tool_calls`` when the
    output is calls and the model stopped by itself)."""
    content, calls = parse_tool_calls(text, plan.fmt) if plan.parse and plan.fmt else (text, [])
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        return msg, finish_reason
    msg["tool_calls"] = openai_calls(calls)
    return msg, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStream:
    """One choice's streamed text under a plan that parses calls (module docstring)."""

    def __init__(self, plan: ToolPlan):
        assert plan.parse and plan.fmt is not None
        self.fmt = plan.fmt
        self.forced = plan.grammar is not None
        self.text = ""
        self.sent = 0  # characters of text already sent as content

    def feed(self, new_text: str) -> str:
        """Content to send now for ``new_text`` (the rest is held)."""
        self.text += new_text
        hold = 0 if self.forced else self._hold_from()  # where the held text begins
        out = self.text[self.sent : max(hold, self.sent)]
        self.sent = max(hold, self.sent)
        return out

    def _hold_from(self) -> int:
        """Where the held text begins: at a marker (or a marker's prefix at the end), less the
        whitespace before it; llama3_json calls are a whole answer, so only at the start."""
        t = self.text
        markers = CALL_MARKERS[self.fmt]
        if self.fmt == "llama3_json":
            body = t.lstrip()
            could_be_call = not body or any(body.startswith(m) or m.startswith(body) for m in markers)
            return 0 if could_be_call and self.sent == 0 else len(t)
        # (text already sent holds no marker: search from there, not the whole text each token)
        at = min((i for i in (t.find(m, self.sent) for m in markers) if i >= 0), default=len(t))
        if at == len(t):  # a marker's beginning at the end of the text
            for k in range(1, max(len(m) for m in markers)):
                if any(m.startswith(t[-k:]) for m in markers) and len(t) >= k:
                    at = min(at, len(t) - k)
        return len(t[:at].rstrip())

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """At the end: the content still to send, the calls, and the finish reason."""
        content, calls = parse_tool_calls(self.text, self.fmt)
        if not calls:
            return self.text[self.sent :], [], finish_reason
        rest = (content or "")[self.sent :]
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return rest, [{"index": k, **c} for k, c in enumerate(openai_calls(calls))], reason
