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
``--engine-ngram K`` profiles whole engine steps instead (``eng.step()`` with n-gram speculation of
K drafts on prompts that hold their continuation, :func:`kiln.runtime.benchmark.cycle_prompts`: on
a successor checkpoint every step is a verify step), CUDA graphs and overlap as served: per step its
wall time, the GPU's kernel time and the host parts (``Engine.host_breakdown``), so the time a
verify step spends outside its forward shows. ``--engine-draft K`` does the same with the
artifact's draft (a draft model, an EAGLE-3 head or an MTP layer: ``--speculative draft``). Both
then also run the same number of steps under cProfile and list the host functions that took
longest (cumulative), so the host path of a speculative step can be read function by function.
``--engine-extend N`` profiles whole prefill steps the same way: one N-token prompt at a time
beside ``--batch-sizes`` decoding requests, ``--mixed off,on`` a run with mixed steps off and on.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kiln import LLM, SamplingParams
from kiln.runtime.benchmark import cycle_prompts, random_prompts
from kiln.runtime.step_stats import KINDS


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
    ap.add_argument(
        "--engine-ngram", type=int, default=0, help="K > 0: whole engine steps, n-gram drafts of K"
    )
    ap.add_argument(
        "--engine-draft",
        type=int,
        default=0,
        help="K > 0: whole engine steps, the artifact's draft, K drafts",
    )
    ap.add_argument(
        "--engine-extend",
        type=int,
        default=0,
        help="N > 0: whole engine prefill steps of one N-token prompt each beside --batch-sizes decoding requests",
    )
    ap.add_argument(
        "--mixed", default="off", help="with --engine-extend: mixed steps off, on or off,on (a run each)"
    )
    ap.add_argument("--kv-memory", type=float, default=40, help="KV pool GiB of the --engine-* modes")
    a = ap.parse_args()
    if a.engine_extend:
        result = {}
        for m in a.mixed.split(","):
            for b in (int(x) for x in a.batch_sizes.split(",")):
                result[f"{b}-mixed-{m}"] = profile_extend_steps(
                    a.artifact, b, a.context, a.steps, a.engine_extend, m == "on", a.kv_memory
                )
                gc.collect()  # the engine goes before the next sizes its pool
                torch.cuda.empty_cache()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    if a.engine_ngram or a.engine_draft:
        source, k = ("draft", a.engine_draft) if a.engine_draft else ("ngram", a.engine_ngram)
        result = {str(b): profile_engine_steps(a.artifact, b, a.context, a.steps, k, a.kv_memory, source)
                  for b in (int(x) for x in a.batch_sizes.split(","))}  # fmt: skip
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        return
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


