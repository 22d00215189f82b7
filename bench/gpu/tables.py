"""Side-by-side table of a GPU call's ``kiln bench latency`` runs (bench/gpu/e2e.sh, compare.sh).

    python bench/gpu/tables.py RAW

RAW/runs.txt lists the runs, one a line: ``GROUP<TAB>LABEL<TAB>ROUND<TAB>FILE`` (a group is a model
shape; a label is a variant in e2e.sh, a source tree in compare.sh; FILE is ``kiln bench latency
--json``'s report). For each group and batch size it prints a row per label: decode tok/s of each
run in round order, their mean, the spread ((max - min) / mean: the noise to judge a difference
by), the mean against the group's first label, and the means of ITL, host time per step, the
fraction of the roofline and, where a run had ``--compare-hf``, HF's tok/s. The rows also go to
RAW/latency_table.json. A run that wrote no report (cut short, failed) is listed as missing.
Standard library only: it runs before and without kiln.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def read_runs(raw: Path) -> list[dict[str, Any]]:
    """The runs of RAW/runs.txt in order, each with its report (None when absent or unreadable)."""
    runs = []
    index = raw / "runs.txt"
    lines = index.read_text().splitlines() if index.exists() else []
    for line in lines:
        if not line.strip():
            continue
        group, label, rnd, file = line.split("\t")
        try:
            report = json.loads(Path(file).read_text())
        except (OSError, json.JSONDecodeError):
            report = None
        runs.append({"group": group, "label": label, "round": int(rnd), "file": file, "report": report})
    return runs


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (group, batch, label), in the order the runs came."""
    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    missing: list[dict[str, Any]] = []
    for run in runs:
        report = run["report"]
        if not report or not report.get("kiln"):
            missing.append({"group": run["group"], "label": run["label"], "round": run["round"]})
            continue
        for r in report["kiln"]:
            key = (run["group"], int(r["batch"]), run["label"])
            row = rows.setdefault(
                key,
                {"group": key[0], "batch": key[1], "label": key[2], "input_len": r.get("input_len"),
                 "output_len": r.get("output_len"), "tok_s": [], "itl_ms": [], "host_ms": [],
                 "frac_roofline": [], "read_gbps": [], "hf_tok_s": []},
            )  # fmt: skip
            row["tok_s"].append(r["decode_tok_s"])
            row["itl_ms"].append(r["itl_ms"])
            row["host_ms"].append(r["host_ms_per_step"])
            row["frac_roofline"].append(r["frac_roofline"])
            row["read_gbps"].append(report.get("read_gbps"))
            hf = (report.get("hf") or {}).get(str(r["batch"]))
            if hf:
                row["hf_tok_s"].append(hf["decode_tok_s"])
    out = []
    base: dict[tuple[str, int], float] = {}
    for (group, batch, _), row in sorted(rows.items(), key=lambda kv: (_order(runs, kv[0][0]), kv[0][1])):
        t = row["tok_s"]
        row["mean_tok_s"] = _mean(t)
        row["spread"] = (max(t) - min(t)) / row["mean_tok_s"] if len(t) > 1 else None
        ref = base.setdefault((group, batch), row["mean_tok_s"])
        row["vs_first"] = row["mean_tok_s"] / ref - 1
        for k in ("itl_ms", "host_ms", "frac_roofline", "hf_tok_s"):
            row[f"mean_{k}"] = _mean(row[k])
        out.append(row)
    return out + [{"missing": m} for m in missing]


def _order(runs: list[dict[str, Any]], group: str) -> int:
    return next(i for i, r in enumerate(runs) if r["group"] == group)


def render(rows: list[dict[str, Any]]) -> str:
    lines, group = [], None
    w = max([len(r["label"]) for r in rows if "label" in r] + [5])
    for row in rows:
        if "missing" in row:
            m = row["missing"]
            lines.append(f"missing: {m['group']} {m['label']} round {m['round']} (no report)")
            continue
        if row["group"] != group:
            group = row["group"]
            lines.append(f"== {group}: input {row['input_len']}, output {row['output_len']}; decode tok/s")
            lines.append(
                f"{'batch':>5} {'label':<{w}} {'each run':<26} {'mean':>9} {'spread':>7} {'vs 1st':>7} "
                f"{'ITL ms':>7} {'host ms':>7} {'roof':>6} {'HF':>7}"
            )
        each = " ".join(f"{x:.1f}" for x in row["tok_s"])
        spread = f"{row['spread']:.2%}" if row["spread"] is not None else "-"
        hf = f"{row['mean_hf_tok_s']:.1f}" if row["mean_hf_tok_s"] else "-"
        lines.append(
            f"{row['batch']:>5} {row['label']:<{w}} {each:<26} {row['mean_tok_s']:>9.1f} {spread:>7} "
            f"{row['vs_first']:>+7.2%} {row['mean_itl_ms']:>7.3f} {row['mean_host_ms']:>7.3f} "
            f"{row['mean_frac_roofline']:>6.1%} {hf:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python bench/gpu/tables.py RAW", file=sys.stderr)
        return 2
    raw = Path(argv[0])
    rows = table(read_runs(raw))
    (raw / "latency_table.json").write_text(json.dumps(rows, indent=1))
    print(render(rows) if rows else f"no latency runs listed in {raw / 'runs.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
