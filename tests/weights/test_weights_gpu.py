"""Loading packs onto a CUDA device: the pinned-staging pipeline and the direct path give exactly
the CPU load, tensors land 256-byte aligned, FP8 packs included; with verify on (the default) a
flipped byte is refused on both paths, naming the tensor (staged: by the checksum kernel over the
arena). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from weights_helpers import pack

from kiln.weights import LoadOptions, PackError, load_pack

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("opts", [LoadOptions(), LoadOptions("pinned", 3, 4096, 2), LoadOptions("direct")])
def test_cuda_load_equals_cpu_load(checkpoint, tmp_path, quant, opts):
    d = checkpoint("qwen3_moe")
    pack(d, tmp_path / "p", tp=2, ep=2, dtype="bfloat16", quant=quant, max_file_bytes=50_000)
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


@pytest.mark.parametrize("opts", [LoadOptions(), LoadOptions("pinned", 3, 4096, 2), LoadOptions("direct")])
def test_cuda_flipped_byte_is_refused(checkpoint, tmp_path, opts):
    out = tmp_path / "p"
    index, _ = pack(checkpoint("qwen3_moe"), out, tp=2, ep=2, dtype="bfloat16", quant="fp8")
    t = index.ranks[1].tensors["layers.1.moe.w2"]
    with open(out / t.file, "r+b") as f:
        f.seek(t.offset + t.nbytes - 3)
        b = f.read(1)
        f.seek(t.offset + t.nbytes - 3)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(PackError) as e:
        load_pack(out, 1, "cuda", options=opts)
    msg = str(e.value)
    assert f"tensor {t.name} ({out / t.file} bytes [{t.offset}, {t.offset + t.nbytes}))" in msg, msg
    assert msg.count("tensor ") == 1 and "corrupt" in msg, msg
    assert load_pack(out, 1, "cuda", verify=False, options=opts)[t.name].is_cuda
    load_pack(out, 0, "cuda", options=opts)  # the other rank is intact
