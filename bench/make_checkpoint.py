"""Write a random-weight Hugging Face checkpoint of a bundled config (or any config.json).

    python bench/make_checkpoint.py --preset llama-3.1-8b -o /tmp/llama8b [--num-layers 4]
    python bench/make_checkpoint.py --config path/to/config.json -o DIR --dtype float16
    python bench/make_checkpoint.py --preset qwen3-30b-a3b --bytes    # its size, nothing written
    python bench/make_checkpoint.py --preset llama-3.1-8b --successor -o DIR  # greedy t -> next(t)
    python bench/make_checkpoint.py --preset llama-3.1-8b --successor -o DIR --eagle3-head HEAD [--decoy 1.2]

Big configs are written without instantiating the model (meta device + random tensors shard by
shard, see kiln.compiler.synth); tiny ones go through transformers' save_pretrained.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from kiln.compiler.cli_inspect import bundled_configs
    from kiln.compiler.synth import make_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(bundled_configs()), help="a bundled config")
    src.add_argument("--config", type=Path, help="a config.json to use instead")
    ap.add_argument("-o", "--out", type=Path, help="output directory")
    ap.add_argument(
        "--bytes", action="store_true", help="print the checkpoint's size in bytes (an upper bound) and exit"
    )
    ap.add_argument("--num-layers", type=int, default=None, help="keep shapes, use fewer layers")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--engine", default="auto", choices=["auto", "hf", "fast"])
    ap.add_argument(
        "--stacked-experts", action="store_true", help="transformers-5 pre-stacked expert tensors"
    )
    ap.add_argument("--no-tokenizer", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--successor",
        action="store_true",
        help="zero o/down projections, LM head = embedding permuted by a cycle: greedy decoding emits "
        "next(t) after t (kiln.compiler.synth.successor_next(vocab, --seed)); Llama-family, untied",
    )
    ap.add_argument(
        "--eagle3-head",
        type=Path,
        metavar="DIR",
        help="with --successor: also an EAGLE-3 head into DIR that drafts the successor's tokens "
        "(kiln.compiler.synth_eagle3.successor_eagle3_head)",
    )
    ap.add_argument(
        "--decoy",
        type=float,
        default=0.0,
        help="with --eagle3-head: > 1 makes the head's best draft always wrong and its second right",
    )
    a = ap.parse_args(argv)
    if a.eagle3_head is not None and not a.successor:
        ap.error("--eagle3-head needs --successor (the head drafts a successor checkpoint's tokens)")
    if a.bytes:
        print(_size_bound(a.preset, a.config, a.num_layers, a.dtype))
        return 0
    if a.out is None:
        ap.error("-o/--out is required (or --bytes)")
    config = a.preset if a.preset else json.loads(a.config.read_text())
    from kiln.errors import KilnError

    t0 = time.perf_counter()
    try:
        out = make_checkpoint(
            a.out,
            config,
            a.dtype,
            a.seed,
            a.max_shard_size,
            a.num_layers,
            not a.no_tokenizer,
            engine=a.engine,
            original_format=not a.stacked_experts,
            threads=a.threads,
            successor=a.successor,
        )
    except KilnError as e:
        print(f"make_checkpoint: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    n = len(list(out.glob("*.safetensors")))
    print(f"wrote {out}: {n} shard(s), {size / 1e9:.2f} GB in {dt:.1f} s ({size / 1e9 / dt:.2f} GB/s)")
    if a.eagle3_head is not None:
        import torch

        from kiln.compiler.synth_eagle3 import successor_eagle3_head

        t0 = time.perf_counter()
        successor_eagle3_head(a.eagle3_head, out, a.seed, a.decoy, dtype=getattr(torch, a.dtype))
        dt = time.perf_counter() - t0
        print(f"wrote the EAGLE-3 head {a.eagle3_head} (decoy {a.decoy}) in {dt:.1f} s")
    return 0


def _size_bound(preset: str | None, config: Path | None, num_layers: int | None, dtype: str) -> int:
    """Bytes the checkpoint's shards take, plus 2% and 64 MB for headers, norms and the tokenizer."""
    from kiln.compiler.cli_inspect import bundled_configs
    from kiln.compiler.config import normalize_config

    path = bundled_configs()[preset] if preset else config
    assert path is not None
    raw = json.loads(Path(path).read_text())
    if num_layers:
        raw["num_hidden_layers"] = num_layers
    cfg = normalize_config(raw)
    return int(cfg.weight_bytes(dtype) * 1.02) + 64 * 2**20


if __name__ == "__main__":
    sys.exit(main())
