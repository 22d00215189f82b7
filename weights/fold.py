"""RMSNorm weights folded into the linear weights that consume them, at load time.

``rmsnorm(h) @ W^T = (h * rstd(h)) @ (W diag(g))^T``: a norm's weight ``g [H]`` can live in the
columns of every weight that reads the normalized row. A decode step's fused kernels then need
neither a norm kernel nor a load of ``g``: the one-token GEMV behind the norm accumulates
``sum(h * h)`` beside its product and scales by ``rstd`` at the end (ops/norm_linear.py,
``folded``).

The compiler decides which norms are folded (compiler/models/base.py ``norm_folds``) and records
``{norm weight: [consumer weights]}`` in the manifest as ``norm_folds``; the graphs it traced
expect the fold. The packs stay as the checkpoint has them; :func:`apply_norm_folds` runs after
``load_pack`` (the runtime's loader, and the compiler before its warm-up): each consumer is
multiplied by ``g`` along its last dim (in place on a GPU: one elementwise kernel per tensor, about
0.1 s for a 20 GB MoE pack; a new tensor on the CPU, where the loaded tensors may map the pack's
files), then ``g`` is set to ones, so the graphs'
unfused paths (the norm kernel, then cuBLAS) compute the same function with the same weights.
"""

from __future__ import annotations

import torch


class FoldError(ValueError):
    pass


def apply_norm_folds(weights: dict[str, torch.Tensor], folds: dict[str, list[str]] | None) -> int:
    """Fold each norm weight of ``folds`` into its consumers in ``weights``; returns how many
    consumer tensors changed. A missing name or a consumer whose last dim is not the norm's size
    raises :class:`FoldError` (an artifact whose manifest does not match its pack)."""
    done = 0
    for norm, consumers in (folds or {}).items():
        g = weights.get(norm)
        if g is None or g.dim() != 1:
            raise FoldError(f"norm_folds: the pack has no 1-D norm weight {norm!r}; rebuild the artifact.")
        for name in consumers:
            w = weights.get(name)
            if w is None or w.shape[-1] != g.shape[0] or w.dtype != g.dtype:
                shape = None if w is None else (tuple(w.shape), w.dtype)
                raise FoldError(
                    f"norm_folds: {name!r} ({shape}) cannot take {norm!r} ({tuple(g.shape)}, {g.dtype}); "
                    "rebuild the artifact."
                )
            # [..., H] * g: torch multiplies 16-bit floats in float32 and rounds once
            if w.device.type == "cuda":
                w.mul_(g)
            else:
                weights[name] = w * g
            done += 1
        if g.device.type == "cuda":
            g.fill_(1)
        else:
            weights[norm] = torch.ones_like(g)
    return done
