"""KVPool allocator and BlockTable bookkeeping against plain-Python models."""

import random

import pytest
import torch

from kiln.errors import KilnError
from kiln.runtime.kv_pool import BlockTable, KVPool, KVPoolError, size_for_memory


def _pool(num_slots=64, page_size=4):
    return KVPool(2, num_slots, 2, 8, 6, torch.float32, "cpu", page_size=page_size)


def test_shapes_and_capacity():
    pool = _pool(64, 4)
    assert pool.k_cache.shape == (2, 64, 2, 8) and pool.v_cache.shape == (2, 64, 2, 6)
    assert pool.num_pages == 16 and pool.capacity_pages == 15 and pool.capacity_tokens == 60
    assert pool.num_free_pages == 15 and pool.num_free_slots == 60
    assert pool.nbytes == (64 * 2 * 8 + 64 * 2 * 6) * 2 * 4


def test_fp8_pool_has_a_scale_per_head_row():
    pool = KVPool(2, 64, 2, 8, 6, torch.float8_e4m3fn, "cpu", page_size=4)
    assert pool.k_scale is not None and pool.v_scale is not None
    assert pool.k_scale.shape == pool.v_scale.shape == (2, 64, 2) and pool.k_scale.dtype == torch.float32
    assert pool.scale_args == (pool.k_scale, pool.v_scale)
    assert pool.nbytes == 64 * 2 * (8 + 6) * 2 + 2 * (2 * 64 * 2 * 4)
    assert _pool().scale_args == () and _pool().k_scale is None  # other dtypes: no scales


def test_alloc_never_hands_out_sink_and_all_or_nothing():
    pool = _pool(64, 4)
    got = pool.alloc_pages(15)
    assert sorted(got) == list(range(1, 16))
    assert pool.alloc_pages(1) is None and pool.num_free_pages == 0
    pool.free_pages(got[:3])
    assert pool.alloc_pages(4) is None and pool.num_free_pages == 3  # nothing taken on failure
    assert sorted(pool.alloc_pages(3)) == sorted(got[:3])
    assert pool.alloc_pages(0) == []


def test_cover_grows_a_row_to_a_length_all_or_nothing():
    pool, bt = _pool(64, 4), BlockTable(2, 16, "cpu", page_size=4)
    row = bt.alloc_row()
    assert bt.cover(row, 5, pool) and bt.num_blocks(row) == 2  # 5 positions: two pages of 4
    assert bt.cover(row, 8, pool) and bt.num_blocks(row) == 2  # already covered: nothing taken
    assert pool.num_free_pages == 13
    assert not bt.cover(row, 8 + 14 * 4, pool) and bt.num_blocks(row) == 2 and pool.num_free_pages == 13
    assert bt.cover(row, 60, pool) and bt.num_blocks(row) == 15 and pool.num_free_pages == 0


def test_random_alloc_free_matches_model():
    rng = random.Random(0)
    pool = _pool(256, 2)
    held: set[int] = set()
    for _ in range(500):
        if rng.random() < 0.55:
            n = rng.randint(0, 10)
            got = pool.alloc_pages(n)
            if n > 127 - len(held):
                assert got is None
            else:
                assert len(got) == n and not (set(got) & held) and 0 not in got
                held |= set(got)
        elif held:
            out = rng.sample(sorted(held), rng.randint(1, len(held)))
            pool.free_pages(out)
            held -= set(out)
        assert pool.num_free_pages == 127 - len(held)
        assert all(pool.is_allocated(p) for p in held)


def test_double_free_foreign_and_sink_are_errors():
    pool = _pool(64, 4)
    pages = pool.alloc_pages(2)
    pool.free_pages(pages)
    with pytest.raises(KVPoolError, match="double free"):
        pool.free_pages(pages[:1])
    for bad in (0, 16, -1):
        with pytest.raises(KVPoolError, match="not a page"):
            pool.free_pages([bad])
    assert isinstance(KVPoolError("x"), KilnError)


def test_slots_of():
    assert _pool(64, 4).slots_of([3, 1]) == [12, 13, 14, 15, 4, 5, 6, 7]
    assert _pool(16, 1).slots_of([5, 2]) == [5, 2]


def test_size_for_memory():
    assert size_for_memory(1000, 10, 1) == 100
    assert size_for_memory(1000, 10, 16) == 96
    with pytest.raises(KVPoolError, match="--kv-memory"):
        size_for_memory(100, 10, 16)
    assert KVPool.size_for_memory(2**20, 256, 16) == 4096


def test_bad_pool_sizes():
    with pytest.raises(KVPoolError, match="multiple of page_size"):
        _pool(30, 4)


