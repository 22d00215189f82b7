"""Kernel microbenchmarks (pytest-benchmark).

On a GPU every benchmark is timed with CUDA events (median) and reported against ceilings
measured in the same session: device read bandwidth and the bf16 matmul rate. Before each timed
call L2 is flushed by reading a 256 MiB buffer (``KILN_BENCH_FLUSH=clean``, the default), so the
call starts cold and pays only for its own traffic. ``KILN_BENCH_FLUSH=dirty`` times with
``triton.testing.do_bench`` instead, which flushes by *writing* 256 MiB: up to L2's 50 MB of dirty
lines are then written back during the timed call, which costs a 30 us kernel several
microseconds (results before 2026-11-29's fourth session were timed that way). Each result lands in ``benchmark.extra_info`` (``ms``, ``gbps``, ``frac_bw``,
``tflops``, ``frac_mm``), so ``pytest bench --benchmark-json=FILE`` carries every figure.

Without a GPU the suite runs in smoke mode: tiny shapes, one round, the Triton kernels through
the interpreter where a benchmark asks for them; it only proves the benchmarks still run.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kiln import settings

SMOKE = not torch.cuda.is_available()
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Ceilings:
    read_gbps: float  # device read bandwidth, GB/s (1e9 bytes)
    bf16_tflops: float  # dense bf16 matmul rate


FLUSH_BYTES = 256 * 1024**2


@functools.cache
def _flush_buffer() -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.ones(FLUSH_BYTES // 4, device="cuda", dtype=torch.float32).view(-1, 8192)
    return buf, torch.empty(8192, device="cuda", dtype=torch.float32)


def _clean_flush() -> None:
    buf, out = _flush_buffer()
    torch.sum(buf, dim=0, out=out)  # reads 256 MiB: L2 ends up holding clean lines


def _median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    if settings.value("bench_flush") == "dirty":  # KILN_BENCH_FLUSH
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    _clean_flush()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)  # ms per call
    reps = int(min(300, max(10, 100 / est)))
    for _ in range(int(min(50, max(1, 25 / est)))):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends, strict=True):
        _clean_flush()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends, strict=True))
    return float(times[len(times) // 2])


def measure_ceilings() -> Ceilings:
    if SMOKE:
        return Ceilings(read_gbps=float("nan"), bf16_tflops=float("nan"))
    # Read bandwidth: a sum over 4 GiB (far past L2) reads every byte once.
    x = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16).view(-1, 8192)
    out = torch.empty(8192, device="cuda", dtype=torch.float32)
    ms = _median_ms(lambda: torch.sum(x, dim=0, dtype=torch.float32, out=out))
    read = x.numel() * x.element_size() / (ms * 1e-3) / 1e9
    x = None  # free before the matmul buffers
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _median_ms(lambda: a @ b)
    return Ceilings(read_gbps=read, bf16_tflops=2 * 8192**3 / (ms * 1e-3) / 1e12)


@pytest.fixture(scope="session")
def ceilings() -> Ceilings:
    return measure_ceilings()


@pytest.fixture
def measure(benchmark, ceilings):
    """``measure(fn, bytes=..., flops=...)`` times ``fn`` and records its fraction of the ceilings."""

    def run(fn: Callable[[], object], *, bytes: float = 0.0, flops: float = 0.0, **info: object) -> None:
        benchmark.extra_info.update(info)
        if SMOKE:
            benchmark.pedantic(fn, rounds=1, iterations=1)
            return
        ms = _median_ms(fn)
        s = ms * 1e-3
        benchmark.extra_info.update(ms=ms, bytes=bytes, flops=flops, l2_flush=settings.value("bench_flush"))
        if bytes:
            benchmark.extra_info.update(gbps=bytes / s / 1e9, frac_bw=bytes / s / 1e9 / ceilings.read_gbps)
        if flops:
            benchmark.extra_info.update(
                tflops=flops / s / 1e12, frac_mm=flops / s / 1e12 / ceilings.bf16_tflops
            )
        benchmark.extra_info.update(
            ceiling_read_gbps=ceilings.read_gbps, ceiling_bf16_tflops=ceilings.bf16_tflops
        )

        def synced() -> None:
            fn()
            torch.cuda.synchronize()

        benchmark.pedantic(synced, rounds=10, iterations=1, warmup_rounds=2)

    return run


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Smoke mode: the ops launch their Triton kernels in the interpreter rather than their torch
    references (``pytestmark = pytest.mark.usefixtures("kernels_on_cpu")`` in a bench file)."""
    if SMOKE:
        monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """On a GPU: ``fn`` warmed up (compiled) on a side stream and captured in a CUDA graph, so
    timings at small sizes measure the kernel, not launch overhead; returns the replay."""
    if SMOKE:
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def kernel_resources(jit_fn: Any) -> dict[str, int]:
    """The registers per thread and spilled bytes of ``jit_fn``'s compiled variants that have run
    in this process, the largest of each (``regs``, ``spills``; empty before any has run or where
    Triton does not say): a kernel that spills, or whose registers leave room for few programs per
    SM, is limited by that rather than by its tiles."""
    kernels = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        compiled = cache[0] if isinstance(cache, tuple) else cache
        kernels += [
            k for k in getattr(compiled, "values", lambda: [])() if getattr(k, "n_regs", None) is not None
        ]
    if not kernels:
        return {}
    return {"regs": max(k.n_regs for k in kernels), "spills": max(k.n_spills for k in kernels)}


def pick(gpu_value, smoke_value):
    """A shape parameter: the real one on a GPU, a tiny one in smoke mode."""
    return smoke_value if SMOKE else gpu_value
