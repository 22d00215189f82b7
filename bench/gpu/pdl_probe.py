"""Does programmatic dependent launch (PDL) shorten a decode step's chain of small kernels on this
GPU, inside a torch CUDA graph, with this Triton?

A batch-1 decode step is ~350 dependent launches, most of them short (norms, RoPE, attention
pieces) or weight-streaming GEMVs whose first loads do not depend on the previous kernel. With
PDL a kernel calls ``gdc_launch_dependents`` early, so the next kernel's programs are scheduled
while it finishes; the next kernel loads what does not depend on its predecessor (weights), then
``gdc_wait``s before reading the predecessor's output.

Chains timed (CUDA graph replay, per launch):
* ``norm``: L one-row RMSNorm-like kernels, each reading the previous one's output (8 KB rows);
* ``gemv``: L GEMVs (y = W_i x, 4096 x 4096 bf16, distinct W_i, x the previous y), FMA style,
  with and without the weight prefetch before the wait;
* ``mixed``: norm -> gemv -> norm -> gemv ...
each with ``launch_pdl`` off and on. Checks the PDL chain's result equals the plain one.

Usage: python bench/gpu/pdl_probe.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

H = 4096


@triton.jit
def _norm_kernel(X, Y, W, N: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, N)
    w = tl.load(W + offs).to(tl.float32)  # a weight: independent of the predecessor
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + offs).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / N + 1e-6)
    tl.store(Y + offs, (x * r * w).to(Y.dtype.element_ty))


@triton.jit
def _gemv_kernel(X, W, Y, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not PREFETCH:
            tl.extra.cuda.gdc_wait()
    w = tl.load(w_ptrs)
    if PDL and PREFETCH:
        tl.extra.cuda.gdc_wait()  # only x depends on the predecessor: the first W tile is in flight
    for k in range(0, K, BLOCK_K):
        x = tl.load(X + k + ks).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if k + BLOCK_K < K:
            w = tl.load(w_ptrs + k + BLOCK_K)
    tl.store(Y + rows, tl.sum(acc, 1).to(Y.dtype.element_ty))


def _launch_norm(x, y, w, pdl):
    _norm_kernel[(1,)](x, y, w, N=H, PDL=pdl, num_warps=4, launch_pdl=pdl)


def _launch_gemv(x, w, y, pdl, prefetch=True):
    bn, bk = 4, 512
    _gemv_kernel[(H // bn,)](x, w, y, K=H, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, PREFETCH=prefetch,
                             num_warps=4, launch_pdl=pdl)  # fmt: skip


def _time_graph(fn, reps=50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--layers", type=int, default=64)
    a = ap.parse_args()
    L = a.layers
    dev = "cuda"
    torch.manual_seed(0)
    bufs = [torch.randn(H, device=dev, dtype=torch.bfloat16) for _ in range(L + 1)]
    nw = torch.rand(H, device=dev, dtype=torch.bfloat16) + 0.5
    ws = [torch.randn(H, H, device=dev, dtype=torch.bfloat16) / 64 for _ in range(L)]
    rows = []

    def chain(kind, pdl, prefetch=True):
        def run():
            for i in range(L):
                if kind == "norm" or (kind == "mixed" and i % 2 == 0):
                    _launch_norm(bufs[i], bufs[i + 1], nw, pdl)
                else:
                    _launch_gemv(bufs[i], ws[i], bufs[i + 1], pdl, prefetch)

        return run

    for kind in ("norm", "gemv", "mixed"):
        variants = [("off", False, True), ("pdl", True, True)]
        if kind != "norm":
            variants.append(("pdl_noprefetch", True, False))
        ref = None
        for name, pdl, pre in variants:
            try:
                fn = chain(kind, pdl, pre)
                fn()
                torch.cuda.synchronize()
                out = bufs[L].clone()
                ms = _time_graph(fn)
                fn()
                torch.cuda.synchronize()
                same = None if ref is None else bool(torch.equal(ref, bufs[L]))
                if ref is None:
                    ref = out
                rows.append(dict(chain=kind, variant=name, us_per_launch=ms * 1e3 / L, same_as_off=same))
            except Exception as err:  # report and go on: the probe's answer is which variants run
                rows.append(dict(chain=kind, variant=name, error=f"{type(err).__name__}: {err}"[:300]))
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, layers=L)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    print(env)
    for r in rows:
        if "error" in r:
            print(f"{r['chain']:<6} {r['variant']:<15} ERROR {r['error']}")
        else:
            print(
                f"{r['chain']:<6} {r['variant']:<15} {r['us_per_launch']:7.2f} us/launch  same={r['same_as_off']}"
            )


if __name__ == "__main__":
    main()
