"""``kiln compile MODEL_DIR -o ART``. The flags of the compile settings (``--gemv-plan``,
``--fold-norms``) are built from their declarations in kiln/settings.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click
import torch

from kiln import settings
from kiln.compiler.build import DTYPES, CompileOptions, compile_model


@click.command("compile")
@click.argument("model_dir", metavar="MODEL")
@click.option(
    "--revision",
    default=None,
    help="Branch, tag or commit of a Hugging Face model id [default: its main branch].",
)
@click.option(
    "-o",
    "--output",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Artifact directory to write.",
)
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default=None,
    help="Device the artifact is built for [default: cuda if present, else cpu].",
)
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default="bfloat16",
    show_default=True,
    help="Activation and weight dtype.",
)
@click.option(
    "--quant",
    type=click.Choice(["fp8", "fp8-block", "none"]),
    default=None,
    help="GEMM weight quantization. Omitted: as the checkpoint is (a 128x128 block-FP8 checkpoint "
    "compiles as fp8-block, others in --dtype); fp8: FP8 per output channel, activations per token; "
    "fp8-block: FP8 in 128x128 blocks, activations per token and 128-column group; none: up-cast an "
    "FP8 checkpoint to --dtype.",
)
@click.option(
    "--tp",
    default=1,
    show_default=True,
    help="Tensor-parallel size: one graph with the collectives in it and a weight pack per rank. "
    "Attention heads, MLPs, the vocabulary and (MoE) each expert's intermediate dim are split over the "
    "ranks; generate / serve / LLM run a --tp N artifact as N processes over torch.distributed, one "
    "per GPU (gloo on CPU).",
)
@click.option(
    "--ep",
    default=1,
    show_default=True,
    help="Expert-parallel size (MoE models): the experts are split into EP groups, each held by TP/EP "
    "ranks that split every expert's intermediate dim; a rank computes its experts' share for every "
    "token and one all-reduce sums the ranks'. Must divide --tp and the number of experts; 1: every "
    "rank holds a slice of every expert.",
)
@click.option(
    "--max-batch-size",
    default=256,
    show_default=True,
    help="Largest decode batch; decode graphs are built for 1, 2, 4, ... up to it.",
)
@click.option(
    "--max-seq-len",
    type=click.IntRange(min=1),
    default=None,
    help="Longest sequence served, above the page size [default: min(max_position_embeddings, 32768)].",
)
@click.option(
    "--chunk-size", default=4096, show_default=True, help="Largest prefill chunk in tokens (chunked prefill)."
)
@click.option(
    "--page-size",
    type=click.Choice(["1", "16"]),
    default="16",
    show_default=True,
    help="KV-cache page size in tokens. 16: a request's keys in runs of 16 cache rows, which decode "
    "attention reads 17-27% faster than single rows scattered over the pool (bench/results "
    "2026-12-04_h200_s17c); the prefix cache then shares whole pages only.",
)
@click.option(
    "--kv-dtype",
    type=click.Choice(["auto", "fp8"]),
    default="auto",
    show_default=True,
    help="KV-cache element type. auto: the activation dtype (--dtype). fp8: e4m3 with one float32 "
    "scale per cached head row, written as the keys and values are: about half the bytes per token, "
    "so twice the tokens in the pool and half the reads of decode attention, for a small accuracy "
    "cost (`kiln bench accuracy` measures it against an auto build).",
)
@click.option(
    "--decode-graphs",
    type=click.Choice(["shared", "per-bucket"]),
    default="shared",
    show_default=True,
    help="shared: the one dynamic-shape graph also serves decode (CUDA graphs are still captured "
    "per bucket), but for batch 1's static graph when the norms are folded (--fold-norms, on by "
    "default); per-bucket: a static graph per decode bucket.",
)
@click.option(
    "--moe-tune",
    is_flag=True,
    help="MoE models on a GPU: time fused-MoE launch configs at a ladder of token counts and record "
    "the fastest per rung in the artifact (default: the op's default table, recorded as well).",
)
@click.option(
    "--moe-backend",
    type=click.Choice(["triton", "cutlass", "auto"]),
    default="triton",
    show_default=True,
    help="MoE expert GEMMs: triton; cutlass (the CUTLASS sm90 grouped GEMM, built with nvcc into the "
    "artifact, for prefill chunks of --moe-cutlass-min-tokens and more; bf16 on an H100/H200); auto "
    "(with --moe-tune: time both per token rung, record the faster).",
)
@click.option(
    "--moe-cutlass-min-tokens",
    default=2048,
    show_default=True,
    help="--moe-backend cutlass: the smallest token count that runs CUTLASS.",
)
@click.option(
    "--fp8-cutlass/--no-fp8-cutlass",
    default=True,
    show_default=True,
    help="--quant fp8 on an H100/H200: build the CUTLASS FP8 GEMM library into the artifact (nvcc and "
    "the nvidia-cutlass headers; one to three minutes, cached) for prefill-sized FP8 linears. "
    "Without it (or when it cannot be built: a warning) they run Triton and cuBLAS.",
)
@click.option(
    "--draft-model",
    default=None,
    metavar="MODEL",
    help="Speculative decoding: a smaller checkpoint of the same tokenizer (a directory or a Hub id) "
    "compiled into ART/draft with this compile's shape options; `serve`/`generate` then draft with it "
    "(--speculative auto). Implies --verify-lengths 4 unless given.",
)
@click.option(
    "--eagle3",
    default=None,
    metavar="HEAD",
    help="Speculative decoding: an EAGLE-3 head trained for this model (LlamaForCausalLMEagle3, "
    "safetensors; a directory or a Hub id) compiled into ART/eagle3; the model's graphs then hand "
    "the head the hidden states of the three layers its config names. `serve`/`generate` draft with "
    "it (--speculative auto). Implies --verify-lengths 4 unless given; not with --draft-model.",
)
@click.option(
    "--mtp",
    is_flag=True,
    help="Speculative decoding: compile a DeepSeek-V3 checkpoint's own next-token-prediction layer "
    "(config.json num_nextn_predict_layers; its weights under model.layers.{num_hidden_layers}) into "
    "ART/mtp; the model's graphs then hand it their last layer's hidden state. `serve`/`generate` "
    "draft with it (--speculative auto). Implies --verify-lengths 4 unless given; with --tp N the layer "
    "is compiled for one rank and drafts on rank 0; not with --draft-model or --eagle3.",
)
@settings.click_options("compile")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
def compile_cmd(
    model_dir: str,
    revision: str | None,
    out: str,
    device: str | None,
    dtype: str,
    quant: str | None,
    tp: int,
    ep: int,
    max_batch_size: int,
    max_seq_len: int | None,
    chunk_size: int,
    page_size: str,
    kv_dtype: str,
    decode_graphs: str,
    moe_tune: bool,
    moe_backend: str,
    moe_cutlass_min_tokens: int,
    fp8_cutlass: bool,
    draft_model: str | None,
    eagle3: str | None,
    mtp: bool,
    force: bool,
    **kw: Any,
) -> None:
    """Compile the Hugging Face checkpoint MODEL (a directory, or a Hub id such as
    meta-llama/Llama-3.1-8B-Instruct: its config, tokenizer and safetensors are downloaded into
    the Hugging Face cache, HF_TOKEN for gated models) into an artifact directory: weight packs
    (fused, sharded, optionally FP8), the decode graph (CUDA graphs are captured per batch bucket
    at load) and the chunked-prefill graph, every Triton kernel precompiled for every bucket,
    the tokenizer, and a manifest with a hash of every file (checked at load). Two compiles of the
    same checkpoint with the same options and versions give the same bytes, but for build-log.json.

    Copy the artifact to any machine with the same GPU architecture and software versions, then
    run `kiln generate ART` or `kiln serve ART`.
    """
    if max_batch_size < 1:
        raise click.BadParameter("must be >= 1", param_hint="--max-batch-size")
    if chunk_size < 2:
        raise click.BadParameter("must be >= 2", param_hint="--chunk-size")
    if moe_cutlass_min_tokens < 1:
        raise click.BadParameter("must be >= 1", param_hint="--moe-cutlass-min-tokens")
    opts = CompileOptions(
        device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
        dtype=dtype,
        quant=quant,
        tp=tp,
        ep=ep,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        chunk_size=chunk_size,
        page_size=int(page_size),
        kv_dtype=kv_dtype,
        decode_graphs=decode_graphs,
        moe_tune=moe_tune,
        moe_backend=moe_backend,
        moe_cutlass_min_tokens=moe_cutlass_min_tokens,
        fp8_cutlass=fp8_cutlass,
        mtp=mtp,
        force=force,
        # --gemv-plan, --fold-norms: given ones only (the others keep CompileOptions' defaults)
        **{k: v for k, v in settings.pop_options(kw, "compile").items() if v is not None},
    )
    from kiln.hub import resolve_checkpoint

    if draft_model is not None:
        opts = replace(opts, draft_model=str(resolve_checkpoint(draft_model, None)))
    if eagle3 is not None:
        opts = replace(opts, eagle3=str(resolve_checkpoint(eagle3, None)))
    compile_model(resolve_checkpoint(model_dir, revision), out, opts)
