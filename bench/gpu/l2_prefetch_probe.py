"""Does the sm_90 bulk L2 prefetch make a later GEMV read from L2? (Tenth session; the answer
was "partly, and not in a decode step": bench/results/2026-11-30_h200_s10a_l2_prefetch.json.)

``cp.async.bulk.prefetch.L2.global [addr], size`` asks the issuing SM's copy engine for ``size``
bytes at once, without registers or shared memory. The idea it tested: a batch-1 decode layer's
small kernels (rope, attention, router, top-k) leave DRAM idle for about 14 us per layer, and the
next GEMVs' weights are known before their inputs are, so a kernel in that window could start
pulling them into L2. Measured: the prefetched GEMV took 5.2 us against 6.3 cold (4.0 with its
weights fully in L2); in the decode step the rope kernel that issued the prefetch (for the o and
router weights) waited on it, and the step went from 1014 to 1177-1201 us.

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
import triton
import triton.language as tl
from cuda_kernels import kernel_events

import kiln.ops  # noqa: F401

CLOCK_GHZ = 1.98  # H200 boost clock, for torch.cuda._sleep's cycles
CHUNK_BYTES = 1 << 15  # bytes per bulk prefetch instruction
# p: the instruction runs only for chunks with bytes (the masked lanes carry size 0); $0: a dummy
# result, since inline asm must produce one (is_pure=False keeps it from being removed)
_ASM = tl.constexpr(
    "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n"
    "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.b32 $0, 0;\n}"
)


@triton.jit
def tl_prefetch_l2(ptr, n, pid, nprog, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid`` of ``nprog`` asks L2 for chunks ``pid, pid + nprog, ...`` of ``ptr[0:n]``
    (``CHUNK`` elements each, ``BLOCK`` chunks per step; a tail under 16 bytes is skipped)."""
    esize = ptr.dtype.element_ty.primitive_bitwidth // 8
    nchunks = tl.cdiv(n, CHUNK)
    for c0 in range(pid * BLOCK, nchunks, nprog * BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        start = c.to(tl.int64) * CHUNK
        nbytes = (tl.minimum(n - start, CHUNK) * esize) // 16 * 16
        nbytes = tl.where(c < nchunks, nbytes, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            _ASM, "=r,l,r", [ptr + start, nbytes], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _prefetch_kernel(P, N, CHUNK: tl.constexpr):
    tl_prefetch_l2(P, N, tl.program_id(0), tl.num_programs(0), CHUNK, 128)


def prefetch_l2(w: torch.Tensor, programs: int) -> None:
    """``programs`` programs ask L2 for all of ``w`` (contiguous, 16-byte aligned) and return."""
    assert w.is_contiguous() and w.data_ptr() % 16 == 0
    _prefetch_kernel[(programs,)](w, w.numel(), CHUNK=CHUNK_BYTES // w.element_size(), num_warps=4)


def _durations(fn, reps: int, match: str) -> list[float]:
    """Run ``fn`` ``reps`` times under the profiler: the last kernel per rep whose name has ``match``."""
    return [us for name, us in kernel_events(fn, reps) if match in name][-reps:]


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
            case(f"pf{p}_s{s}", lambda p=p, s=s: (flush.zero_(), prefetch_l2(w, p), sleep(s), gemv()))
    for mb, buf in streams.items():
        case(
            f"evict{mb}",
            lambda buf=buf: (flush.zero_(), prefetch_l2(w, 64), sleep(10), buf.sum(), gemv()),
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
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'case':16s} {'us':>7s} {'GB/s':>7s}")
    for k, r in res.items():
        print(f"{k:16s} {r['median_us']:7.2f} {r['gbps']:7.0f}")


if __name__ == "__main__":
    main()
