"""Tool calling through the official openai client (runtime/server_tools.py) on the demo model, a
random-weight Llama (tool-call format ``llama3_json``): its free text is noise, so a call that
parses and validates comes only from the grammar that ``tool_choice`` "required" or a named
function imposes; "none" and "auto" answer its noise as text. Streamed and whole answers agree."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city over the next days.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"enum": ["C", "F"]},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_items",
            "parameters": {
                "type": "object",
                "properties": {
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": -99, "maximum": 99},
                        "maxItems": 3,
                    }
                },
                "required": ["items"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},  # no parameters: called with {}
]
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", NO_ARGS) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo this week?"}]


def _check_call(call) -> str:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return call.function.name


@pytest.mark.parametrize("seed", range(8))
def test_required_always_yields_a_valid_call_of_a_declared_tool(server, seed):
    r = server.client().chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=120, temperature=1.0, seed=seed, n=3,
    )  # fmt: skip
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None and len(ch.message.tool_calls) == 1
        assert _check_call(ch.message.tool_calls[0]) in SCHEMAS


def test_a_named_function_is_the_one_called(server):
    r = server.client().chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0, seed=3, n=4,
        tool_choice={"type": "function", "function": {"name": "add_items"}},
    )  # fmt: skip
    assert [_check_call(ch.message.tool_calls[0]) for ch in r.choices] == ["add_items"] * 4


def _streamed(c, model, **kw):
    """(content, [(name, arguments)], finish_reason) assembled from the stream's deltas; every
    chunk says something (no empty delta while text is held back where a call may begin)."""
    content, calls, reason = "", {}, None
    for chunk in c.chat.completions.create(model=model, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            assert d.role or d.content or d.tool_calls or ch.finish_reason, chunk
            content += d.content or ""
            for tc in d.tool_calls or ():
                calls.setdefault(tc.index, [tc.function.name, ""])
                calls[tc.index][1] += tc.function.arguments or ""
            reason = ch.finish_reason or reason
    return content or None, [tuple(v) for _, v in sorted(calls.items())], reason


@pytest.mark.parametrize("choice", ["required", "auto", "none"])
def test_streamed_and_whole_answers_agree(server, choice):
    c = server.client()
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0.0)
    whole = c.chat.completions.create(model=server.model, **kw).choices[0]
    calls = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()]
    assert _streamed(c, server.model, **kw) == (whole.message.content, calls, whole.finish_reason)
    if choice == "required":
        assert len(calls) == 1 and whole.finish_reason == "tool_calls"
    else:  # the random model's noise is not a call: text
        assert not calls and whole.message.content


def test_the_template_sees_the_tools_and_an_earlier_call_and_its_result(server):
    c = server.client()
    plain = c.chat.completions.create(model=server.model, messages=ASK, max_tokens=1)
    with_tools = c.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 4}'},
    ]  # fmt: skip
    r = c.chat.completions.create(model=server.model, messages=history, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),  # a name twice
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ],
    ids=[
        "required-without-tools",
        "unknown-name",
        "duplicate",
        "with-response-format",
        "bad-choice",
        "bad-name",
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=server.model, messages=ASK, max_tokens=4, **kw)
    assert param in str(e.value.body), e.value.body
