"""The decode-sized grouped GEMM (``kiln.fused_moe`` at Qwen3-30B-A3B shapes: E=128, top-8,
H=2048, I=768) timed two ways in one run, both as a share of the read bandwidth measured here:

* ``wall``: an 8-layer chain (distinct weights) in one CUDA graph, time per layer
  (bench/test_bench_moe_decode.py's figure: each layer's launch gaps and ramps included);
* ``kernels``: the same chain launched eagerly under the profiler, the sum of its kernels' own
  durations per layer (CUPTI): the grouped GEMM's kernels by themselves.

Bytes: the experts the layer's tokens hit (w13 and w2 rows) plus the activations.
Usage on the GPU machine (PYTHONPATH as bench/gpu/env.sh sets it):
``python bench/gpu/moe_kernel_time.py --json OUT.json``
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from cuda_kernels import kernel_events

import kiln.ops  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (its conftest, not tests/')
from conftest import _median_ms, graphed, measure_ceilings
from test_bench_moe import TUNING, E, H, I, K, random_experts

LAYERS = 8
REPS = 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", default="1,2,4,8")
    a = ap.parse_args()
    ceil = measure_ceilings()
    g = torch.Generator("cuda").manual_seed(0)
    layers = [random_experts(g) for _ in range(LAYERS)]
    rows = []
    for t in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
        route = lambda r, x=x: torch.ops.kiln.moe_route(
            x, r, None, K, True, "softmax", 1, 1, 1.0, "bfloat16", 0
        )
        routes = [route(r) for _, _, r in layers]  # per layer: (weights [t, k], ids [t, k])
        hit = sum(int(torch.unique(ids).numel()) for _, ids in routes)
        nbytes = hit * 3 * H * I * 2 + LAYERS * 2 * t * H * 2

        def chain(x=x, routes=routes):
            for (w13, w2, _), (w, ids) in zip(layers, routes, strict=True):
                torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, TUNING)

        wall_ms = _median_ms(graphed(chain))
        by_name: dict[str, float] = collections.defaultdict(float)
        for name, us in kernel_events(chain, REPS):
            by_name[name] += us / (REPS * LAYERS)  # us per layer
        kern_us = sum(by_name.values())
        wall_us = wall_ms * 1e3 / LAYERS
        per_layer = nbytes / LAYERS
        row = dict(
            t=t, experts_hit_per_layer=hit / LAYERS, bytes_per_layer=per_layer, wall_us=wall_us,
            kernels_us=kern_us, kernels_by_name_us=dict(by_name),
            frac_bw_wall=per_layer / (wall_us * 1e-6) / 1e9 / ceil.read_gbps,
            frac_bw_kernels=per_layer / (kern_us * 1e-6) / 1e9 / ceil.read_gbps,
        )  # fmt: skip
        rows.append(row)
        fw, fk = 100 * row["frac_bw_wall"], 100 * row["frac_bw_kernels"]
        print(f"T={t}: {hit / LAYERS:.1f} experts/layer, wall {wall_us:.2f} us/layer ({fw:.1f}%), "
              f"kernels {kern_us:.2f} us ({fk:.1f}%)", flush=True)  # fmt: skip
    out = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, read_gbps=ceil.read_gbps, layers=LAYERS,
        shape=dict(E=E, top_k=K, H=H, I=I), tuning="KILN_MOE_TUNING" if TUNING else "default", rows=rows,
    )  # fmt: skip
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
