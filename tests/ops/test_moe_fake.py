"""The shape rules of the MoE ops (``kiln_op``: the reference run on fake tensors, or an explicit
``fake`` where the reference reads data on the host): under ``FakeTensorMode`` every op gives the
shapes, dtypes and strides its real outputs have (what ``torch.export`` traces the graphs with)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ops.moe  # noqa: F401  (registers the ops)

T_, E, H, I, K = 3, 16, 32, 8, 4


def calls(t: int):
    """(name, op, arguments) at ``t`` tokens, the arguments made on the current device."""
    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t, E, generator=g)
    bias = 0.1 * torch.randn(E, generator=g)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)  # not float32: a wrong dtype shows
    router = torch.randn(E, H, generator=g).to(torch.bfloat16)
    ids = torch.randperm(E, generator=g)[:K].repeat(t, 1).to(torch.int32)
    w = torch.rand(t, K, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    kiln = torch.ops.kiln
    routing = (K, True, "sigmoid", 4, 2, 2.5)
    return [
        ("moe_topk", kiln.moe_topk, (logits, None, K, True, "softmax", 1, 1, 1.0)),
        ("moe_topk sigmoid", kiln.moe_topk, (logits, bias, *routing, "bfloat16")),
        ("moe_route", kiln.moe_route, (x, router, None, K, False, "softmax", 1, 1, 1.0, "", 2)),
        ("moe_route sigmoid", kiln.moe_route, (x, router, bias, *routing, "", 2)),
        ("moe_align", kiln.moe_align, (ids, None, E, 16)),
        ("fused_moe", kiln.fused_moe, (x, w13, w2, w, ids, None, None, None, "")),
        ("fused_moe residual", kiln.fused_moe, (x, w13, w2, w, ids, None, None, None, "", x.clone())),
    ]


def layout(out):
    if isinstance(out, (tuple, list)):
        return [layout(o) for o in out]
    return tuple(out.shape), out.dtype, out.stride()


@pytest.mark.parametrize("path", ["reference", "kernel"])
@pytest.mark.parametrize("t", [0, T_])
@pytest.mark.parametrize("i", range(7), ids=[c[0] for c in calls(1)])
def test_fake_outputs_are_the_real_outputs_layout(request, path, t, i):
    """Against the CPU path (the reference) and the kernels (the interpreter)."""
    if path == "kernel":
        request.getfixturevalue("kernel_on_cpu")
    name, op, args = calls(t)[i]
    real = layout(op(*args))
    mode = FakeTensorMode()
    fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode:
        fake = layout(op(*fake_args))
    assert fake == real, name
