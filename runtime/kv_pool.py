"""The paged KV pool and the block table (layout: docs/internals.md, "KV pool").

``KVPool`` owns one K and one V tensor for all layers, allocated once:

    k_cache: [L, S, H_kv, D]    v_cache: [L, S, H_kv, Dv]

and, for an FP8 pool (``float8_e4m3fn``, ``kiln compile --kv-dtype fp8``), one float32 scale per
cached head row, written with it by ``kiln::qkv_rope_kvwrite``:

    k_scale: [L, S, H_kv]       v_scale: [L, S, H_kv]       (row value = cache.float() * scale)

The graphs of such an artifact take the two scale tensors after their other inputs
(``compiler/context.py`` ``KV_SCALE_INPUTS``): :attr:`KVPool.scale_args`.

Slots come in pages of ``page_size`` consecutive slots; page ``p`` holds slots
``p * page_size .. (p + 1) * page_size - 1``. Page 0 (so slot 0) is the padding sink: padded batch
rows write their K/V there, and the allocator never hands it out. The allocator is plain Python (a
free list plus an ownership bitmap that catches double frees and foreign pages); nothing here syncs
the device.

``BlockTable`` is the persistent ``[max_running + 1, max_blocks]`` int32 device table that maps a request's
block index to its page, plus plain-Python bookkeeping per row. Changes are collected on the host
and written to the device by ``flush()``, one small copy per step boundary, never per token.
Row 0 is the padding row (all zeros, so every lookup through it lands on the sink page).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.manifest import KVSpec
from kiln.ops.attention.reference import FP8_KV_DTYPE


class KVPoolError(KilnError, RuntimeError):
    """A misuse of the KV pool or block table (double free, foreign page, full row)."""


def size_for_memory(memory_bytes: int, kv_bytes_per_token: int, page_size: int = 1) -> int:
    """How many slots a pool can have in ``memory_bytes``, rounded down to whole pages.

    ``kv_bytes_per_token`` is K plus V over all layers for one token on this rank (the manifest
    carries it). The count includes the reserved sink page; at least two pages are needed.
    """
    if kv_bytes_per_token <= 0:
        raise KVPoolError(f"kv_bytes_per_token must be positive, got {kv_bytes_per_token}")
    slots = int(memory_bytes) // int(kv_bytes_per_token)
    slots -= slots % page_size
    if slots < 2 * page_size:
        raise KVPoolError(
            f"{memory_bytes / 2**30:.3f} GiB holds only {slots} KV slots at {kv_bytes_per_token} "
            f"bytes per token; need at least {2 * page_size} (raise --kv-memory)"
        )
    return slots


class KVPool:
    """K/V storage for all layers plus a page allocator.

    Args:
        num_layers: L.  num_slots: S, a multiple of ``page_size`` (includes the sink page).
        num_kv_heads: H_kv per rank.  head_dim: D of K.  v_head_dim: Dv of V (may be 0).
        dtype, device: of both caches.  page_size: slots per page (1 or 16 in practice; checked
        here, the runtime's one check besides the manifest's ``kv.page_size``).

    Attributes:
        k_cache: ``[L, S, H_kv, D]`` dtype.  v_cache: ``[L, S, H_kv, Dv]`` dtype.
    """

    size_for_memory = staticmethod(size_for_memory)

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
    ) -> None:
        if page_size < 1:
            raise KVPoolError(f"page_size must be >= 1, got {page_size}")
        if num_slots % page_size or num_slots < 2 * page_size:
            raise KVPoolError(
                f"num_slots={num_slots} must be a multiple of page_size={page_size} and hold at "
                "least two pages (one is the reserved sink)"
            )
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.k_cache = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros(
            num_layers, num_slots, num_kv_heads, v_head_dim, dtype=dtype, device=device
        )
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == FP8_KV_DTYPE:
            self.k_scale = torch.zeros(
                num_layers, num_slots, num_kv_heads, dtype=torch.float32, device=device
            )
            self.v_scale = torch.zeros_like(self.k_scale)
        self.reset()

    @classmethod
    def for_spec(cls, kv: KVSpec, num_slots: int, device: torch.device | str) -> KVPool:
        """The pool of ``num_slots`` slots for an artifact's KV spec (``manifest.kv``)."""
        dtype = getattr(torch, kv.dtype)
        return cls(
            kv.num_layers, num_slots, kv.num_kv_heads, kv.head_dim, kv.v_head_dim, dtype, device, kv.page_size
        )

    def reset(self) -> None:
        """Mark every page but the sink free (the tensors keep their contents)."""
        # Popped from the end: low page ids are handed out first.
        self._free: list[int] = list(range(self.num_pages - 1, 0, -1))
        self._owned = bytearray(self.num_pages)  # 1 = handed out

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * self.page_size

    @property
    def capacity_pages(self) -> int:
        """Pages the allocator can hand out (all but the sink)."""
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes + sum(t.nbytes for t in self.scale_args)

    @property
    def scale_args(self) -> tuple[torch.Tensor, ...]:
        """The graphs' trailing inputs for this pool: ``(k_scale, v_scale)`` for FP8, else none."""
        if self.k_scale is None or self.v_scale is None:
            return ()
        return self.k_scale, self.v_scale

    def alloc_pages(self, n: int) -> list[int] | None:
        """``n`` free pages, or ``None`` (nothing taken) if fewer than ``n`` are free."""
        if n < 0:
            raise KVPoolError(f"alloc_pages(n={n}): n must be >= 0")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        owned = self._owned
        for p in pages:
            owned[p] = 1
        return pages

    def free_pages(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Raises on the sink page, a foreign id or a double free."""
        owned = self._owned
        pages = list(pages)
        for p in pages:
            if not 0 < p < self.num_pages:
                raise KVPoolError(
                    f"free_pages: page {p} is not a page of this pool (1..{self.num_pages - 1})"
                )
            if not owned[p]:
                raise KVPoolError(f"free_pages: page {p} is already free (double free)")
            owned[p] = 0
        self._free.extend(pages)

    def is_allocated(self, page: int) -> bool:
        return 0 < page < self.num_pages and bool(self._owned[page])

    def slots_of(self, pages: Iterable[int]) -> list[int]:
        """The slots of ``pages`` in order: page ``p`` gives ``p * page_size + i``, ``i < page_size``."""
        page_size = self.page_size
        if page_size == 1:
            return list(pages)
        return [p * page_size + i for p in pages for i in range(page_size)]


class BlockTable:
    """The persistent ``[R, max_blocks]`` int32 block table and its per-row host bookkeeping.

    ``num_rows = max_running + 1``: row 0 is the padding row, never handed out and always all zeros,
    so a padded batch entry (``req_rows = 0``) only ever reads and writes the sink page. Rows
    ``1..max_running`` belong to running requests (``alloc_row``). ``assign``/``append``/``release``
    update the host lists immediately and queue the device writes; ``flush()`` (once per step,
    before the step's kernels read the table) applies all queued writes with one copy and one
    ``index_put_``. A released row is zeroed on the device at the next flush.

    Token position ``p`` of row ``r`` lives at slot
    ``table[r, p // page_size] * page_size + p % page_size``.
    """

    PAD_ROW = 0

    def __init__(self, max_running: int, max_blocks: int, device: torch.device | str, page_size: int = 1):
        if max_running < 1 or max_blocks < 1:
            raise KVPoolError(
                f"BlockTable needs max_running >= 1 and max_blocks >= 1, got {max_running}, {max_blocks}"
            )
        self.max_running = max_running
        self.num_rows = max_running + 1  # the padding row, then one per running request
        self.max_blocks = max_blocks
        self.page_size = page_size
        self.device = torch.device(device)
        # table: [R, max_blocks] int32
        if self.num_rows * max_blocks >= 2**31:  # flush() sends flat indices as int32
            raise KVPoolError(
                f"BlockTable: {self.num_rows} rows x {max_blocks} blocks exceeds 2^31 entries; "
                "use a larger page size or fewer concurrent requests"
            )
        self.table = torch.zeros(self.num_rows, max_blocks, dtype=torch.int32, device=self.device)
        self._pages: list[list[int]] = [[] for _ in range(self.num_rows)]
        self._free_rows: list[int] = list(range(self.num_rows - 1, 0, -1))
        self._in_use = bytearray(self.num_rows)
        # row * max_blocks + block (the flat index into ``table``) -> page; last write wins
        self._pending: dict[int, int] = {}
        # tensor-parallel rank 0 (track_changes): the changes flush wrote here since take_changes
        # last ran, which the other ranks' tables have not been sent (None: not tracked)
        self._unsent: dict[int, int] | None = None
        self._sent: dict[int, int] = {}  # the pending changes take_changes handed out (not twice)
        self.stager: Any = None  # a runtime.staging.HostStager, set by the engine

    # rows -------------------------------------------------------------------------------------
    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        """A free row (its block list empty), or ``None`` when all rows are in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._in_use[row] = 1
        return row

    def release(self, row: int) -> list[int]:
        """Free ``row`` and return the pages it held (the caller frees or caches them)."""
        self._check_row(row)
        pages = self._pages[row]
        base = row * self.max_blocks
        for b in range(len(pages)):
            self._pending[base + b] = 0
        self._pages[row] = []
        self._in_use[row] = 0
        self._free_rows.append(row)
        return pages

    # pages ------------------------------------------------------------------------------------
    def assign(self, row: int, pages: Sequence[int]) -> None:
        """Replace the pages of ``row`` with ``pages`` (blocks ``0..len(pages)-1``)."""
        self._check_row(row)
        self._check_fits(row, len(pages))
        old = self._pages[row]
        base = row * self.max_blocks
        for b in range(len(pages), len(old)):
            self._pending[base + b] = 0
        for b, p in enumerate(pages):
            if b >= len(old) or old[b] != p:
                self._pending[base + b] = p
        self._pages[row] = list(pages)

    def append(self, row: int, pages: Sequence[int]) -> None:
        """Add ``pages`` after the pages ``row`` already holds."""
        self._check_row(row)
        cur = self._pages[row]
        self._check_fits(row, len(cur) + len(pages))
        base = row * self.max_blocks
        for p in pages:
            self._pending[base + len(cur)] = p
            cur.append(p)

    def cover(self, row: int, tokens: int, pool: KVPool) -> bool:
        """Append pages from ``pool`` until ``row`` holds slots for ``tokens`` positions; False
        (nothing taken) when the pool has too few free pages. (The scheduler allocates through
        its own path, which evicts cached prefixes first.)"""
        need = -(-tokens // self.page_size) - len(self._pages[row])
        if need <= 0:
            return True
        pages = pool.alloc_pages(need)
        if pages is None:
            return False
        self.append(row, pages)
        return True

    def append_each(self, rows: Sequence[int], pages: Sequence[int]) -> None:
        """``append(rows[i], [pages[i]])`` for every ``i``: what a decode step does for the
        requests whose next token starts a page."""
        tables, pending, in_use, mb = self._pages, self._pending, self._in_use, self.max_blocks
        for row, p in zip(rows, pages, strict=True):
            if not 0 < row < self.num_rows or not in_use[row]:
                self._check_row(row)
            cur = tables[row]
            if len(cur) >= mb:
                self._check_fits(row, len(cur) + 1)
            pending[row * mb + len(cur)] = p
            cur.append(p)

    @property
    def row_pages(self) -> list[list[int]]:
        """Every row's host page list, indexed by row (read-only; for per-step fast paths)."""
        return self._pages

    def pages(self, row: int) -> list[int]:
        """The host copy of ``row``'s pages (do not mutate; use assign/append)."""
        return self._pages[row]

    def num_blocks(self, row: int) -> int:
        return len(self._pages[row])

    def slots(self, row: int, start: int, end: int) -> list[int]:
        """Slots of token positions ``start..end-1`` of ``row`` (for ``out_slots``)."""
        page_size, pages = self.page_size, self._pages[row]
        if end > len(pages) * page_size:
            raise KVPoolError(f"row {row} holds {len(pages) * page_size} slots; positions up to {end} asked")
        if page_size == 1:
            return pages[start:end]
        return [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]

    def slot_each(self, rows: Sequence[int], positions: Sequence[int]) -> list[int]:
        """The slot of position ``positions[i]`` of row ``rows[i]`` for every ``i`` (a decode
        step's ``out_slots``; the rows' pages must cover the positions)."""
        page_size, tables = self.page_size, self._pages
        if page_size == 1:
            return [tables[row][k] for row, k in zip(rows, positions)]
        return [tables[row][k // page_size] * page_size + k % page_size for row, k in zip(rows, positions)]

    # device -----------------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def track_changes(self) -> None:
        """Keep what :meth:`flush` writes for :meth:`take_changes` (tensor-parallel rank 0, whose
        table other ranks mirror: a step that runs on rank 0 alone, a draft's, flushes changes
        the next broadcast step must still carry)."""
        self._unsent = {}

    def take_changes(self) -> dict[int, int]:
        """The changes since the last call, flushed or not, ``{row * max_blocks + block: page}``
        (last write wins): what another rank's table applies with :meth:`queue_changes` to mirror
        this one. Needs :meth:`track_changes`."""
        if self._unsent is None:
            raise KVPoolError("BlockTable.take_changes: call track_changes() first")
        out, self._unsent = self._unsent, {}
        out.update(self._pending)
        self._sent = dict(self._pending)  # the next flush writes them: not unsent then
        return out

    def queue_changes(self, changes: dict[int, int]) -> None:
        """Queue another table's :meth:`take_changes` for the next ``flush`` (the device table
        only: this table's host page lists are left alone)."""
        self._pending.update(changes)

    def flush(self) -> None:
        """Write the queued changes to ``table``: one host->device copy and one ``index_put_``."""
        pending = self._pending
        if not pending:
            return
        n = len(pending)
        packed = np.empty((2, n), dtype=np.int32)  # [flat index, page] x n (the table is int32)
        packed[0] = np.fromiter(pending.keys(), np.int32, n)
        packed[1] = np.fromiter(pending.values(), np.int32, n)
        if self._unsent is not None:
            sent = self._sent
            self._unsent.update((k, v) for k, v in pending.items() if sent.get(k, -1) != v)
            self._sent = {}
        pending.clear()
        host = torch.from_numpy(packed)
        if self.stager is not None:  # persistent pinned buffers (no allocation, no sync)
            dev = self.stager.to_device(host, torch.int32)
        elif self.device.type == "cuda":
            dev = host.pin_memory().to(self.device, non_blocking=True)
        else:
            dev = host
        self.table.view(-1).index_put_((dev[0],), dev[1])

    def check(self) -> None:
        """Assert the device table equals the host lists (syncs; for tests and idle loops)."""
        if self._pending:
            raise KVPoolError("BlockTable.check: unflushed changes (call flush() first)")
        expect = torch.zeros(self.num_rows, self.max_blocks, dtype=torch.int32)
        for r, pages in enumerate(self._pages):
            if pages:
                expect[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        if not torch.equal(self.table.cpu(), expect):
            raise KVPoolError("BlockTable.check: device table differs from the host bookkeeping")
        if self._pages[self.PAD_ROW]:
            raise KVPoolError("BlockTable.check: the padding row holds pages")

    def _check_row(self, row: int) -> None:
        if not 0 < row < self.num_rows or not self._in_use[row]:
            raise KVPoolError(f"row {row} is not an allocated row of this block table")

    def _check_fits(self, row: int, n: int) -> None:
        if n > self.max_blocks:
            raise KVPoolError(
                f"row {row} needs {n} blocks but the table has {self.max_blocks} "
                f"(max context {self.max_blocks * self.page_size} tokens)"
            )
