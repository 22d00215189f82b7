"""RMSNorm weights folded into the linear weights that consume them, at load time.

``rmsnorm(h) @ W^T = (h * rstd(h)) @ (W diag(g))^T``: a norm's weight ``g [H]`` can live in the
columns of every weight that reads the normalized row. A decode step's fused kernels then need
neither a norm kernel nor a load of ``g``: the one-token GEMV behind the norm accumulates
``sum(h * h)`` beside its product and scales by ``rstd`` at the end (ops/linear/norm_linear.py,
``folded``).

The compiler decides which norms are folded (compiler/norm_folds.py) and records
``{norm weight: [consumer weights]}`` in the manifest as ``norm_folds``; the graphs it traced
expect the fold. The packs stay as the checkpoint has them; :func:`apply_norm_folds` runs after
``load_pack`` (the runtime's loader, and the compiler before its warm-up): each consumer is
multiplied in place by ``g`` along its last dim (one elementwise kernel per tensor on a GPU, about
0.1 s for a 20 GB MoE pack), then ``g`` is set to ones. The graphs' unfused paths (the norm
kernel, then cuBLAS) then compute the same function, up to one rounding of each folded weight to
its dtype.
"""

from __future__ import annotations

import torch

from kiln.errors import KilnError


class FoldError(KilnError, ValueError):
    pass


def apply_norm_folds(weights: dict[str, torch.Tensor], folds: dict[str, list[str]] | None) -> int:
    """Fold each norm weight of ``folds`` into its consumers in ``weights`` (in place); returns how
    many consumer tensors changed. A missing name or a consumer whose last dim or dtype is not the
    norm's raises :class:`FoldError` (the manifest's ``norm_folds`` does not match the pack)."""
    done = 0
    for norm, consumers in (folds or {}).items():
        g = weights.get(norm)
        if g is None or g.dim() != 1:
            raise FoldError(
                f"manifest norm_folds names {norm!r}, which the weight pack lacks or is not 1-D; "
                "rebuild the artifact with `kiln compile`."
            )
        for name in consumers:
            w = weights.get(name)
            if w is None:
                raise FoldError(
                    f"manifest norm_folds folds {norm!r} into {name!r}, which the weight pack lacks; "
                    "rebuild the artifact with `kiln compile`."
                )
            if w.shape[-1] != g.shape[0] or w.dtype != g.dtype:
                raise FoldError(
                    f"manifest norm_folds: {name!r} {tuple(w.shape)} {w.dtype} cannot take {norm!r} "
                    f"{tuple(g.shape)} {g.dtype} along its last dim; "
                    "rebuild the artifact with `kiln compile`."
                )
            w.mul_(g)  # [..., H] * g: torch multiplies 16-bit floats in float32 and rounds once
            done += 1
        g.fill_(1)
    return done
