"""Stage 3: checkpoint names -> packed tensors.

The model side declares, per architecture and rank, which checkpoint regions make each packed
tensor (:class:`~kiln.weights.spec.ParamSpec`, built by ``kiln.compiler.mappings``). This module
applies those declarations to a stream:

* **FP8 scale names are normalized**: ``*.weight_scale_inv`` (DeepSeek block scales, a dequant
  multiplier despite the name) -> ``*.weight_scale``; ``*.activation_scale`` -> ``*.input_scale``.
  An FP8 checkpoint weight is dequantized to float32 as soon as its scale has also streamed past
  (per-tensor, per-channel or block scales), except, when the pack asks for them (``keep_blocks``),
  e4m3 weights with 128 x 128 block scales: those come out as :class:`BlockFP8` (the FP8 weight
  and its float32 scales, unchanged) for ``--quant fp8-block`` packs to copy. Static activation
  and KV scales are dropped: packs quantize activations dynamically.
* **Skip rules**: rotary ``inv_freq`` and cos/sin caches; anything matching the model's declared
  skip patterns; decoder layers past those the specs use (next-token-prediction layers, unless the
  specs ask for them); ``lm_head.weight`` when no spec uses it (tied embeddings).
* Every other name must be a source of some spec; an unknown name is an error (a silently dropped
  tensor is a wrong model), as is a source that never arrives or arrives twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.weights.spec import ParamSpec, Piece, Region, block_grid
from kiln.weights.stream import SourceInfo

GENERIC_SKIPS = (
    r"(^|\.)rotary_emb\.inv_freq$",
    r"(^|\.)rotary_emb\.(cos|sin)_cached$",
)
ACTIVATION_SCALE = re.compile(r"\.(input_scale|k_scale|v_scale|kv_scale|q_scale|prob_scale)$")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class MappingError(KilnError, ValueError):
    """A checkpoint whose tensors do not match what the architecture declares. Names the tensors."""


def normalize_name(name: str) -> str:
    """FP8 scale-name normalization (see the module docstring)."""
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_inv")]
    if name.endswith(".activation_scale"):
        return name[: -len("activation_scale")] + "input_scale"
    return name


def dequantize_fp8_weight(w: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """``w`` fp8 ``[..., N, K]`` times ``scale`` (per-tensor ``[]``/``[1]``, per-channel ``[..., N]``
    or ``[..., N, 1]``, or block ``[..., ceil(N/bn), ceil(K/bk)]``) -> float32."""
    wf = w.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return wf * s.reshape(())
    n, k = wf.shape[-2:]
    if s.shape == wf.shape[:-1] or s.shape == (*wf.shape[:-1], 1):
        return wf * s.reshape(*wf.shape[:-1], 1)
    if s.dim() == wf.dim() and s.shape[:-2] == wf.shape[:-2]:
        sn, sk = s.shape[-2:]
        bn, bk = math.ceil(n / sn), math.ceil(k / sk)
        # Block sizes are powers of two (128 in practice); ceil() above undershoots for ragged edges.
        bn, bk = 1 << (bn - 1).bit_length(), 1 << (bk - 1).bit_length()
        if math.ceil(n / bn) == sn and math.ceil(k / bk) == sk:
            full = s.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
            return wf * full[..., :n, :k]
    raise MappingError(
        f"{name}: cannot apply an FP8 scale of shape {list(scale.shape)} to a weight of shape "
        f"{list(w.shape)} (expected per-tensor, per-channel or block scales)."
    )


class BlockFP8:
    """A checkpoint's e4m3 weight ``[(E,) N, K]`` with its 128 x 128 block scales ``[(E,) ceil(N/128),
    ceil(K/128)]`` (converted to float32, which is exact from bf16 or UE8M0), as the checkpoint holds
    them. ``shape`` and ``dtype`` are the weight's; :meth:`dequantized` the float32 values (computed
    once), for packed tensors that do not keep the blocks."""

    def __init__(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.name, self.weight, self.scale = name, weight, scale.float()
        self._dequantized: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def dequantized(self) -> torch.Tensor:
        if self._dequantized is None:
            self._dequantized = dequantize_fp8_weight(self.weight, self.scale, self.name)
        return self._dequantized


def is_block_fp8(w: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``scale`` is a 128 x 128 block scale of the e4m3 weight ``w``: ``[N, K]``, or stacked
    experts ``[E, N, K]`` with ``[E, ceil(N/128), ceil(K/128)]`` scales."""
    return (
        w.dtype == torch.float8_e4m3fn
        and w.dim() in (2, 3)
        and scale.dim() == w.dim()
        and tuple(scale.shape) == block_grid(tuple(w.shape))
    )


@dataclass
class NormalizeStats:
    dropped_activation_scales: int = 0
    dequantized: int = 0
    block_fp8: int = 0  # weights passed on as BlockFP8


