"""Rotary position embeddings: the cos/sin cache and a plain-torch reference rotation.

``rope_cos_sin_cache`` builds the table every attention layer reads: row ``p`` holds
``cos(p * inv_freq)`` in its first ``rotary_dim / 2`` columns and ``sin(p * inv_freq)`` in the rest
(the vLLM/SGLang layout), float32 by default. The frequencies follow transformers'
``ROPE_INIT_FUNCTIONS`` step for step, in float32 like Hugging Face and vLLM, so that the table
matches theirs bit for bit where the formulas agree.

Scaling types (``scaling`` is ``dataclasses.asdict(kiln.compiler.config.RopeScaling)`` or None;
ops may not import the compiler, so it is a plain dict):

* ``default``: ``inv_freq[i] = base ** (-2i / rotary_dim)``.
* ``linear``: ``inv_freq / factor`` (position interpolation).
* ``dynamic`` (NTK-aware): like vLLM and SGLang, the table is built **once** for all
  ``max_position`` rows, with the base adjusted for that length:
  ``base' = base * (factor * L / L0 - (factor - 1)) ** (rot / (rot - 2))`` where ``L0`` is
  ``original_max_position`` (falls back to ``max_position``) and ``L = max(max_position, L0)``.
  Hugging Face instead recomputes the frequencies for the current sequence length and uses the
  unscaled base while the sequence is shorter than ``L0``; below ``L0`` the two differ whenever
  ``max_position > L0``. To serve past ``L0``, pass ``max_position = L0 * factor`` (vLLM's choice).
* ``llama3``: Llama 3.1's piecewise wavelength scaling (``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position``).
* ``yarn``: NTK-by-parts interpolation with ``beta_fast``/``beta_slow`` (default 32/1), and the
  attention factor ``attention_factor`` or, if None, ``mscale(factor, mscale) /
  mscale(factor, mscale_all_dim)`` when both are set (DeepSeek) else ``0.1 ln(factor) + 1``.
  As in Hugging Face, that factor is folded into cos and sin (DeepSeek's extra softmax-scale
  ``mscale ** 2`` is the attention layer's business, not this table's).

``original_max_position`` falls back to ``max_position`` for llama3 and yarn, as transformers does
with ``max_position_embeddings``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SCALING_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _arange_exponent(rotary_dim: int, device: torch.device | str | None) -> torch.Tensor:
    # [rot/2] f32: 2i / rot, computed like transformers (int64 arange, then float)
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim


def _get(scaling: dict[str, Any], key: str, default: Any = None) -> Any:
    v = scaling.get(key)
    return default if v is None else v


def _yarn(
    rotary_dim: int, base: float, scaling: dict[str, Any], orig: int, device: torch.device | str | None
) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    beta_fast = float(_get(scaling, "beta_fast", 32))
    beta_slow = float(_get(scaling, "beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if _get(scaling, "truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    # ramp: [rot/2] f32, 0 below `low`, 1 above `high`
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = (1 - ramp).to(device)
    pos_freqs = base ** torch.arange(0, rotary_dim, 2, device=device).float().div(rotary_dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv = inv_inter * (1 - extrapolate) + inv_extra * extrapolate
    return inv, float(attention)


def _llama3(inv: torch.Tensor, scaling: dict[str, Any], orig: int) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_ff, high_ff = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if low_ff is None or high_ff is None:
        raise ValueError(
            "rope scaling 'llama3' needs 'low_freq_factor' and 'high_freq_factor'; "
            "add them to the rope_scaling of config.json."
        )
    low_wavelen, high_wavelen = orig / low_ff, orig / high_ff
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def rope_inv_freq(
    rotary_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim / 2]`` f32 and the factor cos/sin are multiplied by."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}.")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}.")
    scaling = dict(scaling or {})
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind not in SCALING_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported; use one of {SCALING_TYPES}.")
    if kind != "default" and float(_get(scaling, "factor", 0.0)) <= 0:
        raise ValueError(f"rope scaling {kind!r} needs a positive 'factor', got {scaling.get('factor')!r}.")
    orig = int(_get(scaling, "original_max_position", max_position))
    if kind == "yarn":
        return _yarn(rotary_dim, base, scaling, orig, device)
    if kind == "dynamic":
        factor = float(scaling["factor"])
        seq = max(max_position, orig)
        base = base * ((factor * seq / orig) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    inv = 1.0 / (base ** _arange_exponent(rotary_dim, device))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling, orig)
    return inv, 1.0


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The rotary table ``[max_position, rotary_dim]``: cos in the first half of the columns, sin in
    the second, for positions ``0 .. max_position - 1`` (yarn's attention factor folded into both).

    Computed in float32 exactly as transformers does (float32 ``position * inv_freq``), then cast to
    ``dtype``.
    """
    inv, attention = rope_inv_freq(rotary_dim, max_position, base, scaling, device)
    t = torch.arange(max_position, dtype=torch.int64, device=device).float()  # [P]
    freqs = torch.outer(t, inv.float())  # [P, rot/2] f32
    cos = freqs.cos() * attention
    sin = freqs.sin() * attention
    return torch.cat([cos, sin], dim=-1).to(dtype)


def apply_rope_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    """Reference rotation of ``x [T, H, D]`` at ``positions [T]`` (int) with table ``cos_sin [P, rot]``.

    NeoX style (``is_neox=True``; Llama, Qwen, Mistral; transformers' ``rotate_half``) rotates the
    pairs ``(i, i + rot/2)``; GPT-J style (DeepSeek's interleaved rope) rotates ``(2i, 2i + 1)``.
    Dims ``rot .. D`` pass through unchanged (partial rotary). Computed in float32, returned in
    ``x.dtype``.
    """
    d = x.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= d:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be even and in (0, head_dim={d}].")
    if cos_sin.shape[-1] != rotary_dim:
        raise ValueError(f"cos_sin has {cos_sin.shape[-1]} columns, rotary_dim is {rotary_dim}.")
    half = rotary_dim // 2
    cs = cos_sin[positions.long()].float()  # [T, rot]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, rot/2]
    xf = x.float()
    xr = xf[..., :rotary_dim]  # [T, H, rot]
    if is_neox:
        x1, x2 = xr[..., :half], xr[..., half:]
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rotated = torch.cat([o1, o2], -1) if is_neox else torch.stack([o1, o2], -1).flatten(-2)
    return torch.cat([rotated, xf[..., rotary_dim:]], -1).to(x.dtype)


__all__ = ["SCALING_TYPES", "apply_rope_ref", "rope_cos_sin_cache", "rope_inv_freq"]
