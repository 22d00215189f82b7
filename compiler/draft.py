"""A draft model compiled into the target's artifact (``kiln compile TARGET --draft-model DRAFT``;
docs/speculative.md section 4).

The draft is compiled as an artifact of its own under ``ART/draft`` with the target's shape options
(device, dtype, KV dtype, page size, longest sequence, batch buckets, chunk size), so that one block
table serves both KV pools page for page; it gets no draft of its own and keeps its checkpoint's
quantization. Its verify graphs are those of one draft (``CATCH_UP_LENGTH``: two tokens per request,
no tree graph): its catch-up before a chain (runtime/spec_draft.py) brings two tokens per request
after a verify step that accepted every draft (the last draft and the bonus token), which then
replays a captured graph instead of running the extend graph eagerly. The target's manifest pins it
(:class:`~kiln.manifest.DraftSpec`: its manifest's self-hash) and leaves its files to the draft's
own file table.

The compile refuses a draft whose tokenizer vocabulary differs from the target's: the same vocabulary
files, ``tokenizer.json`` compared by its ``model`` (type, vocab, merges) and ``added_tokens``, the
others byte for byte. Their vocabulary sizes (LM head rows) may differ (checkpoints pad them
differently); the runtime drafts only ids both heads have.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kiln import artifact_format as fmt
from kiln.compiler.build import CompileError, CompileOptions, compile_model
from kiln.manifest import DraftSpec

DRAFT_DIR = "draft"
CATCH_UP_LENGTH = "1"  # the draft's --verify-lengths: (B, 1) graphs of two tokens per request
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _vocabulary(path: Path) -> object:
    """What of a vocabulary file decides the token ids."""
    if path.name != "tokenizer.json":
        return path.read_bytes()
    doc = json.loads(path.read_text())
    return doc.get("model"), doc.get("added_tokens")


def vocabulary_mismatch(target_tok: Path, draft_tok: Path) -> str | None:
    """Why the tokenizers in the two directories give different token ids, or None."""
    have = [n for n in VOCAB_FILES if (target_tok / n).is_file()]
    other = [n for n in VOCAB_FILES if (draft_tok / n).is_file()]
    if not have:
        return "the target has no tokenizer vocabulary file"
    if have != other:
        return f"the target's vocabulary files are {have}, the draft's {other}"
    for name in have:
        if _vocabulary(target_tok / name) != _vocabulary(draft_tok / name):
            return f"their {name} differ"
    return None


def compile_draft(draft_dir: str | Path, out: Path, opts: CompileOptions, verbose: bool) -> DraftSpec:
    """Compile ``draft_dir`` into ``out/draft`` for a target compiled with ``opts`` (whose tokenizer
    is already in ``out/tokenizer``); returns the record the target's manifest keeps."""
    dst = out / DRAFT_DIR
    draft_opts = replace(
        opts, quant=None, tp=1, ep=1, verify_lengths=CATCH_UP_LENGTH, tree_graph=False, draft_model=None,
        moe_tune=False, force=False,
    )  # fmt: skip
    if verbose:
        print(f"[kiln compile] draft model {draft_dir} -> {dst}", flush=True)
    manifest = compile_model(draft_dir, dst, draft_opts, verbose=verbose)
    why = vocabulary_mismatch(out / "tokenizer", dst / "tokenizer")
    if why is not None:
        raise CompileError(
            f"--draft-model {draft_dir}: its tokenizer does not give the target's token ids ({why}); "
            "use a draft of the same tokenizer (e.g. a smaller model of the same family)."
        )
    doc = json.loads((dst / fmt.MANIFEST).read_text())
    return DraftSpec(
        path=DRAFT_DIR, manifest_xxh3_128=doc[fmt.MANIFEST_HASH_KEY], vocab_size=manifest.vocab_size
    )
