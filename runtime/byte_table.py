"""Token id -> text tables for decoding without the Rust ``decode`` call per token.

``decode_table(tokenizer)`` reads the backend tokenizer's decoder and, for the two decoders
LLM tokenizers use, builds (once per tokenizer object, cached by identity) what each token
contributes to the decoded text:

* ``ByteLevel`` (GPT-2, Llama-3, Qwen): every token is a string over GPT-2's byte alphabet; its
  bytes are the inverse of ``bytes_to_unicode`` (a token with a character outside that alphabet,
  such as an added token holding a space, contributes its own UTF-8 bytes, as the Rust decoder
  does). The text is the concatenation of all bytes, decoded with U+FFFD per invalid sequence
  (``String::from_utf8_lossy``; Python's ``"replace"`` handler gives the same maximal subparts).
* ``Sequence[Replace("▁", " "), ByteFallback, Fuse]`` with an optional trailing
  ``Strip(" ", 1, 0)`` (Llama-2, Mistral): a token's text is its string with ``▁`` replaced by a
  space; a run of ``<0xNN>`` tokens is one byte group, decoded as UTF-8 when the whole group is
  valid, else one U+FFFD per byte; ``Strip`` removes one leading space of the whole output.

Skipped special tokens (``skip_special_tokens``: ids whose string is a special added token) are
removed before the decoder runs, so they contribute nothing and do not close a byte group; other
added tokens go through the decoder like any token (what tokenizers' ``decode`` does).

Anything else (another decoder, a slow tokenizer) has no table: callers keep decoding windows.
A table is checked when built (a sample of ids decoded together) and per token id the first time
it is used (``verify``: the table's text against ``decode([id])``); an id that fails is marked
unsafe and the caller falls back to decoding windows for that request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

BYTE_LEVEL, BYTE_FALLBACK = "byte_level", "byte_fallback"
UNCHECKED, SAFE, UNSAFE = 0, 1, 2
_HEX = re.compile(rb"\+?[0-9A-Fa-f]+")  # what Rust's u8::from_str_radix(_, 16) accepts here
_tables: dict[int, tuple[Any, DecodeTable | None]] = {}


def _char_bytes() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: printable character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


CHAR_BYTES = _char_bytes()
# str.translate table: a character of the alphabet -> the latin-1 character of its byte; any
# other character below U+0100 -> U+FFFF, so that encoding the result as latin-1 fails exactly
# when the token has a character outside the alphabet
_TO_LATIN1 = {c: "\uffff" for c in range(256)} | {ord(c): chr(b) for c, b in CHAR_BYTES.items()}


def _byte_value(token: str) -> int:
    """The byte of a ``<0xNN>`` token as the ByteFallback decoder reads it, else -1."""
    raw = token.encode()
    if len(raw) == 6 and raw.startswith(b"<0x") and raw.endswith(b">") and _HEX.fullmatch(raw[3:5]):
        return int(raw[3:5], 16)
    return -1


def _decoder_kind(cfg: dict | None) -> tuple[str, bool] | None:
    """(kind, strip) for a decoder config this module understands, else None."""
    if not cfg:
        return None
    if cfg.get("type") == "ByteLevel":
        return BYTE_LEVEL, False
    if cfg.get("type") != "Sequence":
        return None
    steps = cfg.get("decoders") or []
    strip = len(steps) == 4 and steps[3] == {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    head = steps[:3] if strip else steps
    want = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    return (BYTE_FALLBACK, strip) if head == want else None


def _decoder_config(backend: Tokenizer) -> dict | None:
    try:
        dec = backend.decoder
        return None if dec is None else json.loads(dec.__getstate__())
    except Exception:  # an older binding without __getstate__: read the whole tokenizer
        return json.loads(backend.to_str()).get("decoder")


def utf8_group(group: Sequence[int]) -> str:
    """A ByteFallback byte group: its text when valid UTF-8, else one U+FFFD per byte."""
    try:
        return bytes(group).decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(group)


class DecodeTable:
    """Per-token decoding data of one backend tokenizer (see the module docstring).

    ``kind`` is ``BYTE_LEVEL`` or ``BYTE_FALLBACK``; ``strip``: the output loses one leading
    space. ``n``: table size (ids ``>= n`` are unknown). For ``skip`` in (False, True):

    * byte level: ``raw[skip][i]`` the token's bytes (b"" when skipped), ``text[skip][i]`` the
      same as ``str`` when they are valid UTF-8 on their own, else None;
    * byte fallback: ``byte[skip][i]`` the byte of a ``<0xNN>`` token, else -1; ``text[skip][i]``
      the token's text, None when it is skipped (contributes nothing, closes no group).

    ``state[skip]``: per id UNCHECKED / SAFE / UNSAFE, shared by every request.
    """

    def __init__(self, backend: Tokenizer, kind: str, strip: bool) -> None:
        self.backend, self.kind, self.strip = backend, kind, strip
        added = backend.get_added_tokens_decoder()
        self.n = n = max(backend.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)
        tokens = [backend.id_to_token(i) for i in range(n)]
        specials = {t.content for t in added.values() if t.special}
        skipped = [t is None or t in specials for t in tokens]
        self.raw: list[list[bytes]] = []
        self.byte: list[list[int]] = []
        self.text: list[list[Any]] = []
        if kind == BYTE_LEVEL:
            raw = []
            for t in tokens:
                if t is None:
                    raw.append(b"")
                    continue
                try:
                    raw.append(t.translate(_TO_LATIN1).encode("latin-1"))
                except UnicodeEncodeError:  # a character outside the alphabet: its own UTF-8
                    raw.append(t.encode())
            text: list[str | None] = []
            for b in raw:
                try:
                    text.append(b.decode("utf-8"))
                except UnicodeDecodeError:
                    text.append(None)
            raw_skip = [b"" if s else b for b, s in zip(raw, skipped)]
            text_skip = ["" if s else t for t, s in zip(text, skipped)]
            self.raw, self.text = [raw, raw_skip], [text, text_skip]
        else:
            byte = [-1 if t is None else _byte_value(t) for t in tokens]
            txt = [None if t is None else t.replace("▁", " ") for t in tokens]
            byte_skip = [-1 if s else b for b, s in zip(byte, skipped)]
            txt_skip = [None if s else t for t, s in zip(txt, skipped)]
            self.byte, self.text = [byte, byte_skip], [txt, txt_skip]
        self.state = [bytearray(n), bytearray(n)]
        self._nostrip: Tokenizer | None = None

    def decode(self, ids: Sequence[int], skip: bool) -> str:
        """The whole text of ``ids`` from the table (the reference the incremental path follows)."""
        if self.kind == BYTE_LEVEL:
            raw = self.raw[skip]
            return b"".join(raw[i] for i in ids).decode("utf-8", "replace")
        byte, text = self.byte[skip], self.text[skip]
        out: list[str] = []
        group: list[int] = []
        for i in ids:
            if byte[i] >= 0:
                group.append(byte[i])
            elif text[i] is not None:
                if group:
                    out.append(utf8_group(group))
                    group = []
                out.append(text[i])
        if group:
            out.append(utf8_group(group))
        s = "".join(out)
        return s[1:] if self.strip and s.startswith(" ") else s

    def verify(self, token_id: int, skip: bool) -> bool:
        """Whether the table's text for ``token_id`` matches ``decode([token_id])``; remembered."""
        if token_id >= self.n or token_id < 0:
            return False
        state = self.state[skip]
        if state[token_id] == UNCHECKED:
            ok = self.decode([token_id], skip) == self.backend.decode([token_id], skip)
            state[token_id] = SAFE if ok else UNSAFE
        return state[token_id] == SAFE

    def verify_all(self, skip: bool) -> int:
        """Check every id at once (one ``decode_batch``, parallel in Rust) so that no request pays
        a ``decode([id])`` on an id's first use; returns how many ids are unsafe."""
        ids = range(self.n)
        got = self.backend.decode_batch([[i] for i in ids], skip)
        if self.kind == BYTE_LEVEL:
            text, raw = self.text[skip], self.raw[skip]
            want = [t if t is not None else r.decode("utf-8", "replace") for t, r in zip(text, raw)]
        else:
            want = [self.decode([i], skip) for i in ids]
        self.state[skip] = bytearray(SAFE if a == b else UNSAFE for a, b in zip(want, got))
        return self.state[skip].count(UNSAFE)

    def nostrip_backend(self) -> Tokenizer:
        """A copy of the backend without the final ``Strip`` (its decode concatenates across
        windows); the caller strips the one leading space itself."""
        if self._nostrip is None:
            from tokenizers import decoders

            clone = Tokenizer.from_str(self.backend.to_str())
            clone.decoder = decoders.Sequence(
                [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            )
            self._nostrip = clone
        return self._nostrip


def _sanity_check(table: DecodeTable) -> bool:
    """Decode a spread of ids (plus all byte tokens) in one call and compare with the table."""
    n = table.n
    ids = list(range(0, n, max(1, n // 256)))[:256]
    if table.kind == BYTE_FALLBACK:
        ids += [i for i, b in enumerate(table.byte[False]) if b >= 0][:64]
    ids += list(range(max(0, n - 32), n))  # the added tokens usually sit at the end
    return all(table.decode(ids, skip) == table.backend.decode(ids, skip) for skip in (False, True))


def decode_table(tokenizer: Any) -> DecodeTable | None:
    """The table for ``tokenizer`` (a transformers fast tokenizer, kiln's FastTokenizer or a
    ``tokenizers.Tokenizer``), or None when its decoder is not one this module handles."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
    hit = _tables.get(id(backend))
    if hit is not None and hit[0] is backend:
        return hit[1]
    table = None
    if isinstance(backend, Tokenizer):
        kind = _decoder_kind(_decoder_config(backend))
        if kind is not None:
            table = DecodeTable(backend, *kind)
            if not _sanity_check(table):
                table = None
    _tables[id(backend)] = (backend, table)
    return table
