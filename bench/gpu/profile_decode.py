"""Where a decode step's GPU time goes: kernel durations per step by kernel, at given batch sizes.

    python bench/gpu/profile_decode.py ART --batch-sizes 1,64 --json OUT.json

Runs the decode graph eagerly (no CUDA graph) under torch.profiler so each kernel is recorded;
kernel durations are what the CUDA-graph replay runs too, without the launch gaps. With PDL
(ops/common/launch.py) a kernel starts before its predecessor ends, so its duration includes its wait:
``KILN_PDL=0`` gives each kernel's own time. ``--sequence N`` also lists the first N kernels of
the last profiled step in launch order (duration and the gap or overlap to the previous kernel's
end), which tells one layer's GEMVs (qkv, o, router) apart. ``--drafts K`` profiles speculative
verify steps instead (each request's newest token and K random drafts, the eager extend graph that
the verify CUDA graphs capture), to set beside the decode step of the same call.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kiln import LLM, SamplingParams
from kiln.runtime.benchmark import random_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sequence", type=int, default=0, help="list the first N kernels of one step")
    ap.add_argument(
        "--drafts", default="0", help="comma list of K: 0 a decode step, K > 0 a verify step of K drafts"
    )
    a = ap.parse_args()
    # no overlap: a verify step reads each request's newest token, which an overlapped step leaves
    # in flight (the kernels' durations are the same either way)
    llm = LLM(a.artifact, cuda_graph=False, kv_memory_gib=40, overlap=False)
    eng = llm.engine
    result = {}
    cases = [(int(b), int(k)) for b in a.batch_sizes.split(",") for k in a.drafts.split(",")]
    for b, k in cases:
        prof = profile_decode_steps(
            eng, b, a.context, a.steps, warm=2, activities=[ProfilerActivity.CUDA], drafts=k
        )
        per: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] += e.device_time / a.steps  # us per step
        total = sum(per.values())
        top = sorted(per.items(), key=lambda kv: -kv[1])[:14]
        key = f"{b}" if k == 0 else f"{b}-verify{k}"
        result[key] = {"gpu_us_per_step": total, "top": top}
        if a.sequence:
            result[key]["sequence"] = _sequence(prof, a.steps, a.sequence)
        what = "decode step" if k == 0 else f"verify step of {k} drafts"
        print(f"\nbatch {b}: GPU kernel time {total / 1e3:.3f} ms per {what}")
        for name, us in top:
            print(f"  {us:9.1f} us {us / total:6.1%}  {name[:90]}")
        eng.run_until_done()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


def profile_decode_steps(
    eng, batch: int, context: int, steps: int, warm: int, activities, drafts: int = 0
) -> profile:
    """``batch`` greedy requests of ``context`` random tokens, prefilled, ``warm`` decode steps,
    then ``steps`` decode steps under torch.profiler (``activities``): the profiler, finished.
    ``drafts`` > 0: the profiled steps are verify steps of that many random drafts per request, run
    by the runner alone (they write the same slots each time; no token is accepted). The requests
    are left running (``eng.run_until_done()`` ends them)."""
    for p in random_prompts(batch, context, eng.vocab_size):
        eng.add_request(p, SamplingParams(max_tokens=steps + warm + 8, temperature=0.0, ignore_eos=True))
    while any(r.prefilling for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(warm):
        eng.step()
    run = eng.step
    if drafts:
        assert eng.stepper.inflight is None, "verify steps to profile need an engine without overlap"
        reqs = list(eng.scheduler.running)
        guesses = [random_prompts(1, drafts, eng.vocab_size)[0] for _ in reqs]
        held = eng.scheduler.reserve_drafts(reqs, guesses)
        # fresh inputs each step: their host buffers come from the stager's ring
        run = lambda: eng.runner.verify(eng.scheduler.verify_inputs(reqs, held))
        for _ in range(warm):
            run()
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return prof


def _sequence(prof, steps: int, n: int) -> list[tuple[str, float, float]]:
    """The first ``n`` kernels of the last step, in start order: (name, us, us since the previous
    kernel ended; negative = overlap)."""
    evs = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per_step = len(evs) // steps
    last = evs[per_step * (steps - 1) :][:n]
    out, prev_end = [], None
    for e in last:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        out.append((e.name[:60], round(e.device_time, 2), round(gap, 2)))
        prev_end = e.time_range.end
    for name, us, gap in out:
        print(f"  {us:8.2f} us  gap {gap:7.2f}  {name}")
    return out


if __name__ == "__main__":
    main()
