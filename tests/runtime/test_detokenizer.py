"""Incremental detokenization with both synthetic tokenizers (byte-level BPE and byte-fallback
BPE), and stop-string matching across piece boundaries, against one-shot references.

The table path (``kiln.runtime.byte_table``) is checked against ``decode`` for the byte-level,
byte-fallback and Llama-2 style (byte fallback + ``Strip``) decoders: random id streams, added
and special tokens, invalid bytes, an unknown decoder, the on/off switch, and the fall back to
window decoding when an id's table entry is wrong."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from kiln.compiler.synth_tokenizer import build_tokenizer
from kiln.runtime.byte_table import (
    BYTE_FALLBACK,
    BYTE_LEVEL,
    CHAR_BYTES,
    SAFE,
    UNCHECKED,
    UNSAFE,
    decode_table,
)
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
    m = StopMatcher(["STOP"], include=True)  # include_stop_str_in_output: the text ends after it
    assert (
        m.feed("Hi ST") == ("Hi ", False) and m.feed("OPmore") == ("STOP", True) and m.feed("x") == ("", True)
    )


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


# -- the table path (kiln.runtime.byte_table) ------------------------------------------------

STRIP_DECODER = [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
]


def _build(root, flavour):
    """A synthetic tokenizer directory of ``flavour`` loaded with AutoTokenizer: byte-level BPE,
    byte fallback, or byte fallback with Llama-2's trailing ``Strip`` (the leading space of the
    output removed)."""
    import json

    info = build_tokenizer(root, byte_fallback=flavour != "byte_level")
    if flavour == "strip":
        path = info.path / "tokenizer.json"
        cfg = json.loads(path.read_text())
        cfg["decoder"] = {"type": "Sequence", "decoders": STRIP_DECODER}
        path.write_text(json.dumps(cfg, ensure_ascii=False))
    return AutoTokenizer.from_pretrained(info.path)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback", "strip"])
def flavour_tok(request, tmp_path_factory):
    return request.param, _build(tmp_path_factory.mktemp(request.param), request.param)


def _fresh(tok):
    """A new backend object for ``tok`` (its own table, so tests may spoil it)."""
    return Tokenizer.from_str(tok.backend_tokenizer.to_str())


def _byte_ids(tok):
    """Ids of the single-byte tokens, by byte value."""
    vocab = tok.get_vocab()
    if "<0x41>" in vocab:
        return {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    return {b: vocab[c] for c, b in CHAR_BYTES.items()}


def _interesting_ids(tok):
    """Byte tokens (lead and continuation bytes, ASCII, space), specials and the tokens of texts
    with multi-byte characters split across tokens."""
    b = _byte_ids(tok)
    ids = [b[x] for x in (0x20, 0x41, 0x0A, 0xE4, 0xBB, 0x8A, 0xF0, 0x9F, 0x9A, 0x80, 0xC3, 0xA9, 0xFF, 0xED)]
    ids += [tok.convert_tokens_to_ids(s) for s in ("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>")]
    for text in TEXTS:
        ids += tok.encode(" " + text, add_special_tokens=False)
    return sorted(set(ids))


def _fast_stream(tok, ids, skip, backend=None):
    """Stream ``ids`` through the table path; checks it against both decodes and returns pieces."""
    detok = IncrementalDetokenizer(backend or tok, [], skip, fast=True)
    assert detok.fast
    final = tok.decode(ids, skip_special_tokens=skip)
    assert final == (backend or tok.backend_tokenizer).decode(ids, skip)
    pieces = []
    for t in ids:
        pieces.append(detok.add(t))
        assert final.startswith("".join(pieces)), "emitted text that later changed (a partial char)"
    pieces.append(detok.flush())
    assert "".join(pieces) == final == detok.text
    return detok, pieces


def test_table_built_for_known_decoders(flavour_tok):
    flavour, tok = flavour_tok
    table = decode_table(tok)
    assert table is not None and table is decode_table(tok.backend_tokenizer)  # cached
    assert table.kind == (BYTE_LEVEL if flavour == "byte_level" else BYTE_FALLBACK)
    assert table.strip == (flavour == "strip")
    assert table.n == len(tok)
    for byte, t in _byte_ids(tok).items():
        if flavour == "byte_level":
            assert table.raw[False][t] == bytes([byte])
        else:
            assert table.byte[False][t] == byte and table.byte[True][t] == byte
    ids = tok.encode(TEXTS[2], add_special_tokens=False)
    detok, _ = _fast_stream(tok, ids, True)
    assert detok.fast and table.state[True][ids[0]] == SAFE


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_table_path_matches_decode(flavour_tok, data):
    _, tok = flavour_tok
    pool = _interesting_ids(tok)
    ids = data.draw(
        st.lists(st.one_of(st.sampled_from(pool), st.integers(0, len(tok) - 1)), max_size=40), label="ids"
    )
    detok, _ = _fast_stream(tok, ids, data.draw(st.booleans(), label="skip"))
    assert detok.fast  # every id verified safe: no request fell back


def test_table_path_texts_and_strip(flavour_tok):
    flavour, tok = flavour_tok
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    for text in TEXTS:
        ids = tok.encode(" " + text, add_special_tokens=False)
        _, pieces = _fast_stream(tok, ids, True)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == (text if flavour == "strip" else " " + text)
        # a skipped special token first: Strip still takes the output's first space
        _, pieces = _fast_stream(tok, [eot, *ids], True)
        assert "".join(pieces) == (text if flavour == "strip" else " " + text)
        _, pieces = _fast_stream(tok, [eot, *ids], False)
        assert "".join(pieces) == "<|eot_id|> " + text


def test_invalid_bytes_give_decodes_replacement_count(flavour_tok):
    flavour, tok = flavour_tok
    b = _byte_ids(tok)
    word = tok.encode("Hello", add_special_tokens=False)
    _, pieces = _fast_stream(tok, [b[0xE4], b[0xBB], *word], True)
    # byte level: from_utf8_lossy, one U+FFFD for the maximal subpart E4 BB; byte fallback:
    # the invalid <0xNN> group gives one U+FFFD per byte
    assert "".join(pieces).count("\ufffd") == (1 if flavour == "byte_level" else 2)
    _, pieces = _fast_stream(tok, [b[0xE4], b[0xBB], b[0x8A], *word], True)
    # byte level: emitted with its last byte; byte fallback: held until a non-byte token
    assert pieces[:3] == ["", "", "今" if flavour == "byte_level" else ""]
    assert pieces[3].startswith("Hell" if flavour == "byte_level" else "今")
    _, pieces = _fast_stream(tok, [b[0xE4], b[0xBB], b[0x8A], b[0x80], *word], True)
    assert "".join(pieces).count("\ufffd") == (1 if flavour == "byte_level" else 4)
    _, pieces = _fast_stream(tok, [b[0xF0], b[0x9F]], True)  # held to the end, then flushed
    assert pieces[:2] == ["", ""] and pieces[2] == ("\ufffd" if flavour == "byte_level" else "\ufffd\ufffd")


def test_added_tokens_follow_decode(flavour_tok):
    from tokenizers import AddedToken

    flavour, tok = flavour_tok
    backend = _fresh(tok)
    plain = ["héllo", "two words", "Ġlead", "▁lead", "<0x41>", "東京"]
    special = ["<|spé cial|>", "<tool>"]
    backend.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    table = decode_table(backend)
    assert table is not None and table.n == backend.get_vocab_size()
    added = [backend.token_to_id(s) for s in plain + special]
    word = backend.encode("Hello", add_special_tokens=False).ids
    for skip in (False, True):
        one = [backend.decode([i], skip) for i in added]
        if flavour == "byte_level":  # added tokens go through the byte-level decoder too
            assert one[:3] == ["h\ufffdllo", "two words", " lead"]
        else:
            assert one[3] == ("lead" if flavour == "strip" else " lead") and one[4] == "A"
        assert one[-2:] == (["", ""] if skip else special)
        for t in added:
            assert table.verify(t, skip)
        rng = random.Random(1)
        for _ in range(40):
            ids = [rng.choice(added + word + [backend.token_to_id("<0xE4>") or 0]) for _ in range(8)]
            detok = IncrementalDetokenizer(backend, [], skip)
            out = "".join(detok.add(t) for t in ids) + detok.flush()
            assert detok.fast and out == backend.decode(ids, skip)


@pytest.mark.parametrize("decoder", ["Metaspace", "WordPiece", "ByteLevelInSequence", "none"])
def test_unknown_decoder_has_no_table(fallback_tok, decoder):
    from tokenizers import decoders

    backend = _fresh(fallback_tok)
    backend.decoder = {
        "Metaspace": decoders.Metaspace(),
        "WordPiece": decoders.WordPiece(),
        "ByteLevelInSequence": decoders.Sequence([decoders.ByteLevel(), decoders.Fuse()]),
        "none": None,
    }[decoder]
    assert decode_table(backend) is None
    ids = backend.encode(TEXTS[1] + " Hello", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(backend, [], True)
    assert not detok.fast
    assert "".join(detok.add(t) for t in ids) + detok.flush() == backend.decode(ids, True)


def test_fast_switch(tok):
    assert IncrementalDetokenizer(tok, [], True).fast
    assert not IncrementalDetokenizer(tok, [], True, fast=False).fast
    ids = tok.encode(TEXTS[2], add_special_tokens=False)
    slow = IncrementalDetokenizer(tok, [], True, fast=False)
    assert "".join(slow.add(t) for t in ids) + slow.flush() == TEXTS[2]


def test_unsafe_id_falls_back_with_the_same_text(flavour_tok):
    flavour, tok = flavour_tok
    backend = _fresh(tok)
    table = decode_table(backend)
    b = _byte_ids(tok)
    eot = backend.token_to_id("<|eot_id|>")
    text_ids = backend.encode(" " + TEXTS[2], add_special_tokens=False).ids
    bad = next(t for t in text_ids[2:] if not backend.id_to_token(t).startswith("<0x"))
    for skip in (False, True):  # spoil the table's entry for one id
        if flavour == "byte_level":
            table.raw[skip][bad], table.text[skip][bad] = b"XX", "XX"
        else:
            table.text[skip][bad] = "XX"
    rng = random.Random(2)
    cases = [text_ids, [bad, *text_ids], [eot, bad, *text_ids], [b[0xE4], b[0xBB], bad, *text_ids]]
    pool = [*text_ids, eot, b[0xE4], b[0xBB], b[0x8A], b[0x20]]
    cases += [[rng.choice(pool) for _ in range(20)] for _ in range(30)]
    for ids in cases:
        if bad not in ids:
            ids = [*ids, bad, *ids]
        cut = ids.index(bad)
        for skip in (False, True):
            final = backend.decode(ids, skip)
            detok, pieces = IncrementalDetokenizer(backend, [], skip), []
            for i, t in enumerate(ids):
                assert detok.fast == (i <= cut)  # the table until the spoilt id, windows after
                pieces.append(detok.add(t))
                assert final.startswith("".join(pieces))
            pieces.append(detok.flush())
            assert "".join(pieces) == final == detok.text
            assert table.state[skip][bad] == UNSAFE
    # ids out of the table: windows too
    detok = IncrementalDetokenizer(backend, [], True)
    assert detok.add(text_ids[0]) == backend.decode(text_ids[:1], True) and detok.fast
    detok.add(len(tok) + 5)
    assert not detok.fast


def test_verify_all_checks_every_id_at_once(flavour_tok):
    flavour, tok = flavour_tok
    backend = _fresh(tok)
    table = decode_table(backend)
    assert all(s == UNCHECKED for s in table.state[True])
    assert table.verify_all(True) == 0 and all(s == SAFE for s in table.state[True])
    text_ids = backend.encode(" " + TEXTS[2], add_special_tokens=False).ids
    bad = next(t for t in text_ids[2:] if not backend.id_to_token(t).startswith("<0x"))
    if flavour == "byte_level":
        table.raw[True][bad], table.text[True][bad] = b"XX", "XX"
    else:
        table.text[True][bad] = "XX"
    assert table.verify_all(True) == 1 and table.state[True][bad] == UNSAFE
    assert all(s == UNCHECKED for s in table.state[False])  # skip=False is still checked lazily


def test_prepare_builds_the_shared_tables_once(flavour_tok):
    from kiln.runtime.detokenizer import _byte_ids_cache, prepare

    _, tok = flavour_tok
    backend = _fresh(tok)
    prepare(backend)
    assert all(s == SAFE for s in decode_table(backend).state[True])
    # the byte-token ids (a pass over the vocabulary) only serve the window path: not built for
    # a tokenizer with a table until a request falls back to windows
    assert id(backend) not in _byte_ids_cache
    IncrementalDetokenizer(backend, [], True, fast=False)
    assert _byte_ids_cache[id(backend)][0] is backend
