"""Fused kernels, in families (one subpackage each): ``attention`` (paged decode and extend
attention, RoPE, the fused QKV+RoPE+KV write), ``linear`` (GEMV, norm+linear, FP8 GEMMs),
``moe`` (routing, alignment, grouped GEMMs, the fused MoE), ``norm`` (RMSNorm family),
``activation`` (SiLU-and-mul), ``sampling`` (greedy and seeded sampling) and ``common`` (the one
way to define an op, launch plumbing, FP8 helpers). docs/ops.md says how to add an op.

Importing this package registers every ``torch.ops.kiln.*`` op (needed before exported graphs
that call them are deserialized).
"""

from kiln.ops import activation, attention, linear, moe, norm, sampling  # noqa: F401  (registers the ops)
from kiln.ops.common import collective, hidden  # noqa: F401  (the tensor-parallel collectives, save_hidden)
