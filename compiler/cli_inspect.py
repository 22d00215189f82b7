"""``kiln inspect``: what a checkpoint is and what serving it costs, before touching a GPU."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import click

from kiln.compiler.config import ConfigError, ModelConfig, load_config, resolve_quant
from kiln.compiler.parallel import ParallelConfig, kv_capacity_tokens, per_rank_shapes, validate_parallel

GIB = 1024**3
DTYPES = ("bfloat16", "float16", "float32", "fp8")


def bundled_configs() -> dict[str, Path]:
    """Configs shipped with kiln (published config.json files), by short name."""
    root = resources.files("kiln.compiler") / "configs"
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".json")}


def resolve_model_arg(arg: str) -> Path:
    """A model directory, a config.json path, the name of a bundled config, or a Hugging Face
    model id ``org/name`` (its config only is downloaded: kiln/hub.py)."""
    from kiln.hub import is_hub_id, resolve_checkpoint

    p = Path(arg)
    if (p / "manifest.json").is_file():  # an artifact: its config is the checkpoint's
        import json

        log = p / "build-log.json"
        source = json.loads(log.read_text()).get("source") if log.is_file() else None
        raise ConfigError(
            f"{arg} is a kiln artifact; kiln inspect reads a checkpoint's config: pass the checkpoint it "
            f"was compiled from{f' ({source})' if source else ''}"
        )
    if p.exists():
        return p
    bundled = bundled_configs()
    if arg in bundled:
        return bundled[arg]
    if "/" in arg and is_hub_id(arg):
        return resolve_checkpoint(arg, progress=False, config_only=True)
    raise ConfigError(
        f"{arg!r} is neither a path nor a bundled config. Bundled: {', '.join(sorted(bundled))}."
    )


def inspect_report(
    cfg: ModelConfig,
    tp: int = 1,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    kv_memory_gib: float | None = None,
) -> dict[str, Any]:
    """Everything ``kiln inspect`` prints, as a JSON-ready dict."""
    validate_parallel(cfg, ParallelConfig(tp=tp))
    kv_dtype = kv_dtype or ("bfloat16" if dtype == "fp8" else dtype)
    report: dict[str, Any] = {
        "architecture": cfg.architecture,
        "model_type": cfg.model_type,
        "attention": cfg.attention,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rotary_dim": cfg.rotary_dim,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": asdict(cfg.rope_scaling),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "intermediate_size": cfg.intermediate_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "qkv_bias": cfg.qkv_bias,
        "qk_norm": cfg.qk_norm,
        "sliding_window": cfg.sliding_window,
        "moe": asdict(cfg.moe) if cfg.moe else None,
        "mla": asdict(cfg.mla) if cfg.mla else None,
        "num_params": cfg.num_params,
        "num_activated_params": cfg.num_activated_params,
        "tp": tp,
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "weight_bytes": cfg.weight_bytes(dtype, tp),
        "kv_heads_per_rank": cfg.kv_heads_per_rank(tp) if cfg.mla is None else None,
        "kv_bytes_per_token": cfg.kv_bytes_per_token(kv_dtype, tp),
        "per_rank_shapes": per_rank_shapes(cfg, tp),
        **_quantization(cfg, tp),
    }
    if kv_memory_gib is not None:
        report["kv_memory_gib"] = kv_memory_gib
        report["kv_capacity_tokens"] = kv_capacity_tokens(cfg, int(kv_memory_gib * GIB), kv_dtype, tp)
    return report


def _quantization(cfg: ModelConfig, tp: int) -> dict[str, Any]:
    """The checkpoint's own FP8 format (config.json ``quantization_config``), what ``kiln compile``
    makes of it without ``--quant`` (compiler/config.py ``resolve_quant``; or why it refuses) and,
    for ``fp8-block``, the weight bytes per rank it packs."""
    out: dict[str, Any] = {"checkpoint_quant": asdict(cfg.fp8_checkpoint) if cfg.fp8_checkpoint else None}
    try:
        out["compile_quant"] = resolve_quant(None, cfg)
    except ConfigError as err:
        out["compile_quant"] = None
        out["compile_quant_error"] = str(err)
    if out["compile_quant"] == "fp8-block":
        out["compile_weight_bytes"] = cfg.weight_bytes("fp8-block", tp)
        if cfg.moe is not None:
            from kiln.compiler.moe_layer import block_fp8_experts  # (torch modules: only when asked)

            why = block_fp8_experts(cfg, tp)  # expert tp = tp without --ep
            out["compile_experts"] = "block FP8" if why is None else f"up-cast to --dtype: {why}"
    return out


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.2f} {prefix}{unit}" if prefix else f"{int(n)} {unit}"
        n /= 1024
    return str(n)


def format_report(r: dict[str, Any]) -> str:
    moe = r["moe"]
    mla = r["mla"]
    rows: list[tuple[str, str]] = [
        ("architecture", f"{r['architecture']} ({r['model_type']})"),
        ("attention", r["attention"]),
        ("layers x hidden", f"{r['num_layers']} x {r['hidden_size']}"),
        (
            "heads / kv heads",
            f"{r['num_heads']} / {r['num_kv_heads']} (head_dim {r['head_dim']}, "
            f"v_head_dim {r['v_head_dim']})",
        ),
        (
            "rotary",
            f"dim {r['rotary_dim']}, theta {r['rope_theta']:g}, scaling {r['rope_scaling']['type']}"
            + (f" x{r['rope_scaling']['factor']:g}" if r["rope_scaling"]["type"] != "default" else ""),
        ),
        ("vocab", f"{r['vocab_size']} ({'tied' if r['tie_word_embeddings'] else 'untied'} embeddings)"),
        ("qkv bias / qk-norm", f"{r['qkv_bias']} / {r['qk_norm']}"),
        ("sliding window", str(r["sliding_window"])),
    ]
    if moe:
        rows.append(
            (
                "moe",
                f"{moe['num_experts']} experts, top-{moe['top_k']}, intermediate "
                f"{moe['intermediate_size']}, shared {moe['num_shared_experts']}, "
                f"{moe['scoring_func']}, norm_topk {moe['norm_topk_prob']}",
            )
        )
    if mla:
        rows.append(
            (
                "mla",
                f"q_lora {mla['q_lora_rank']}, kv_lora {mla['kv_lora_rank']}, nope "
                f"{mla['qk_nope_head_dim']}, rope {mla['qk_rope_head_dim']}, v {mla['v_head_dim']}",
            )
        )
    ckpt = r.get("checkpoint_quant")
    if ckpt:
        block = ckpt["weight_block_size"]
        fmt = f"{block[0]}x{block[1]} block scales" if block else "per-tensor scales"
        how = r.get("compile_quant_error") or (
            f"kiln compile keeps it as quant {r['compile_quant']}"
            if r.get("compile_quant")
            else "kiln compile up-casts it to --dtype"
        )
        rows.append(("checkpoint quantization", f"fp8 e4m3 weights, {fmt}; {how}"))
        if "compile_experts" in r:
            rows.append(("routed experts (fp8-block)", r["compile_experts"]))
    rows += [
        ("parameters", f"{r['num_params'] / 1e9:.3f} B ({r['num_activated_params'] / 1e9:.3f} B activated)"),
        (f"weights / rank (tp={r['tp']}, {r['dtype']})", _human(r["weight_bytes"])),
        *(
            [(f"weights / rank (tp={r['tp']}, fp8-block)", _human(r["compile_weight_bytes"]))]
            if "compile_weight_bytes" in r
            else []
        ),
        (f"KV / token / rank ({r['kv_dtype']})", f"{r['kv_bytes_per_token']} B"),
    ]
    if "kv_capacity_tokens" in r:
        rows.append((f"KV capacity in {r['kv_memory_gib']:g} GiB", f"{r['kv_capacity_tokens']:,} tokens"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("per-rank shapes:")
    lines += [f"  {k:<{width - 2}}  {v}" for k, v in r["per_rank_shapes"].items()]
    return "\n".join(lines)


@click.command("inspect")
@click.argument("model", metavar="MODEL")
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel size to check and shard for.")
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="bfloat16",
    show_default=True,
    help="Weight dtype (fp8: GEMM weights in e4m3, the rest in bf16).",
)
@click.option(
    "--kv-dtype",
    type=click.Choice(DTYPES),
    default=None,
    help="KV-cache dtype [default: the weight dtype; bfloat16 when --dtype fp8].",
)
@click.option(
    "--kv-memory",
    type=float,
    default=None,
    metavar="GiB",
    help="Report how many tokens of KV fit in this much memory per rank.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def inspect_cmd(
    model: str, tp: int, dtype: str, kv_dtype: str | None, kv_memory: float | None, as_json: bool
) -> None:
    """Normalize MODEL's config.json and report per-rank shapes, weight bytes,
    KV bytes per token and KV capacity.

    MODEL is a Hugging Face model directory, a config.json path, the name of a bundled config
    (llama-3.1-8b, qwen3-30b-a3b, deepseek-v3, ...), or a Hub model id such as
    meta-llama/Llama-3.1-8B (only its config.json is downloaded).
    """
    if kv_memory is not None and kv_memory <= 0:
        raise click.BadParameter("must be > 0", param_hint="--kv-memory")
    cfg = load_config(resolve_model_arg(model))
    report = inspect_report(cfg, tp=tp, dtype=dtype, kv_dtype=kv_dtype, kv_memory_gib=kv_memory)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
