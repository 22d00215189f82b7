"""RadixCache: unit cases plus hypothesis-driven request lifecycles against a naive model.

The reference model is a dict from every cached whole-page prefix (a tuple of token ids) to the
slots of its last page; locks are the prefixes running requests matched. After every operation the tree's
matches, insert results, evictions and sizes must agree with it, and ``check_integrity`` and the
page accounting (pool free + tree + requests' own pages == capacity) must hold.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime.kv_pool import KVPool
from kiln.runtime.radix_cache import RadixCache


def _pool(page_size: int, pages: int = 512) -> KVPool:
    return KVPool(1, pages * page_size, 1, 1, 1, torch.float32, "cpu", page_size=page_size)


def _slots(pool: KVPool, n_tokens: int) -> tuple[list[int], list[int]]:
    pages = pool.alloc_pages(-(-n_tokens // pool.page_size))
    return pages, pool.slots_of(pages)


# ---- unit cases -------------------------------------------------------------------------------


def test_match_leaves_one_token_and_splits():
    rc = RadixCache(page_size=1)
    assert rc.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    slots, node = rc.match_prefix([1, 2, 3, 4])
    assert slots == [10, 11, 12] and node.key == [1, 2, 3]  # split at 3, one token left
    slots, node = rc.match_prefix([1, 2, 9])
    assert slots == [10, 11] and node.key == [1, 2]  # split again
    assert rc.match_prefix([1])[0] == [] and rc.match_prefix([])[0] == []
    assert rc.insert([1, 2, 3, 4, 5], [0, 0, 0, 0, 14]) == 4
    assert rc.total_size == 5 and rc.evictable_size == 5
    rc.check_integrity()


def test_page_granularity():
    rc = RadixCache(page_size=4)
    toks = list(range(10))
    assert rc.insert(toks, list(range(4, 14))) == 0  # only 8 tokens (2 pages) go in
    assert rc.total_size == 8
    assert rc.match_prefix(toks)[0] == list(range(4, 12))
    assert rc.match_prefix(toks[:8])[0] == list(range(4, 8))  # at most len - 1, whole pages
    assert rc.match_prefix([0, 1, 2, 3, 4, 5, 99, 7, 8])[0] == [4, 5, 6, 7]  # mismatch inside page 2
    rc.check_integrity()


def test_lock_protects_and_lru_evicts_oldest_leaf():
    pool = _pool(1, 64)
    rc = RadixCache(page_size=1)
    seqs = [[1, 2, 3], [1, 2, 4], [5, 6], [7]]
    for s in seqs:
        _, slots = _slots(pool, len(s))
        assert rc.insert(s, slots) == (2 if s == [1, 2, 4] else 0)
    pool.free_pages([4])  # the duplicate of [1, 2] from the second insert
    _, node = rc.match_prefix([5, 6, 0])  # touch [5, 6]
    rc.lock(node)
    assert rc.protected_size == 2 and rc.evictable_size == 5
    freed: list[int] = []
    rc.evict(1, lambda pages: (freed.extend(pages), pool.free_pages(pages)))
    assert freed == [3]  # leaf [3] of [1, 2, 3] is the least recently used
    assert rc.evict(100, pool.free_pages) == 4  # [4], then [1, 2] (now a leaf), then [7]
    assert rc.total_size == 2 and rc.match_prefix([5, 6, 1])[0] == [7, 8]
    rc.unlock(node)
    assert rc.evictable_size == 2 and rc.protected_size == 0
    with pytest.raises(RuntimeError, match="holds no lock"):
        rc.unlock(node)
    rc.check_integrity(pool.is_allocated)


def test_integrity_catches_corruption():
    rc = RadixCache(page_size=1)
    rc.insert([1, 2], [5, 6])
    rc.insert([3], [5])
    with pytest.raises(AssertionError, match="two nodes"):
        rc.check_integrity()
    rc = RadixCache(page_size=1)
    rc.insert([1, 2], [5, 6])
    rc.evictable_size += 1
    with pytest.raises(AssertionError, match="evictable_size"):
        rc.check_integrity()


def test_disabled_caches_nothing_and_finish_frees_all():
    pool = _pool(4, 16)
    rc = RadixCache(page_size=4, disabled=True)
    slots, node = rc.match_prefix(list(range(9)))
    assert slots == [] and node is rc.root
    rc.lock(node)
    pages, s = _slots(pool, 9)
    assert rc.insert(list(range(9)), s) == 0 and rc.total_size == 0
    rc.finish_request(list(range(9)), pages, 0, node, pool.free_pages)
    assert pool.num_free_pages == pool.capacity_pages and rc.evict(10, pool.free_pages) == 0
    rc.check_integrity()


def test_cache_unfinished_moves_lock_and_adopts_cached_pages():
    pool = _pool(2, 32)
    rc = RadixCache(page_size=2)
    a_pages, a_slots = _slots(pool, 6)
    rc.insert([1, 2, 3, 4, 5, 6], a_slots)  # another request cached these
    b_pages, _ = _slots(pool, 7)  # request B computed the same 6 tokens itself, plus one more
    pages, plen, node = rc.cache_unfinished([1, 2, 3, 4, 5, 6, 7], b_pages, 0, rc.root, pool.free_pages)
    assert pages[:3] == a_pages and pages[3:] == b_pages[3:] and plen == 6
    assert rc.protected_size == 6 and rc.evictable_size == 0
    rc.finish_request([1, 2, 3, 4, 5, 6, 7, 8, 9], pages, plen, node, pool.free_pages)
    assert rc.total_size == 8 and rc.protected_size == 0
    assert pool.num_free_pages == pool.capacity_pages - 4
    rc.check_integrity(pool.is_allocated)


# ---- property test against a naive model -----------------------------------------------------


class Model:
    """cached: whole-page prefix tuple -> slots of its last page."""

    def __init__(self, P: int):
        self.P = P
        self.cached: dict[tuple[int, ...], list[int]] = {}

    def slots(self, seq: list[int], m: int) -> list[int]:
        return [s for i in range(0, m, self.P) for s in self.cached[tuple(seq[: i + self.P])]]

    def locked(self, running: list[dict]) -> set[tuple[int, ...]]:
        return {tuple(r["seq"][: i + self.P]) for r in running for i in range(0, r["plen"], self.P)}

    def match_len(self, seq: list[int], limit: int) -> int:
        m = 0
        while m + self.P <= limit and tuple(seq[: m + self.P]) in self.cached:
            m += self.P
        return m

    def insert(self, seq: list[int], slots: list[int]) -> int:
        n = len(seq) // self.P * self.P
        already = self.match_len(seq, n)
        for i in range(already, n, self.P):
            self.cached[tuple(seq[: i + self.P])] = list(slots[i : i + self.P])
        return already


def _seq(draw, P: int) -> list[int]:
    # Pages from a few patterns that differ only in their last token, so prefixes share and
    # diverge inside pages; then a partial page.
    pages = draw(st.lists(st.integers(0, 2), max_size=4))
    out: list[int] = []
    for k in pages:
        out += [7] * (P - 1) + [k]
    return out + [7] * draw(st.integers(0, P - 1)) + draw(st.lists(st.integers(0, 2), max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(P=st.sampled_from([1, 2, 16]), data=st.data())
def test_random_lifecycles_agree_with_model(P, data):
    pool = _pool(P, 256)
    rc, ref = RadixCache(page_size=P), Model(P)
    running: list[dict] = []  # {seq, pages, plen, node}

    def check():
        rc.check_integrity(pool.is_allocated)
        locked = ref.locked(running)
        assert rc.total_size == len(ref.cached) * P
        assert rc.protected_size == len(locked) * P
        assert rc.evictable_size == (len(ref.cached) - len(locked)) * P
        own = sum(len(r["pages"]) - r["plen"] // P for r in running)
        assert pool.num_free_pages + rc.total_size // P + own == pool.capacity_pages

    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["start", "start", "finish", "chunk", "insert", "evict", "match"]))
        if op in ("start", "match", "insert"):
            seq = _seq(data.draw, P)
            slots, node = rc.match_prefix(seq)
            m = ref.match_len(seq, max(0, (len(seq) - 1) // P * P))
            assert slots == ref.slots(seq, m)
            assert len(node.key) == 0 or len(slots) > 0
            if op == "insert":  # a bare insert of fresh slots; the duplicates go straight back
                pages, s = _slots(pool, len(seq))
                got = rc.insert(seq, s)
                assert got == ref.insert(seq, s)
                n = len(seq) // P * P
                pool.free_pages(pages[: got // P] + pages[n // P :])
            elif op == "start" and len(running) < 4:
                rc.lock(node)
                pages, _ = _slots(pool, len(seq) - len(slots))
                pages = [s // P for s in slots[::P]] + pages
                running.append({"seq": seq, "pages": pages, "plen": len(slots), "node": node})
        elif op in ("finish", "chunk") and running:
            r = running[data.draw(st.integers(0, len(running) - 1))]
            P_ = r["plen"]
            if op == "finish":
                running.remove(r)
                slots = pool.slots_of(r["pages"])
                rc.finish_request(r["seq"], r["pages"], P_, r["node"], pool.free_pages)
                ref.insert(r["seq"], slots)
            else:
                k = data.draw(st.integers(0, len(r["seq"])))
                slots = pool.slots_of(r["pages"])
                pages, plen, node = rc.cache_unfinished(
                    r["seq"][:k], r["pages"], P_, r["node"], pool.free_pages
                )
                ref.insert(r["seq"][:k], slots)
                assert plen == max(P_, k // P * P)
                assert pool.slots_of(pages)[:plen] == ref.slots(r["seq"], plen)
                r.update(pages=pages, plen=plen, node=node)
        elif op == "evict":
            want = data.draw(st.integers(0, 3 * P))
            before = rc.evictable_size
            freed_slots: set[int] = set()

            def free(pages, freed_slots=freed_slots):
                freed_slots.update(pool.slots_of(pages))
                pool.free_pages(pages)

            got = rc.evict(want, free)
            gone = {k for k, s in ref.cached.items() if set(s) & freed_slots}
            assert got == len(gone) * P == len(freed_slots) and got >= min(want, before)
            assert not gone & ref.locked(running)
            for k in gone:
                del ref.cached[k]
            assert all(k[:i] in ref.cached for k in ref.cached for i in range(P, len(k), P))  # prefix-closed
        check()
    for r in running:
        rc.finish_request(r["seq"], r["pages"], r["plen"], r["node"], pool.free_pages)
    assert rc.protected_size == 0
    rc.evict(rc.total_size, pool.free_pages)
    assert rc.total_size == 0 and pool.num_free_pages == pool.capacity_pages
    rc.check_integrity()
