"""Fold a pytest-benchmark JSON (the kernel suite) into a results file with the environment and
print a short table: each kernel's time and its fraction of the ceilings measured in the run.

    python bench/report.py RAW.json OUT.json --command "..."
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("out")
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    with open(a.raw) as f:
        raw = json.load(f)
    rows = []
    for b in raw["benchmarks"]:
        x = b.get("extra_info", {})
        rows.append({"name": b["fullname"].split("::")[-1], "file": b["fullname"].split("::")[0], **x})
    mi = raw.get("machine_info", {})
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "command": a.command,
        "cpu": mi.get("cpu", {}).get("brand_raw"),
        "python": mi.get("python_version"),
    }
    try:
        import torch
        import triton

        env |= {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        }
    except ImportError:
        pass
    ceil = next((r for r in rows if "ceiling_read_gbps" in r), {})
    report = {
        "env": env,
        "results": rows,
        "ceilings": {
            "read_gbps": ceil.get("ceiling_read_gbps"),
            "bf16_tflops": ceil.get("ceiling_bf16_tflops"),
        },
    }
    spec = speculative_table(rows)
    if spec:
        report["speculative_computed"] = spec
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"ceilings: read {ceil.get('ceiling_read_gbps', float('nan')):.0f} GB/s, "
        f"bf16 {ceil.get('ceiling_bf16_tflops', float('nan')):.0f} TFLOP/s"
    )
    for r in rows:
        if "ms" not in r:
            continue
        f = r.get("frac_bw", r.get("frac_mm"))
        kind = "bw" if "frac_bw" in r else "mm"
        extra = f" x{r['speedup_vs_bf16']:.2f}" if "speedup_vs_bf16" in r else ""
        print(f"{r['name'][:70]:<70} {r['ms']:>9.4f} ms {'' if f is None else f'{f:6.1%} {kind}'}{extra}")


def speculative_table(rows: list[dict]) -> list[dict]:
    """Issue 30's figures from test_bench_decode_step.py's ``test_verify_step`` (plan ``gemv``: what
    an artifact's verify graphs run) and ``test_draft_step`` rows, per batch: verify(k) / decode, and
    per draft source the tok/s at acceptance length L (tokens per verify step) = ``B L / (t_verify(4)
    + 4 t_draft)``, COMPUTED from the measured step costs (random weights accept nothing real),
    beside plain decoding's ``B / t_decode``. Printed, and returned for the results file."""
    ver = {
        (r["batch"], r["drafts"]): r["ms"]
        for r in rows
        if "drafts" in r and r.get("plan") == "gemv" and "ms" in r
    }
    drafts = {(r["batch"], r["draft"]): r["ms"] for r in rows if "draft" in r and "ms" in r}
    out = []
    for b in sorted({b for b, _ in ver}):
        dec = ver.get((b, 0))
        if dec is None:
            continue
        row: dict = {"batch": b, "decode_ms": dec, "plain_tok_s": b / dec * 1e3}
        row |= {f"verify{k}_over_decode": ver[(b, k)] / dec for k in (2, 4, 8) if (b, k) in ver}
        for (db, name), t in sorted(drafts.items()):
            if db == b and (b, 4) in ver:
                row[f"{name}_draft_ms"] = t
                for L in (2, 3, 4):
                    row[f"{name}_L{L}_tok_s_computed"] = b * L / (ver[(b, 4)] + 4 * t) * 1e3
        out.append(row)
    for row in out:
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return out


if __name__ == "__main__":
    main()
