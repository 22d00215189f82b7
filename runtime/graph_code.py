"""Loading a graph the compiler wrote as Python source (see ``kiln.compiler.graph_code``).

The source is the exported graph printed by ``torch.fx`` (calls of ``torch.ops.*`` only); it is
checked against the sha256 the manifest records before it is executed, and it runs with exactly
the names the compiler allowed. Loading takes milliseconds where ``torch.export.load`` takes
seconds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

GLOBALS: dict[str, Any] = {
    "torch": torch,
    "device": torch.device,
    "inf": math.inf,
    "nan": math.nan,
    "NoneType": type(None),
    "fx_pytree": fx_pytree,
    "pytree": pytree,
}


class GraphCodeError(RuntimeError):
    pass


class CodeGraph:
    """Callable as ``graph(weights, *inputs)`` like the module ``torch.export.load`` gives."""

    def __init__(self, forward: Callable[..., Any], weight_keys: list[str], num_inputs: int):
        self.forward = forward
        self.weight_keys = weight_keys
        self.num_inputs = num_inputs

    def __call__(self, weights: Mapping[str, torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != self.num_inputs:
            raise TypeError(f"the graph takes weights and {self.num_inputs} inputs, got {len(inputs)}")
        return self.forward(None, *[weights[k] for k in self.weight_keys], *inputs)[0]


def load_graph_code(path: Path, layout: Mapping[str, Any], sha256: str | None) -> CodeGraph:
    src = path.read_bytes()
    if sha256 is not None and hashlib.sha256(src).hexdigest() != sha256:
        raise GraphCodeError(
            f"{path} does not match the sha256 in manifest.json; copy the artifact again or rebuild it."
        )
    if layout.get("output") != "tensor":
        raise GraphCodeError(f"{path}: unsupported graph output {layout.get('output')!r}")
    namespace = dict(GLOBALS)
    exec(compile(src, str(path), "exec"), namespace)  # the compiler's own output, hash-checked above
    return CodeGraph(namespace["forward"], list(layout["weight_keys"]), int(layout["num_inputs"]))
