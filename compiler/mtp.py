"""DeepSeek-V3's next-token-prediction (MTP) layer compiled into its model's artifact as a draft
head (``kiln compile DEEPSEEK_CKPT --mtp``; docs/speculative.md section 4; the model is
compiler/models/mtp.py, the drafter runtime/spec_eagle.py's, shared with EAGLE-3).

A checkpoint with ``num_nextn_predict_layers`` holds the layer ``L = num_hidden_layers`` under
``model.layers.{L}.*``; only the first is compiled (DeepSeek-V3 has one; SGLang and vLLM chain
that one for k drafts). The compile:

* traces the target with ``aux_layers = (L,)``: every target graph writes its last decoder layer's
  output (the residual stream before the final norm, which the head applies) into its aux buffer;
* packs layer ``L`` (the model's own pack leaves it out) with the model's embedding and final
  norm into a nested
  artifact under ``ART/mtp`` (compiler/eagle3.py :func:`compile_head`: the target's shape options,
  one block table; ``manifest.mtp``), activation dtype (a block-FP8 checkpoint's layer up-cast);
* pins it in the target's manifest (``DraftSpec`` of kind ``"mtp"``).

Refused before any work, each in one line naming the field: a config without
``num_nextn_predict_layers``, an architecture other than DeepSeek-V2/V3, a checkpoint whose weights
lack the layer, ``--draft-model`` or ``--eagle3`` beside it. With ``--tp`` > 1 the layer is
compiled for one rank and drafts on rank 0.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from kiln.compiler.build import CompileError, CompileOptions
from kiln.compiler.config import ModelConfig
from kiln.compiler.eagle3 import HeadBuild, compile_head, tensor_names
from kiln.compiler.mappings import param_specs as layer_specs
from kiln.compiler.models.deepseek import DeepseekForCausalLM
from kiln.compiler.models.eagle3 import AuxHeadGraph
from kiln.compiler.models.mtp import EXTRA_NAMES, MtpForCausalLM
from kiln.compiler.parallel import ParallelConfig
from kiln.compiler.registry import model_class
from kiln.manifest import DraftSpec, MtpSpec
from kiln.weights.discover import discover_weights
from kiln.weights.spec import ParamSpec, Piece, Region

MTP_DIR = "mtp"
EMBED = "model.embed_tokens.weight"  # the model's; the MTP layer's copy (the same) is not read
FINAL_NORM = "model.norm.weight"  # the model's final norm: the head applies it to the target's stream


def check_mtp(model_dir: Path, cfg: ModelConfig, opts: CompileOptions) -> None:
    """Refuse ``--mtp`` where it cannot compile (module docstring), before any work."""
    if opts.draft_model is not None or opts.eagle3 is not None:
        flag = "--draft-model" if opts.draft_model is not None else "--eagle3"
        raise CompileError(f"--mtp and {flag}: an artifact has one draft source; pass one.")
    if not cfg.num_nextn_layers:
        raise CompileError(
            f"--mtp: {model_dir}/config.json has no 'num_nextn_predict_layers'; only DeepSeek-V3 "
            "checkpoints with their next-token-prediction layer can draft with --mtp."
        )
    if not issubclass(model_class(cfg.architecture), DeepseekForCausalLM):
        raise CompileError(
            f"--mtp: config.json 'architectures' is {cfg.architecture}; kiln compiles the MTP layers of "
            "DeepSeek-V3 checkpoints only."
        )
    files = discover_weights(model_dir)
    if files.format != "safetensors":
        raise CompileError(
            f"--mtp: the checkpoint's weights are {files.format} files; kiln reads the MTP layer from "
            "safetensors only (convert them, e.g. with safetensors.torch.save_file)."
        )
    names = set(files.weight_map) if files.weight_map else tensor_names(files.files)
    want = [f"model.layers.{cfg.num_layers}.{src}" for src in EXTRA_NAMES.values()]
    missing = [n for n in want if n not in names]
    if missing:
        raise CompileError(
            f"--mtp: config.json has 'num_nextn_predict_layers' {cfg.num_nextn_layers} but the checkpoint "
            f"lacks the layer ({missing[0]}); use the original checkpoint (conversions often drop it)."
        )


def head_config(cfg: ModelConfig) -> ModelConfig:
    """The head's config (its manifest's model, KV cache and RoPE): the target's with one layer."""
    return replace(cfg, num_layers=1, num_nextn_layers=0)


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """The head's packed tensors (kiln names of compiler/models/mtp.py) from the checkpoint's:
    layer ``L``'s as compiler/mappings.py declares any DeepSeek layer's, renamed ``layers.0.*``."""
    last = f"layers.{cfg.num_layers}."
    extras = {last + src: name for name, src in EXTRA_NAMES.items()}  # compiler/mappings.py's names
    specs = []
    for spec in layer_specs(cfg, ParallelConfig(), 0, None, nextn=True):
        if spec.name in extras:
            specs.append(replace(spec, name=extras[spec.name]))
        elif spec.name.startswith(last):
            specs.append(replace(spec, name="layers.0." + spec.name.removeprefix(last)))
    h, v = cfg.hidden_size, cfg.vocab_size
    for name, src, shape in (
        ("embed.weight", EMBED, (v, h)),
        ("final_norm.weight", FINAL_NORM, (h,)),
        ("lm_head.weight", f"model.{last}shared_head.head.weight", (v, h)),
    ):
        specs.append(ParamSpec(name, shape, (Piece((Region(src, shape),)),), "replicated"))
    return specs


def skip_patterns(cfg: ModelConfig) -> tuple[str, ...]:
    """The checkpoint's tensors the head does not pack: the model's layers and LM head, later MTP
    layers, and layer ``L``'s copy of the embedding (the model's is read)."""
    last = cfg.num_layers
    return (
        rf"^model\.layers\.(?!{last}\.)\d+\.",
        rf"^model\.layers\.{last}\.embed_tokens\.weight$",
        r"^lm_head\.weight$",
    )


def compile_mtp(
    target_dir: Path, cfg: ModelConfig, out: Path, opts: CompileOptions, verbose: bool
) -> DraftSpec:
    """Compile the MTP layer of the checkpoint ``target_dir`` (config ``cfg``, checked by
    :func:`check_mtp`) into ``out/mtp`` with the target's options ``opts`` (its ``max_seq_len``
    resolved); returns the record the target's manifest keeps."""

    def model(dtype: torch.dtype) -> AuxHeadGraph:
        return MtpForCausalLM(cfg, dtype)

    build = HeadBuild(
        kind=MTP_DIR,
        cfg=head_config(cfg),
        specs=param_specs(cfg),
        skip=skip_patterns(cfg),
        model=model,
        stage=lambda _tmp: target_dir,
        record={"mtp": MtpSpec(layer=cfg.num_layers)},
        source=target_dir,
    )
    return compile_head(build, out, opts, verbose)
