"""Tool calls in the server's replies (runtime/server_tools.py) on recorded model outputs in each
format, well-formed and malformed: streamed in any chunking, the content and calls equal the whole
answer's; malformed calls are plain content."""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("pydantic")

from kiln.runtime.server_tools import ToolDef, ToolRequestError, ToolStream, tool_message, tool_plan

TOOLS = [ToolDef.model_validate({"type": "function", "function": {"name": n}}) for n in ("a", "get_weather")]
OUTPUTS = {
    "LlamaForCausalLM": [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '<|python_tag|>{"name": "a", "parameters": {}}',
        ' {"name": "a", "parameters": {"x": 1}}; {"name": "get_weather", "parameters": {}}',
        "Hello {not a call}",
        '{"name": "get_weather", "parameters": {"city": "Os',  # cut by max_tokens
        "<|python_ta",
        "The answer is 4.  ",
    ],
    "Qwen3ForCausalLM": [
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "a", "arguments": {"k": 2}}</tool_call>',
        '  Hi  <tool_call>{"name": "a", "arguments": {bad}}</tool_call>',  # malformed JSON
        'x <tool_call>{"name": "a"',  # unterminated
        "a < b <tool",  # a marker's prefix at the end
        "plain text\n\n",
    ],
    "MistralForCausalLM": [
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": [1, 2]}}]',
        'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "get_weather", "arguments": {}}]',
        "[TOOL_CALLS] not json",
        "[TOOL",
    ],
}


def _stream(text: str, plan, cuts: list[int]):
    s = ToolStream(plan)
    content, bounds = "", [0, *cuts, len(text)]
    for lo, hi in itertools.pairwise(bounds):
        content += s.feed(text[lo:hi])
    rest, calls, reason = s.finish("stop")
    content += rest
    return content or None, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], reason


@pytest.mark.parametrize("arch", sorted(OUTPUTS))
def test_streamed_content_and_calls_equal_the_whole_answer(arch):
    plan = tool_plan(TOOLS, "auto", arch)
    rng = random.Random(0)
    parsed = 0
    for text in OUTPUTS[arch]:
        msg, reason = tool_message(text, plan, "stop")
        want = (
            msg["content"],
            [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])],
            reason,
        )
        parsed += bool(want[1])
        assert (reason == "tool_calls") == bool(want[1])
        for cuts in [
            list(range(1, len(text))),
            sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))),
            [],
        ]:
            assert _stream(text, plan, cuts) == want, (text, cuts)
    assert 0 < parsed < len(OUTPUTS[arch])  # both kinds among the recordings


def test_malformed_calls_are_plain_content():
    plan = tool_plan(TOOLS, "auto", "Qwen3ForCausalLM")
    text = '  Hi  <tool_call>{"name": "a", "arguments": {bad}}</tool_call>'
    assert tool_message(text, plan, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_text_before_a_call_streams_before_the_call_ends():
    s = ToolStream(tool_plan(TOOLS, "auto", "Qwen3ForCausalLM"))
    assert s.feed("Let me look") == "Let me look"
    assert s.feed(".\n<tool") == "."  # the newline and the marker's prefix are held
    assert s.feed('_call>{"name": "a", "arguments": {}}</tool_call>') == ""
    assert s.finish("stop")[0] == ""


def test_none_is_not_parsed_and_forced_holds_everything():
    assert tool_plan(TOOLS, "none", "LlamaForCausalLM").parse is False
    forced = tool_plan(TOOLS, "required", "LlamaForCausalLM")
    assert forced.grammar is not None and ToolStream(forced).feed("{") == ""
    with pytest.raises(ToolRequestError, match="no tool-call format for GPT2LMHeadModel") as e:
        tool_plan(TOOLS, None, "GPT2LMHeadModel")
    assert e.value.param == "tools"
    assert tool_plan(TOOLS, "none", "GPT2LMHeadModel").parse is False  # text only: no format needed
