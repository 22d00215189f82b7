"""runtime/tool_parsers.py on model outputs in each format, well formed and not."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.tool_parsers import ToolCall, format_for, parse_tool_calls

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"}))
TIME = ToolCall("get_time", json.dumps({"tz": "UTC"}))


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None, [WEATHER]),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}', None, [WEATHER]),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}', None, [WEATHER, TIME]),
        ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>', "Let me check.", [WEATHER]),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', None, [WEATHER, TIME]),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]', None, [WEATHER, TIME]),
        ("mistral", 'Sure. [TOOL_CALLS] {"name": "get_time", "arguments": {"tz": "UTC"}}', "Sure.", [TIME]),
    ],
)  # fmt: skip
def test_calls_are_parsed(fmt, text, content, calls):
    assert parse_tool_calls(text, fmt) == (content, calls)


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),  # truncated at max_tokens
        ("llama3_json", '{"parameters": {"city": "Paris"}}'),  # no name
        ("llama3_json", "The weather is fine."),  # plain text
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'),  # not an object
        ("hermes", "<tool_call>not json</tool_call>"),
        ("hermes", '<tool_call>{"name": "get_weather"'),  # never closed: no block
        ("mistral", "[TOOL_CALLS] [{"),
        ("mistral", '[TOOL_CALLS] [{"name": "", "arguments": {}}]'),  # empty name
    ],
)  # fmt: skip
def test_malformed_output_is_plain_content(fmt, text):
    assert parse_tool_calls(text, fmt) == (text, [])


def test_formats_by_architecture_and_unknown_format():
    assert format_for("LlamaForCausalLM") == "llama3_json"
    assert format_for("Qwen3ForCausalLM") == format_for("Qwen2ForCausalLM") == "hermes"
    assert format_for("MixtralForCausalLM") == format_for("MistralForCausalLM") == "mistral"
    assert format_for("GPT2LMHeadModel") is None
    with pytest.raises(
        ValueError, match="unknown tool-call format 'xml'; one of llama3_json, hermes, mistral"
    ):
        parse_tool_calls("x", "xml")
