"""Loading packs onto a CUDA device: the pinned-staging pipeline and the direct path give exactly
the CPU load, tensors land 256-byte aligned, FP8 packs included. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from weights_helpers import pack

from kiln.weights import LoadOptions, load_pack

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("opts", [LoadOptions(), LoadOptions("pinned", 3, 4096, 2), LoadOptions("direct")])
def test_cuda_load_equals_cpu_load(checkpoint, tmp_path, quant, opts):
    d = checkpoint("qwen3_moe")
    # 2 KiB hash blocks: the 4 KiB staged chunks hold two, checked in the reader threads
    pack(
        d, tmp_path / "p", tp=2, ep=2, dtype="bfloat16", quant=quant, max_file_bytes=50_000, block_bytes=2048
    )
    for r in range(2):
        want = load_pack(tmp_path / "p", r)
        got = load_pack(tmp_path / "p", r, "cuda", verify=True, options=opts)
        assert set(got) == set(want)
        for n, t in want.items():
            g = got[n]
            assert g.is_cuda and g.dtype == t.dtype and g.shape == t.shape, n
            assert torch.equal(g.cpu().view(torch.uint8), t.view(torch.uint8)), n
            if opts.staging != "direct":
                assert g.data_ptr() % 256 == 0
