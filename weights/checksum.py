"""wsum64: the per-tensor checksum of weight packs, computed on the device after a load (a Triton
kernel over the loader's arena) and on the CPU by numpy (the packer, CPU loads, ``kiln pack
--verify``). Both compute exactly the same 64-bit value.

Definition. A tensor's ``n`` bytes, zero-padded to a multiple of 8, are little-endian 64-bit words
``w_0 .. w_{m-1}``. Each word is mixed by ``x_i = w_i ^ (w_i >> 32)`` (a bijection: applying it
twice gives ``w_i`` back), and::

    wsum64 = (sum_i x_i * (2*i + 1) + n * K) mod 2**64,   K = 0x9E3779B97F4A7C15 (odd)

All arithmetic wraps mod 2**64 (uint64 in numpy, int64 bit patterns in Triton: two's complement
addition and multiplication are the same ring), so the order of the additions does not matter:
the kernel adds per-program partial sums with atomics and the result is deterministic.

What it detects (``v2(a)``: the exponent of the largest power of 2 dividing ``a``):

* Any change inside one word (one byte, several bytes of the same 8): the mixed word changes by
  ``d != 0`` (the mix is a bijection), the sum by ``d * (2i + 1)``, and an odd multiplier is
  invertible mod 2**64, so the difference is never 0.
* Any two flipped bits of a tensor under 2**30 words (8 GiB). Without the mix, two flips of bit 63
  anywhere always cancel (``2**63 * odd + 2**63 * odd == 0 mod 2**64``): in bf16 data, the sign
  bits of any two elements ``4k+3``; half the pairs of bit-62 flips too. Proof: a flip of bit ``b < 32`` changes
  ``x_i`` by ``+-2**b``; of bit ``b >= 32``, by ``+-2**b +- 2**(b-32) = 2**(b-32) * o`` with ``o``
  in ``{+-2**32 +- 1}``: in both cases by ``2**v * o``, ``v <= 31``, ``o`` odd. Two flips in words
  ``i != j`` cancel only with equal ``v`` and ``o1*(2i+1) + o2*(2j+1) == 0 mod 2**(64-v)``, so mod
  2**33; with ``o = s*2**32 + t`` or ``o = t`` (``s, t = +-1``; ``s*2**32*odd == 2**32 mod 2**33``)
  that reduces to ``2(i+j+1)`` or ``2(i-j)`` (two flips of the same kind) or ``2**32 + 2(i+j+1)``
  or ``2**32 + 2(i-j)`` (one of each) being ``0 mod 2**33``, up to sign, which needs ``i + j + 1 >=
  2**31`` or ``|i - j| >= 2**31``. Two flips in one word: the first case.
* Reordered data: a swap of unequal words ``i < j`` changes the sum by ``(x_i - x_j) * 2(j - i)``,
  missed only when ``v2(x_i - x_j) + v2(j - i) >= 63``; swapped runs of words likewise unless the
  difference of their weighted sums has that many trailing zero bits (about 2**-(63 - v2(j - i))
  for unrelated data).
* Truncation or extension: ``n`` is folded in with an odd ``K``, so a tensor that lost (or gained)
  zero bytes at its end, which the word sum alone would not see, changes by ``(n - n') * K != 0``.
* Anything else (a stale or zeroed page, garbage, a truncation that dropped nonzero bytes): missed
  with probability about 2**-64 for errors unrelated to the weights ``2i + 1``.

It guards against accidental corruption (a bad disk, copy, transfer or memory), not against an
attacker, who could edit pack.json as well as the files. The sha256 of every file in pack.json is
for external tools and ``kiln pack --verify``.

Here: :func:`wsum64` (one buffer), :func:`wsum64_many` (many, split into pieces on threads; numpy
releases the GIL in its loops), :func:`device_wsum64` (tensors in one device buffer, one kernel
launch, one device-to-host read of the sums; runs under the Triton interpreter on CPU tensors) and
:func:`warm_up` (``kiln compile``: compile the kernel into the artifact).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import triton
import triton.language as tl

K = 0x9E3779B97F4A7C15  # folds the byte count in; odd
MASK64 = (1 << 64) - 1
STEP_WORDS = 1 << 17  # numpy works on 1 MiB of words at a time (stays in cache)
SPLIT_BYTES = 64 << 20  # wsum64_many: pieces of a large buffer summed on different threads
CHUNK_WORDS = 1 << 16  # device: words (512 KiB) per kernel program
BLOCK = 1024  # device: words per program per loop step
ALIGN = 256  # device: byte alignment of every tensor in the buffer (the loader's DEVICE_ALIGN)
_ODD = 2 * np.arange(STEP_WORDS, dtype=np.uint64) + np.uint64(1)


def hex64(x: int) -> str:
    return f"{x:016x}"


def _mix(x: int) -> int:
    return x ^ (x >> 32)


def _words_sum(words: np.ndarray, first: int) -> int:
    """``sum_j mix(words[j]) * (2*(first + j) + 1) mod 2**64``. Per step: ``sum x*(2j+1)`` with a
    shared odd-number table, plus ``2*(first + step start) * sum x`` (the same sum, regrouped)."""
    total = 0
    tmp = np.empty(min(STEP_WORDS, len(words)), np.uint64)
    for s in range(0, len(words), STEP_WORDS):
        w = words[s : s + STEP_WORDS]
        x = tmp[: len(w)]
        np.right_shift(w, np.uint64(32), out=x)
        np.bitwise_xor(w, x, out=x)
        plain = int(x.sum(dtype=np.uint64))
        np.multiply(x, _ODD[: len(w)], out=x)
        total += int(x.sum(dtype=np.uint64)) + 2 * (first + s) * plain
    return total & MASK64


def _piece(buf: np.ndarray, begin: int, end: int) -> int:
    """The word sum (without the length term) of bytes ``[begin, end)`` of ``buf``; ``begin`` is a
    multiple of 8, and so is ``end`` unless it is the buffer's end (the last word zero-padded)."""
    full = begin + (end - begin) // 8 * 8
    total = _words_sum(buf[begin:full].view("<u8"), begin // 8) if full > begin else 0
    if full < end:
        tail = int.from_bytes(buf[full:end].tobytes(), "little")
        total += _mix(tail) * (2 * (full // 8) + 1)
    return total & MASK64


def finish(words_sum: int, nbytes: int) -> int:
    """wsum64 from the word sum and the byte count."""
    return (words_sum + nbytes * K) & MASK64


def as_bytes(data: np.ndarray | torch.Tensor | bytes | bytearray | memoryview) -> np.ndarray:
    """A 1-D uint8 numpy view of a contiguous CPU tensor, numpy array or bytes-like (no copy)."""
    if isinstance(data, torch.Tensor):
        assert data.device.type == "cpu" and data.is_contiguous()
        return data.reshape(-1).view(torch.uint8).numpy()
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def wsum64(data: np.ndarray | torch.Tensor | bytes | bytearray | memoryview) -> int:
    """wsum64 of one buffer's bytes (the numpy reference; module docstring)."""
    buf = as_bytes(data)
    return finish(_piece(buf, 0, len(buf)), len(buf))


def wsum64_many(bufs: Sequence[np.ndarray], threads: int = 8) -> list[int]:
    """wsum64 of each uint8 buffer (:func:`as_bytes`), computed on ``threads`` threads in pieces
    of :data:`SPLIT_BYTES` (a large tensor is split across threads; the pieces' sums are added)."""
    jobs = [
        (i, a, min(a + SPLIT_BYTES, len(b)))
        for i, b in enumerate(bufs)
        for a in range(0, len(b), SPLIT_BYTES)
    ]

    def one(job: tuple[int, int, int]) -> int:
        return _piece(bufs[job[0]], job[1], job[2])

    if threads > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="kiln-wsum") as pool:
            parts = list(pool.map(one, jobs))
    else:
        parts = [one(j) for j in jobs]
    sums = [0] * len(bufs)
    for (i, _, _), p in zip(jobs, parts):
        sums[i] += p
    return [finish(s & MASK64, len(b)) for s, b in zip(sums, bufs)]


@triton.jit
def _wsum64_kernel(words_ptr, table_ptr, sums_ptr, BLOCK: tl.constexpr):
    # One program: up to CHUNK_WORDS words of one tensor. Its table row: tensor index, buffer word
    # of its first word (a multiple of 32: tensors start 256-byte aligned, chunks are whole
    # blocks), that word's index in the tensor, bytes it covers (only a tensor's last program may
    # end inside a word: that word is masked to its bytes, the buffer's padding is uninitialized).
    row = table_ptr + tl.program_id(0).to(tl.int64) * 4
    t = tl.load(row)
    start = tl.multiple_of(tl.load(row + 1), 32)
    k0 = tl.load(row + 2)
    nbytes = tl.load(row + 3)
    nw = ((nbytes + 7) >> 3).to(tl.int32)
    full = (nbytes >> 3).to(tl.int32)  # the partial word's index, if any
    tail = (tl.full((), 1, tl.int64) << ((nbytes & 7) * 8)) - 1
    acc = tl.zeros([BLOCK], dtype=tl.int64)  # sum of x
    acc_j = tl.zeros([BLOCK], dtype=tl.int64)  # sum of j * x
    for s in range(0, nw, BLOCK):
        j = s + tl.arange(0, BLOCK)
        w = tl.load(words_ptr + start + j, mask=j < nw, other=0)
        w = tl.where(j == full, w & tail, w)
        x = w ^ ((w >> 32) & 0xFFFFFFFF)  # logical shift: the arithmetic one, masked
        acc += x
        acc_j += x * j.to(tl.int64)
    # sum over the program's words of x * (2 * (k0 + j) + 1), wrapping
    part = 2 * tl.sum(acc_j, axis=0) + (2 * k0 + 1) * tl.sum(acc, axis=0)
    tl.atomic_add(sums_ptr + t, part)


def program_table(offsets: Sequence[int], nbytes: Sequence[int]) -> np.ndarray:
    """``[programs, 4]`` int64 rows of :func:`_wsum64_kernel` for tensors at byte ``offsets`` of
    the buffer with ``nbytes`` bytes each (empty tensors get no program: their sum is 0)."""
    off = np.asarray(offsets, dtype=np.int64)
    n = np.asarray(nbytes, dtype=np.int64)
    counts = -(-n // (8 * CHUNK_WORDS))
    idx = np.repeat(np.arange(len(n), dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    k0 = (np.arange(len(idx), dtype=np.int64) - first) * CHUNK_WORDS
    table = np.empty((len(idx), 4), dtype=np.int64)
    table[:, 0] = idx
    table[:, 1] = off[idx] // 8 + k0
    table[:, 2] = k0
    table[:, 3] = np.minimum(n[idx] - 8 * k0, 8 * CHUNK_WORDS)
    return table


def launch(buf: torch.Tensor, rows: torch.Tensor, sums: torch.Tensor) -> None:
    """The kernel alone: add each program's partial sum (``rows``: :func:`program_table` on the
    device) into ``sums`` (int64, one per tensor, zeroed by the caller), on ``buf``'s device's
    current stream (whichever device is current)."""
    with torch.cuda.device(buf.device) if buf.is_cuda else contextlib.nullcontext():
        _wsum64_kernel[(len(rows),)](buf.view(torch.int64), rows, sums, BLOCK=BLOCK, num_warps=4)


def device_wsum64(buf: torch.Tensor, offsets: Sequence[int], nbytes: Sequence[int]) -> list[int]:
    """wsum64 of each tensor held in ``buf`` (1-D uint8, a whole allocation: the loader's arena),
    tensor ``i`` at byte ``offsets[i]`` (a multiple of :data:`ALIGN`), ``nbytes[i]`` long. One
    kernel launch on the current stream, then one device-to-host read of the sums (which waits for
    the stream). Every kernel argument is a pointer to a fresh allocation and the launch options
    are fixed, so every model runs the same compiled specialization."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"device_wsum64 takes a 1-D uint8 buffer, got {buf.dtype} {tuple(buf.shape)}")
    table = program_table(offsets, nbytes)
    sums = torch.zeros(len(nbytes), dtype=torch.int64, device=buf.device)
    if len(table):
        # the kernel's aligned loads need the buffer on a 256-byte boundary (the CPU allocator's 64 do
        # for the interpreter) and a whole number of words
        aligned = buf.data_ptr() % (ALIGN if buf.is_cuda else 8) == 0 and buf.numel() % 8 == 0
        if not aligned or any(o % ALIGN for o in offsets):
            raise ValueError(f"device_wsum64: the buffer and every tensor in it must be {ALIGN}-byte aligned")
        if max(o + n for o, n in zip(offsets, nbytes)) > buf.numel():
            raise ValueError("device_wsum64: a tensor ends past the buffer")
        launch(buf, torch.from_numpy(table).to(buf.device), sums)
    return [finish(s & MASK64, n) for s, n in zip(sums.cpu().tolist(), nbytes)]


def load_kernel(device: torch.device) -> None:
    """Find (or compile) the kernel for ``device`` and load its launcher on this thread: one launch
    over one aligned block. The weight loader calls it before its reader thread starts, so that
    thread's launches load nothing. Triton 3.6 loads each kernel's launcher as a C extension
    module, all named ``__triton_launcher``; the reader thread's first launch, beside the engine's
    graph captures on the main thread, once got another kernel's launcher (H100, session 33: a
    server start failed with "function takes exactly 55 arguments (17 given)")."""
    device_wsum64(torch.zeros(ALIGN, dtype=torch.uint8, device=device), [0], [ALIGN])


def arena_of(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int], list[int]]:
    """The one allocation ``tensors`` live in (as a uint8 buffer), their byte offsets and sizes:
    the arguments of :func:`device_wsum64` for what a staged load returned."""
    if not tensors:
        raise ValueError("arena_of: no tensors")
    storage = tensors[0].untyped_storage()
    base = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        raise ValueError("arena_of: the tensors are not in one allocation (not a staged load)")
    buf = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage)
    return buf, [t.data_ptr() - base for t in tensors], [t.numel() * t.element_size() for t in tensors]


def warm_up(weights: dict[str, torch.Tensor]) -> None:
    """Run the kernel over ``weights`` as a verified load of them would (``kiln compile``, inside
    the artifact's kernel cache, so the runtime never compiles it). A launch earlier in this
    process is served from memory and would not be written to the cache: forget it first."""
    _wsum64_kernel.device_caches.clear()
    device_wsum64(*arena_of(list(weights.values())))
