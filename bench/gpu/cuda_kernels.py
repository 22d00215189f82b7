"""Kernel durations of a piece of GPU work, from the profiler (CUPTI): for the probes in this folder."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_events(fn: Callable[[], object], reps: int) -> list[tuple[str, float]]:
    """``fn`` once to warm up, then ``reps`` times under the profiler: ``(kernel name, its own
    duration in us)`` of every CUDA kernel launched, in order (copies and memsets left out)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return [
        (e.name, e.device_time)
        for e in prof.events()
        if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))
    ]
