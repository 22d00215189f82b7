"""A lower bound on a text's token count that costs nothing: ``ceil(len(text) / L)``.

``kiln serve`` checks it before tokenizing a prompt, so a prompt far past the context (a 5 MB
string) is refused at once instead of after seconds of tokenization.

:func:`chars_per_token_bound` returns ``L``, the most characters of input text any one token can
stand for, or ``None`` when that cannot be proven for the tokenizer (then prompts are tokenized in
full, as before). It is proven only for the pipelines LLM checkpoints use (byte-level BPE, Llama-3
and Qwen style; SentencePiece-style BPE with byte fallback, Llama-2 and Mistral style):

* the model is a BPE: every token it emits is one vocabulary entry, whose string spells the
  characters (byte-level BPE: the bytes, one character per byte, and a character is at least one
  byte) of the piece of normalized text it covers; byte-fallback tokens cover one byte of a
  character; an unknown character becomes one unknown token, unless ``fuse_unk`` merges a whole
  run into one (refused: no bound). So one token covers at most ``max(len(entry))`` characters;
* added (special) tokens are matched as their exact content, which covers ``len(content)``
  characters (``lstrip``/``rstrip`` tokens also swallow any whitespace next to them: no bound);
* the pre-tokenizer only splits, never drops text (``ByteLevel``, ``Metaspace``, ``Split`` and
  ``Punctuation`` without the ``Removed`` behaviour, ``Digits``, ``UnicodeScripts``); one that
  drops whitespace (``Whitespace``, ``BertPreTokenizer``) gives no bound;
* the normalizer shrinks text by at most a known factor: none, ``NFD``/``NFKD``, ``Lowercase``,
  ``Prepend`` (never shrink), ``NFC``/``NFKC`` (canonical composition joins at most 4 code points
  into one: Unicode's longest canonical decomposition, UAX #15), ``Replace`` of a literal string
  by a non-empty one (by ``len(pattern) / len(content)``); others (``Strip``, ``StripAccents``,
  ``Precompiled``, regex ``Replace``) give no bound;
* the post-processor only adds tokens (BOS), and truncation is off (a tokenizer that truncates
  could fit any text: no bound).

So ``tokens(text) >= len(normalized) / max_entry >= len(text) / (shrink * max_entry)``, and a
prompt refused because ``ceil(len(text) / L)`` already reaches the limit could never have fit.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_CANONICAL_DECOMPOSITION = 4  # code points; U+1F82 (UAX #15, NFD's maximum expansion factor)

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"}
_NON_SHRINKING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}


def chars_per_token_bound(tokenizer: Any) -> int | None:
    """The most characters of input text one token of ``tokenizer`` can cover (``L`` above), or
    None when no bound holds for it. ``tokenizer``: anything with a ``backend_tokenizer`` (a
    ``tokenizers.Tokenizer``): kiln's ``FastTokenizer`` or a transformers fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # an unserializable custom component: no bound
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None:
        return None
    vocab = model.get("vocab") or {}
    pre = spec.get("pre_tokenizer")
    if not _every_char_has_a_token(
        model, vocab, _has_byte_level(pre) or _has_byte_level(spec.get("normalizer"))
    ):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(pre):
        return None
    longest = max([len(s) for s in vocab] + [len(a.get("content", "")) for a in added] + [1])
    return math.ceil(longest * shrink)


def min_tokens(text: str, bound: int | None) -> int:
    """A lower bound on the tokens ``text`` encodes to (0 without a bound)."""
    return -(-len(text) // bound) if bound else 0


def _every_char_has_a_token(model: dict, vocab: dict, byte_level: bool) -> bool:
    from tokenizers.pre_tokenizers import ByteLevel

    if byte_level and all(c in vocab for c in ByteLevel.alphabet()):
        return True
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    return model.get("unk_token") in vocab and not model.get("fuse_unk")


def _has_byte_level(step: dict | None) -> bool:
    if step is None:
        return False
    if step.get("type") == "Sequence":
        return any(_has_byte_level(s) for s in step.get("pretokenizers", step.get("normalizers", ())))
    return step.get("type") == "ByteLevel"


def _shrink(norm: dict | None) -> float | None:
    """By how much ``norm`` can shrink a text's length at most (None: unbounded or unknown)."""
    if norm is None:
        return 1.0
    kind = norm.get("type")
    if kind == "Sequence":
        total = 1.0
        for sub in norm.get("normalizers", ()):
            f = _shrink(sub)
            if f is None:
                return None
            total *= f
        return total
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1.0
    if kind in ("NFC", "NFKC"):
        return float(MAX_CANONICAL_DECOMPOSITION)
    if kind == "Replace":
        pattern, content = norm.get("pattern") or {}, norm.get("content", "")
        if "String" not in pattern or not content or not pattern["String"]:
            return None
        return max(1.0, len(pattern["String"]) / len(content))
    return None


def _keeps_text(pre: dict | None) -> bool:
    """Whether pre-tokenizer ``pre`` keeps every character of its input in some piece."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", ()))
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS
