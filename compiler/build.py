"""``kiln compile``: checkpoint -> artifact directory.

Phases: config (normalize, validate) -> weights (pack per rank) -> trace (export every graph) ->
kernels (run every graph once on the target device so every Triton kernel of every bucket is
compiled into ``kernels/``) -> tokenizer -> manifest (a typed ``kiln.manifest.Manifest``: versions,
GPU arch, a hash of every file) -> build log (``build-log.json``: timings, source path, time, host).

Reproducible: the same checkpoint, options and versions give the same bytes in every file but the
build log (what would differ, timings and measurements, goes there). Triton's kernels compile into
``kernels/`` through ``kiln.kernel_cache`` (group files with relative paths).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kiln import settings
from kiln.artifact_format import TOKENIZER_FILES, gpu_arch, write_build_log
from kiln.compiler.config import ConfigError, ModelConfig, load_config, resolve_quant
from kiln.compiler.context import graph_inputs
from kiln.compiler.cutlass_build import check_request, cutlass_backend, drop_unused, fp8_library
from kiln.compiler.graph_code import emit_graph_code
from kiln.compiler.layers import match_pack_quant
from kiln.compiler.models.base import DecoderOnlyLM
from kiln.compiler.moe_layer import FusedMoE, block_fp8_experts
from kiln.compiler.moe_tune import MoEShape, moe_tuning
from kiln.compiler.norm_folds import norm_folds
from kiln.compiler.parallel import ParallelConfig, validate_parallel
from kiln.compiler.registry import model_class
from kiln.compiler.trace import CacheSpec, example_inputs, export_graph, strip_example_inputs
from kiln.errors import KilnError
from kiln.kernel_cache import kernel_cache
from kiln.manifest import (
    KV_FP8,
    GraphCode,
    GraphEntry,
    KernelChoices,
    KVSpec,
    LibraryRecord,
    Manifest,
    MoEChoice,
    RopeSpec,
    VerifySpec,
    Versions,
    file_table,
)
from kiln.ops.common.collective import without_tp_group
from kiln.ops.common.quant import FP8_DTYPE
from kiln.ops.linear.gemv import gemv_plan
from kiln.weights.fold import apply_norm_folds

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # compiler/eagle3.py: compiled only into a target's artifact
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Speculative decoding's verify graphs (--verify-lengths): for decode buckets up to this batch (larger
# batches decode plainly: their steps are bound by compute more than by the weight read), k up to
# VERIFY_MAX_LENGTH drafts. Every verify step runs the shared graph (captured per (B, k) at load):
# static graphs with the GEMV on every token measured slower (docs/speculative.md section 7).
VERIFY_MAX_BATCH = 32
# --draft-model without --verify-lengths: verify graphs for the run's default num_draft_tokens
DRAFT_VERIFY_LENGTH = settings.SETTINGS["num_draft_tokens"].default
VERIFY_MAX_LENGTH = 32
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CompileError(KilnError):
    pass


@dataclass(frozen=True)
class CompileOptions:
    """``kiln compile``'s options, one field per flag. The graph-changing settings of
    kiln/settings.py (``gemv_plan``, ``fold_norms``) are fields here and nowhere else: the model
    build gets them explicitly and the manifest records them (``kernel_choices.gemv_plan``,
    ``norm_folds``); the environment does not change them."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    # --quant: None (as the checkpoint is: "fp8-block" for 128 x 128 block-FP8 checkpoints), "fp8",
    # "fp8-block" or "none"; compile_model resolves it (compiler/config.py resolve_quant) and the
    # manifest records the result (None, "fp8" or "fp8-block")
    quant: str | None = None
    tp: int = 1  # --tp: the ranks (processes) that run the artifact, one graph with the collectives
    ep: int = 1  # --ep: MoE experts split into ep groups of tp/ep ranks (compiler/parallel.py)
    max_batch_size: int = 256  # the largest decode bucket (decode_buckets)
    max_seq_len: int | None = None  # default: min(max_position_embeddings, 32768)
    chunk_size: int = 4096  # largest extend (prefill chunk) in tokens
    page_size: int = 16  # KV-cache page size in tokens: 1 or 16 (--page-size)
    # --kv-dtype: "auto" (the activation dtype) or "fp8" (e4m3, one float32 scale per cached head
    # row, written by kiln::qkv_rope_kvwrite: half the bytes decode attention reads)
    kv_dtype: str = "auto"
    # "shared": the dynamic graph serves decode too (but batch 1's static graph with folded norms);
    # "per-bucket": a static graph per bucket
    decode_graphs: str = "shared"
    moe_tune: bool = False  # on a GPU: time fused-MoE launch configs per token rung (compiler/moe_tune.py)
    moe_backend: str = "triton"  # "cutlass" / "auto": the CUTLASS grouped GEMM (compiler/cutlass_build.py)
    moe_cutlass_min_tokens: int = 2048  # moe_backend "cutlass": rungs from this many tokens on use it
    fp8_cutlass: bool = True  # quant fp8 on an sm90 GPU: build the CUTLASS FP8 GEMM library (fp8_library)
    # --gemv-plan: which bf16 linears trace the GEMV, up to which T (ops/linear/gemv.py gemv_plan)
    gemv_plan: str = settings.SETTINGS["gemv_plan"].default
    # --fold-norms/--no-fold-norms: fold the norm weights into their consumers where possible
    # (compiler/norm_folds.py) and trace batch 1's decode graph in the residual-stream layout
    fold_norms: bool = True
    # --verify-lengths: draft counts k with verify graphs per (batch, k) (speculative decoding; "": none)
    verify_lengths: str = settings.SETTINGS["verify_lengths"].default
    # --draft-model: a smaller checkpoint of the same tokenizer compiled into ART/draft (compiler/draft.py)
    draft_model: str | None = None
    # --eagle3: an EAGLE-3 head checkpoint compiled into ART/eagle3 (compiler/eagle3.py); the target's
    # graphs then hand out the streams it reads (aux_layers)
    eagle3: str | None = None
    # --mtp: a DeepSeek-V3 checkpoint's next-token-prediction layer compiled into ART/mtp
    # (compiler/mtp.py); the target's graphs then hand out their last layer's output (aux_layers)
    mtp: bool = False
    # layers whose input residual stream every graph hands out (0..L, L: before the final norm), for
    # drafts that read the target's hidden states (EAGLE-3, DeepSeek MTP: docs/speculative.md section 4)
    aux_layers: tuple[int, ...] = ()
    # the token-tree verify graph beside the verify graphs (a draft model's compile sets it off: it
    # drafts chains; its verify graphs serve its catch-up, compiler/draft.py)
    tree_graph: bool = True
    force: bool = False

    @property
    def max_tokens(self) -> int:
        """The most tokens one call of the shared graph takes: a prefill chunk or a decode batch."""
        return max(self.chunk_size, self.max_batch_size)

    @property
    def verify(self) -> VerifySpec | None:
        """The verify graphs' lengths and batches (``--verify-lengths``; None without it): the
        decode buckets up to ``VERIFY_MAX_BATCH``. Raises :class:`CompileError` on a bad list."""
        spec = self.verify_lengths.strip()
        if not spec:
            return None
        try:
            ks = sorted({int(p) for p in spec.split(",")})
        except ValueError:
            ks = []
        if not ks or ks[0] < 1 or ks[-1] > VERIFY_MAX_LENGTH:
            raise CompileError(
                f"--verify-lengths is {self.verify_lengths!r}; it takes a comma list of draft counts "
                f"1..{VERIFY_MAX_LENGTH}, e.g. 4,8"
            )
        buckets = tuple(b for b in self.decode_buckets if b <= VERIFY_MAX_BATCH)
        return VerifySpec(lengths=tuple(ks), buckets=buckets)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """The batch sizes decode runs at (the artifact's graphs and CUDA graphs): the
        ``DEFAULT_BUCKETS`` below ``max_batch_size``, then ``max_batch_size``."""
        return (*(b for b in DEFAULT_BUCKETS if b < self.max_batch_size), self.max_batch_size)


