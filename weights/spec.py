"""What a packed tensor is made of: :class:`ParamSpec` (one tensor of one rank) built from
:class:`Piece` s, each a :class:`Region` of a checkpoint tensor copied to a place in the output.

The placement is frozen per tensor when the spec is built (the rank's slice ranges are numbers in
the pieces, not a rank looked up at load time), so a spec list fully describes one rank's pack.

A piece: ``src = ckpt[name][index].narrow(dim, start, length)`` (optionally with its last two dims
transposed) is copied into ``out[dst_index].narrow(dst_dim, dst_start, src.shape[dst_dim])``; all
other dims of the destination must match ``src`` exactly. Output elements no piece covers are zero
(the padding of uneven splits and of the vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from kiln.weights.st_format import DTYPE_NAMES, dtype_name

ACT_DTYPES = ("bfloat16", "float16", "float32")


def even_split(n: int, parts: int, rank: int) -> tuple[int, int, int]:
    """Split ``n`` rows over ``parts`` ranks, ``ceil(n / parts)`` each, the last ones short.

    Returns ``(start, length, per_rank)``; ``length < per_rank`` means zero padding.
    """
    per = math.ceil(n / parts)
    start = min(rank * per, n)
    return start, max(0, min(per, n - start)), per


@dataclass(frozen=True)
class Region:
    """A slice of checkpoint tensor ``name`` whose full shape must be ``shape``."""

    name: str
    shape: tuple[int, ...]
    index: tuple[int, ...] = ()  # leading indices, e.g. (expert,) into a pre-stacked [E, ...] tensor
    dim: int = 0  # dim (after index) narrowed
    start: int = 0
    length: int | None = None  # None: to the end of ``dim``

    @property
    def out_shape(self) -> tuple[int, ...]:
        s = list(self.shape[len(self.index) :])
        if s:
            s[self.dim] = self.length if self.length is not None else s[self.dim] - self.start
        return tuple(s)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        for i in self.index:
            t = t[i]
        if t.dim() == 0:
            return t
        n = self.length if self.length is not None else t.shape[self.dim] - self.start
        return t.narrow(self.dim, self.start, n)


@dataclass(frozen=True)
class Piece:
    """One region copied into the output. ``sources`` are alternative spellings of the same data
    (per-expert vs pre-stacked tensors, Mixtral vs Qwen names); exactly one must be in the checkpoint."""

    sources: tuple[Region, ...]
    dst_index: tuple[int, ...] = ()
    dst_dim: int = 0
    dst_start: int = 0
    transpose: bool = False  # transpose the last two dims of the region (MLA w_vc)

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.sources[0].out_shape
        return (*s[:-2], s[-1], s[-2]) if self.transpose else s

    def dst(self, out: torch.Tensor) -> torch.Tensor:
        for i in self.dst_index:
            out = out[i]
        if out.dim() == 0:
            return out
        return out.narrow(self.dst_dim, self.dst_start, self.shape[self.dst_dim])

    def place(self, region: Region, src: torch.Tensor, out: torch.Tensor) -> None:
        """Copy ``region`` (one of :attr:`sources`) of checkpoint tensor ``src`` (full, shape-checked)
        into ``out``."""
        t = region.take(src)
        if self.transpose:
            t = t.transpose(-1, -2)
        self.dst(out).copy_(t)


@dataclass(frozen=True)
class ParamSpec:
    """One packed tensor of one rank.

    ``dtype``: ``"act"`` stores it in the pack's activation dtype (bf16/f16/f32), ``"float32"``
    always in float32. ``quant="fp8"``: stored as float8_e4m3fn quantized per output channel (dim -2)
    with a float32 scale tensor ``scale_name`` of shape ``shape[:-1]`` beside it.
    ``quant="fp8-block"`` (``[N, K]``, or stacked experts ``[E, N, K]``): float8_e4m3fn with a float32
    scale per 128 x 128 block, ``scale_name`` of shape ``[(E,) ceil(N/128), ceil(K/128)]``; when every
    piece keeps the blocks whole (:attr:`block_exact`) a block-FP8 checkpoint's bytes and scales are
    copied as they are.
    """

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    placement: str  # e.g. "column", "row", "vocab", "qkv-heads", "experts", "replicated"
    dtype: Literal["act", "float32"] = "act"
    quant: Literal["fp8", "fp8-block"] | None = None

    def __post_init__(self) -> None:
        covered = 0
        for p in self.pieces:
            ps = p.shape
            for alt in p.sources[1:]:
                alt_shape = alt.out_shape
                if p.transpose:
                    alt_shape = (*alt_shape[:-2], alt_shape[-1], alt_shape[-2])
                if alt_shape != ps:
                    raise ValueError(f"{self.name}: alternative {alt.name} gives {alt_shape}, not {ps}")
            dshape = list(self.shape[len(p.dst_index) :])
            ok = len(dshape) == len(ps) and all(
                (p.dst_start + ps[d] <= dshape[d]) if d == p.dst_dim else ps[d] == dshape[d]
                for d in range(len(ps))
            )
            if not ok:
                raise ValueError(
                    f"{self.name}: piece from {p.sources[0].name} of shape {ps} does not fit "
                    f"{self.shape} at index {p.dst_index}, dim {p.dst_dim}, offset {p.dst_start}"
                )
            covered += math.prod(ps)
        if covered > math.prod(self.shape):
            raise ValueError(f"{self.name}: pieces cover {covered} elements of a {self.shape} tensor")
        if self.quant is not None and len(self.shape) < 2:
            raise ValueError(f"{self.name}: only matrices can be quantized, shape is {self.shape}")
        if self.quant == "fp8-block" and len(self.shape) not in (2, 3):
            raise ValueError(
                f"{self.name}: block FP8 is for [N, K] weights and [E, N, K] experts, shape is {self.shape}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def padded(self) -> bool:
        """True when some output elements come from no piece (they are zero)."""
        return sum(math.prod(p.shape) for p in self.pieces) < self.numel

    @property
    def scale_name(self) -> str:
        return scale_name(self.name)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The shape of the scale tensor of a quantized spec (per channel or per block)."""
        if self.quant == "fp8-block":
            return block_grid(self.shape)
        return self.shape[:-1]

    @property
    def block_exact(self) -> bool:
        """``fp8-block`` and every piece moves whole 128 x 128 blocks (:func:`keeps_blocks`): the
        checkpoint's FP8 blocks and their scales can be copied as they are."""
        return self.quant == "fp8-block" and all(
            keeps_blocks(p, r, self.shape) for p in self.pieces for r in p.sources
        )

    def storage_dtype(self, act: str) -> torch.dtype:
        if self.quant in ("fp8", "fp8-block"):
            return torch.float8_e4m3fn
        return torch.float32 if self.dtype == "float32" else DTYPE_NAMES[act]

    def packed(self, act: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The pack entries this spec produces: itself, and its scale when quantized."""
        out = [(self.name, self.shape, self.storage_dtype(act))]
        if self.quant is not None:
            out.append((self.scale_name, self.scale_shape, torch.float32))
        return out

    @property
    def source_names(self) -> list[str]:
        return [r.name for p in self.pieces for r in p.sources]


FP8_BLOCK = 128  # the weight block of quant "fp8-block" (ops/linear/fp8_block.py BLOCK)


def block_grid(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The block-scale shape of a weight of ``shape`` ``[..., N, K]``: ``[..., ceil(N/128), ceil(K/128)]``."""
    return (*shape[:-2], *(-(-d // FP8_BLOCK) for d in shape[-2:]))


def keeps_blocks(piece: Piece, region: Region, dst_shape: tuple[int, ...]) -> bool:
    """Whether copying ``region`` of a checkpoint weight to ``piece``'s place in a tensor of
    ``dst_shape`` moves whole 128 x 128 blocks: both are matrices once the leading indices are taken
    (``region.index``: an expert of a stacked ``[E, N, K]`` tensor; ``piece.dst_index``: an expert
    slot of a stacked output), and in both dims the source and destination offsets are multiples of
    128 and the extent is too, or ends both tensors (the ragged last block)."""
    src_shape = region.shape[len(region.index) :]
    dst_shape = dst_shape[len(piece.dst_index) :]
    if piece.transpose or len(src_shape) != 2 or len(dst_shape) != 2:
        return False
    ext = region.out_shape
    for d in (0, 1):
        s0 = region.start if region.dim == d else 0
        d0 = piece.dst_start if piece.dst_dim == d else 0
        if s0 % FP8_BLOCK or d0 % FP8_BLOCK:
            return False
        if ext[d] % FP8_BLOCK and not (s0 + ext[d] == src_shape[d] and d0 + ext[d] == dst_shape[d]):
            return False
    return True


def place_block_scale(piece: Piece, region: Region, scale: torch.Tensor, out: torch.Tensor) -> None:
    """The scales of the blocks :meth:`Piece.place` copies (``keeps_blocks`` holds): rows/columns of
    the checkpoint's block scales ``scale`` ``[(E,) ceil(N/128), ceil(K/128)]`` into the packed tensor's
    ``out`` (leading indices as :meth:`Piece.place` takes them)."""
    ext = region.out_shape
    for i in region.index:
        scale = scale[i]
    for i in piece.dst_index:
        out = out[i]
    start, n = region.start // FP8_BLOCK, -(-ext[region.dim] // FP8_BLOCK)
    src = scale.narrow(region.dim, start, n)
    out.narrow(piece.dst_dim, piece.dst_start // FP8_BLOCK, src.shape[piece.dst_dim]).copy_(src)


def scale_name(name: str) -> str:
    """``x.weight`` -> ``x.weight_scale``; ``layers.0.moe.w13`` -> ``layers.0.moe.w13_scale``."""
    return name + "_scale"


def expected_tensors(specs: list[ParamSpec], dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype name)}`` of everything a rank's pack holds, for ``load_pack(expected=)``."""
    if dtype not in ACT_DTYPES:
        raise ValueError(f"dtype must be one of {ACT_DTYPES}, got {dtype!r}")
    return {n: (s, dtype_name(d)) for spec in specs for n, s, d in spec.packed(dtype)}
