"""Incremental detokenization with both synthetic tokenizers (byte-level BPE and byte-fallback
BPE), and stop-string matching across piece boundaries, against one-shot references."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kiln.compiler.synth_tokenizer import build_tokenizer
from kiln.runtime.detokenizer import IncrementalDetokenizer, StopMatcher

TEXTS = [
    "Hello world! The kiln is hot.",
    "今天天气很好，我们去公园散步吧。龘靐齉",
    "Emoji: 🚀🔥✅ 🫠 and café crème, Größe, niño 👩‍👩‍👧",
    "Ελληνικά и русский; 東京の春は桜がきれいです。",
]


@pytest.fixture(scope="module", params=[False, True], ids=["byte_level", "byte_fallback"])
def tok(request, tmp_path_factory):
    info = build_tokenizer(tmp_path_factory.mktemp("tok"), byte_fallback=request.param)
    return AutoTokenizer.from_pretrained(info.path)


def _stream(tok, ids, skip=True):
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip)
    final = tok.decode(ids, skip_special_tokens=skip)
    pieces = []
    for t in ids:
        piece = detok.add(t)
        pieces.append(piece)
        assert final.startswith("".join(pieces)), "emitted text that later changed"
    pieces.append(detok.flush())
    assert "".join(pieces) == final == detok.text
    return pieces


def test_text_roundtrip_and_no_partial_characters(tok):
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
        pieces = _stream(tok, ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)  # complete characters only, flush included
    assert split_chars >= 3, "the tokenizer should split some characters across tokens"


def test_special_tokens_kept_or_skipped(tok):
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "天气 ok"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(chat, add_special_tokens=False)
    assert "<|eot_id|>" in "".join(_stream(tok, ids, skip=False))
    assert "<|eot_id|>" not in "".join(_stream(tok, ids, skip=True))


def test_raw_tokenizers_backend_accepted(tok):
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend_tokenizer, [], True)
    assert "".join(detok.add(t) for t in ids) + detok.flush() == TEXTS[1]


def test_random_id_streams_match_decode(tok):
    # Random ids from the whole vocabulary (byte tokens, specials, stray continuation bytes):
    # the text must still never change after it is emitted, and add up to decode(ids).
    rng = random.Random(0)
    V = len(tok)
    byte_ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE4, 0xBB, 0x8A, 0x80, 0xF0, 0x9F)]
    byte_ids = [i for i in byte_ids if i is not None and i != tok.unk_token_id and i < V]
    for _ in range(60):
        pool = [rng.randrange(V) for _ in range(6)] + byte_ids
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))]
        _stream(tok, ids, skip=rng.random() < 0.5)


@pytest.fixture(scope="module")
def fallback_tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        build_tokenizer(tmp_path_factory.mktemp("fb"), byte_fallback=True).path
    )


def test_byte_group_closed_only_by_a_non_byte_token(fallback_tok):
    tok = fallback_tok
    b = [tok.convert_tokens_to_ids(f"<0x{x:02X}>") for x in (0xE4, 0xBB, 0x8A, 0x80)]
    word = tok.encode("Hello", add_special_tokens=False)
    # "今" followed by a stray byte decodes as four U+FFFD: "今" must not have been emitted early.
    pieces = _stream(tok, b[:3] + [b[3]] + word)
    assert "今" not in "".join(pieces)
    pieces = _stream(tok, b[:3] + word)
    assert pieces[:3] == ["", "", ""] and pieces[3] == "今" + tok.decode(word[:1])


def test_stop_matcher_cases():
    m = StopMatcher(["\n\n", "STOP"])
    assert m.feed("Hello S") == ("Hello ", False)
    assert m.feed("TO") == ("", False)
    assert m.feed("Ny") == ("STONy", False)
    assert m.feed(" end\n") == (" end", False)
    assert m.feed("\nmore") == ("", True) and m.matched == "\n\n"
    assert m.feed("x") == ("", True) and m.flush() == ""
    m = StopMatcher(["abc"])
    assert m.feed("xab") == ("x", False) and m.flush() == "ab"
    assert StopMatcher([]).feed("abc") == ("abc", False)
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("zabcd") == ("za", True) and m.matched == "bc"  # "bc" completes first
    m = StopMatcher(["b", "ab"])
    assert m.feed("xab") == ("x", True) and m.matched == "ab"  # same end: the longer one


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab天\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab天\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_matcher_equals_one_shot(text, stops, cuts):
    # reference: the stop string whose first occurrence ends first (longest on a tie)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expect = (text[: min(hits)[1]], True) if hits else (text, False)
    m = StopMatcher(stops)
    out, stopped = "", False
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in itertools.pairwise(bounds):
        piece, stopped = m.feed(text[a:b])
        out += piece
        # never show text that could still turn out to be part of a stop string
        assert not any(s in out for s in stops)
    if not stopped:
        out += m.flush()
    assert (out, stopped) == expect


def test_detok_into_stop_matcher_across_tokens(tok):
    text = "我们去公园散步吧。今天天气很好"
    ids = tok.encode(text, add_special_tokens=False)
    detok, m = IncrementalDetokenizer(tok, [], True), StopMatcher(["天气"])
    shown = ""
    for t in ids:
        piece, stopped = m.feed(detok.add(t))
        shown += piece
        if stopped:
            break
    assert stopped and shown == "我们去公园散步吧。今天"


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_synth_tokenizer_files_ids_and_determinism(tmp_path, byte_fallback):
    import json
    import time

    t0 = time.perf_counter()
    info = build_tokenizer(tmp_path / "a", vocab_size=2048, byte_fallback=byte_fallback)
    assert time.perf_counter() - t0 < 5.0
    again = build_tokenizer(tmp_path / "b", vocab_size=2048, byte_fallback=byte_fallback)
    assert (info.path / "tokenizer.json").read_bytes() == (again.path / "tokenizer.json").read_bytes()
    cfg = json.loads((info.path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|begin_of_text|>" and cfg["eos_token"] == "<|eot_id|>"
    assert "<|start_header_id|>" in cfg["chat_template"] and cfg["model_max_length"] == 8192
    assert json.loads((info.path / "special_tokens_map.json").read_text())["eos_token"] == "<|eot_id|>"
    tok = AutoTokenizer.from_pretrained(info.path)
    assert len(tok) == info.vocab_size == 2048
    assert (tok.bos_token_id, tok.eos_token_id) == (info.bos_token_id, info.eos_token_id)
    assert tok.convert_ids_to_tokens(list(info.eos_token_ids)) == ["<|end_of_text|>", "<|eot_id|>"]
    assert tok.encode("hi")[0] == info.bos_token_id
    assert ("<0xE4>" in tok.get_vocab()) == byte_fallback
    chat = tok.apply_chat_template(
        [{"role": "user", "content": " Hi "}], tokenize=False, add_generation_prompt=True
    )
    assert chat == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_synth_tokenizer_small_vocab(tmp_path):
    for bf in (False, True):
        info = build_tokenizer(tmp_path / str(bf), vocab_size=300, byte_fallback=bf)
        tok = AutoTokenizer.from_pretrained(info.path)
        ids = tok.encode(TEXTS[2], add_special_tokens=False)
        assert len(tok) == 300 and max(ids) < 300 and tok.decode(ids) == TEXTS[2]
    with pytest.raises(ValueError, match="vocab_size must be >= 262"):
        build_tokenizer(tmp_path / "tiny", vocab_size=250)
