"""Stages 4-6: shard, post-process and write a checkpoint as per-rank weight packs, in one pass.

Every checkpoint tensor is read once (all ranks are served from the same read); each piece a spec
declares is copied into that rank's staging buffer for the packed tensor (converting the dtype on
the way); when a packed tensor's last piece arrives it is quantized if asked (FP8 e4m3 per output
channel, ``kiln.ops.quant``; or per 128 x 128 block, ``kiln.ops.linear.fp8_block``), checksummed
(its wsum64, :mod:`weights.checksum`, which every load checks) and written at its offset, and freed.
Once every tensor is written, each file is read back once (from the page cache) for its sha256 and
the xxh3 of its header (:mod:`weights.integrity`).

**Block FP8** (``quant="fp8-block"``): a checkpoint weight in e4m3 with 128 x 128 block scales
(:class:`~weights.mapping.BlockFP8`) is copied as it is, FP8 bytes and scales, into every packed
tensor whose pieces keep its blocks whole (``ParamSpec.block_exact``: fused qkv and gate_up of
128-row multiples, tensor-parallel slices on block boundaries); a packed tensor fed otherwise (a
piece off the block grid, a weight the checkpoint left in bf16 or scaled another way) is assembled
in float32 and quantized per block when complete. Stacked routed experts (``w13 [E, 2I, H]``,
``w2 [E, H, I]``, scales ``[E, ceil(N/128), ceil(K/128)]``) are kept per expert the same way: each
expert's gate, up and down blocks copied into its slot. Weights that are not ``fp8-block`` (MLA
``w_kc``/``w_vc``; experts whose slice is off the block grid, compiler/moe_layer.py
``block_fp8_experts``) get the dequantized values. pack.json's ``model`` counts both
(``fp8_block_kept``, ``fp8_block_quantized``) and says whether the experts are block FP8
(``fp8_block_experts``).

**Reproducible**: the same checkpoint, options and kiln version give byte-identical files and
pack.json (layout, headers and metadata are functions of the specs; nothing time- or
path-dependent is written). What differs between runs is returned as ``index.provenance``.

**Host memory** (anonymous, beyond the page cache) stays bounded by: the stream's read-ahead window
(0 with mmap, see :mod:`weights.stream`) + staging buffers of packed tensors still waiting for a
piece (with Hugging Face's layer-ordered shards: about one decoder layer, all ranks together) + the
writer's queue (``write_budget_bytes``, 1 GiB by default). A packed tensor that is a whole,
same-dtype, contiguous checkpoint tensor is written straight from the mmap without staging.
``bench/weights_load.py`` measures the peak for an 8B-shaped checkpoint; ``tests/weights`` on a
small one.
"""

from __future__ import annotations

import datetime
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import kiln
from kiln.weights.discover import discover_weights
from kiln.weights.index import (
    INDEX_NAME,
    PackError,
    PackFile,
    PackIndex,
    PackProvenance,
    PackTensor,
    RankIndex,
)
from kiln.weights.integrity import hash_file
from kiln.weights.mapping import BlockFP8, MappingError, NormalizeStats, Plan, normalize_stream, precheck
from kiln.weights.spec import ACT_DTYPES, ParamSpec, block_grid, place_block_scale
from kiln.weights.st_format import dtype_name, read_header
from kiln.weights.stream import CheckpointStream
from kiln.weights.writer import RankFiles, TensorWriter

DEFAULT_MAX_FILE_BYTES = 2 * 1024**3  # files past this are split; smaller files hash and load in parallel


