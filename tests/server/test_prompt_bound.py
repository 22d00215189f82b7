"""The length bound ``kiln serve`` checks before tokenizing (runtime/server_limits.py): a text of
C characters encodes to at least ceil(C / L) tokens, so refusing on that bound never refuses a
prompt that fits. Checked on real tokenizers of both kinds kiln builds (byte-level BPE as in
Llama 3; SentencePiece-style BPE with byte fallback as in Llama 2), with an NFC normalizer (as in
Qwen2), against adversarial texts: long runs of one character (the longest tokens), special-token
strings, combining marks, any Unicode. Pipelines without a provable bound get none."""

from __future__ import annotations

import json
import sys
import unicodedata
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.compiler.synth_tokenizer import SPECIAL_TOKENS, build_tokenizer
from kiln.runtime.server_limits import MAX_CANONICAL_DECOMPOSITION, chars_per_token_bound, min_tokens
from kiln.runtime.tokenizer import load_tokenizer


def _variant(tok, **changes) -> SimpleNamespace:
    """``tok``'s pipeline with top-level tokenizer.json fields replaced (or edited by a function)."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    for key, value in changes.items():
        spec[key] = value(spec[key]) if callable(value) else value
    return SimpleNamespace(backend_tokenizer=Tokenizer.from_str(json.dumps(spec)))


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build_tokenizer(d, vocab_size=4096, byte_fallback=request.param == "byte_fallback")
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def nfc_tok(tok):
    return _variant(tok, normalizer={"type": "NFC"})


def _texts(tok) -> st.SearchStrategy:
    vocab = sorted(tok.backend_tokenizer.get_vocab(), key=len, reverse=True)[:50]  # the longest tokens
    pieces = st.sampled_from(
        [*SPECIAL_TOKENS, *vocab, " ", "\n", "=", "é", "\u0301", "\u0345", "ᾂ", "\u1100\u1161\u11a8", "😀"]
    )
    runs = st.tuples(st.sampled_from([" ", "=", "-", "\n", "a", "\u0301", "e\u0301"]), st.integers(1, 300))
    return st.one_of(
        st.text(max_size=200),
        st.lists(pieces, max_size=60).map("".join),
        runs.map(lambda r: r[0] * r[1]),
        st.lists(st.one_of(pieces, runs.map(lambda r: r[0] * r[1])), max_size=10).map("".join),
    )


def _holds(tok, bound: int, text: str) -> None:
    for special in (True, False):
        n = len(tok.backend_tokenizer.encode(text, add_special_tokens=special).ids)
        assert n >= min_tokens(text, bound), (n, len(text), bound, text[:80])


SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


def test_bound_holds(tok):
    bound = chars_per_token_bound(tok)
    assert bound is not None and bound >= max(len(t) for t in SPECIAL_TOKENS)

    @SETTINGS
    @given(_texts(tok))
    def run(text: str) -> None:
        _holds(tok, bound, text)

    run()


def test_bound_holds_under_nfc(nfc_tok, tok):
    """NFC composes up to 4 code points into one: the bound is 4 times looser, and still holds on
    text made of decomposed characters."""
    bound = chars_per_token_bound(nfc_tok)
    assert bound == MAX_CANONICAL_DECOMPOSITION * chars_per_token_bound(tok)
    decomposed = "".join(unicodedata.normalize("NFD", c) for c in "ᾂἂἃéèêấầẩ한국어" * 40)
    _holds(nfc_tok, bound, decomposed)

    @SETTINGS
    @given(_texts(tok))
    def run(text: str) -> None:
        _holds(nfc_tok, bound, text)

    run()


def test_longest_canonical_decomposition():
    longest = max(
        len(unicodedata.normalize("NFD", chr(c)))
        for c in range(sys.maxunicode + 1)
        if not 0xD800 <= c < 0xE000
    )
    assert longest <= MAX_CANONICAL_DECOMPOSITION


def test_no_bound_where_none_can_be_proven(tok):
    """Pipelines that can turn any amount of text into few tokens, or none: no bound (the prompt is
    then tokenized in full, as before)."""
    drop_spaces = {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}]}
    removed = {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}

    def lstrip(added: list[dict]) -> list[dict]:
        return [{**a, "lstrip": True} if i == 0 else a for i, a in enumerate(added)]

    def fuse_unk(model: dict) -> dict:
        vocab = {k: v for k, v in model["vocab"].items() if not k.startswith("<0x")}
        return {
            **model,
            "vocab": vocab,
            "byte_fallback": False,
            "unk_token": "<|end_of_text|>",
            "fuse_unk": True,
        }

    cases = {
        "whitespace pre-tokenizer": {"pre_tokenizer": drop_spaces},
        "split that removes": {"pre_tokenizer": removed},
        "strip normalizer": {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
        "strip accents": {"normalizer": {"type": "StripAccents"}},
        "regex replace": {"normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}},
        "lstrip added token": {"added_tokens": lstrip},
        "truncation": {
            "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
        },
    }
    spec = json.loads(tok.backend_tokenizer.to_str())
    if spec["model"]["byte_fallback"]:
        cases["fused unknown tokens"] = {"model": fuse_unk}
    for name, change in cases.items():
        assert chars_per_token_bound(_variant(tok, **change)) is None, name
    assert chars_per_token_bound(SimpleNamespace()) is None  # a slow tokenizer


def test_whitespace_pre_tokenizer_really_breaks_the_bound(tok):
    """Why such pipelines get no bound: a run of spaces costs nothing."""
    t = _variant(tok, pre_tokenizer={"type": "Whitespace"})
    text = "a" + " " * 5000 + "b"
    assert len(t.backend_tokenizer.encode(text).ids) < min_tokens(text, chars_per_token_bound(tok))
