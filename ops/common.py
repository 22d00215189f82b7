"""Shared plumbing for the ops: when to launch Triton, FP8 constants, small launch helpers.

Every op in this package is a ``torch.library.custom_op`` in the ``kiln`` namespace with a fake
(meta) implementation, so that ``torch.export`` records it as one opaque node. Its body picks the
implementation at call time:

* CUDA tensors: the Triton kernel.
* CPU tensors: the plain-torch reference, unless ``KILN_TRITON_ON_CPU=1`` and
  ``TRITON_INTERPRET=1`` are both set, in which case the Triton kernel runs in the interpreter
  (how the tests exercise the real kernels without a GPU).

Rules every kernel follows so that it can sit inside a CUDA graph: no host synchronisation, no
``.item()``, per-batch metadata read from device tensors, grids computed from tensor shapes only.

``kiln_op`` registers an op and also records its Python body in ``DIRECT``: the runtime calls the
bodies straight from the graphs it loads (``runtime/graph_code.py``), skipping the dispatcher,
whose first custom-op call imports ``torch._dynamo`` (seconds on a slow host) and whose every call
costs tens of microseconds of Python in eager steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_MIN_SCALE = 1e-12  # guards all-zero rows against division by zero


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op called on ``t`` should launch its Triton kernel (see the module docstring)."""
    if t.is_cuda:
        return True
    return interpreting() and os.environ.get("KILN_TRITON_ON_CPU", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


DIRECT: dict[str, Callable[..., Any]] = {}  # op name (no namespace) -> its Python body


def kiln_op(name: str, mutates_args: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op(f"kiln::{name}", mutates_args)`` that also records the body in
    ``DIRECT`` (the same function the dispatcher ends up calling for every device)."""

    def register(fn: Callable[..., Any]) -> Any:
        DIRECT[name] = fn
        return torch.library.custom_op(f"kiln::{name}", mutates_args=tuple(mutates_args))(fn)

    return register