@dataclass
class _Pending:
    buf: torch.Tensor
    done: set[int]
    # block-exact staging (``fp8-block``, the checkpoint's blocks copied): buf is fp8 and this holds
    # the packed block scales; None: buf holds values (quantized when complete, if asked)
    scale: torch.Tensor | None = None


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PackError(f"output {out} exists and is not a directory.")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise PackError(f"output directory {out} is not empty; pass --force to overwrite the pack in it.")
        (out / INDEX_NAME).unlink(missing_ok=True)  # first: a half-rewritten pack must not look complete
        for p in out.glob("rank*.safetensors"):
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def pack_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    specs_per_rank: list[list[ParamSpec]],
    tp: int,
    ep: int = 1,
    dtype: str = "bfloat16",
    quant: str | None = None,
    progress: bool = True,
    *,
    skip: tuple[str, ...] = (),
    readahead: int = 0,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    force: bool = False,
    workers: int = 4,
    write_budget_bytes: int = 1 << 30,
    model_info: dict[str, Any] | None = None,
) -> PackIndex:
    """Pack ``model_dir``'s checkpoint into ``out_dir`` for ``tp`` ranks; returns the written index,
    with ``index.provenance`` (when, from where, peak memory: not in pack.json) set.

    Args:
        specs_per_rank: ``specs_per_rank[r]`` lists rank ``r``'s packed tensors
            (``kiln.compiler.mappings.param_specs``).
        dtype: activation dtype of the pack (bfloat16, float16, float32).
        quant: ``None``, ``"fp8"`` or ``"fp8-block"``; must agree with the specs (a quantized
            pack has quantized specs of that kind only).
        skip: extra regexes of checkpoint names not to pack (the generic skip rules always apply).
        readahead: shards read ahead by worker threads (0: mmap; see :mod:`weights.stream`).
        max_file_bytes: a rank's data is split into several files past this size.
        model_info: written to pack.json's ``model``; keep it deterministic.
    """
    t0 = time.perf_counter()
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    model_dir, out = Path(model_dir), Path(out_dir)
    if dtype not in ACT_DTYPES:
        raise PackError(f"dtype must be one of {', '.join(ACT_DTYPES)}, got {dtype!r}.")
    if quant not in (None, "fp8", "fp8-block"):
        raise PackError(f"quant must be None, 'fp8' or 'fp8-block', got {quant!r}.")
    if len(specs_per_rank) != tp:
        raise PackError(f"got specs for {len(specs_per_rank)} ranks but tp={tp}.")
    quantized = {s.name for specs in specs_per_rank for s in specs if s.quant}
    kinds = {s.quant for specs in specs_per_rank for s in specs if s.quant}
    if bool(quantized) != (quant is not None) or kinds - {quant}:
        raise PackError(
            f"quant={quant!r} but {len(quantized)} spec(s) ask for quantization "
            f"({', '.join(map(str, kinds))})."
        )
    files = discover_weights(model_dir)
    stream = CheckpointStream(files, readahead)
    plan = Plan(specs_per_rank, tuple(skip))
    if files.format == "safetensors":
        precheck(plan, stream.infos)
    _prepare_out(out, force)
    meta = {"format": "kiln-pack", "dtype": dtype, "quant": quant or "none"}
    ranks = [
        RankFiles(
            out, r, [e for s in specs for e in s.packed(dtype)], max_file_bytes, {**meta, "rank": str(r)}
        )
        for r, specs in enumerate(specs_per_rank)
    ]
    total_tensors = sum(len(rf.slots) for rf in ranks)
    writer = TensorWriter(workers, write_budget_bytes)
    pending: dict[tuple[int, str], _Pending] = {}
    finished: set[tuple[int, str]] = set()
    unknown: list[str] = []
    nstats = NormalizeStats()
    bstats = _BlockStats()
    skipped = 0
    bar = tqdm(
        total=stream.total_bytes or None,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="pack",
        disable=not progress,
    )
    try:
        read = 0
        for name, t in normalize_stream(stream, nstats, keep_blocks=quant == "fp8-block"):
            if name not in plan.targets:
                if plan.skip_reason(name) is None:
                    unknown.append(name)
                skipped += 1
            else:
                where = stream.infos[name].file if name in stream.infos else "checkpoint"
                for tg in plan.check_shape(name, t, where):
                    key = (tg.rank, tg.spec.name)
                    if key in finished:
                        raise MappingError(
                            f"{name} would be loaded twice into rank {tg.rank} {tg.spec.name}."
                        )
                    slots = ranks[tg.rank].slots
                    spec = tg.spec
                    exact = bstats.exact(spec)
                    src = t if exact or not isinstance(t, BlockFP8) else bstats.dequantized(t, nstats)
                    if len(spec.pieces) == 1 and _direct(spec, tg, src, dtype, exact):
                        if isinstance(src, BlockFP8):
                            writer.submit(spec.name, src.weight, slots[spec.name])
                            writer.submit(spec.scale_name, src.scale, slots[spec.scale_name])
                            bstats.kept += 1
                        else:
                            writer.submit(spec.name, tg.region.take(src), slots[spec.name])
                        finished.add(key)
                        continue
                    p = pending.get(key)
                    if p is None:
                        p = pending[key] = _staging(spec, dtype, exact and isinstance(src, BlockFP8))
                    if tg.piece_idx in p.done:
                        raise MappingError(f"{name} would be loaded twice into rank {tg.rank} {spec.name}.")
                    _place(tg, src, p, bstats, nstats)
                    p.done.add(tg.piece_idx)
                    if len(p.done) == len(spec.pieces):
                        del pending[key]
                        finished.add(key)
                        _finish(spec, p, slots, writer, bstats)
            del t
            bar.update(stream.stats.bytes - read)
            read = stream.stats.bytes
            bar.set_postfix_str(f"{writer.written}/{total_tensors} tensors", refresh=False)
        if unknown:
            raise MappingError(
                f"{len(unknown)} checkpoint tensor(s) that no packed parameter uses: {', '.join(unknown[:12])}."
            )
        _check_complete(plan, finished, pending)
        writer.drain()
        bar.set_postfix_str(f"{writer.written}/{total_tensors} tensors", refresh=True)
    finally:
        bar.close()
        writer.close()  # waits for queued writes, on the error path too
        for rf in ranks:
            rf.close()
    index = _build_index(model_dir, stream, ranks, specs_per_rank, writer, tp, ep, dtype, quant)
    index.model = {
        **(model_info or {}),
        "skipped_tensors": skipped,
        "dropped_activation_scales": nstats.dropped_activation_scales,
        "dequantized_fp8": nstats.dequantized,
        **(
            {
                "fp8_block_kept": bstats.kept,
                "fp8_block_quantized": bstats.quantized,
                "fp8_block_experts": any(
                    s.quant == "fp8-block" and s.placement == "experts"
                    for specs in specs_per_rank
                    for s in specs
                ),
            }
            if quant == "fp8-block"
            else {}
        ),
    }
    index.save(out)
    index.provenance = PackProvenance(
        created=created,
        source_dir=str(model_dir.resolve()),
        seconds=time.perf_counter() - t0,
        peak_write_queue_bytes=writer.peak_inflight,
        peak_readahead_bytes=stream.stats.peak_buffered_bytes,
    )
    return index