@dataclass
class PhaseTimer:
    times: dict[str, float] = field(default_factory=dict)
    verbose: bool = True

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.verbose:
            print(f"[kiln compile] {name} ...", flush=True)
        t0 = time.perf_counter()
        yield
        self.times[name] = time.perf_counter() - t0
        if self.verbose:
            print(f"[kiln compile] {name} done in {self.times[name]:.1f} s", flush=True)


def _check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CompileError("--device cuda was asked for but no CUDA device is visible; use --device cpu.")
    if not (device == "cpu" or device.startswith("cuda")):
        raise CompileError(f"--device must be cpu or cuda, got {device!r}.")


def _copy_tokenizer(model_dir: Path, out: Path) -> list[str]:
    dst = out / "tokenizer"
    dst.mkdir(exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, dst / name)  # bytes only: no source mtime or mode
            copied.append(name)
    return copied


def _decode_splits(cfg: ModelConfig, batch: int, max_seq_len: int, tp: int) -> int:
    """The split-KV factor the decode attention picks at ``batch`` (the manifest's record): MLA's
    rule for MLA layers (one latent KV head read by every head block), else GQA's per KV head."""
    from kiln.ops.attention.decode import choose_num_splits
    from kiln.ops.attention.mla import mla_num_splits

    if cfg.mla is not None:
        return mla_num_splits(batch, max_seq_len, cfg.num_heads // tp)
    return choose_num_splits(batch, max_seq_len, cfg.kv_heads_per_rank(tp))


def _model(cfg: ModelConfig, opts: CompileOptions, plan: dict[str, int]) -> DecoderOnlyLM:
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        return cls(cfg, DTYPES[opts.dtype], tp=opts.tp, quant=opts.quant, gemv_plan=plan, ep=opts.ep)


def _check_pack_matches(model: torch.nn.Module, pack: dict[str, torch.Tensor]) -> None:
    """Every model parameter present once with its shape and dtype; nothing unexpected."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(pack))
    unexpected = sorted(set(pack) - set(params))
    if missing or unexpected:
        raise CompileError(
            f"weight pack does not match the model definition: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}"
        )
    for name, p in params.items():
        t = pack[name]
        if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
            raise CompileError(
                f"tensor {name}: the checkpoint gives {tuple(t.shape)} {t.dtype}, the config implies "
                f"{tuple(p.shape)} {p.dtype}; config.json and the weights disagree."
            )


def _norm_folds(model: torch.nn.Module, fold: bool, verbose: bool) -> dict[str, list[str]]:
    """The norm weights to fold into their consumers' weights (weights/fold.py), or {} when not asked
    for (``fold``: ``CompileOptions.fold_norms``) or not possible (said on stderr). Every graph is
    correct on folded weights (the norm weights become ones); the batch-1 decode graph is traced in
    the residual-stream layout that needs no norm kernel (``model.fold_norms``,
    compiler/models/base.py)."""
    if not fold:
        return {}
    folds, why = norm_folds(model)
    if not folds and verbose:
        print(f"[kiln compile] norms not folded: {why}", file=sys.stderr, flush=True)
    return folds


def _graph_entry(name: str, batch: int | None, cache: CacheSpec, tree: bool = False, **kw: Any) -> GraphEntry:
    """The manifest entry of graph ``name``: its inputs after the weights (compiler/context.py
    ``graph_inputs``; ``tree``: with the token-tree mask)."""
    inputs = graph_inputs(cache.dtype, aux=cache.aux_width > 0, tree=tree)
    return GraphEntry(file=f"graphs/{name}.pt2", inputs=inputs, batch=batch, **kw)


def _export_dynamic(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], ex: dict[str, Any], opts: CompileOptions
) -> Any:
    """A graph over dynamic tokens and requests (the shared graph, the token-tree graph, a draft
    head's catch-up graph): up to ``opts.max_tokens`` tokens of ``opts.max_batch_size`` requests."""
    return export_graph(
        model, weights, ex, opts.page_size, max_tokens=opts.max_tokens, max_batch=max(opts.max_batch_size, 2)
    )


def _add_tree_graph(
    programs: dict[str, Any], graphs: dict[str, GraphEntry], model: torch.nn.Module,
    weights: dict[str, torch.Tensor], cache: CacheSpec, rotary_dim: int, device: torch.device,
    max_blocks: int, opts: CompileOptions,
) -> None:  # fmt: skip
    """Export ``Manifest.TREE_GRAPH`` (the model's dynamic shapes with the ``tree_mask`` input, logits
    at every token) into ``programs`` and its entry into ``graphs``: a target's tree verify graph, a
    draft head's tree-step graph."""
    ex = example_inputs(2, 8, cache, rotary_dim, device, max_blocks=max_blocks, every_token=True, tree=True)
    name = Manifest.TREE_GRAPH
    programs[name] = _export_dynamic(model, weights, ex, opts)
    graphs[name] = _graph_entry(name, None, cache, tree=True, max_tokens=opts.max_tokens)


def _trees_traceable(cfg: ModelConfig, opts: CompileOptions) -> bool:
    """Whether the artifact gets the token-tree verify graph (``Manifest.TREE_GRAPH``) beside its
    verify graphs: not for sliding windows (refused with trees), nor a draft model's."""
    return opts.tree_graph and not cfg.sliding_window


KV_DTYPES = ("auto", "fp8")  # --kv-dtype


def _kv_spec(cfg: ModelConfig, opts: CompileOptions) -> KVSpec:
    """The KV cache the graphs are traced for (per rank), as the manifest records it. MLA
    (DeepSeek-V2/V3): the latent cache, one "head" of ``kv_lora_rank + qk_rope_head_dim`` per token
    in the K cache (whole on every rank) and an empty V cache (compiler/mla_layer.py)."""
    dtype = KV_FP8 if opts.kv_dtype == "fp8" else opts.dtype
    heads, head_dim, v_head_dim = cfg.kv_heads_per_rank(opts.tp), cfg.head_dim, cfg.v_head_dim
    if cfg.mla is not None:
        if opts.kv_dtype == "fp8":
            raise ConfigError(
                f"--kv-dtype fp8 is not supported for MLA models ({cfg.architecture}): their latent cache "
                "has no FP8 format yet; compile without --kv-dtype fp8."
            )
        heads, head_dim, v_head_dim = 1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, 0
    return KVSpec(
        num_layers=cfg.num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=dtype,
        page_size=opts.page_size,
        bytes_per_token=cfg.kv_bytes_per_token(dtype, opts.tp),
    )


def _rope_spec(cfg: ModelConfig) -> RopeSpec:
    # HF falls back to max_position_embeddings when scaling has no original length
    original = cfg.rope_scaling.original_max_position or cfg.max_position_embeddings
    scaling = asdict(cfg.rope_scaling) | {"original_max_position": original}
    return RopeSpec(rotary_dim=cfg.rotary_dim, base=cfg.rope_theta, scaling=scaling, is_neox=cfg.rope_is_neox)


def _eos_token_ids(cfg: ModelConfig, model_dir: Path) -> tuple[int, ...]:
    """The config's EOS ids, else generation_config.json's ``eos_token_id`` (an id or a list)."""
    if cfg.eos_token_ids:
        return tuple(cfg.eos_token_ids)
    path = model_dir / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return (eos,) if isinstance(eos, int) else tuple(eos or ())


def compile_model(
    model_dir: str | Path, out_dir: str | Path, opts: CompileOptions, verbose: bool = True
) -> Manifest:
    """Build the artifact for ``model_dir`` into ``out_dir``; returns its manifest. The trace and
    the warm-up run as one rank, whatever tensor-parallel group this process may serve.

    The build goes into a hidden folder (beside ``out_dir``, or inside it when it exists: it may be
    ``.``, a mount point, or in a folder this user cannot write) and takes ``out_dir``'s place only
    once it is complete: a failed or interrupted compile leaves nothing behind, and with
    ``--force`` the artifact it replaces stays whole until then."""
    model_dir, out = Path(model_dir), Path(out_dir)
    _check_out(model_dir, out, opts.force)
    if out.is_dir():
        work = Path(tempfile.mkdtemp(dir=out, prefix=".kiln-build-"))
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.kiln-build-"))
    try:
        with without_tp_group():
            manifest = _compile_model(model_dir, work, opts, verbose, out)
        _put_in_place(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _check_out(model_dir: Path, out: Path, force: bool) -> None:
    """Refuse an output folder that is the checkpoint or holds it (``--force`` would delete the
    checkpoint), and a non-empty one without ``--force``."""
    src, dst = model_dir.resolve(), out.resolve()
    if model_dir.is_dir() and (src == dst or dst in src.parents):
        raise CompileError(
            f"output directory {out} is the checkpoint {model_dir} or holds it; pick another -o."
        )
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not force):
        raise CompileError(f"output directory {out} exists and is not empty; pass --force to replace it.")


def _put_in_place(work: Path, out: Path) -> None:
    """The finished build ``work`` becomes ``out``: renamed there when ``out`` does not exist, else
    its entries swapped in for ``out``'s (the old ones moved aside first, deleted after; put back
    if the swap fails half way)."""
    if not out.is_dir():
        os.rename(work, out)
        return
    old = Path(tempfile.mkdtemp(dir=out, prefix=".kiln-old-"))
    keep = {work.name, old.name}
    try:
        for e in list(out.iterdir()):
            if e.name not in keep:
                os.rename(e, old / e.name)
        for e in list(work.iterdir()):
            os.rename(e, out / e.name)
    except BaseException:
        for e in list(out.iterdir()):  # the new entries out, the old ones back
            if e.name in keep:
                continue
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e)
            else:
                e.unlink()
        for e in list(old.iterdir()):
            os.rename(e, out / e.name)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _compile_model(model_dir: Path, out: Path, opts: CompileOptions, verbose: bool, final: Path) -> Manifest:
    from kiln.compiler.mappings import all_rank_specs, skip_patterns
    from kiln.weights import load_pack, pack_checkpoint

    _check_device(opts.device)
    if opts.dtype not in DTYPES:
        raise CompileError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}.")
    if opts.kv_dtype not in KV_DTYPES:
        raise CompileError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {opts.kv_dtype!r}.")
    try:
        plan = gemv_plan(opts.gemv_plan)  # a bad --gemv-plan fails here, before any work
    except ValueError as err:
        raise CompileError(str(err)) from None
    for line in settings.environment_warnings("compile"):  # variables that no longer change a compile
        warnings.warn(f"kiln compile: {line}", stacklevel=2)
    timer = PhaseTimer(verbose=verbose)
    with timer.phase("config"):
        cfg = load_config(model_dir)
        # the quantization the checkpoint implies or --quant asks for (a combination that makes no
        # sense, or FP8 blocks other than 128 x 128, fails here)
        opts = replace(opts, quant=resolve_quant(opts.quant, cfg))
        par = ParallelConfig(tp=opts.tp, ep=opts.ep)
        validate_parallel(cfg, par)  # --tp/--ep: a layout that cannot shard the model fails here
        max_seq = opts.max_seq_len or min(cfg.max_position_embeddings, 32768)
        if max_seq <= opts.page_size:  # one page: the block table's width would be a constant 1
            raise CompileError(
                f"--max-seq-len ({max_seq}) must be above the page size ({opts.page_size}) so that a "
                "sequence spans pages; raise it (the model's own limit is max_position_embeddings, "
                f"{cfg.max_position_embeddings})"
            )
        if max_seq > cfg.max_position_embeddings:
            warnings.warn(
                f"kiln compile: --max-seq-len {max_seq} is past the model's max_position_embeddings "
                f"({cfg.max_position_embeddings}): positions beyond it were never trained",
                stacklevel=2,
            )
        if cfg.architecture == EAGLE3_ARCHITECTURE:
            raise CompileError(
                f"{model_dir} is an EAGLE-3 head; it compiles into its target's artifact: "
                f"kiln compile TARGET --eagle3 {model_dir}"
            )
        model_class(cfg.architecture)  # fail before any work if the architecture cannot compile
        _kv_spec(cfg, opts)  # likewise a KV cache it cannot have (--kv-dtype fp8 for MLA)
        head = None
        if opts.mtp:
            from kiln.compiler.mtp import check_mtp

            check_mtp(model_dir, cfg, opts)  # no MTP layer or another draft source: fails here
            opts = replace(opts, aux_layers=(cfg.num_layers,))  # the stream before the final norm
        if opts.eagle3 is not None:
            from kiln.compiler.eagle3 import load_eagle3_config

            if opts.draft_model is not None:
                raise CompileError("--eagle3 and --draft-model: an artifact has one draft source; pass one.")
            head = load_eagle3_config(opts.eagle3, cfg)  # a head that does not fit the target fails here
            opts = replace(opts, aux_layers=head.aux_layers)
        drafted = opts.draft_model is not None or head is not None or opts.mtp
        if drafted and not opts.verify_lengths.strip():
            opts = replace(opts, verify_lengths=DRAFT_VERIFY_LENGTH)  # a draft verifies
        verify = opts.verify  # a bad --verify-lengths fails here
        if list(opts.aux_layers) != sorted(set(opts.aux_layers)) or not all(
            0 <= i <= cfg.num_layers for i in opts.aux_layers
        ):
            raise CompileError(
                f"aux_layers {opts.aux_layers}: ascending distinct layer indices 0..{cfg.num_layers} "
                f"({cfg.num_layers}: the stream before the final norm)"
            )
        if cfg.moe is not None:
            check_request(opts.moe_backend, torch.device(opts.device), opts.dtype, _experts_quant(opts, cfg))
    with timer.phase("weights"):
        pack_checkpoint(
            model_dir,
            out / "weights",
            all_rank_specs(cfg, par, opts.quant),
            tp=opts.tp,
            ep=opts.ep,
            dtype=opts.dtype,
            quant=opts.quant,
            progress=verbose,
            skip=skip_patterns(cfg),
        )
    device = torch.device(opts.device)
    fp8_choice: dict[str, Any] = {}
    if opts.quant == "fp8":
        with timer.phase("cutlass_fp8"):  # before the warm-up, which then runs it
            fp8_choice = fp8_library(opts.fp8_cutlass, device, opts.quant, out / "kernels", verbose)
    moe_choice = None
    if cfg.moe is not None:
        with timer.phase("moe_tune" if opts.moe_tune else "moe_table"):
            moe_choice = _moe_choice(cfg, opts, device, out)
    with timer.phase("trace"):
        model = _model(cfg, opts, plan)
        if moe_choice is not None:  # the graphs pass the recorded table to kiln::fused_moe
            for mod in model.modules():
                if isinstance(mod, FusedMoE):
                    mod.tuning = moe_choice["table"]
        weights = load_pack(out / "weights", 0, device, verify=False)  # hashed as it was written
        match_pack_quant(model, weights)  # block-FP8 linears the checkpoint left unquantized
        _check_pack_matches(model, weights)
        # the residual-stream layout adds the residual inside the o/down projections, before a
        # tensor-parallel all-reduce could: no folds with --tp > 1
        folds = _norm_folds(model, opts.fold_norms and opts.tp == 1, verbose)
        apply_norm_folds(weights, folds)  # as the runtime will, before the warm-up runs the graphs
        kv = _kv_spec(cfg, opts)
        model.aux_layers = opts.aux_layers  # the residual streams the graphs hand out
        cache = CacheSpec(
            kv.num_layers,
            kv.num_kv_heads,
            kv.head_dim,
            kv.v_head_dim,
            getattr(torch, kv.dtype),
            kv.page_size,
            aux_width=len(opts.aux_layers) * cfg.hidden_size,
        )
        graphs: dict[str, GraphEntry] = {}
        (out / "graphs").mkdir()
        buckets = opts.decode_buckets
        max_blocks = kv.pages_for(max_seq)  # the block-table width: Manifest.max_blocks at run time
        programs: dict[str, Any] = {}
        # The shared graph: dynamic tokens and requests; serves prefill and (captured per bucket) decode.
        ex = example_inputs(2, 8, cache, cfg.rotary_dim, device, max_blocks=max_blocks)
        programs["model"] = _export_dynamic(model, weights, ex, opts)
        graphs["model"] = _graph_entry("model", None, cache, max_tokens=opts.max_tokens)
        # Static decode graphs: every bucket's with "per-bucket"; with folded norms, batch 1's in the
        # residual-stream layout (the shared graph keeps the add+norm kernels, faster from batch 2:
        # bench/results/2026-11-30_h200_s9d_fold_step.json).
        static = buckets if opts.decode_graphs == "per-bucket" else ([1] if folds else [])
        try:
            for b in static:
                model.fold_norms = bool(folds) and b == 1
                ex = example_inputs(b, b, cache, cfg.rotary_dim, device, max_blocks=max_blocks)
                programs[f"decode_b{b}"] = export_graph(model, weights, ex, opts.page_size, static_batch=True)
                kind = "residual_stream" if model.fold_norms else "add_norm"
                graphs[f"decode_b{b}"] = _graph_entry(f"decode_b{b}", b, cache, layout=kind)
        finally:
            model.fold_norms = False
        if verify is not None and _trees_traceable(cfg, opts):
            # token trees (speculative tree verification); the runtime captures it per verify shape
            _add_tree_graph(programs, graphs, model, weights, cache, cfg.rotary_dim, device, max_blocks, opts)
    with timer.phase("kernels"):
        moe_table = moe_choice["table"] if moe_choice else ""

        def warm(modules: dict[str, Any]) -> None:
            _warm_up(
                modules,
                graphs,
                weights,
                cache,
                cfg,
                device,
                buckets,
                max_blocks,
                opts.chunk_size,
                moe_table,
                par,
                verify,
            )
            _warm_up_sampler(cfg.vocab_size, device)

        graphs = build_graphs(out, programs, graphs, weights, cache, device, warm)
    with timer.phase("tokenizer"):
        tok_files = _copy_tokenizer(model_dir, out)
    draft = None
    nested = replace(opts, max_seq_len=max_seq)  # a draft's block table is the target's
    if opts.draft_model is not None:
        from kiln.compiler.draft import compile_draft

        with timer.phase("draft"):
            draft = compile_draft(opts.draft_model, out, nested, verbose)
    if head is not None:
        from kiln.compiler.eagle3 import compile_eagle3

        with timer.phase("eagle3"):
            draft = compile_eagle3(model_dir, head, out, nested, verbose)
    if opts.mtp:
        from kiln.compiler.mtp import compile_mtp

        with timer.phase("mtp"):
            draft = compile_mtp(model_dir, cfg, out, nested, verbose)
    with timer.phase("manifest"):
        records, measured = split_build_facts(
            {
                "moe": moe_choice | {"table": json.loads(moe_choice["table"])} if moe_choice else {},
                "fp8": fp8_choice,
            }
        )
        choices = KernelChoices(
            attention="triton",
            decode_graphs=opts.decode_graphs,
            decode_num_splits={b: _decode_splits(cfg, b, max_seq, opts.tp) for b in buckets},
            gemv_plan=plan,  # role -> largest T on the GEMV kernel (ops/linear/gemv.py)
            moe=MoEChoice.from_json(records["moe"], "kernel_choices.moe") if records["moe"] else None,
            fp8=LibraryRecord.from_json(records["fp8"], "kernel_choices.fp8") if records["fp8"] else None,
        )
        manifest = Manifest(
            model=json.loads(json.dumps(cfg.to_dict())),  # as load returns it (lists, not tuples)
            dtype=opts.dtype,
            quant=opts.quant,
            tp=opts.tp,
            ep=opts.ep,
            device=device.type,
            gpu_arch=gpu_arch(opts.device),
            versions=Versions.current(),
            max_seq_len=max_seq,
            max_batch_size=opts.max_batch_size,
            chunk_size=opts.chunk_size,
            decode_buckets=buckets,
            verify=verify,
            draft=draft,
            aux_layers=opts.aux_layers or None,
            graphs=graphs,
            kv=kv,
            rope=_rope_spec(cfg),
            vocab_size=cfg.vocab_size,
            eos_token_ids=_eos_token_ids(cfg, model_dir),
            bos_token_id=cfg.bos_token_id,
            tokenizer_files=tuple(tok_files),
            norm_folds={norm: tuple(consumers) for norm, consumers in folds.items()},  # weights/fold.py
            kernel_choices=choices,
            files=file_table(out, skip=(draft.path,) if draft else ()),
        )
        manifest.save(out)
    write_build_log(
        out,
        {
            "compile_seconds": timer.times,
            "source": str(model_dir.resolve()),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "kernel_choices": measured,
        },
    )
    if verbose:
        size = sum(f.size for f in manifest.files.values())
        print(
            f"[kiln compile] artifact {final} ({size / 2**30:.2f} GiB) in "
            f"{sum(timer.times.values()):.1f} s: "
            + ", ".join(f"{k} {v:.1f}s" for k, v in timer.times.items()),
            flush=True,
        )
    return manifest


