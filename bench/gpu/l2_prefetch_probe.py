"""Does the sm_90 bulk L2 prefetch (ops/l2_prefetch.py) make a later GEMV read from L2?

Eager launches under the profiler, so each figure is the GEMV kernel's own duration (CUPTI):

* ``cold``: L2 flushed (a 256 MiB write), then the GEMV;
* ``warm``: the GEMV right after the same GEMV (its weights in L2 as far as they fit);
* ``pf{P}_s{S}``: flush, ``prefetch_l2`` with ``P`` programs, a ``S`` us sleep, the GEMV (how fast
  the prefetch fills L2, and how many programs it needs);
* ``evict{MB}``: flush, prefetch, 10 us, then ``MB`` MiB streamed by an aten sum, then the GEMV
  (whether the prefetched lines survive a stream like the experts' between them).

Shape: Qwen3-30B-A3B's o projection ``[2048, 4096]`` bf16 (16.8 MB) at one token, kiln's GEMV.
Usage: python bench/gpu/l2_prefetch_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import kiln.ops  # noqa: F401
from kiln.ops.l2_prefetch import prefetch_l2

CLOCK_GHZ = 1.98  # H200 boost clock, for torch.cuda._sleep's cycles


def _durations(fn, reps: int, match: str) -> list[float]:
    """Run ``fn`` ``reps`` times under the profiler: the last kernel per rep whose name has ``match``."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and match in e.name]
    return [e.device_time for e in evs[-reps:]]  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = "cuda"
    w = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    streams = {mb: torch.ones(mb << 19, dtype=torch.bfloat16, device=dev) for mb in (16, 32, 64, 96)}

    def gemv():
        return torch.ops.kiln.linear(x, w, None, 1)

    def sleep(us: float):
        if us > 0:
            torch.cuda._sleep(int(us * CLOCK_GHZ * 1e3))

    res: dict[str, dict] = {}

    def case(name: str, fn) -> None:
        d = _durations(fn, a.reps, "gemv")
        res[name] = {"median_us": statistics.median(d), "min_us": min(d), "n": len(d)}
        print(f"{name:16s} {res[name]['median_us']:7.2f} us  (min {res[name]['min_us']:.2f})", flush=True)

    case("cold", lambda: (flush.zero_(), gemv()))
    case("cold_sleep10", lambda: (flush.zero_(), sleep(10), gemv()))
    case("warm", lambda: (gemv(), gemv()))
    for p in (1, 4, 16, 64, 132):
        for s in (0, 3, 6, 10, 20):
            case(f"pf{p}_s{s}", lambda p=p, s=s: (flush.zero_(), prefetch_l2([w], p), sleep(s), gemv()))
    for mb, buf in streams.items():
        case(
            f"evict{mb}",
            lambda buf=buf: (flush.zero_(), prefetch_l2([w], 64), sleep(10), buf.sum(), gemv()),
        )
    gbytes = w.numel() * w.element_size() / 1e9
    for r in res.values():
        r["gbps"] = gbytes / (r["median_us"] * 1e-6)
    out = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "weight_bytes": w.numel() * w.element_size(),
        "cases": res,
    }
    json.dump(out, open(a.json, "w"), indent=1)
    print(f"{'case':16s} {'us':>7s} {'GB/s':>7s}")
    for k, r in res.items():
        print(f"{k:16s} {r['median_us']:7.2f} {r['gbps']:7.0f}")


if __name__ == "__main__":
    main()
