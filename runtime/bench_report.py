"""Merging ``kiln bench`` results (latency, throughput, start-up, kernel suite) into one report,
with a plot: decode tokens/s against batch size beside the roofline and Hugging Face, and
throughput bars."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def merge(parts: dict[str, str | None]) -> dict[str, Any]:
    """``{"latency": path, ...}`` -> one dict holding each part's JSON (missing parts skipped)."""
    out: dict[str, Any] = {}
    for name, path in parts.items():
        if path:
            out[name] = json.loads(Path(path).read_text())
    return out


def ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """kiln/HF ratios for every latency figure measured on both."""
    lat = report.get("latency", {})
    hf = lat.get("hf", {})
    rows = []
    for r in lat.get("kiln", []):
        h = hf.get(str(r["batch"]))
        if h:
            rows.append(
                {
                    "batch": r["batch"],
                    "decode_tok_s": r["decode_tok_s"] / h["decode_tok_s"],
                    "ttft": h["ttft_s"] / r["ttft_s"],
                    "itl": h["itl_ms"] / r["itl_ms"],
                }
            )
    return rows


def speculation(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The latency rows that ran with speculative decoding on (``kiln bench latency --speculative
    ngram``): batch, decode tokens/s, drafts accepted / proposed, tokens a request gained per
    verify step and the verify steps (runtime/benchmark.py ``LatencyResult``)."""
    keys = ("batch", "decode_tok_s", "spec_acceptance_rate", "spec_mean_emitted", "verify_steps")
    rows = report.get("latency", {}).get("kiln", [])
    return [{k: r[k] for k in keys} for r in rows if r.get("verify_steps") is not None]


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = report.get("latency", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    rows = lat.get("kiln", [])
    if rows:
        b = [r["batch"] for r in rows]
        ax.plot(b, [r["decode_tok_s"] for r in rows], "o-", label="kiln")
        ax.plot(b, [r["roofline_tok_s"] for r in rows], "k--", label="roofline (bytes / read bandwidth)")
        hf = lat.get("hf", {})
        if hf:
            ax.plot(
                [int(k) for k in hf], [v["decode_tok_s"] for v in hf.values()], "s-", label="HF transformers"
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"decode, input {rows[0]['input_len']}, output {rows[0]['output_len']}")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    bars: dict[str, float] = {}
    tp = report.get("throughput", {}).get("kiln")
    if tp:
        bars["kiln output tok/s"] = tp["output_tok_s"]
        bars["kiln input tok/s"] = tp["input_tok_s"]
    kern = report.get("kernels", {}).get("results", [])
    if bars:
        ax.bar(list(bars), list(bars.values()))
        ax.set_title("offline throughput")
    elif kern:
        best = [k for k in kern if "frac_bw" in k or "frac_mm" in k][:20]
        ax.barh([k["name"][:40] for k in best], [k.get("frac_bw", k.get("frac_mm", 0)) for k in best])
        ax.set_title("kernels: fraction of ceiling")
    else:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