def build_graphs(
    out: Path,
    programs: dict[str, Any],
    graphs: dict[str, GraphEntry],
    weights: dict[str, torch.Tensor],
    cache: CacheSpec,
    device: torch.device,
    warm: Any,
) -> dict[str, GraphEntry]:
    """Run ``warm(modules)`` over the exported ``programs`` (runnable modules by graph name) with
    the Triton cache pointed at ``out/kernels``, then write every graph (``graphs/{name}.pt2`` and
    its generated Python); returns ``graphs`` with their ``python`` entries."""
    kernels_dir = out / "kernels"
    kernels_dir.mkdir(exist_ok=True)  # the FP8 and MoE phases may have put CUTLASS libraries there
    forget_loaded_kernels()  # kernels this process launched would never be looked up on disk
    # into the artifact, group files with relative paths; C modules built reproducibly
    with _reproducible_c_builds(), kernel_cache(write=kernels_dir):
        # runnable, unlifted; without the stored example inputs (the module would also carry
        # an input-guard submodule the graph's Python source cannot hold)
        modules = {name: strip_example_inputs(ep).module() for name, ep in programs.items()}
        warm(modules)
        if device.type == "cuda":
            from kiln.weights.checksum import warm_up as warm_up_checksum

            warm_up_checksum(weights)  # the check a verified load_pack runs on the arena
            _build_driver_utils(kernels_dir)
    graphs = dict(graphs)
    for name, ep in programs.items():
        torch.export.save(ep, out / graphs[name].file)
        layout = emit_graph_code(
            modules[name], out / "graphs" / f"{name}.py", list(weights), len(graphs[name].inputs)
        )
        if layout is not None:
            code = GraphCode.from_json({"file": f"graphs/{name}.py", **layout}, f"graphs.{name}.python")
            graphs[name] = replace(graphs[name], python=code)
    return graphs


