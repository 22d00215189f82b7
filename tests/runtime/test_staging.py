"""HostStager: ring buffers hand back exactly the values given, across slot reuse and growth, on
the CPU (plain memory) and, on a GPU, through pinned memory and events while the stream is busy."""

import random

import pytest
import torch

from kiln.runtime.staging import HostStager


def _roundtrip(device: str, ring: bool) -> None:
    st = HostStager(device, ring=ring, slots=3)
    rng = random.Random(0)
    kept = []
    for step in range(40):
        n = rng.choice([1, 5, 64, 700, 3000])  # 3000 int64 > the 4096-byte first buffer: growth
        vals = [[rng.randrange(-(2**40), 2**40) for _ in range(n)] for _ in range(2)]
        dev = st.to_device(vals, torch.int64)
        kept.append((dev, vals))
        host = st.to_host(dev[1] * 3)
        if device == "cuda":
            torch.cuda.synchronize()
        assert host.tolist() == [3 * v for v in vals[1]], step
    for dev, vals in kept[-3:]:  # device tensors stay valid after their staging slot is reused
        assert dev.tolist() == vals


@pytest.mark.parametrize("ring", [True, False])
def test_cpu_roundtrip(ring):
    _roundtrip("cpu", ring)


@pytest.mark.gpu
@pytest.mark.parametrize("ring", [True, False])
def test_gpu_roundtrip(ring):
    _roundtrip("cuda", ring)


@pytest.mark.gpu
def test_gpu_ring_does_not_wait_for_a_busy_stream():
    st = HostStager("cuda", ring=True)
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(4):
        a = a @ a * 1e-4  # keep the stream busy
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = st.to_device([1, 2, 3], torch.int64)
        host = st.to_host(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert host.tolist() == [1, 2, 3]
