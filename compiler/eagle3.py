"""An EAGLE-3 head compiled into the target's artifact (``kiln compile TARGET --eagle3 HEAD``;
docs/speculative.md section 4; the drafter is runtime/spec_eagle.py).

The head is a checkpoint in its published layout (``LlamaForCausalLMEagle3``: config.json with
one layer, ``draft_vocab_size``, optionally ``target_hidden_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``; safetensors named as
compiler/models/eagle3.py ``CHECKPOINT_NAMES``, ``d2t``, ``t2d``). Its embedding is the target's
when the head has none. The compile:

* traces the target at the head's layers (``manifest.aux_layers``: the inputs of layers
  ``ids + 1``, as SGLang captures them; without ids the inputs of layers 2, L/2 and L - 3), so that
  every target graph writes the three residual streams into its aux buffer;
* compiles the head as an artifact of its own under ``ART/eagle3`` with the target's shape options
  (one block table serves both KV pools page for page), ``manifest.eagle3`` recording its input
  widths: the shared graph ``model`` reads the target's streams through ``fc`` (the head's catch-up
  over accepted tokens), a static ``decode_b{b}`` graph per batch bucket feeds the head's own output
  back (a chain of drafts);
* pins it in the target's manifest (``DraftSpec`` of kind ``"eagle3"``), as a draft model is.

:func:`compile_head` is that nested compile for any head fed the target's hidden states
(:class:`HeadBuild`): DeepSeek's MTP layer (compiler/mtp.py) is the other.

Safetensors only (a head published as ``pytorch_model.bin`` is refused: convert it first); no
tensor parallelism; the head keeps the activation dtype (no FP8).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import artifact_format as fmt
from kiln.artifact_format import gpu_arch, write_build_log
from kiln.compiler.build import (
    DTYPES,
    EAGLE3_ARCHITECTURE,
    CompileError,
    CompileOptions,
    PhaseTimer,
    _add_tree_graph,
    _check_pack_matches,
    _decode_splits,
    _export_dynamic,
    _graph_entry,
    _kv_spec,
    _rope_spec,
    _trees_traceable,
    _warm_up,
    build_graphs,
    tokens_per_program_runs,
)
from kiln.compiler.config import ConfigError, ModelConfig, normalize_config
from kiln.compiler.layers import use_gemv_plan
from kiln.compiler.models.eagle3 import CHECKPOINT_NAMES, AuxHeadGraph, Eagle3ForCausalLM
from kiln.compiler.trace import CacheSpec, example_inputs, export_graph
from kiln.manifest import (
    DraftSpec,
    Eagle3Spec,
    GraphEntry,
    KernelChoices,
    Manifest,
    VerifySpec,
    Versions,
    file_table,
)
from kiln.ops.linear.gemv import gemv_plan
from kiln.weights.discover import discover_weights
from kiln.weights.spec import ParamSpec, Piece, Region

EAGLE3_DIR = "eagle3"
EMBED = "embed_tokens.weight"
NOT_PACKED = (r"^t2d$",)  # the target -> draft map: the graphs use d2t


@dataclass(frozen=True)
class Eagle3Config:
    """A head's config.json, checked against its target's."""

    cfg: ModelConfig  # its decoder layer (Llama fields; vocab_size: the embedding's, the target's)
    draft_vocab: int  # draft_vocab_size: its LM head's rows
    target_hidden: int  # the target's hidden size (fc reads 3 of it)
    aux_layers: tuple[int, ...]  # the target layers whose input streams it reads (ascending)
    files: tuple[Path, ...]  # its safetensors files
    tensors: frozenset[str]  # their tensor names


def load_eagle3_config(head_dir: str | Path, target: ModelConfig) -> Eagle3Config:
    """The head in ``head_dir`` for ``target``; a head that does not fit it is refused, naming the
    field (before any work: the compile checks it first)."""
    path = Path(head_dir) / "config.json"
    where = f"--eagle3 {head_dir}"
    if not path.is_file():
        raise CompileError(f"{where}: no config.json; pass the directory of an EAGLE-3 head checkpoint.")
    raw: dict[str, Any] = json.loads(path.read_text())
    if raw.get("architectures") != [EAGLE3_ARCHITECTURE]:
        raise CompileError(
            f"{where}: config.json 'architectures' is {raw.get('architectures')}, not ['{EAGLE3_ARCHITECTURE}']; "
            "pass an EAGLE-3 head (a smaller model of the same tokenizer goes to --draft-model)."
        )
    try:
        cfg = normalize_config(raw)
    except ConfigError as err:
        raise CompileError(f"{where}: {err}") from None
    if cfg.num_layers != 1:
        raise CompileError(
            f"{where}: config.json 'num_hidden_layers' is {cfg.num_layers}; an EAGLE-3 head has 1."
        )
    if cfg.vocab_size != target.vocab_size:
        raise CompileError(
            f"{where}: config.json 'vocab_size' is {cfg.vocab_size}, the target's {target.vocab_size}; "
            "use the head trained for this target."
        )
    target_hidden = int(raw.get("target_hidden_size") or target.hidden_size)
    if target_hidden != target.hidden_size:
        raise CompileError(
            f"{where}: config.json 'target_hidden_size' is {target_hidden}, the target's hidden_size "
            f"{target.hidden_size}; use the head trained for this target."
        )
    draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
    if not 1 <= draft_vocab <= cfg.vocab_size:
        raise CompileError(
            f"{where}: config.json 'draft_vocab_size' is {draft_vocab}; it must be 1..{cfg.vocab_size}."
        )
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    key = "'eagle_config.eagle_aux_hidden_state_layer_ids'"
    layers: tuple[int, ...]
    if ids is None:
        layers = (2, n // 2, n - 3)
        field = f"config.json has no {key}, and the default layers (2, L/2, L-3)"
    else:
        layers = tuple(sorted(int(i) + 1 for i in ids))
        field = f"config.json {key} {ids}"
    if len(layers) != 3 or len(set(layers)) != 3 or not 1 <= layers[0] <= layers[-1] <= n:
        raise CompileError(
            f"{where}: {field} do not name three distinct layers of the target's {n}; list the ids "
            f"(0..{n - 1}) the head was trained on in {key}."
        )
    files = discover_weights(head_dir)
    if files.format != "safetensors":
        raise CompileError(
            f"{where}: the head's weights are {files.format} files; kiln reads safetensors only "
            "(convert them, e.g. with safetensors.torch.save_file)."
        )
    names = tensor_names(files.files)
    if draft_vocab < cfg.vocab_size and "d2t" not in names:
        raise CompileError(
            f"{where}: its draft vocabulary ({draft_vocab}) is smaller than the target's "
            f"({cfg.vocab_size}) and it has no d2t tensor mapping draft ids to target ids."
        )
    return Eagle3Config(cfg, draft_vocab, target_hidden, layers, files.files, frozenset(names))


def param_specs(head: Eagle3Config, d2t: bool) -> list[ParamSpec]:
    """The head's packed tensors (kiln names of compiler/models/eagle3.py) from its checkpoint's."""
    cfg = head.cfg
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {
        "embed.weight": [(cfg.vocab_size, h)],
        "fc.weight": [(h, 3 * head.target_hidden)],
        "attn.qkv.weight": [(n * d, 2 * h) for n in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)],
        "attn.o.weight": [(h, cfg.num_heads * d)],
        "mlp.gate_up.weight": [(cfg.intermediate_size, h)] * 2,
        "mlp.down.weight": [(h, cfg.intermediate_size)],
        "lm_head.weight": [(head.draft_vocab, h)],
    }
    specs = []
    for name, sources in CHECKPOINT_NAMES.items():
        parts = shapes.get(name, [(h,)])  # the norms
        pieces, start = [], 0
        for src, shape in zip(sources, parts, strict=True):
            pieces.append(Piece((Region(src, shape),), dst_start=start))
            start += shape[0]
        specs.append(ParamSpec(name, (start, *parts[0][1:]), tuple(pieces), "replicated"))
    if d2t:
        specs.append(
            ParamSpec(
                "d2t",
                (head.draft_vocab,),
                (Piece((Region("d2t", (head.draft_vocab,)),)),),
                "replicated",
                "float32",
            )
        )
    return specs


def tensor_names(files: tuple[Path, ...]) -> set[str]:
    """Every tensor name in the safetensors ``files`` (their headers only)."""
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            names.update(st.keys())
    return names


def _stage(head: Eagle3Config, target_dir: Path, tmp: Path) -> None:
    """A checkpoint directory ``tmp`` holding the head's tensors, and the target's embedding as
    ``embed_tokens.weight`` when the head has none."""
    for i, f in enumerate(head.files):  # names outside a shard set: every file is read
        (tmp / f"head-{i}.safetensors").symlink_to(f.resolve())
    if EMBED in head.tensors:
        return
    target = discover_weights(target_dir)
    src = target.weight_map.get(f"model.{EMBED}")
    for f in [target.root / src] if src else target.files:
        with safe_open(str(f), "pt") as st:
            names = list(st.keys())  # a safe_open handle has no __contains__
            if f"model.{EMBED}" in names:
                save_file({EMBED: st.get_tensor(f"model.{EMBED}")}, str(tmp / "embed.safetensors"))
                return
    raise CompileError(f"--eagle3: the head has no {EMBED} and the target no model.{EMBED}.")


@dataclass(frozen=True)
class HeadBuild:
    """A draft head fed the target's hidden states (an EAGLE-3 head, a DeepSeek MTP layer), as
    :func:`compile_head` builds it into ``ART/{kind}``."""

    kind: str  # DraftSpec.kind, and the nested artifact's directory
    cfg: ModelConfig  # the head's config: one layer (its manifest's model, KV cache and RoPE)
    specs: list[ParamSpec]  # its packed tensors
    skip: tuple[str, ...]  # checkpoint names not packed
    model: Callable[[torch.dtype], AuxHeadGraph]  # the head, built on the meta device
    stage: Callable[[Path], Path]  # a scratch directory -> the checkpoint directory to pack from
    record: dict[str, Any]  # its manifest's own field: {"eagle3": Eagle3Spec} or {"mtp": MtpSpec}
    source: Path  # where it came from (the build log)


def compile_eagle3(
    target_dir: Path, head: Eagle3Config, out: Path, opts: CompileOptions, verbose: bool
) -> DraftSpec:
    """Compile the head ``opts.eagle3`` (checked: ``head``) into ``out/eagle3`` for a target
    compiled from ``target_dir`` with ``opts`` (its ``max_seq_len`` resolved); returns the record
    the target's manifest keeps."""
    assert opts.eagle3 is not None
    cfg, d2t = head.cfg, "d2t" in head.tensors

    def stage(tmp: Path) -> Path:
        _stage(head, target_dir, tmp)
        return tmp

    def model(dtype: torch.dtype) -> AuxHeadGraph:
        return Eagle3ForCausalLM(cfg, head.target_hidden, head.draft_vocab, cfg.vocab_size, dtype, d2t)

    build = HeadBuild(
        kind=EAGLE3_DIR,
        cfg=cfg,
        specs=param_specs(head, d2t),
        skip=NOT_PACKED,
        model=model,
        stage=stage,
        record={
            "eagle3": Eagle3Spec(target_hidden_size=head.target_hidden, draft_vocab_size=head.draft_vocab)
        },
        source=Path(opts.eagle3),
    )
    return compile_head(build, out, opts, verbose)