def normalize_stream(
    stream: Iterable[tuple[str, torch.Tensor]],
    stats: NormalizeStats | None = None,
    keep_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor | BlockFP8]]:
    """Apply scale-name normalization and FP8 dequantization to ``stream`` (see the module
    docstring); with ``keep_blocks``, 128 x 128 block-scaled e4m3 weights come out as :class:`BlockFP8`."""
    stats = stats if stats is not None else NormalizeStats()
    fp8: dict[str, torch.Tensor] = {}  # weight name -> fp8 weight waiting for its scale
    scales: dict[str, torch.Tensor] = {}  # weight name -> scale waiting for its weight

    def pair(wname: str, w: torch.Tensor, scale: torch.Tensor) -> tuple[str, torch.Tensor | BlockFP8]:
        if keep_blocks and is_block_fp8(w, scale):
            stats.block_fp8 += 1
            return wname, BlockFP8(wname, w, scale)
        stats.dequantized += 1
        return wname, dequantize_fp8_weight(w, scale, wname)

    for raw, t in stream:
        name = normalize_name(raw)
        if ACTIVATION_SCALE.search(name):
            stats.dropped_activation_scales += 1
            continue
        if name.endswith(".weight_scale"):
            wname = name[: -len("_scale")]
            if wname in fp8:
                yield pair(wname, fp8.pop(wname), t)
            else:
                scales[wname] = t.clone()
            continue
        if t.dtype in FP8_DTYPES:
            if name in scales:
                yield pair(name, t, scales.pop(name))
            else:
                fp8[name] = t
            continue
        yield name, t
    if fp8 or scales:
        lonely = [f"{n} (no weight_scale)" for n in fp8] + [f"{n}_scale (no fp8 weight)" for n in scales]
        raise MappingError(f"unpaired FP8 tensors in the checkpoint: {', '.join(sorted(lonely)[:20])}")


@dataclass(frozen=True)
class Target:
    rank: int
    spec: ParamSpec
    piece_idx: int  # index of ``piece`` in ``spec.pieces``
    piece: Piece
    region: Region


@dataclass
class Plan:
    """The inverse of the specs: checkpoint name -> every (rank, spec, piece, region) it feeds."""

    specs_per_rank: list[list[ParamSpec]]
    skip: tuple[str, ...] = ()
    targets: dict[str, list[Target]] = field(default_factory=dict)
    max_layer: int = -1  # highest decoder layer index any spec reads

    def __post_init__(self) -> None:
        self._skip = [re.compile(p) for p in (*GENERIC_SKIPS, *self.skip)]
        for rank, specs in enumerate(self.specs_per_rank):
            seen: set[str] = set()
            for spec in specs:
                if spec.name in seen:
                    raise ValueError(f"rank {rank}: two specs named {spec.name}")
                seen.add(spec.name)
                for k, piece in enumerate(spec.pieces):
                    for region in piece.sources:
                        self.targets.setdefault(region.name, []).append(Target(rank, spec, k, piece, region))
                        m = LAYER_RE.search(region.name)
                        if m:
                            self.max_layer = max(self.max_layer, int(m.group(1)))

    def skip_reason(self, name: str) -> str | None:
        """Why ``name`` is not packed, or None when it must be (or is unknown)."""
        if name in self.targets:
            return None
        for p in self._skip:
            if p.search(name):
                return f"skip rule {p.pattern}"
        m = LAYER_RE.search(name)
        if m and int(m.group(1)) > self.max_layer >= 0:
            return "layer past the model's layers (next-token-prediction layers not requested)"
        if name == "lm_head.weight":
            return "lm_head unused (tied embeddings)"
        return None

    def check_shape(self, name: str, t: torch.Tensor | BlockFP8, where: str) -> list[Target]:
        """The targets of ``name``, after checking ``t`` has the shape every region expects."""
        targets = self.targets[name]
        want = targets[0].region.shape
        if tuple(t.shape) != want:
            users = sorted({tg.spec.name for tg in targets})
            raise MappingError(
                f"checkpoint tensor {name!r} ({where}) has shape {list(t.shape)} but packed "
                f"{', '.join(users[:4])} expects {list(want)} from config.json; the config and the "
                "weights disagree (wrong config.json, or a layout kiln does not know)."
            )
        return targets


def precheck(plan: Plan, infos: dict[str, SourceInfo]) -> None:
    """With safetensors headers in hand, fail before reading data: missing, doubled, mis-shaped or
    unknown tensors, each named."""
    present: dict[str, SourceInfo] = {}
    scales = set()
    for raw, info in infos.items():
        name = normalize_name(raw)
        if name.endswith(".weight_scale"):
            scales.add(name.removesuffix("_scale"))
        elif not ACTIVATION_SCALE.search(name):
            present[name] = info
    unscaled = sorted(n for n, i in present.items() if i.dtype in FP8_DTYPES and n not in scales)
    if unscaled:
        raise MappingError(f"FP8 checkpoint weights without a weight_scale(_inv): {', '.join(unscaled[:12])}")
    missing: list[str] = []
    for rank, specs in enumerate(plan.specs_per_rank):
        for spec in specs:
            for piece in spec.pieces:
                found = [r for r in piece.sources if r.name in present]
                if not found:
                    missing.append(f"{piece.sources[0].name} (for rank {rank} {spec.name})")
                elif len(found) > 1:
                    raise MappingError(
                        f"{spec.name}: the checkpoint holds the same weights twice, as "
                        f"{' and '.join(f'{r.name} ({present[r.name].file})' for r in found)}; remove one copy."
                    )
    if missing:
        raise MappingError(f"{len(missing)} tensor(s) missing from the checkpoint: {', '.join(missing[:12])}")
    for name, info in present.items():
        if name in plan.targets:
            want = plan.targets[name][0].region.shape
            if info.shape != want:
                users = sorted({t.spec.name for t in plan.targets[name]})
                raise MappingError(
                    f"checkpoint tensor {name!r} ({info.file}) has shape {list(info.shape)} but packed "
                    f"{', '.join(users[:4])} expects {list(want)} from config.json; the config and the "
                    "weights disagree."
                )
    unknown = sorted(n for n in present if n not in plan.targets and plan.skip_reason(n) is None)
    if unknown:
        raise MappingError(
            f"{len(unknown)} checkpoint tensor(s) that no packed parameter uses: {', '.join(unknown[:12])}. "
            "The architecture's name mapping does not know them (wrong architecture in config.json?)."
        )
