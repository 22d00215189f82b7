"""ops/l2_prefetch.py: the switches, which tensors qualify, and the prefetch kernel on the GPU."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.l2_prefetch import prefetch_l2, prefetch_programs, prefetch_requested, prefetchable


def test_switches_parse_and_reject(monkeypatch):
    monkeypatch.delenv("KILN_L2_PREFETCH", raising=False)
    monkeypatch.delenv("KILN_L2_PREFETCH_PROGRAMS", raising=False)
    assert not prefetch_requested() and prefetch_programs() == 16
    monkeypatch.setenv("KILN_L2_PREFETCH", "1")
    monkeypatch.setenv("KILN_L2_PREFETCH_PROGRAMS", "64")
    assert prefetch_requested() and prefetch_programs() == 64
    monkeypatch.setenv("KILN_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="KILN_L2_PREFETCH must be 0 or 1"):
        prefetch_requested()
    for bad in ("0", "x", "2000"):
        monkeypatch.setenv("KILN_L2_PREFETCH_PROGRAMS", bad)
        with pytest.raises(ValueError, match="KILN_L2_PREFETCH_PROGRAMS"):
            prefetch_programs()


def test_cpu_tensors_are_not_prefetched():
    w = torch.randn(64, 64)
    assert not prefetchable(w)
    assert prefetch_l2([w]) == 0  # launches nothing
    with pytest.raises(ValueError, match="at most 2"):
        prefetch_l2([w, w, w])


@pytest.mark.gpu
def test_prefetch_kernel_runs_and_skips_what_it_cannot_read():
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    odd = torch.randn(1001, device="cuda", dtype=torch.bfloat16)[1:]  # 2-byte offset: not 16-byte aligned
    assert prefetchable(w) and not prefetchable(odd) and not prefetchable(w.t())
    assert prefetch_l2([w, odd], programs=8) == 1
    assert prefetch_l2([w[:, :4000].contiguous(), w[7]], programs=3) == 2  # tails, a 8 KiB row
    torch.cuda.synchronize()
    assert torch.equal(w, before)