# Extend warm-up shapes (tokens, requests): Triton specializes integer arguments by value class
# (== 1, divisible by 16, other), so each class of T and B must run once for the cache to cover
# every launch the runtime can make; steps of at most 16 tokens a request go to verify attention
# instead (ops/attention/paged.py), whose one varying parameter, tokens per program (1, 2, 4, 8, 16:
# ops/attention/verify.py ``qtile``), each of these reaches.
EXTEND_WARMUP = (
    (1, 1),
    (2, 1),
    (2, 2),
    (4, 1),
    (16, 1),
    (16, 2),
    (16, 16),
    (17, 1),
    (17, 3),
    (17, 16),
    (32, 16),
    (33, 1),
    (48, 3),
)


def _warm_up(
    modules: dict[str, Any],
    graphs: dict[str, GraphEntry],
    weights: dict[str, torch.Tensor],
    cache: CacheSpec,
    cfg: ModelConfig,
    device: torch.device,
    buckets: tuple[int, ...],
    max_blocks: int,
    chunk: int,
    moe_table: str = "",
    par: ParallelConfig | None = None,
    verify: VerifySpec | None = None,
    tree_shapes: list[tuple[int, int]] | None = None,
) -> None:
    """Run every graph at every shape class the runtime will use (compiling each Triton kernel
    specialization into the cache) and check the logits are finite. ``tree_shapes``: ``(batch,
    tokens)`` of the tree graph's runs (default :func:`_tree_shapes` of ``verify``)."""
    decode_graph = {b: f"decode_b{b}" for b in buckets if f"decode_b{b}" in graphs}
    # (graph, requests, tokens, logits at every token)
    runs = [(decode_graph.get(b, "model"), b, b, False) for b in buckets]  # decode steps: T == B
    # T == B never reaches the extend graph: the runner sends one-token-each extends to decode
    runs += [("model", b, t, False) for t, b in EXTEND_WARMUP if t <= chunk and b <= buckets[-1] and t != b]
    runs += [("model", b, t, True) for b, _, t in _verify_shapes(verify)]  # verify steps
    if Manifest.TREE_GRAPH in graphs:  # tree verify steps (eager): a few shapes, chain masks
        shapes = _tree_shapes(verify) if tree_shapes is None else tree_shapes
        runs += [(Manifest.TREE_GRAPH, b, t, True) for b, t in shapes]
    max_len = max_blocks * cache.page_size  # the longest request

    def prefills(sizes: Iterable[int]) -> list[tuple[str, int, int, bool]]:
        # prefills of t tokens, in as few requests as hold them (a chunk may exceed max_seq_len)
        return [("model", -(-t // max_len), t, False) for t in sizes if 1 < t <= max_len * buckets[-1]]

    if cfg.moe is not None:  # each block-size choice of the grouped GEMM, as one prefill
        from kiln.ops.moe.gemm import moe_warmup_tokens

        e, i = _local_experts(cfg, par or ParallelConfig())
        sizes = moe_warmup_tokens(e, i, cfg.hidden_size, cfg.moe.top_k, chunk, moe_table)
        runs += prefills(sizes)
    if device.type == "cuda" and any(w.dtype == FP8_DTYPE for w in weights.values()):
        # FP8 linears pick a launch config (or cuBLAS) per M bucket (ops/linear/fp8_gemm.py): one prefill
        # per bucket, so that prefill chunks of any length find their kernels compiled
        from kiln.ops.linear import fp8_block, fp8_gemm

        # and for block-FP8 linears (ops/linear/fp8_block.py) one per launch-config bucket
        runs += prefills(sorted(set(fp8_gemm.warmup_tokens(chunk)) | set(fp8_block.warmup_tokens(chunk))))
    if device.type == "cpu":  # no Triton kernels to compile: a finiteness check per graph suffices
        runs = [r for r in runs if r[1] <= 2]
    for name, b, t, every_token in runs:
        ex = example_inputs(
            b,
            t,
            cache,
            cfg.rotary_dim,
            device,
            max_blocks=max_blocks,
            num_slots=max(64, 2 * t),
            rows=max(8, b + 1),
            every_token=every_token,
            tree=name == Manifest.TREE_GRAPH,
        )
        logits = modules[name](weights, *(ex[n] for n in graphs[name].inputs))
        # -inf: an id the model never emits (an EAGLE-3 head's outside its draft vocabulary)
        if not (torch.isfinite(logits) | (logits == float("-inf"))).all():
            raise CompileError(
                f"graph {name} produced non-finite logits during warm-up (batch {b}, tokens {t})"
            )


def _tree_shapes(verify: VerifySpec | None) -> list[tuple[int, int]]:
    """``(batch, tokens)`` the token-tree graph is warmed up at: one request of the shortest and of
    the longest verify length, two requests of the shortest, and the largest verify batch at the
    longest (T of each Triton value class, 1 mod 16 aside: the runtime runs tree steps on these
    verify shapes' captured graphs, or eagerly at any T when none holds the step)."""
    if verify is None:
        return []
    k0, k1, bmax = verify.lengths[0], verify.lengths[-1], verify.buckets[-1]
    shapes = {(1, k0 + 1), (1, k1 + 1), (min(2, bmax), min(2, bmax) * (k0 + 1)), (bmax, bmax * (k1 + 1))}
    return sorted(shapes | tokens_per_program_runs(k1 + 1))


def tokens_per_program_runs(most: int) -> set[tuple[int, int]]:
    """``(1, t)`` runs that reach every tokens-per-program value of verify attention (1, 2, 4, 8, 16:
    ops/attention/verify.py ``qtile``) that steps of up to ``most`` tokens a request can take: an
    eager tree step of any size runs one of them, and each is its own kernel specialization."""
    return {(1, min(q, most)) for q in (1, 2, 4, 8, 16) if q // 2 < most}


def _verify_shapes(verify: VerifySpec | None) -> list[tuple[int, int, int]]:
    """``(batch, k, tokens)`` of every verify graph (``tokens = batch * (k + 1)``)."""
    if verify is None:
        return []
    return [(b, k, b * (k + 1)) for b in verify.buckets for k in verify.lengths]


def _moe_choice(cfg: ModelConfig, opts: CompileOptions, device: torch.device, out: Path) -> dict[str, Any]:
    """The fused-MoE launch table for this artifact (compiler/moe_tune.py), and its backends: the
    CUTLASS library is built into ``out/kernels`` when a rung may use it (compiler/cutlass_build.py)."""
    m = cfg.moe
    assert m is not None
    shape = MoEShape(*_local_experts(cfg, ParallelConfig(opts.tp, opts.ep)), cfg.hidden_size, m.top_k)
    max_tokens = opts.max_tokens
    quant = _experts_quant(opts, cfg)
    measure = opts.moe_tune and quant is None
    backend, lib = cutlass_backend(opts.moe_backend, device, opts.dtype, quant, measure, out / "kernels")
    choice = moe_tuning(
        shape, max_tokens, measure, DTYPES[opts.dtype], device, backend, opts.moe_cutlass_min_tokens, lib
    )
    drop_unused(choice, out)
    return choice


def _experts_quant(opts: CompileOptions, cfg: ModelConfig) -> str | None:
    """The MoE experts' quantization: ``opts.quant``, but for ``fp8-block`` only where the experts
    stay block FP8 (compiler/moe_layer.py ``block_fp8_experts``; else they are up-cast to the
    activation dtype), so their tuning and the CUTLASS path's checks see what the experts are."""
    if opts.quant != "fp8-block":
        return opts.quant
    etp = ParallelConfig(opts.tp, opts.ep).expert_tp
    return "fp8-block" if block_fp8_experts(cfg, etp) is None else None


def _local_experts(cfg: ModelConfig, par: ParallelConfig) -> tuple[int, int]:
    """``(experts, intermediate size)`` of one rank's ``w13``/``w2`` (the shapes the MoE kernels and
    their launch table see): ``E / ep`` experts, ``ceil(I / (tp / ep))`` rows of each."""
    m = cfg.moe
    assert m is not None
    return m.num_experts // par.ep, -(-m.intermediate_size // par.expert_tp)


def _warm_up_sampler(vocab: int, device: torch.device) -> None:
    """Compile the sampling kernels the runtime launches, for each row-count class: the seeded
    sampler's, and the greedy argmax (the sampler's for small batches, and the one each decode
    graph captures under ``KILN_GRAPH_GREEDY``, on the same ``[rows, V]`` float32 rows)."""
    if device.type != "cuda":
        return
    from kiln.ops.sampling.gumbel import argmax_rows, gumbel_argmax

    for rows in (1, 2, 16):
        x = torch.randn(rows, vocab, device=device)
        keys = torch.randint(0, 1 << 31, (rows, 2), dtype=torch.int64, device=device)
        gumbel_argmax(x, keys)
        argmax_rows(x)


def forget_loaded_kernels(modules: Iterable[Any] | None = None) -> int:
    """Drop the in-process caches of every Triton kernel of ``kiln.ops`` (returns how many were
    cleared). A kernel this process already launched is served from memory and never looked up
    on disk, so without this a second compile in one process (tests, notebooks) would leave those
    kernels out of its artifact and the runtime would compile them at load."""
    cleared = 0
    if modules is None:
        modules = [m for n, m in list(sys.modules.items()) if n.startswith("kiln.ops") and m is not None]
    for mod in modules:
        for obj in list(vars(mod).values()):
            caches = getattr(obj, "device_caches", None)
            if caches is None:  # autotuner / heuristics wrappers hold the JITFunction as .fn
                caches = getattr(getattr(obj, "fn", None), "device_caches", None)
            if isinstance(caches, dict) and caches:
                caches.clear()
                cleared += 1
    return cleared


def _build_driver_utils(kernels_dir: Path) -> None:
    """Put Triton's driver helper module (``cuda_utils``, C built with the host compiler) in the
    artifact's cache too. This process may have built it before the cache pointed at the artifact,
    so a fresh process does it here, where the runtime would otherwise do it at load (seen on the
    H200: the only entry the runtime added to the artifact's cache). It inherits ``CC`` from
    :func:`_reproducible_c_builds`."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(kernels_dir.resolve()))
    code = "import triton; triton.runtime.driver.active.utils"
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        err = p.stderr.strip()[-500:] if p.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        err = str(e)
    if err:
        warnings.warn(
            f"kiln compile: Triton's driver helper was not built into the artifact ({err})", stacklevel=2
        )


@contextlib.contextmanager
def _reproducible_c_builds() -> Iterator[None]:
    """Inside the block, Triton builds its C modules (the driver helper, kernel launchers) with a
    compiler wrapper (``CC``, which Triton runs as ``$CC SRC ...`` with SRC in a fresh temporary
    directory) that maps SRC's directory to ``.`` in what it embeds (``__FILE__``): otherwise
    ``cuda_utils`` holds that random path (seen on the H200: the one file two compiles of the same
    checkpoint wrote differently). Without a C compiler, nothing changes."""
    old = os.environ.get("CC")
    real = old or shutil.which("gcc") or shutil.which("clang")
    with tempfile.TemporaryDirectory(prefix="kiln-cc-") as tmp:
        if real is not None:
            script = Path(tmp) / "cc"
            script.write_text(
                f'#!/bin/sh\nexec {shlex.quote(real)} "-ffile-prefix-map=$(dirname "$1")=." "$@"\n'
            )
            script.chmod(0o755)
            os.environ["CC"] = str(script)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("CC", None)
            else:
                os.environ["CC"] = old


# kernel_choices entries that differ between two compiles of the same inputs: where a CUTLASS
# library came from (prebuilt, build cache or nvcc) and how long that took, and the timings of a
# measured MoE tuning. They go to the build log.
BUILD_FACTS = {
    "moe": ("report",),
    "moe.cutlass": ("build", "build_seconds"),
    "fp8": ("build", "build_seconds"),
}


def split_build_facts(kernel_choices: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(kernel_choices without the BUILD_FACTS, those facts at the same paths)``."""
    kept = copy.deepcopy(kernel_choices)
    facts: dict[str, Any] = {}
    for path, keys in BUILD_FACTS.items():
        src: Any = kept
        dst = facts
        for part in path.split("."):
            src = src.get(part) if isinstance(src, dict) else None
        if not isinstance(src, dict):
            continue
        for key in keys:
            if key in src:
                for part in path.split("."):
                    dst = dst.setdefault(part, {})
                dst[key] = src.pop(key)
    return kept, facts