def _head_tree_shapes(verify: VerifySpec) -> list[tuple[int, int]]:
    """``(batch, tokens)`` a head's tree graph is warmed up at: its tree steps run eagerly over 1 to
    ``B (k - 1)`` expanded nodes (runtime/spec_eagle.py ``_tree_step``), so every Triton value class
    of both (1, a multiple of 16, other) up to the largest verify batch at the longest length."""
    bmax, k = verify.buckets[-1], verify.lengths[-1]
    shapes = {(1, 1), (1, 2), (1, 16), (min(2, bmax), 16), (min(2, bmax), 3)}
    shapes.add((bmax, max(bmax, bmax * (k - 1))))
    return sorted(shapes | tokens_per_program_runs(max(1, k - 1)))


def compile_head(head: HeadBuild, out: Path, opts: CompileOptions, verbose: bool) -> DraftSpec:
    """Compile ``head`` into ``out/{head.kind}`` with the target's shape options ``opts`` (its
    ``max_seq_len`` resolved: one block table serves both KV pools page for page): its pack, the
    shared graph (:attr:`~AuxHeadGraph.fused`: a catch-up from the target's streams, also run at
    the target's verify shapes: the runtime captures the catch-up per ``(B, k)`` as the target's
    verify steps), a static ``decode_b{b}`` graph per bucket (a chain step on its own output), with
    verify graphs and a model that can have them the tree graph (``Manifest.TREE_GRAPH``:
    draft-tree steps on the parents' outputs), their kernels and its manifest; returns the record
    the target's manifest keeps (``DraftSpec`` of ``head.kind``). Activation dtype (no FP8), one
    rank."""
    from kiln.weights import load_pack, pack_checkpoint

    assert opts.max_seq_len is not None
    dst = out / head.kind
    if verbose:
        print(f"[kiln compile] {head.kind} head {head.source} -> {dst}", flush=True)
    timer = PhaseTimer(verbose=verbose)
    cfg, device = head.cfg, torch.device(opts.device)
    opts = replace(opts, quant=None, tp=1, ep=1)
    dst.mkdir(parents=True)
    with timer.phase(f"{head.kind} weights"), tempfile.TemporaryDirectory(prefix=f"kiln-{head.kind}-") as tmp:
        src = head.stage(Path(tmp))
        pack_checkpoint(
            src, dst / "weights", [head.specs], tp=1, dtype=opts.dtype, progress=verbose, skip=head.skip
        )
    max_seq = opts.max_seq_len
    with timer.phase(f"{head.kind} trace"):
        (dst / "graphs").mkdir()
        plan = gemv_plan(opts.gemv_plan)
        with torch.device("meta"):
            model = head.model(DTYPES[opts.dtype])
        use_gemv_plan(model, plan)
        weights = load_pack(dst / "weights", 0, device, verify=False)
        _check_pack_matches(model, weights)
        kv = _kv_spec(cfg, opts)
        width = max(model.width, cfg.hidden_size)
        cache = CacheSpec(
            1, kv.num_kv_heads, kv.head_dim, kv.v_head_dim, getattr(torch, kv.dtype), kv.page_size, width
        )
        buckets, max_blocks = opts.decode_buckets, kv.pages_for(max_seq)
        ex = example_inputs(2, 8, cache, cfg.rotary_dim, device, max_blocks=max_blocks)
        programs = {"model": _export_dynamic(model, weights, ex, opts)}
        graphs: dict[str, GraphEntry] = {
            "model": _graph_entry("model", None, cache, max_tokens=opts.max_tokens)
        }
        model.fused = False  # a chain step: the head's own output fed back
        for b in buckets:
            ex = example_inputs(b, b, cache, cfg.rotary_dim, device, max_blocks=max_blocks)
            programs[f"decode_b{b}"] = export_graph(model, weights, ex, opts.page_size, static_batch=True)
            graphs[f"decode_b{b}"] = _graph_entry(f"decode_b{b}", b, cache, layout="add_norm")
        verify = opts.verify
        if verify is not None and _trees_traceable(cfg, opts):
            # draft trees (runtime/spec_eagle.py propose_tree): expanded nodes on their parents' outputs
            _add_tree_graph(programs, graphs, model, weights, cache, cfg.rotary_dim, device, max_blocks, opts)
    with timer.phase(f"{head.kind} kernels"):

        def warm(modules: dict[str, Any]) -> None:
            shapes = _head_tree_shapes(verify) if verify is not None else []
            _warm_up(
                modules, graphs, weights, cache, cfg, device, buckets, max_blocks, opts.chunk_size,
                verify=verify, tree_shapes=shapes,
            )  # fmt: skip

        graphs = build_graphs(dst, programs, graphs, weights, cache, device, warm)
    manifest = Manifest(
        model=json.loads(json.dumps(cfg.to_dict())),
        dtype=opts.dtype,
        quant=None,
        tp=1,
        device=device.type,
        gpu_arch=gpu_arch(opts.device),
        versions=Versions.current(),
        max_seq_len=max_seq,
        max_batch_size=opts.max_batch_size,
        chunk_size=opts.chunk_size,
        decode_buckets=buckets,
        graphs=graphs,
        kv=kv,
        rope=_rope_spec(cfg),
        vocab_size=cfg.vocab_size,
        eos_token_ids=(),
        bos_token_id=None,
        tokenizer_files=(),
        norm_folds={},
        kernel_choices=KernelChoices(
            attention="triton",
            decode_graphs="per-bucket",
            decode_num_splits={b: _decode_splits(cfg, b, max_seq, 1) for b in buckets},
            gemv_plan=plan,
        ),
        files=file_table(dst),
        verify=verify,  # the catch-up's (B, k) graphs (runtime/spec_eagle.py _catch_up)
        **head.record,
    )
    manifest.save(dst)
    write_build_log(dst, {"compile_seconds": timer.times, "source": str(head.source.resolve())})
    doc = json.loads((dst / fmt.MANIFEST).read_text())
    return DraftSpec(
        path=head.kind,
        manifest_xxh3_128=doc[fmt.MANIFEST_HASH_KEY],
        vocab_size=cfg.vocab_size,
        kind=head.kind,
    )
