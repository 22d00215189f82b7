"""Incremental detokenization and stop-string matching, per request.

``IncrementalDetokenizer.add(token_id)`` returns the text that became final with that token.

For byte-level BPE and SentencePiece-style byte-fallback tokenizers it takes each token's bytes
or text from a table built once per tokenizer (:mod:`kiln.runtime.byte_table`), a few hundred
nanoseconds a token instead of a Rust ``decode`` call (~10 us): byte-level bytes go through an
incremental UTF-8 decoder (an incomplete character is held until complete, invalid bytes give
U+FFFD as ``decode`` does); ``<0xNN>`` tokens are gathered until a non-byte token closes the
group. Each token id is checked against ``decode([id])`` the first time it is met; a request
that meets an id the table gets wrong goes on with the window path below, emitting the same
text. ``fast=False`` turns the table path off (tests and bench/detok_cost.py compare the two).

Otherwise it decodes a short sliding window of the generated ids (Hugging Face's decode, via the
fast tokenizer's Rust backend) and emits only what cannot change any more:

* a window whose text ends in U+FFFD is held (an incomplete UTF-8 character: byte-level BPE
  tokens and ``<0xNN>`` byte-fallback tokens split characters across tokens);
* with byte fallback, a run of ``<0xNN>`` tokens is decoded as one group (valid UTF-8, or one
  U+FFFD per byte), so a window ending in a byte token is held until a non-byte token closes it.

The concatenation of every ``add`` result and the final ``flush()`` equals
``tokenizer.decode(generated_ids, skip_special_tokens=...)`` (what HF's ``decode(output_ids)``
gives; no tokenization-space clean-up).

``StopMatcher`` sits after it: fed those pieces, it returns the text safe to show now, holding
back any tail that could be the start of a stop string, so stop strings are found across token
boundaries. On a match the text stops just before the stop string (OpenAI semantics).
"""

from __future__ import annotations

import re
from codecs import utf_8_decode as _utf8
from collections.abc import Callable, Sequence
from typing import Any, cast

from tokenizers import Tokenizer

from kiln.runtime.byte_table import BYTE_LEVEL, SAFE, decode_table, utf8_group

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_HEX = "0123456789ABCDEFabcdef"
_BYTE_TOKEN_STRINGS = [f"<0x{a}{b}>" for a in _HEX for b in _HEX]  # every string _BYTE_TOKEN matches
_byte_ids_cache: dict[int, tuple[Any, frozenset[int], frozenset[int]]] = {}
_one_len_cache: dict[tuple[int, bool], tuple[Any, dict[int, int]]] = {}


def _byte_token_ids(tokenizer: Any) -> tuple[frozenset[int], frozenset[int]]:
    """Ids of ``<0xNN>`` byte-fallback tokens (empty for byte-level tokenizers), and, when there
    are any, of the special tokens (``skip_special_tokens`` drops them before the decoder, so
    they do not close a byte group); cached."""
    hit = _byte_ids_cache.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1], hit[2]
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
    if isinstance(backend, Tokenizer):  # 484 lookups, not a pass over the vocabulary (0.1 s at 128k)
        found = (backend.token_to_id(t) for t in _BYTE_TOKEN_STRINGS)
        ids = frozenset(i for i in found if i is not None)
    else:
        vocab = tokenizer.get_vocab()
        ids = frozenset(i for t, i in vocab.items() if len(t) == 6 and _BYTE_TOKEN.match(t))
    specials: frozenset[int] = frozenset()
    if ids:
        if isinstance(backend, Tokenizer):
            added = backend.get_added_tokens_decoder().items()
            specials = frozenset(i for i, t in added if t.special)
        else:
            specials = frozenset(getattr(tokenizer, "all_special_ids", ()))
    _byte_ids_cache[id(tokenizer)] = (tokenizer, ids, specials)
    return ids, specials


def _one_token_lengths(backend: Any, skip_special_tokens: bool) -> dict[int, int]:
    """``len(decode([t]))`` by token id for ``backend``, filled lazily and shared by every
    request (decoding is a pure function of the ids; this saves a decode per emitted token)."""
    key = (id(backend), skip_special_tokens)
    hit = _one_len_cache.get(key)
    if hit is not None and hit[0] is backend:
        return hit[1]
    lengths: dict[int, int] = {}
    _one_len_cache[key] = (backend, lengths)
    return lengths


