"""Loading a graph the compiler wrote as Python source (see ``kiln.compiler.graph_code``).

The source is the exported graph printed by ``torch.fx`` (calls of ``torch.ops.*`` only); the bytes
read are checked against the hash the manifest records (always, ``--no-verify`` included: it is
code) before they are executed, and they run with exactly the names the compiler allowed. Any
failure is a one-line :class:`GraphCodeError` naming the file. Loading takes milliseconds where ``torch.export.load`` takes
seconds.

The graph's ``torch.ops.kiln.*`` calls go straight to the ops' Python bodies
(``kiln.ops.common.DIRECT``), not through the dispatcher: the dispatcher's first custom-op call
imports ``torch._dynamo`` (6 s of start-up on the H200 host) and each call costs Python overhead in
the eager (prefill) steps. An op without a body in ``DIRECT`` goes through the dispatcher.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from kiln.artifact_format import bytes_digest
from kiln.ops.common.op import DIRECT
from kiln.runtime.artifact import RECOPY, ArtifactError, one_line

GLOBALS: dict[str, Any] = {
    "torch": torch,
    "device": torch.device,
    "inf": math.inf,
    "nan": math.nan,
    "NoneType": type(None),
    "fx_pytree": fx_pytree,
    "pytree": pytree,
}


class _DirectOp:
    """``torch.ops.kiln.NAME`` for generated code: ``.default`` is the op's Python body."""

    __slots__ = ("default",)

    def __init__(self, fn: Callable[..., Any]):
        self.default = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)


class _KilnOps:
    def __getattr__(self, name: str) -> Any:
        fn = DIRECT.get(name)
        op = _DirectOp(fn) if fn is not None else getattr(torch.ops.kiln, name)
        setattr(self, name, op)
        return op


class _Through:
    """``target``'s attributes, each looked up once (then an instance attribute: no
    ``__getattr__`` call per op call in eager steps), except those set at construction."""

    def __init__(self, target: Any, **own: Any) -> None:
        self._target = target
        self.__dict__.update(own)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        setattr(self, name, value)
        return value


def _direct_torch() -> _Through:
    """``torch`` as generated code sees it: everything is torch's, except ``ops.kiln``."""
    return _Through(torch, ops=_Through(torch.ops, kiln=_KilnOps()))


class GraphCodeError(ArtifactError, RuntimeError):
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


def _devices_on(target: torch.device | None) -> Callable[..., torch.device]:
    """The generated code's ``device(type=..., index=...)``: a device of ``target``'s type is
    ``target`` (the graph was traced on the compile's GPU, ``cuda:0``; rank 1 of a tensor-parallel
    run executes it on ``cuda:1``)."""

    def device(type: str, index: int | None = None) -> torch.device:
        if target is not None and type == target.type:
            return target
        return torch.device(type) if index is None else torch.device(type, index)

    return device


def load_graph_code(
    path: Path, layout: Mapping[str, Any], digest: str | None, device: torch.device | None = None
) -> CodeGraph:
    """The graph in ``path`` (``layout``: the manifest's ``graphs.NAME.python``), after checking its
    bytes against ``digest`` (xxh3-128 hex from the manifest's file table; None: unchecked), its
    devices placed on ``device`` (None: as traced)."""
    try:
        src = path.read_bytes()
    except OSError as e:
        raise GraphCodeError(f"graph file {path} cannot be read ({e.strerror}); {RECOPY}.") from None
    got = bytes_digest(src)
    if digest is not None and got != digest:
        raise GraphCodeError(
            f"graph file {path} does not match its hash in manifest.json (xxh3-128 {got}, recorded "
            f"{digest}): it was altered or damaged; {RECOPY}."
        )
    if layout.get("output") != "tensor":
        raise GraphCodeError(f"{path}: unsupported graph output {layout.get('output')!r}; {RECOPY}.")
    namespace = dict(GLOBALS, torch=_direct_torch(), device=_devices_on(device))
    try:
        exec(compile(src, str(path), "exec"), namespace)  # the compiler's own output, hash-checked above
        forward = namespace["forward"]
    except Exception as e:  # unchecked source (digest None) that is not a graph: a message, not a traceback
        raise GraphCodeError(f"graph file {path} does not load ({one_line(e)}); {RECOPY}.") from None
    return CodeGraph(forward, list(layout["weight_keys"]), int(layout["num_inputs"]))