class _BlockStats:
    """Block-FP8 bookkeeping of one pack: which specs keep the checkpoint's blocks (cached per spec),
    the checkpoint weights dequantized for other specs (once each), and the counts for pack.json."""

    def __init__(self) -> None:
        self._exact: dict[str, bool] = {}
        self._dequantized: set[str] = set()
        self.kept = 0  # fp8-block tensors written with the checkpoint's blocks and scales
        self.quantized = 0  # fp8-block tensors quantized here (values from elsewhere)

    def exact(self, spec: ParamSpec) -> bool:
        if spec.name not in self._exact:
            self._exact[spec.name] = spec.block_exact
        return self._exact[spec.name]

    def dequantized(self, t: BlockFP8, nstats: NormalizeStats) -> torch.Tensor:
        if t.name not in self._dequantized:
            self._dequantized.add(t.name)
            nstats.dequantized += 1
        return t.dequantized()


def _staging(spec: ParamSpec, dtype: str, blocks: bool) -> _Pending:
    """The staging buffer of a packed tensor: the checkpoint's FP8 blocks and their scales (``blocks``;
    blocks no piece covers are zero with scale 1), else values, float32 for what is quantized per
    block when complete (one rounding), the storage dtype otherwise."""
    alloc = torch.zeros if spec.padded else torch.empty
    if blocks:
        scale = torch.ones(block_grid(spec.shape), dtype=torch.float32)
        return _Pending(alloc(spec.shape, dtype=torch.float8_e4m3fn), set(), scale)
    sdt = torch.float32 if spec.dtype == "float32" or spec.quant == "fp8-block" else getattr(torch, dtype)
    return _Pending(alloc(spec.shape, dtype=sdt), set())


def _place(
    tg: Any, src: torch.Tensor | BlockFP8, p: _Pending, bstats: _BlockStats, nstats: NormalizeStats
) -> None:
    """One piece into its staging buffer. A piece that is not block FP8 arriving at a buffer of
    blocks turns the buffer into values (the blocks so far dequantized, exactly); a block-FP8 piece
    for a buffer of values is dequantized."""
    if p.scale is not None and not isinstance(src, BlockFP8):
        from kiln.ops.linear.fp8_block import dequantize_fp8_block

        p.buf, p.scale = dequantize_fp8_block(p.buf, p.scale), None
    if isinstance(src, BlockFP8):
        if p.scale is None:
            src = bstats.dequantized(src, nstats)
        else:
            tg.piece.place(tg.region, src.weight, p.buf)
            place_block_scale(tg.piece, tg.region, src.scale, p.scale)
            return
    tg.piece.place(tg.region, src, p.buf)


