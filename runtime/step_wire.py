"""A tensor-parallel step as one int64 tensor: what rank 0 broadcasts to its followers each step.

The protocol of runtime/tensor_parallel.py sends each forward's inputs from rank 0 to the other
ranks over a gloo group, on the host (it never waits for a GPU stream, so rank 0 can send step N+1
while step N runs). As a pickled object that costs two collectives, ~1 ms a step on the H200 pair
(a quarter of a batch-1 step); as one tensor, one. Layout (int64)::

    [kind, T, B, K, input_ids[T], positions[T], out_slots[T], req_rows[B], seq_lens[B],
     extend_lens[B] (extend and verify only), tree_mask[T] (tree verify only), flat indices[K], pages[K]]

``kind``: :data:`OBJECT` (the message follows as a Python object: setup, stop, and steps larger
than the wire), :data:`DECODE`, :data:`EXTEND`, :data:`VERIFY` (speculative decoding's verify
step: an extend with logits at every new token), :data:`VERIFY_TREE` (a verify step of token trees:
each token's ancestor bitmask follows), or :data:`DECODE_ARGMAX`: a decode step whose
input ids are each rank's own argmax of the step before (``ModelRunner.argmax_ids``: every rank has
the whole logits, so the same ids; rank 0 launched it without reading them, with overlap). ``K`` block-table changes
``{flat index: page}`` travel with the step (``BlockTable.take_changes``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.runtime.model_runner import StepInputs

OBJECT, DECODE, EXTEND, DECODE_ARGMAX, VERIFY, VERIFY_TREE = 0, 1, 2, 3, 4, 5
_KINDS = {"decode": DECODE, "extend": EXTEND, "verify": VERIFY}
_MODES = {
    DECODE: "decode",
    DECODE_ARGMAX: "decode",
    EXTEND: "extend",
    VERIFY: "verify",
    VERIFY_TREE: "verify",
}
HEADER = 4
WIRE_INTS = 1 << 14  # 128 KiB: every decode step of up to ~2,700 requests, prefill chunks to ~5,000 tokens


def wire_size(step: StepInputs, pending: dict[int, int]) -> int:
    """Ints the step takes on the wire."""
    b, t = step.batch, len(step.input_ids)
    tree = t if step.tree_mask is not None else 0
    return HEADER + 3 * t + tree + (2 if step.mode == "decode" else 3) * b + 2 * len(pending)


def encode(
    out: np.ndarray, step: StepInputs | None, pending: dict[int, int] | None = None, argmax: bool = False
) -> bool:
    """Write ``step`` and ``pending`` into ``out`` (int64, ``WIRE_INTS``); None, or a step that
    does not fit: an :data:`OBJECT` header (the caller sends the message as an object). ``argmax``:
    a decode step whose ids are the ranks' own argmax (:data:`DECODE_ARGMAX`). Returns whether the
    step is on the wire."""
    pending = pending or {}
    if step is None or wire_size(step, pending) > out.shape[0]:
        out[:HEADER] = (OBJECT, 0, 0, 0)
        return False
    t, b, k = len(step.input_ids), step.batch, len(pending)
    if argmax and step.mode == "decode":
        kind = DECODE_ARGMAX
    else:
        kind = VERIFY_TREE if step.tree_mask is not None else _KINDS[step.mode]
    out[:HEADER] = (kind, t, b, k)
    i = HEADER
    for part in (step.input_ids, step.positions, step.out_slots):
        out[i : i + t] = part
        i += t
    parts = [step.req_rows, step.seq_lens] + ([] if step.mode == "decode" else [step.extend_lens])
    for part in parts:
        out[i : i + b] = part
        i += b
    if kind == VERIFY_TREE:
        out[i : i + t] = step.tree_mask
        i += t
    out[i : i + k] = np.fromiter(pending.keys(), np.int64, k)
    out[i + k : i + 2 * k] = np.fromiter(pending.values(), np.int64, k)
    return True


def decode(wire: np.ndarray) -> tuple[StepInputs, dict[int, int], bool] | None:
    """The step, its table changes and whether its ids are the ranks' argmax, from ``wire``
    (:func:`encode`'s), or None for an :data:`OBJECT`."""
    kind, t, b, k = (int(v) for v in wire[:HEADER])
    if kind == OBJECT:
        return None
    if kind not in _MODES:
        raise ValueError(f"step wire: unknown kind {kind}")
    i = HEADER
    lists: list[Any] = []
    for n in (t, t, t, b, b) + ((b,) if kind in (EXTEND, VERIFY, VERIFY_TREE) else ()):
        lists.append(wire[i : i + n].tolist())
        i += n
    tree_mask = None
    if kind == VERIFY_TREE:
        tree_mask = wire[i : i + t].tolist()
        i += t
    pending = dict(zip(wire[i : i + k].tolist(), wire[i + k : i + 2 * k].tolist(), strict=True))
    return StepInputs(_MODES[kind], *lists, tree_mask=tree_mask), pending, kind == DECODE_ARGMAX
