"""Tool calls in a model's output text: the formats of the architectures kiln serves, parsed into
OpenAI's ``tool_calls``, and the shape of one call for a grammar that forces it (``CALL_SHAPES``,
:func:`call_schema`: ``tool_choice`` "required" or a named function, runtime/server_tools.py).

Formats (``FORMATS``; :func:`format_for` picks one from the architecture):

* ``llama3_json`` (Llama 3.x): the whole answer is one JSON object ``{"name": ..., "parameters":
  {...}}`` (``"arguments"`` accepted too), optionally after ``<|python_tag|>``; several calls are
  separated by ``;``.
* ``hermes`` (Qwen 2/2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks; text before the first block is the message content (trailing whitespace dropped).
* ``mistral`` (Mistral, Mixtral): ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``
  objects; text before the marker is the content (trailing whitespace dropped).

:func:`parse_tool_calls` returns ``(content, calls)``. Output that does not parse as the format's
calls (truncated JSON, a call without a name, arguments that are not an object) is plain content
with no calls: never an error, so a server answers it as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("llama3_json", "hermes", "mistral")
_BY_ARCH = (
    ("Llama", "llama3_json"),
    ("Qwen", "hermes"),
    ("Mistral", "mistral"),
    ("Mixtral", "mistral"),
)
# One call as each format writes it: (text before the JSON object, its arguments' key, text after).
CALL_SHAPES = {
    "llama3_json": ("", "parameters", ""),
    "hermes": ("<tool_call>\n", "arguments", "\n</tool_call>"),
    "mistral": ("[TOOL_CALLS][", "arguments", "]"),
}
# Where a call may begin in free text (tool_choice "auto"): streamed text is held back from here.
CALL_MARKERS = {
    "llama3_json": ("{", "<|python_tag|>"),
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON object's text (OpenAI's shape)."""

    name: str
    arguments: str


def format_for(architecture: str) -> str | None:
    """The tool-call format of a Hugging Face architecture name, or None when kiln knows none."""
    return next((fmt for prefix, fmt in _BY_ARCH if architecture.startswith(prefix)), None)


def call_schema(fmt: str, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call of function ``name`` in format ``fmt``'s object: the name as a
    constant, its arguments under the format's key following ``parameters`` (None: no arguments,
    ``{}``, as OpenAI defines a function without parameters)."""
    args_key = CALL_SHAPES[fmt][1]
    none = {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: parameters or none},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(objs: list[Any], args_key: str) -> list[ToolCall] | None:
    calls = [_call(o, args_key) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a model's output in format ``fmt`` (module docstring); content is
    None when the output is calls only."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}")
    calls: list[ToolCall] | None = None
    content: str | None = text
    if fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            parts = (
                [_loads(p) for p in body.split(";")]
                if ";" in body and _loads(body) is None
                else [_loads(body)]
            )
            calls = _calls(parts, "parameters")
            content = None
    elif fmt == "hermes":
        blocks = _HERMES.findall(text)
        if blocks:
            calls = _calls([_loads(b) for b in blocks], "arguments")
            content = text[: text.index("<tool_call>")].rstrip() or None
    else:  # mistral
        if "[TOOL_CALLS]" in text:
            head, _, tail = text.partition("[TOOL_CALLS]")
            objs = _loads(tail.strip())
            calls = _calls(objs if isinstance(objs, list) else [objs], "arguments")
            content = head.rstrip() or None
    if calls is None:
        return text, []
    return content, calls
