"""The step wire (runtime/step_wire.py): a tensor-parallel step as one int64 tensor."""

from __future__ import annotations

import numpy as np

from kiln.runtime import step_wire
from kiln.runtime.model_runner import StepInputs


def _buf(n: int = step_wire.WIRE_INTS) -> np.ndarray:
    return np.full(n, -7, dtype=np.int64)  # stale values a decode must not pick up


def test_decode_and_extend_steps_round_trip_with_their_table_changes():
    dec = StepInputs("decode", [5, 6, 7], [100, 3, 41], [900, 12, 77], [2, 0, 1], [101, 4, 42])
    ext = StepInputs("extend", [9, 8, 7, 6, 5], [0, 1, 2, 7, 8], [0, 1, 2, 30, 31], [3, 4], [3, 9], [3, 2])
    ver = StepInputs("verify", [9, 8, 7, 6, 5], [4, 5, 6, 7, 8], [4, 5, 6, 30, 31], [3, 4], [7, 9], [3, 2])
    # a token tree: request 0's root and two children at depth 1, request 1's chain of two
    tree = StepInputs(
        "verify", [9, 8, 7, 6, 5], [4, 5, 5, 7, 8], [4, 5, 6, 30, 31], [3, 4], [7, 9], [3, 2], [1, 3, 5, 1, 3]
    )
    cases = (
        (dec, {7: 12, 130: 4}, False),
        (ext, {}, False),
        (dec, {}, True),
        (ver, {5: 6}, False),
        (tree, {5: 6, 9: 1}, False),
    )
    for step, pending, argmax in cases:
        wire = _buf()
        assert step_wire.encode(wire, step, pending, argmax)
        assert step_wire.decode(wire) == (step, pending, argmax)


def test_messages_that_are_not_steps_or_do_not_fit_say_an_object_follows():
    wire = _buf()
    assert not step_wire.encode(wire, None) and step_wire.decode(wire) is None
    big = StepInputs("extend", list(range(300)), list(range(300)), list(range(300)), [0], [300], [300])
    assert step_wire.wire_size(big, {}) == 4 + 3 * 300 + 3 * 1
    small = _buf(step_wire.wire_size(big, {}) - 1)  # one int short of the step
    assert not step_wire.encode(small, big, {}) and step_wire.decode(small) is None
