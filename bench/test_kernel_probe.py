"""bench/kernel_probe.py: a Triton kernel compiled for Hopper on any machine, its registers, shared
memory and instruction mix read back."""

from __future__ import annotations

import kernel_probe
import triton
import triton.language as tl


@triton.jit
def _scale_rows(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


@triton.jit
def _tile_dot(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r[:, None] * BLOCK + r[None, :])
    b = tl.load(b_ptr + r[:, None] * BLOCK + r[None, :])
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], tl.dot(a, b))


def test_probe_reads_registers_and_instructions():
    small = kernel_probe.probe(_scale_rows, {"BLOCK": 256}, {}, warps=4, stages=1, arch=90)
    assert 1 <= small["registers"] <= 64 and small["spill_store_bytes"] == 0
    assert small["programs_per_sm_by_registers"] >= 8 and small["wgmma"] == small["mma_sync"] == 0
    dot = kernel_probe.probe(_tile_dot, {"BLOCK": 64}, {"c_ptr": "*fp32"}, warps=4, stages=1, arch=90)
    assert dot["wgmma"] + dot["mma_sync"] > 0  # the dot became tensor-core instructions
    assert dot["registers"] >= small["registers"]