def prepare(tokenizer: Any) -> None:
    """Build at start-up what every request's detokenizer shares, so that the first request does
    not pay for it (on a 128k vocabulary: 0.2-0.3 s on a 2-core CPU, several times that on a slow
    host): the token table, checked for the default ``skip_special_tokens``, or, for a tokenizer
    without one, the byte-token ids the window path needs."""
    table = decode_table(tokenizer)
    if table is None:
        _byte_token_ids(tokenizer)
    else:
        table.verify_all(True)


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, one token at a time.

    Args:
        tokenizer: a transformers tokenizer (fast: its ``backend_tokenizer`` is used) or a
            ``tokenizers.Tokenizer``.
        prompt_ids: the request's prompt. The text is that of the generated ids alone, as
            ``decode(output_ids)`` gives; the prompt is kept for callers (``echo``), not decoded.
        skip_special_tokens: leave special tokens out of the text.
        fast: use the token table when the tokenizer has one (default); False always decodes
            windows.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        fast: bool = True,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
        # _dec(ids, skip_special_tokens): the fast backend's own method, called positionally (a
        # partial with keyword arguments costs about half a decode more per call).
        self._dec: Callable[[Sequence[int], bool], str]
        if isinstance(backend, Tokenizer):
            self._dec = backend.decode
        else:  # a slow transformers tokenizer
            self._dec = lambda ids, skip: backend.decode(  # type: ignore[misc]
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
        self._tokenizer = tokenizer
        self._byte_ids: frozenset[int] = frozenset()  # window path only (_use_windows)
        self._skipped: frozenset[int] = frozenset()
        self._last = -1  # the last id the decoder sees (skipped special tokens are not)
        self._one_len = _one_token_lengths(backend, skip_special_tokens)
        self.ids: list[int] = []
        self._pieces: list[str] = []  # everything emitted so far (``text`` joins them)
        self._prefix = 0  # window start: a token whose text was already emitted (or 0)
        self._read = 0  # tokens before this are emitted
        self._prefix_chars = 0  # len(decode(ids[_prefix:_read]))
        self._strip = False  # the next non-empty piece loses a leading space (Strip decoder)
        self._stripped = 0  # 1 once that space was removed
        # None on the window path; the table paths read it per token (no None check there)
        self._table: Any = decode_table(tokenizer) if fast else None
        table = self._table
        if table is not None:
            skip = bool(skip_special_tokens)
            self._n, self._state, self._text = table.n, table.state[skip], table.text[skip]
            if table.kind == BYTE_LEVEL:
                self._raw, self._pending = table.raw[skip], b""
                self._add, self._flush = self._add_bytes, self._flush_bytes
            else:
                self._byte, self._group = table.byte[skip], cast(list[int], [])
                self._strip = table.strip
                self._add, self._flush = self._add_tokens, self._flush_tokens
        else:
            self._use_windows()

    def _use_windows(self) -> None:
        """Decode windows from now on (with the byte-token and special ids that path needs)."""
        self._byte_ids, specials = _byte_token_ids(self._tokenizer)
        self._skipped = specials if self.skip_special_tokens else frozenset()
        self._add, self._flush = self._add_window, self._flush_window

    @property
    def fast(self) -> bool:
        """Whether tokens are decoded from the table now (False: decoding windows)."""
        return self._add != self._add_window

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, ids: list[int]) -> str:
        return self._dec(ids, self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append ``token_id``; return the text that became final (often "", never partial)."""
        return self._add(int(token_id))

    def flush(self) -> str:
        """At the end of the request: whatever is still held (may contain U+FFFD)."""
        return self._flush()

    def _emit(self, piece: str) -> str:
        """``piece`` as emitted: without the Strip decoder's leading space once, kept in ``text``."""
        if self._strip and piece:
            piece = self._strip_first(piece)
        if piece:
            self._pieces.append(piece)
        return piece

    def _strip_first(self, piece: str) -> str:
        self._strip = False
        if piece[0] == " ":
            self._stripped = 1
            return piece[1:]
        return piece

    # -- table path, byte-level: bytes through an incremental UTF-8 decoder ------------------
    def _add_bytes(self, t: int) -> str:
        if (t >= self._n or self._state[t] != SAFE) and not self._table.verify(t, self.skip_special_tokens):
            return self._fall_back(t)
        self.ids.append(t)
        if self._pending:  # an incomplete character is held
            data = self._pending + self._raw[t]
            piece, used = _utf8(data, "replace", False)
            self._pending = data[used:]
        else:
            piece = self._text[t]
            if piece is None:  # not valid UTF-8 alone
                data = self._raw[t]
                piece, used = _utf8(data, "replace", False)
                self._pending = data[used:]
        return self._emit(piece)

    def _flush_bytes(self) -> str:
        piece = _utf8(self._pending, "replace", True)[0] if self._pending else ""
        self._pending = b""
        return self._emit(piece)

    # -- table path, byte fallback: token texts, <0xNN> runs held until a token closes them --
    def _add_tokens(self, t: int) -> str:
        if (t >= self._n or self._state[t] != SAFE) and not self._table.verify(t, self.skip_special_tokens):
            return self._fall_back(t)
        self.ids.append(t)
        b = self._byte[t]
        if b >= 0:
            self._group.append(b)
            return ""
        piece = self._text[t]
        if piece is None:  # a skipped special token: nothing, and the byte group stays open
            return ""
        if self._group:
            piece = utf8_group(self._group) + piece
            self._group.clear()
        return self._emit(piece)

    def _flush_tokens(self) -> str:
        piece = utf8_group(self._group) if self._group else ""
        self._group.clear()
        return self._emit(piece)

    def _fall_back(self, t: int) -> str:
        """``t`` is not safe to take from the table: decode windows for the rest of the request,
        the first one from the request's start (the text emitted so far is its prefix)."""
        table = self._table
        if table.strip:  # windows decoded without the Strip step; _strip_first does it once
            nostrip = table.nostrip_backend()
            self._dec = nostrip.decode
            self._one_len = _one_token_lengths(nostrip, self.skip_special_tokens)
        self._prefix = self._read = 0
        self._prefix_chars = len(self.text) + self._stripped
        self._use_windows()
        self._last = next((i for i in reversed(self.ids) if i not in self._skipped), -1)
        return self._add_window(t)

    # -- window path: the Rust decode of a short window of ids ------------------------------
    def _add_window(self, t: int) -> str:
        ids = self.ids
        ids.append(t)
        full = self._dec(ids[self._prefix :], self.skip_special_tokens)
        skip = self._prefix_chars
        if t not in self._skipped:
            self._last = t
        if len(full) <= skip or full.endswith("\ufffd") or self._last in self._byte_ids:
            return ""
        piece = full[skip:]
        prefix, read = self._read, len(ids)
        self._prefix, self._read = prefix, read
        if read - prefix == 1:  # the usual window: one token, whose decoded length is cached
            t = ids[prefix]
            n = self._one_len.get(t)
            if n is None:
                n = self._one_len[t] = len(self._decode([t]))
            self._prefix_chars = n
        else:
            self._prefix_chars = len(self._decode(ids[prefix:read]))
        return self._emit(piece)

    def _flush_window(self) -> str:
        full = self._decode(self.ids[self._prefix :])
        piece = full[self._prefix_chars :]
        self._prefix = self._read = len(self.ids)
        self._prefix_chars = 0
        return self._emit(piece)


class StopMatcher:
    """Finds stop strings in a stream of text pieces.

    ``feed(piece) -> (text, stopped)``: ``text`` is safe to emit now; ``stopped`` is True once a
    stop string completed, ``text`` then ending just before it (``include``: just after it; what
    follows is dropped, and later feeds return ``("", True)``). The stop string that completes
    first wins (the longer one when two end together), so the result does not depend on how the
    text was cut into pieces. ``matched`` names the stop
    string. ``flush()`` returns the held-back tail when the request ends for another reason.
    """

    def __init__(self, stop_strings: Sequence[str] = (), include: bool = False) -> None:
        self.stops = [s for s in stop_strings if s]
        self.include = include  # the text ends after the stop string (vLLM's include_stop_str_in_output)
        self.max_hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        buf = self.held + piece
        best: tuple[int, int] | None = None  # (end, start) of the match that completes first
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (best is None or (i + len(s), i) < best):
                best, self.matched = (i + len(s), i), s
        if best is not None:
            self.stopped, self.held = True, ""
            return buf[: best[0] if self.include else best[1]], True
        hold = 0
        for k in range(min(self.max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out
