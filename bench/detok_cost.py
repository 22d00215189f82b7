"""Host cost of incremental detokenization per token: the window path (a Rust ``decode`` call per
token) against the table path (``kiln.runtime.byte_table``), CPU only.

    python bench/detok_cost.py [--requests 64] [--tokens 128] [--vocab 32000]

Tokenizers are the offline synthetic ones (``kiln.compiler.synth_tokenizer``): byte-level BPE
(Llama-3 style), byte fallback, and byte fallback with Llama-2's ``Strip`` decoder. Each row
streams ``--requests`` requests of ``--tokens`` ids, interleaved one token per request per step
as the engine does, through ``IncrementalDetokenizer.add`` (+ ``flush``). ``random``: ids drawn
from the whole vocabulary; ``text``: ids of encoded multilingual text. ``table cold`` includes
each id's first-use check (a ``decode([id])`` per distinct id, once per process); ``table warm``
is the steady state. ``build ms``: building the table, once per tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from kiln.compiler.synth_tokenizer import build_tokenizer, corpus
from kiln.runtime import byte_table
from kiln.runtime.detokenizer import IncrementalDetokenizer

STRIP = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


def _tokenizer(root: Path, flavour: str, vocab: int):
    from tokenizers import Tokenizer

    info = build_tokenizer(root / flavour, vocab_size=vocab, byte_fallback=flavour != "byte_level")
    path = info.path / "tokenizer.json"
    if flavour == "strip":
        cfg = json.loads(path.read_text())
        cfg["decoder"] = STRIP
        path.write_text(json.dumps(cfg, ensure_ascii=False))
    return Tokenizer.from_file(str(path))


def _run(tok, streams: list[list[int]], fast: bool) -> tuple[float, str]:
    """Seconds per token for one pass over ``streams`` (one token per request per step)."""
    detoks = [IncrementalDetokenizer(tok, [], True, fast=fast) for _ in streams]
    steps = max(len(s) for s in streams)
    t0 = time.perf_counter()
    for i in range(steps):
        for d, s in zip(detoks, streams):
            if i < len(s):
                d.add(s[i])
    for d in detoks:
        d.flush()
    dt = time.perf_counter() - t0
    assert all(d.fast == fast for d in detoks)
    return dt / sum(len(s) for s in streams), "".join(d.text for d in detoks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    rng = random.Random(0)
    text = "\n".join(corpus()[:400])
    print(f"{args.requests} requests x {args.tokens} tokens, vocab {args.vocab}; us/token")
    print(
        f"{'tokenizer':<14}{'ids':<8}{'window':>9}{'table cold':>12}{'table warm':>12}{'speed-up':>10}{'build ms':>10}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for flavour in ("byte_level", "byte_fallback", "strip"):
            tok = _tokenizer(Path(tmp), flavour, args.vocab)
            t0 = time.perf_counter()
            assert byte_table.decode_table(tok) is not None
            build_ms = (time.perf_counter() - t0) * 1e3
            text_ids = tok.encode(text, add_special_tokens=False).ids
            for kind in ("random", "text"):
                if kind == "random":
                    V = tok.get_vocab_size()
                    streams = [[rng.randrange(V) for _ in range(args.tokens)] for _ in range(args.requests)]
                else:
                    starts = [rng.randrange(len(text_ids) - args.tokens) for _ in range(args.requests)]
                    streams = [text_ids[s : s + args.tokens] for s in starts]
                byte_table._tables.clear()  # a fresh table: ids unchecked (the cold pass)
                assert byte_table.decode_table(tok) is not None
                cold, out_cold = _run(tok, streams, True)
                warm = min(_run(tok, streams, True)[0] for _ in range(3))
                window, out_window = min((_run(tok, streams, False) for _ in range(2)), key=lambda r: r[0])
                assert out_cold == out_window, "table and window paths disagree"
                print(
                    f"{flavour:<14}{kind:<8}{window * 1e6:9.2f}{cold * 1e6:12.2f}{warm * 1e6:12.2f}"
                    f"{window / warm:9.1f}x{build_ms:10.1f}"
                )


if __name__ == "__main__":
    main()
