"""The ceilings every kernel is judged against, measured in the same session."""

import math

import torch
from conftest import SMOKE, measure_ceilings, pick


def test_device_copy(measure):
    n = pick(1024**3, 1024)  # elements of bf16: 2 GiB on a GPU
    dev = "cpu" if SMOKE else "cuda"
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    measure(lambda: dst.copy_(src), bytes=2 * src.numel() * src.element_size())
    assert torch.equal(dst, src)


def test_ceilings_are_sane():
    c = measure_ceilings()
    if SMOKE:
        assert math.isnan(c.read_gbps) and math.isnan(c.bf16_tflops)
    else:
        assert 100 < c.read_gbps < 10_000 and 10 < c.bf16_tflops < 5_000
