"""``kiln pack``: a Hugging Face checkpoint -> pre-sharded, fused, optionally FP8 weight packs."""

from __future__ import annotations

import time
from pathlib import Path

import click

from kiln.compiler.config import load_config, resolve_quant
from kiln.compiler.mappings import all_rank_specs, skip_patterns
from kiln.compiler.parallel import ParallelConfig, validate_parallel
from kiln.compiler.synth import parse_size


@click.command("pack")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="Output pack directory."
)
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel ranks to shard for.")
@click.option(
    "--ep", default=1, show_default=True, help="Expert-parallel size (MoE); tp / ep ranks split each expert."
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="Activation dtype: embeddings, norms, routers, and every weight unless --quant.",
)
@click.option(
    "--quant",
    type=click.Choice(["fp8", "fp8-block", "none"]),
    default=None,
    help="GEMM weights as `kiln compile --quant` takes them (omitted: as the checkpoint is; a 128x128 "
    "block-FP8 checkpoint keeps its blocks).",
)
@click.option("--verify", is_flag=True, help="Re-read the written pack and check every file's sha256.")
@click.option("--force", is_flag=True, help="Overwrite the pack in a non-empty OUT.")
@click.option("--fuse-shared-experts", is_flag=True, help="Pack shared experts as extra experts of w13/w2.")
@click.option("--nextn", is_flag=True, help="Also pack next-token-prediction layers (DeepSeek-V3 MTP).")
@click.option(
    "--readahead",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Shards read ahead by threads (0: mmap).",
)
@click.option(
    "--max-file-size", default="2GiB", show_default=True, help="Split a rank's data into files of this size."
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def pack_cmd(
    model_dir: Path,
    out: Path,
    tp: int,
    ep: int,
    dtype: str,
    quant: str | None,
    verify: bool,
    force: bool,
    fuse_shared_experts: bool,
    nextn: bool,
    readahead: int,
    max_file_size: str,
    quiet: bool,
) -> None:
    """Pack MODEL_DIR (a Hugging Face checkpoint) into OUT: rank{r}.safetensors per tensor-parallel
    rank, already fused (qkv, gate_up, experts, MLA w_kc/w_vc), sharded and optionally quantized, plus
    pack.json with shapes, dtypes, the sha256 of every file and a checksum (wsum64) of every tensor."""
    from kiln.weights import pack_checkpoint, verify_pack

    if out.exists() and out.is_dir() and any(out.iterdir()) and not force:
        raise click.UsageError(
            f"output directory {out} is not empty; pass --force to overwrite the pack in it."
        )
    try:
        max_file_bytes = parse_size(max_file_size)
    except ValueError as e:
        raise click.BadParameter(f"{e}; e.g. 2GiB, 500MB", param_hint="--max-file-size") from None
    if max_file_bytes < 1:
        raise click.BadParameter("must be above 0, e.g. 2GiB", param_hint="--max-file-size")
    cfg = load_config(model_dir)
    par = ParallelConfig(tp=tp, ep=ep)
    validate_parallel(cfg, par)
    quant = resolve_quant(quant, cfg)  # as kiln compile resolves it (block-FP8 checkpoints keep blocks)
    specs = all_rank_specs(cfg, par, quant, fuse_shared_experts=fuse_shared_experts, nextn=nextn)
    t0 = time.perf_counter()
    index = pack_checkpoint(
        model_dir,
        out,
        specs,
        tp=tp,
        ep=ep,
        dtype=dtype,
        quant=quant,
        progress=not quiet,
        skip=skip_patterns(cfg, nextn),
        readahead=readahead,
        max_file_bytes=max_file_bytes,
        force=force,
        model_info={
            "architecture": cfg.architecture,
            "num_layers": cfg.num_layers,
            "fuse_shared_experts": fuse_shared_experts,
            "nextn": nextn,
        },
    )
    dt = time.perf_counter() - t0
    click.echo(index.summary())
    click.echo(f"  wrote {out} in {dt:.1f} s ({index.nbytes / max(dt, 1e-9) / 1e9:.2f} GB/s)")
    if verify:
        t0 = time.perf_counter()
        verify_pack(out)
        n = sum(len(r.files) for r in index.ranks)
        click.echo(f"  verified sizes, headers and sha256 of {n} file(s) in {time.perf_counter() - t0:.1f} s")
