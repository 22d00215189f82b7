"""wsum64 (weights/checksum.py): the numpy reference against the definition in plain Python
integers, what it provably detects (one changed word, two flipped bits anywhere, truncation), the
Triton kernel against the reference on tensors of odd sizes in one buffer with garbage in the
padding (the interpreter without a GPU, compiled on one), and the kernel over a real staged load's
arena against the sums pack.json records."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from weights_helpers import pack, wsum64_definition

import kiln.weights.checksum as cs
from kiln.weights import LoadOptions, PackIndex, load_pack
from kiln.weights.checksum import CHUNK_WORDS, arena_of, device_wsum64, wsum64, wsum64_many

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the kernel in Triton's interpreter
# 1, 7, 8, 9 bytes; a whole and a partial last word; several loop steps; several programs
SIZES = [1, 7, 8, 9, 0, 255, 256, 257, 3 * 8 * cs.BLOCK + 5, 2 * 8 * CHUNK_WORDS + 13]


def _rand(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 8 * cs.STEP_WORDS + 3])
def test_reference_is_the_definition(n):
    data = _rand(n, n)
    assert wsum64(data) == wsum64_definition(data)
    assert wsum64(np.frombuffer(data, np.uint8)) == wsum64(bytearray(data))


def test_many_splits_large_buffers_into_pieces(monkeypatch):
    bufs = [np.frombuffer(_rand(n, n), np.uint8) for n in (0, 5, 40, 41, 333, 4096 + 3)]
    want = [wsum64_definition(b.tobytes()) for b in bufs]
    monkeypatch.setattr(cs, "SPLIT_BYTES", 40)  # many pieces per buffer, summed on threads
    assert wsum64_many(bufs, threads=3) == want
    assert wsum64_many(bufs, threads=1) == want


def _plain(data: bytes) -> int:
    """The same weighted sum without the mix: what the mix is for (see the test below)."""
    w = np.frombuffer(data, "<u8")
    return int((w * (2 * np.arange(len(w), dtype=np.uint64) + np.uint64(1))).sum(dtype=np.uint64))


def _flip(data: bytes, *bits: tuple[int, int]) -> bytes:
    out = bytearray(data)
    for word, bit in bits:
        out[8 * word + bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_every_change_inside_one_word_is_detected():
    data = _rand(8 * 64, 1)
    base = wsum64(data)
    rng = np.random.default_rng(2)
    for word in range(64):
        for _ in range(8):
            mask = int(rng.integers(1, 2**63)) << int(rng.integers(0, 2))  # any nonzero 64-bit pattern
            bits = [(word, b) for b in range(64) if mask >> b & 1]
            assert wsum64(_flip(data, *bits)) != base, (word, hex(mask))


def test_any_two_flipped_bits_are_detected():
    """Every pair of bit positions of the high and low halves, in word pairs at odd, even and
    power-of-two distances. Without the mix, two flips of bit 63 always cancel."""
    data = _rand(8 * 300, 3)
    base = wsum64(data)
    positions = [0, 1, 30, 31, 32, 33, 62, 63]
    for i, j in [(0, 1), (0, 2), (3, 10), (5, 133), (0, 256), (17, 299)]:
        for b1 in positions:
            for b2 in positions:
                assert wsum64(_flip(data, (i, b1), (j, b2))) != base, (i, j, b1, b2)
    assert _plain(_flip(data, (0, 63), (5, 63))) == _plain(data)  # what the mix prevents


def test_truncation_and_zero_extension_are_detected():
    data = _rand(100, 4) + bytes(12)  # ends in zeros: the word sum alone cannot tell
    assert len({wsum64(data), wsum64(data[:-1]), wsum64(data[:-8]), wsum64(data + bytes(8))}) == 4


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // cs.ALIGN) * cs.ALIGN
    return offsets, pos + cs.ALIGN


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_reference(seed):
    """Tensors at 256-byte-aligned offsets of one buffer filled with random bytes: the padding
    after each tensor (the arena's uninitialized bytes) holds garbage the kernel must mask."""
    sizes = SIZES[seed:] + SIZES[:seed]
    offsets, total = _layout(sizes)
    host = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    want = [wsum64_definition(host[o : o + n].tobytes()) for o, n in zip(offsets, sizes)]
    assert wsum64_many([host[o : o + n] for o, n in zip(offsets, sizes)], 2) == want
    got = device_wsum64(torch.from_numpy(host).to(DEVICE), offsets, sizes)
    assert got == want


def test_kernel_refuses_a_misaligned_tensor():
    buf = torch.zeros(1024, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="256-byte aligned"):
        device_wsum64(buf, [8], [16])
    with pytest.raises(ValueError, match="past the buffer"):
        device_wsum64(buf, [768], [300])


def test_kernel_over_a_staged_arena_matches_pack_json(checkpoint, tmp_path):
    """What load_pack does on a GPU (and ``warm_up`` at compile time): the kernel over the arena a
    staged load returned gives the sums the packer recorded."""
    out = tmp_path / "pack"
    pack(checkpoint("qwen2"), out, tp=1, dtype="bfloat16")
    ri = PackIndex.load(out).rank(0)
    weights = load_pack(out, 0, DEVICE, verify=False, options=LoadOptions("pinned", 2, 4096))
    buf, offsets, sizes = arena_of(list(weights.values()))
    got = device_wsum64(buf, offsets, sizes)
    assert [cs.hex64(g) for g in got] == [ri.tensors[n].wsum64 for n in weights]
    with pytest.raises(ValueError, match="not in one allocation"):
        arena_of([weights["norm.weight"], torch.ones(3, device=DEVICE)])