def test_block_table_flush_matches_host_model():
    rng = random.Random(1)
    bt = BlockTable(max_running=5, max_blocks=8, device="cpu", page_size=4)
    assert bt.table.shape == (6, 8) and bt.table.dtype == torch.int32
    model: dict[int, list[int]] = {}
    for step in range(200):
        op = rng.random()
        if op < 0.25 and bt.num_free_rows:
            row = bt.alloc_row()
            assert row not in model and row != BlockTable.PAD_ROW
            model[row] = []
        elif op < 0.5 and model:
            row = rng.choice(sorted(model))
            pages = [rng.randint(1, 99) for _ in range(rng.randint(0, 8))]
            bt.assign(row, pages)
            model[row] = pages
        elif op < 0.8 and model:
            row = rng.choice(sorted(model))
            extra = [rng.randint(1, 99) for _ in range(rng.randint(0, 8 - len(model[row])))]
            bt.append(row, extra)
            model[row] += extra
        elif model:
            row = rng.choice(sorted(model))
            assert bt.release(row) == model.pop(row)
        if step % 7 == 0:
            bt.flush()
            bt.check()
            expect = torch.zeros(6, 8, dtype=torch.int32)
            for r, pages in model.items():
                expect[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            assert torch.equal(bt.table, expect)
        for r, pages in model.items():
            assert bt.pages(r) == pages


def test_block_table_append_each_equals_append():
    rng = random.Random(2)
    a = BlockTable(max_running=6, max_blocks=5, device="cpu", page_size=4)
    b = BlockTable(max_running=6, max_blocks=5, device="cpu", page_size=4)
    rows = [a.alloc_row() for _ in range(6)]
    assert rows == [b.alloc_row() for _ in range(6)]
    for step in range(12):
        grow = [r for r in rows if a.num_blocks(r) < 5 and rng.random() < 0.7]
        pages = [rng.randint(1, 99) for _ in grow]
        a.append_each(grow, pages)
        for r, p in zip(grow, pages):
            b.append(r, [p])
        if step % 3 == 2:
            a.flush()
            b.flush()
            a.check()
            assert torch.equal(a.table, b.table)
        assert [a.pages(r) for r in rows] == [b.pages(r) for r in rows]
        held = [(r, rng.randrange(a.num_blocks(r) * 4)) for r in rows if a.num_blocks(r)]
        got = a.slot_each([r for r, _ in held], [k for _, k in held])
        assert got == [a.slots(r, k, k + 1)[0] for r, k in held]
    full = next(r for r in rows if a.num_blocks(r) == 5)
    with pytest.raises(KVPoolError, match="max context 20 tokens"):
        a.append_each([full], [1])
    a.release(rows[0])
    with pytest.raises(KVPoolError, match="not an allocated row"):
        a.append_each([rows[0]], [1])


def test_block_table_one_write_per_flush(monkeypatch):
    bt = BlockTable(max_running=2, max_blocks=4, device="cpu", page_size=1)
    row = bt.alloc_row()
    bt.assign(row, [7, 8])
    bt.append(row, [9])
    calls = []
    orig = torch.Tensor.index_put_
    monkeypatch.setattr(
        torch.Tensor, "index_put_", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k)
    )
    bt.flush()
    bt.flush()  # nothing pending: no device work
    assert len(calls) == 1
    assert bt.table[row].tolist() == [7, 8, 9, 0]


def test_block_table_changes_reach_a_mirror_though_flushed_between():
    """``take_changes`` (tensor-parallel rank 0): every change since the last call, those a flush
    already wrote included, so a mirror table that applies them (``queue_changes``) equals this one
    although steps on this rank alone flushed in between."""
    bt, mirror = BlockTable(3, 4, "cpu"), BlockTable(3, 4, "cpu")
    with pytest.raises(KVPoolError, match="track_changes"):
        bt.take_changes()
    bt.track_changes()
    rows = [bt.alloc_row(), bt.alloc_row()]
    bt.append(rows[0], [5, 6])
    bt.flush()  # a draft's step on this rank alone
    bt.append(rows[1], [7])
    changes = bt.take_changes()
    assert changes == {rows[0] * 4: 5, rows[0] * 4 + 1: 6, rows[1] * 4: 7}
    bt.flush()
    bt.release(rows[0])
    bt.flush()
    bt.append(rows[1], [8])
    for c in (changes, bt.take_changes()):
        mirror.queue_changes(c)
        mirror.flush()
    bt.flush()
    assert torch.equal(mirror.table, bt.table)
    assert bt.take_changes() == {}  # each change went once
    bt.append(rows[1], [9])
    bt.assign(rows[1], [7, 8, 10])  # pending rewrites of what was handed out, then flushed
    first = bt.take_changes()
    bt.flush()
    bt.assign(rows[1], [7, 11, 10])
    bt.flush()  # block 1 back to a value the mirror has not seen: sent again
    second = bt.take_changes()
    assert second == {rows[1] * 4 + 1: 11}
    for c in (first, second):
        mirror.queue_changes(c)
        mirror.flush()
    assert torch.equal(mirror.table, bt.table)


def test_block_table_slots_and_limits():
    bt = BlockTable(max_running=1, max_blocks=3, device="cpu", page_size=4)
    row = bt.alloc_row()
    assert bt.alloc_row() is None
    bt.assign(row, [5, 2])
    assert bt.slots(row, 2, 7) == [22, 23, 8, 9, 10]
    with pytest.raises(KVPoolError, match="positions up to 9"):
        bt.slots(row, 0, 9)
    with pytest.raises(KVPoolError, match="max context 12 tokens"):
        bt.append(row, [1, 3])
    with pytest.raises(KVPoolError, match="not an allocated row"):
        bt.assign(BlockTable.PAD_ROW, [1])
    bt.release(row)
    with pytest.raises(KVPoolError, match="not an allocated row"):
        bt.release(row)


@pytest.mark.gpu
def test_block_table_flush_on_gpu_without_sync():
    bt = BlockTable(max_running=8, max_blocks=16, device="cuda", page_size=16)
    rows = [bt.alloc_row() for _ in range(8)]
    for i, r in enumerate(rows):
        bt.assign(r, list(range(10 * i + 1, 10 * i + 1 + i)))
    bt.flush()  # warms the pinned-memory allocator
    bt.append(rows[3], [99, 98])
    bt.release(rows[5])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bt.flush()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    bt.check()
    pool = KVPool(4, 1024, 8, 128, 128, torch.bfloat16, "cuda", page_size=16)
    assert pool.k_cache.is_cuda and pool.k_cache.shape == (4, 1024, 8, 128)