def profile_engine_steps(
    artifact: str, batch: int, context: int, steps: int, k: int, kv_gib: float = 40, source: str = "ngram"
) -> dict:
    """``steps`` engine steps of ``batch`` greedy requests on cycle prompts of ``context`` tokens
    with ``source`` drafts (``ngram``, or ``draft``: the artifact's) of ``k`` (after two warm
    steps), under torch.profiler: per step the wall time, the GPU kernel time and the host parts,
    and the costliest kernels; then as many steps under cProfile: the host functions by
    cumulative time."""
    # every step verifies (the measured policy would decode some plainly): a verify step is profiled
    llm = LLM(
        artifact, kv_memory_gib=kv_gib, speculative=source, num_draft_tokens=k, speculative_policy="always"
    )
    eng = llm.engine
    out_len = (2 * steps + 4) * (k + 1)
    prompts = cycle_prompts(llm, batch, max(context, 2 * out_len + 1), out_len)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
    while any(r.prefilling for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(2):
        eng.step()
    verified = eng.spec_stats.steps
    out = _profile_window(eng, steps, eng.step)
    out["verify_steps"] = eng.spec_stats.steps - verified
    print(f"\nbatch {batch}, {source} k {k}: {out['verify_steps']} of {steps} steps verified")
    _print_window(out)
    eng.run_until_done()
    return out


def profile_extend_steps(
    artifact: str, batch: int, context: int, steps: int, chunk: int, mixed: bool, kv_gib: float = 40
) -> dict:
    """Whole engine steps that prefill one ``chunk``-token prompt each (it asks for one token, so it
    ends with its prefill) beside ``batch`` greedy requests of ``context`` tokens that keep decoding,
    with ``mixed`` steps on or off, CUDA graphs and overlap as served: per step kind the mean wall
    and host time (the engine's step figures), GPU kernel time, host parts, and the host functions
    by cumulative time (cProfile), so the host path of a prefill step can be read function by
    function."""
    llm = LLM(artifact, kv_memory_gib=kv_gib, mixed_steps=mixed, chunk_size=chunk)
    eng = llm.engine
    vocab = eng.vocab_size
    for p in random_prompts(batch, context, vocab):
        eng.add_request(p, SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True))
    while any(r.prefilling for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    seeds = iter(range(1, 10**6))

    def one() -> None:  # one prompt of `chunk` tokens in, stepped until it has been prefilled
        prompt = random_prompts(1, chunk, vocab, seed=next(seeds))[0]
        req = eng.add_request(prompt, SamplingParams(max_tokens=1))
        while not req.finished:
            eng.step()

    for _ in range(3):
        one()
    out = _profile_window(eng, steps, one)
    print(
        f"\nbatch {batch} decoding, one {chunk}-token prompt at a time, mixed steps {'on' if mixed else 'off'}"
    )
    _print_window(out)
    for r in list(eng.scheduler.running):
        eng.abort(r.rid)
    eng.run_until_done()
    eng.close()
    return out


def _profile_window(eng, steps: int, run: Callable[[], object]) -> dict:
    """``steps`` calls of ``run`` under torch.profiler, then as many under cProfile: wall time per
    call, GPU kernel time per call and the costliest kernels, the engine's step figures by kind over
    the first window (steps, mean batch, wall and host ms a step), host parts (ms per call) and the
    host functions by cumulative time (ms per call)."""
    hb = eng.host_breakdown
    before = dict(hb)
    eng.reset_step_stats()  # the engine's own step figures, over the window
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time / steps
    keys = ("steps", "mean_batch", "step_ms", "host_ms_per_step", "tokens_per_step")
    m = eng.step_metrics()
    kinds = {k: {f: m[k][f] for f in keys} for k in KINDS if m[k]["steps"]}
    out = {
        "wall_ms_per_step": 1e3 * wall / steps,
        "gpu_kernel_ms_per_step": sum(per.values()) / 1e3,
        "host_ms_per_step_by_part": {name: 1e3 * (hb[name] - before[name]) / steps for name in hb},
        "step_kinds": kinds,
        "top": sorted(per.items(), key=lambda kv: -kv[1])[:20],
    }
    prof_host = cProfile.Profile()
    prof_host.enable()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    prof_host.disable()
    stats: dict = pstats.Stats(prof_host).stats  # type: ignore[attr-defined]
    rows = [
        (f"{Path(f).name}:{line}({fn})", ct / steps * 1e3, tt / steps * 1e3, nc / steps)
        for (f, line, fn), (_, nc, tt, ct, _) in stats.items()
    ]
    out["host_top_cumulative_ms"] = sorted(rows, key=lambda r: -r[1])[:40]
    out["host_top_own_ms"] = sorted(rows, key=lambda r: -r[2])[:25]
    return out


def _print_window(out: dict) -> None:
    parts = out["host_ms_per_step_by_part"]
    print(
        f"wall {out['wall_ms_per_step']:.3f} ms a call, GPU kernels {out['gpu_kernel_ms_per_step']:.3f} ms; "
        "host parts (ms): " + ", ".join(f"{n} {v:.3f}" for n, v in parts.items())
    )
    for kind, f in out["step_kinds"].items():
        print(f"  {kind}: {f['steps']} steps, batch {f['mean_batch']:.1f}, {f['tokens_per_step']:.0f} tokens, "
              f"{f['step_ms']:.2f} ms a step ({f['host_ms_per_step']:.2f} host)")  # fmt: skip
    for name, us in out["top"]:
        print(f"  {us:9.1f} us  {name[:90]}")
    print("  host, per call (cumulative ms, own ms, calls):")
    for name, cum, own, calls in out["host_top_cumulative_ms"][:30]:
        print(f"  {cum:8.3f} {own:8.3f} {calls:6.1f}  {name[:90]}")
    print("  host, by own time:")
    for name, cum, own, calls in out["host_top_own_ms"][:15]:
        print(f"  {cum:8.3f} {own:8.3f} {calls:6.1f}  {name[:90]}")


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
