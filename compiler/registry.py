"""Architecture registry, keyed by ``config.json`` ``architectures[0]``.

Adding an architecture is one line in ``ARCHITECTURES``: its family (which config fields and
which model definition apply) and, once it can be compiled, the model definition to build.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from kiln.errors import KilnError

Family = Literal["dense", "moe", "mla"]


@dataclass(frozen=True)
class ArchSpec:
    name: str
    family: Family
    qkv_bias: bool = False  # default when config.json has no attention_bias field
    qk_norm: bool = False  # per-head RMSNorm on Q and K (Qwen3)
    model: str | None = None  # "module:Class" of the model definition, None until it exists


LLAMA = "kiln.compiler.models.llama:LlamaForCausalLM"
MOE = "kiln.compiler.models.moe:MoEForCausalLM"
DEEPSEEK = "kiln.compiler.models.deepseek:DeepseekForCausalLM"
EAGLE3 = "kiln.compiler.models.eagle3:Eagle3ForCausalLM"  # only inside a target's artifact (--eagle3)

ARCHITECTURES: dict[str, ArchSpec] = {
    s.name: s
    for s in (
        ArchSpec("LlamaForCausalLM", "dense", model=LLAMA),
        ArchSpec("MistralForCausalLM", "dense", model=LLAMA),
        ArchSpec("Qwen2ForCausalLM", "dense", qkv_bias=True, model=LLAMA),
        ArchSpec("Qwen3ForCausalLM", "dense", qk_norm=True, model=LLAMA),
        ArchSpec("Qwen3MoeForCausalLM", "moe", qk_norm=True, model=MOE),
        ArchSpec("MixtralForCausalLM", "moe", model=MOE),
        ArchSpec("DeepseekV2ForCausalLM", "mla", model=DEEPSEEK),
        ArchSpec("DeepseekV3ForCausalLM", "mla", model=DEEPSEEK),
        ArchSpec("LlamaForCausalLMEagle3", "dense", model=EAGLE3),
    )
}


class UnsupportedArchitecture(KilnError, ValueError):
    pass


def resolve_architecture(name: str) -> ArchSpec:
    """The registry entry for ``name``; an unknown name lists the supported ones."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitecture(
            f"config.json field 'architectures' names {name!r}, which kiln does not support. "
            f"Supported: {supported}."
        ) from None


def model_class(name: str) -> type:
    """Import the model definition registered for ``name``."""
    spec = resolve_architecture(name)
    if spec.model is None:
        compilable = ", ".join(sorted(n for n, s in ARCHITECTURES.items() if s.model))
        raise UnsupportedArchitecture(
            f"{name} is recognized (config, weights) but has no model definition to compile yet. "
            f"Compilable now: {compilable or 'none'}."
        )
    module, cls = spec.model.split(":")
    return getattr(importlib.import_module(module), cls)