def _direct(spec: ParamSpec, tg: Any, t: torch.Tensor | BlockFP8, dtype: str, exact: bool) -> bool:
    """Whether ``t``'s region is the packed tensor as is (no staging copy needed): a whole
    contiguous tensor of the storage dtype, or a whole block-FP8 weight for a block-exact spec."""
    piece = tg.piece
    if spec.padded or piece.transpose or piece.dst_index:
        return False
    if isinstance(t, BlockFP8):
        whole = tg.region.out_shape == tg.region.shape == spec.shape
        return exact and whole and t.weight.is_contiguous()
    if spec.quant or t.dtype != spec.storage_dtype(dtype):
        return False
    return tg.region.take(t).is_contiguous()


def _finish(
    spec: ParamSpec, p: _Pending, slots: dict[str, Any], writer: TensorWriter, bstats: _BlockStats
) -> None:
    if spec.quant == "fp8":
        from kiln.ops.common.quant import quantize_fp8_per_channel

        w, s = quantize_fp8_per_channel(p.buf)  # w: [..., N, K] fp8, s: [..., N] f32
    elif spec.quant == "fp8-block" and p.scale is not None:
        w, s = p.buf, p.scale  # the checkpoint's blocks, as they were
        bstats.kept += 1
    elif spec.quant == "fp8-block":
        from kiln.ops.linear.fp8_block import quantize_fp8_block

        w, s = quantize_fp8_block(p.buf)  # w: [(E,) N, K] fp8, s: [(E,) ceil(N/128), ceil(K/128)] f32
        bstats.quantized += 1
    else:
        writer.submit(spec.name, p.buf, slots[spec.name])
        return
    writer.submit(spec.name, w, slots[spec.name])
    writer.submit(spec.scale_name, s, slots[spec.scale_name])


def _check_complete(
    plan: Plan, finished: set[tuple[int, str]], pending: dict[tuple[int, str], _Pending]
) -> None:
    missing = []
    for rank, specs in enumerate(plan.specs_per_rank):
        for spec in specs:
            if (rank, spec.name) in finished:
                continue
            done = pending[(rank, spec.name)].done if (rank, spec.name) in pending else set()
            need = [p.sources[0].name for k, p in enumerate(spec.pieces) if k not in done]
            missing.append(f"rank {rank} {spec.name} (needs {', '.join(need[:3])})")
    if missing:
        raise MappingError(
            f"{len(missing)} packed tensor(s) incomplete, sources missing from the checkpoint: {'; '.join(missing[:10])}"
        )


def _build_index(
    model_dir: Path,
    stream: CheckpointStream,
    ranks: list[RankFiles],
    specs_per_rank: list[list[ParamSpec]],
    writer: TensorWriter,
    tp: int,
    ep: int,
    dtype: str,
    quant: str | None,
) -> PackIndex:
    paths = [p for rf in ranks for p in rf.paths]
    headers = {p: read_header(p) for p in paths}

    def hashes(p: Path) -> PackFile:
        h = hash_file(p, headers[p].data_start)
        return PackFile(p.name, headers[p].file_size, h.sha256, headers[p].data_start, h.header_xxh3)

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(paths)))) as pool:
        files = dict(zip(paths, pool.map(hashes, paths)))
    index = PackIndex(
        tp=tp,
        ep=ep,
        dtype=dtype,
        quant=quant,
        source=stream.fingerprint(model_dir),
        ranks=[],
        kiln_version=kiln.__version__,
    )
    for r, (rf, specs) in enumerate(zip(ranks, specs_per_rank)):
        placement = {n: s.placement for s in specs for n, *_ in s.packed(dtype)}
        ri = RankIndex(rank=r, files=[files[p] for p in rf.paths])
        for path in rf.paths:
            hdr = headers[path]
            for name, info in hdr.tensors.items():
                ri.tensors[name] = PackTensor(
                    name,
                    info.shape,
                    dtype_name(info.dtype),
                    path.name,
                    info.begin,
                    info.nbytes,
                    writer.sums[(path.name, name)],
                    placement.get(name, ""),
                )
        index.ranks.append(ri)
    return index


__all__ = ["DEFAULT_MAX_FILE_BYTES", "pack_checkpoint"]
