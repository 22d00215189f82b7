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
