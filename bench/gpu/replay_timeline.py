"""Where a CUDA-graph decode step goes: each graph kernel's share of the critical path, and what runs
between two replays.

    python bench/gpu/replay_timeline.py ART --json OUT.json [--batch 1] [--steps 16]

``bench/gpu/profile_decode.py`` runs the graph eagerly, so its durations are each kernel's own. Here
the engine decodes as ``kiln bench latency`` does (CUDA graphs, overlapped steps) under
torch.profiler, whose CUDA trace records the kernels inside each replay. A kernel of the graph
tied to a ``cudaGraphLaunch`` by its correlation id is a graph kernel; anything else on the device
(the sampler's argmax, the step-input copies) is outside it.

With programmatic dependent launch a graph kernel starts early and waits, so its start and duration
say little. Its *end* is what counts: each kernel ends after the one before it (it waits for it), so
``end[i] - end[i - 1]`` is what kernel i adds to the step. Summed by kernel name (per layer where a
name repeats per layer), that is the step's critical path by kernel. Tracing may perturb the
replay: compare the traced step span with the untraced ITL of ``kiln bench latency``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from profile_decode import profile_decode_steps  # bench/gpu, beside this script
from torch.profiler import ProfilerActivity

from kiln import LLM


def _device_events(trace: dict) -> tuple[list[dict], set[int]]:
    """(device events: kernels, copies, sets; sorted by start) and the graph launches' correlation ids."""
    evs, graph_corr = [], set()
    for e in trace["traceEvents"]:
        cat = e.get("cat", "")
        if cat == "cuda_runtime" and e.get("name") == "cudaGraphLaunch":
            graph_corr.add(e["args"]["correlation"])
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            evs.append(e)
    evs.sort(key=lambda e: e["ts"])
    return evs, graph_corr


def _steps(evs: list[dict], graph_corr: set[int]) -> list[dict]:
    """One entry per replay: its kernels and what ran on the device after it, before the next one."""
    steps: list[dict] = []
    for e in evs:
        in_graph = e["args"].get("correlation") in graph_corr
        corr = e["args"].get("correlation")
        if in_graph and (not steps or steps[-1]["corr"] != corr):
            steps.append({"corr": corr, "kernels": [], "between": []})
        if not steps:
            continue
        (steps[-1]["kernels"] if in_graph else steps[-1]["between"]).append(e)
    return steps


def _short(name: str) -> str:
    return name.split("(")[0][:70]


def analyse(trace: dict, layers: int) -> dict:
    evs, graph_corr = _device_events(trace)
    steps = _steps(evs, graph_corr)[1:-1]  # whole replays with a replay after them
    if not steps:
        raise SystemExit("no CUDA-graph replay in the trace (was the engine built with cuda_graph=True?)")
    crit: dict[str, float] = defaultdict(float)
    own: dict[str, float] = defaultdict(float)
    spans, periods, between = [], [], defaultdict(float)
    names = [_short(k["name"]) for k in steps[0]["kernels"]]
    seq_crit = [0.0] * len(names)  # by launch index, over the replays with the first one's kernels
    for s, nxt in zip(steps, steps[1:] + [None], strict=False):
        ks = s["kernels"]
        t0 = prev_end = ks[0]["ts"]
        for i, k in enumerate(ks):
            end = k["ts"] + k["dur"]
            adds = max(0.0, end - prev_end)
            crit[_short(k["name"])] += adds
            own[_short(k["name"])] += k["dur"]
            if len(ks) == len(names):
                seq_crit[i] += adds
            prev_end = max(prev_end, end)
        spans.append(prev_end - t0)
        if nxt is not None:
            periods.append(nxt["kernels"][0]["ts"] - t0)
        for b in s["between"]:
            between[_short(b["name"])] += b["dur"]
    n = len(steps)
    seq_crit = [c / n for c in seq_crit]
    p, lo = _layer_period(names, layers)
    rows = sorted(((name, crit[name] / n, own[name] / n) for name in crit), key=lambda r: -r[1])
    return {
        "steps": n,
        "kernels_per_step": len(steps[0]["kernels"]),
        "graph_span_us": sum(spans) / n,
        "step_period_us": sum(periods) / max(1, len(periods)),
        "critical_path_us": [(name, round(c, 2), round(o, 2), round(c / layers, 2)) for name, c, o in rows],
        "between_replays_us": {k: round(v / n, 2) for k, v in between.items()},
        # one middle layer's kernels in launch order: (name, us this kernel adds to the step)
        "middle_layer": [(names[i], round(seq_crit[i], 2)) for i in range(lo, lo + p)],
        "prologue_epilogue_us": round(sum(seq_crit) - layers * sum(seq_crit[lo : lo + p]), 2),
    }


def _layer_period(names: list[str], layers: int) -> tuple[int, int]:
    """(kernels per layer, the first index of a middle layer): the shortest period that repeats
    the middle of the step's kernel names."""
    mid = len(names) // 2
    for p in range(2, len(names) // max(2, layers) + 2):
        if all(names[j] == names[j + p] for j in range(mid - p, mid)):
            start = mid - p
            while start > 0 and names[start - 1] == names[start - 1 + p]:  # back to the first layer
                start -= 1
            return p, min(start + (layers // 2) * p, start + (len(names) - p - start) // p * p)
    return 1, mid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None, help="per-layer divisor (default: the artifact's)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(a.artifact, kv_memory_gib=40)
    llm.engine.finish_captures()  # no capture inside the traced steps
    eng = llm.engine
    layers = a.layers or eng.pool.num_layers
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]  # CPU: the cudaGraphLaunch calls
    prof = profile_decode_steps(eng, a.batch, a.context, a.steps, warm=4, activities=activities)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        res = analyse(json.loads(path.read_text()), layers)
    eng.run_until_done()
    res |= {"batch": a.batch, "context": a.context, "layers": layers}
    print(
        f"batch {a.batch}: {res['steps']} replays, {res['kernels_per_step']} graph kernels each, graph span "
        f"{res['graph_span_us']:.1f} us, replay to replay {res['step_period_us']:.1f} us"
    )
    print(f"  {'critical us/step':>16} {'own us/step':>11} {'crit us/layer':>13}  kernel")
    for name, c, o, per in res["critical_path_us"][:16]:
        print(f"  {c:16.1f} {o:11.1f} {per:13.2f}  {name}")
    print("  between replays (us/step):", res["between_replays_us"])
    print("  a middle layer, launch order (us it adds to the step):")
    for name, c in res["middle_layer"]:
        print(f"  {c:8.2f}  {name}")
    print(f"  outside the layers: {res['prologue_epilogue_us']:.1f} us")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
