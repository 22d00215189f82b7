"""``kiln_op``'s registration rules (ops/common/op.py)."""

import pytest
import torch

import kiln.ops  # noqa: F401  # registers every kiln op
from kiln.ops.common.op import DIRECT, kiln_op


def test_no_registered_op_gives_a_mutated_argument_a_default():
    # torch 2.11 bumps args[i] for each mutated position i of the arguments as passed: a mutated
    # argument left at its default is an IndexError on CUDA (qkv_rope_kvwrite's FP8 scales were)
    assert DIRECT, "no kiln op registered"
    for name in DIRECT:
        schema = getattr(torch.ops.kiln, name).default._schema
        for a in schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                assert a.default_value is None and not a.has_default_value(), f"{name}.{a.name} has a default"


def test_a_mutated_argument_with_a_default_is_refused():
    def ref(x, out=None):
        return x

    with pytest.raises(TypeError, match=r"mutated argument 'out' .* must not have a default"):

        @kiln_op("test_mutated_default", ref=ref, mutates_args=("out",))
        def launch(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            return x


def test_a_mutated_argument_must_be_a_parameter():
    with pytest.raises(TypeError, match="mutated argument 'y' is not a parameter"):

        @kiln_op("test_mutated_missing", ref=lambda x: x, mutates_args=("y",))
        def launch(x: torch.Tensor) -> torch.Tensor:
            return x
