"""runtime/grammar.py on the demo tokenizer: what the compiled grammars allow, token by token."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.grammar import GrammarCompiler, GrammarError, StructuredOutputs, allocate_bitmask
from kiln.runtime.tokenizer import FastTokenizer


@pytest.fixture(scope="module")
def compiler(demo_one_rank):
    tok = FastTokenizer(demo_one_rank / "tokenizer")
    return (
        tok.backend_tokenizer,
        GrammarCompiler(tok.backend_tokenizer, len(tok), [tok.eos_token_id]),
        tok.eos_token_id,
    )


def _allowed(matcher, token: int) -> bool:
    mask = allocate_bitmask(1, matcher.vocab_size)
    matcher.fill(mask, 0)
    return (int(mask[0, token // 32]) >> (token % 32)) & 1 == 1


def test_bounded_json_strings_refuse_control_characters(compiler):
    # xgrammar 0.2.9 lets a string with maxLength hold raw control characters, which JSON forbids
    backend, comp, _ = compiler
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    m = comp.matcher(StructuredOutputs(json_schema=json.dumps(schema)))
    m.catch_up(backend.encode('{"s": "', add_special_tokens=False).ids)
    ctrl = backend.token_to_id("\u011e")  # the byte-level token of byte 0x1e
    letter = backend.token_to_id("a")
    assert ctrl is not None and letter is not None
    assert _allowed(m, letter) and not _allowed(m, ctrl)


def test_unenforced_keywords_and_bad_specs_are_errors(compiler):
    _, comp, _ = compiler
    with pytest.raises(GrammarError, match=r"uniqueItems at schema.properties.x is not enforced"):
        comp.matcher(
            StructuredOutputs(
                json_schema=json.dumps({"properties": {"x": {"type": "array", "uniqueItems": True}}})
            )
        )
    with pytest.raises(GrammarError, match="allOf with several schemas"):
        comp.matcher(
            StructuredOutputs(json_schema=json.dumps({"allOf": [{"type": "object"}, {"required": ["a"]}]}))
        )
    with pytest.raises(GrammarError, match="json_schema does not compile"):
        comp.matcher(StructuredOutputs(json_schema="{not json"))
    with pytest.raises(GrammarError, match="exactly one of"):
        comp.matcher(StructuredOutputs(regex="a", choice=("a",)))


def test_choice_allows_exactly_its_strings(compiler):
    backend, comp, eos = compiler
    spec = StructuredOutputs(choice=("yes", 'say "hi"'))
    for text in ("yes", 'say "hi"'):  # each string whole: then only the end of sequence
        m = comp.matcher(spec)
        m.catch_up(backend.encode(text, add_special_tokens=False).ids)
        assert _allowed(m, eos) and not _allowed(m, backend.token_to_id("a"))
    m = comp.matcher(spec)
    assert not _allowed(m, eos) and not _allowed(m, backend.token_to_id("n"))  # nothing else starts


@pytest.mark.parametrize("fmt", ["llama3_json", "hermes", "mistral"])
def test_a_forced_tool_call_always_parses_in_each_format(compiler, fmt):
    """Random walks through the grammar of one call of one of two tools (tool_choice "required"):
    every finished output parses in the format, names a declared tool and validates."""
    import random

    import jsonschema

    from kiln.runtime.grammar import ToolCallGrammar
    from kiln.runtime.tool_parsers import parse_tool_calls

    backend, comp, eos = compiler
    params = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "tag": {"enum": ["x", "y"]}},
        "required": ["n", "tag"],
        "additionalProperties": False,
    }
    spec = StructuredOutputs(tool_call=ToolCallGrammar(fmt, (("count", json.dumps(params)), ("ping", None))))
    rng = random.Random(5)
    for _ in range(6):
        m, out = comp.matcher(spec), []
        while not m.terminated and len(out) < 200:
            mask = allocate_bitmask(1, m.vocab_size)
            m.fill(mask, 0)
            allowed = [t for t in range(m.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
            tok = rng.choice(allowed)
            if tok == eos:
                break
            out.append(tok)
            m.catch_up(out)
        content, calls = parse_tool_calls(backend.decode(out), fmt)
        assert content is None and len(calls) == 1, backend.decode(out)
        args = json.loads(calls[0].arguments)
        if calls[0].name == "count":
            jsonschema.validate(args, params)
        else:
            assert calls[0].name == "ping" and args == {}
