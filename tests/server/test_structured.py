"""Structured outputs through the official openai client (runtime/grammar.py): the demo model has
random weights, so its free text is noise; under a structure every answer must parse and validate
(``jsonschema``), match its regex, or be one of its choices, greedy or sampled, streamed or not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

SCHEMAS = [
    {  # nested object, enum, bounded integer, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]},
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": False,
    },
    {  # an array of bounded numbers
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4}
        },
        "required": ["xs"],
        "additionalProperties": False,
    },
    {  # booleans, enums of numbers, a pattern
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": [1, 2, 3]},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        },
        "required": ["ok", "level", "code"],
        "additionalProperties": False,
    },
]


def _parse(text: str):
    # strict: no raw control characters in strings (xgrammar admits them in length-bounded ones;
    # runtime/grammar.py rewrites that rule)
    return json.loads(text)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested", "array", "enums"])
def test_json_schema_outputs_parse_and_validate(server, schema):
    c = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    r = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe it."}], response_format=rf,
        max_tokens=200, temperature=1.0, seed=11, n=4,
    )  # fmt: skip
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(_parse(ch.message.content), schema)


def test_stream_agrees_with_non_stream_and_json_object_is_an_object(server):
    c = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMAS[0]}}
    body = dict(model=server.model, prompt="Once upon a time", max_tokens=200, temperature=0)
    r = c.completions.create(**body, extra_body={"response_format": rf})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(_parse(r.choices[0].text), SCHEMAS[0])
    stream = c.completions.create(**body, stream=True, extra_body={"response_format": rf})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == r.choices[0].text
    free = c.completions.create(**body)  # the same greedy request without a structure: noise
    assert free.choices[0].text != r.choices[0].text
    # any JSON object: unbounded, so a random model may not close it within max_tokens; those that
    # stop parse as objects, and every one starts as an object
    r = c.completions.create(
        **{**body, "temperature": 1.0}, n=4, seed=3, extra_body={"response_format": {"type": "json_object"}}
    )
    assert all(ch.text.lstrip().startswith("{") for ch in r.choices), [ch.text for ch in r.choices]
    assert all(isinstance(_parse(ch.text), dict) for ch in r.choices if ch.finish_reason == "stop")


def test_regex_and_choice(server):
    c = server.client()
    r = c.completions.create(
        model=server.model, prompt="Code:", max_tokens=40, temperature=1.0, seed=5, n=4,
        extra_body={"regex": r"[0-9]{3}-[a-z]{2,4}"},
    )  # fmt: skip
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", ch.text) for ch in r.choices), [
        ch.text for ch in r.choices
    ]
    options = ["yes", "no", "maybe not", 'say "hi"']
    r = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "?"}], max_tokens=20, temperature=1.0,
        seed=2, n=6, extra_body={"choice": options},
    )  # fmt: skip
    assert all(ch.message.content in options for ch in r.choices), [ch.message.content for ch in r.choices]
    server.wait_idle()
