"""Fused kernels. One file per op: a torch reference, the Triton kernel(s) and a ``torch.library``
op (namespace ``kiln``) whose CUDA implementation launches the kernel and whose CPU
implementation is the reference.

Importing this package registers every ``torch.ops.kiln.*`` op (needed before exported graphs
that call them are deserialized).
"""

from kiln.ops import (  # noqa: F401  (imported to register the ops)
    activation,
    attention,
    decode_attention,
    extend_attention,
    fp8_linear,
    gemv,
    moe,
    moe_align,
    moe_route,
    moe_routing,
    norm,
    norm_linear,
    qkv_rope,
)
