"""Incremental detokenization and stop-string matching, per request.

``IncrementalDetokenizer.add(token_id)`` returns the text that became final with that token.
It decodes a short sliding window of the generated ids (Hugging Face's decode, via the fast
tokenizer's Rust backend) and emits only what cannot change any more:

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
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_byte_ids_cache: dict[int, tuple[Any, frozenset[int]]] = {}
_one_len_cache: dict[tuple[int, bool], tuple[Any, dict[int, int]]] = {}


def _byte_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of ``<0xNN>`` byte-fallback tokens (empty for byte-level tokenizers); cached."""
    hit = _byte_ids_cache.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    vocab = tokenizer.get_vocab()
    ids = frozenset(i for t, i in vocab.items() if len(t) == 6 and _BYTE_TOKEN.match(t))
    _byte_ids_cache[id(tokenizer)] = (tokenizer, ids)
    return ids


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


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, one token at a time.

    Args:
        tokenizer: a transformers tokenizer (fast: its ``backend_tokenizer`` is used) or a
            ``tokenizers.Tokenizer``.
        prompt_ids: the request's prompt. The text is that of the generated ids alone, as
            ``decode(output_ids)`` gives; the prompt is kept for callers (``echo``), not decoded.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.prompt_ids = prompt_ids
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
        # _dec(ids, skip_special_tokens): the fast backend's own method, called positionally (a
        # partial with keyword arguments costs about half a decode more per call).
        if isinstance(backend, Tokenizer):
            self._dec = backend.decode
        else:  # a slow transformers tokenizer
            self._dec = lambda ids, skip: backend.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
        self._byte_ids = _byte_token_ids(tokenizer)
        self._one_len = _one_token_lengths(backend, skip_special_tokens)
        self.ids: list[int] = []
        self._pieces: list[str] = []  # everything emitted so far (``text`` joins them)
        self._prefix = 0  # window start: a token whose text was already emitted (or 0)
        self._read = 0  # tokens before this are emitted
        self._prefix_chars = 0  # len(decode(ids[_prefix:_read]))

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
        ids = self.ids
        ids.append(int(token_id))
        full = self._dec(ids[self._prefix :], self.skip_special_tokens)
        skip = self._prefix_chars
        if len(full) <= skip or full.endswith("\ufffd") or ids[-1] in self._byte_ids:
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
        self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """At the end of the request: whatever is still held (may contain U+FFFD)."""
        full = self._decode(self.ids[self._prefix :])
        piece = full[self._prefix_chars :]
        self._prefix = self._read = len(self.ids)
        self._prefix_chars = 0
        self._pieces.append(piece)
        return piece


class StopMatcher:
    """Finds stop strings in a stream of text pieces.

    ``feed(piece) -> (text, stopped)``: ``text`` is safe to emit now; ``stopped`` is True once a
    stop string completed, ``text`` then ending just before it (the stop string and anything
    after it are dropped, and later feeds return ``("", True)``). The stop string that completes
    first wins (the longer one when two end together), so the result does not depend on how the
    text was cut into pieces. ``matched`` names the stop
    string. ``flush()`` returns the held-back tail when the request ends for another reason.
    """

    def __init__(self, stop_strings: Sequence[str] = ()) -> None:
        self.stops = [s for s in stop_strings if s]
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
            return buf[: best[1]], True
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
