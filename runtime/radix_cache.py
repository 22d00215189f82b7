"""Radix prefix cache over token ids at page granularity.

The tree maps token prefixes to the KV slots that hold them, so a request whose prompt starts
with a cached prefix skips recomputing it. Everything is plain Python: keys are lists of token
ids, values the matching lists of slot ids; no device tensors live in the tree.

Page granularity (``page_size``): only whole pages are inserted and matched; keys are compared
page by page, and children are keyed by their first page (a tuple of ``page_size`` token ids).
Node keys always hold a whole number of pages, and the slots of each page are ``page_size``
consecutive slots starting at a multiple of it, so ``slot // page_size`` names the page. Eviction
hands page ids to ``free_fn``.

How the scheduler uses it (token counts below are always multiples of ``page_size``):

* admit: ``slots, node = match_prefix(tokens)``; ``lock(node)``; the request reuses the pages of
  ``slots`` (``slots[::page_size] // page_size``) and allocates pages for the rest.
* finish or abort: ``finish_request(tokens, pages, prefix_len, node, free_fn)``, which inserts
  the request's whole pages, frees its duplicates of pages another request cached meanwhile,
  frees the pages past the cached part, and unlocks ``node``.
* chunked prefill between chunks: ``cache_unfinished(...)`` inserts the chunk's pages and moves
  the lock to the new deepest node (the caller rewrites its block-table row with the pages it
  returns).
* out of pages: ``evict(n, pool.free_pages)`` frees least-recently-used unlocked leaves.

``RadixCache(page_size, disabled=True)`` (``--no-radix-cache``) keeps the same interface and
caches nothing: matches are empty and ``finish_request`` frees every page.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

FreeFn = Callable[[list[int]], None]


class TreeNode:
    __slots__ = ("children", "held", "id", "key", "last_access", "lock_ref", "parent", "value")
    _ids = itertools.count()

    def __init__(self, key: list[int], value: list[int], parent: TreeNode | None) -> None:
        self.key = key  # token ids, a whole number of pages
        self.value = value  # slot ids, one per token
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0  # locks on this node or any descendant
        self.held = 0  # locks taken on this very node
        self.last_access = 0
        self.id = next(TreeNode._ids)

    @property
    def up(self) -> TreeNode:
        """The parent of a node in the tree (every node but the root has one)."""
        assert self.parent is not None, f"{self!r} is the root or detached"
        return self.parent

    def __lt__(self, other: TreeNode) -> bool:  # heap order: LRU first, then oldest node
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache:
    """Radix tree of cached prefixes; see the module docstring for the protocol.

    Accounting (in tokens): ``protected_size`` is held by nodes some running request has locked
    (``lock_ref > 0``), ``evictable_size`` by the rest; ``total_size`` is their sum.
    """

    def __init__(self, page_size: int = 1, disabled: bool = False) -> None:
        self.page_size = page_size
        self.disabled = disabled
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree (the caller owns freeing the pages; see ``all_pages``)."""
        self.root = TreeNode([], [], None)
        self.root.lock_ref = 1  # never evicted, never counted
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---------------------------------------------------------------------------------- lookup
    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], TreeNode]:
        """The longest cached prefix of ``tokens``: ``(slots, last_node)``.

        The match is cut to whole pages and to at most ``len(tokens) - 1`` tokens, so at least one
        token is left to compute (its logits start decoding). ``last_node`` ends exactly at the
        match (a node is split if needed); lock it while the request runs. ``slots``: list[int].
        """
        if self.disabled:
            return [], self.root
        page_size = self.page_size
        limit = (len(tokens) - 1) // page_size * page_size if tokens else 0
        node, slots = self._walk(tokens, limit)
        return slots, node

    def _walk(self, tokens: Sequence[int], limit: int) -> tuple[TreeNode, list[int]]:
        page_size = self.page_size
        node, pos, slots = self.root, 0, []
        self._clock += 1
        node.last_access = self._clock
        while pos < limit:
            child = node.children.get(tuple(tokens[pos : pos + page_size]))
            if child is None:
                break
            n = self._common(child.key, tokens, pos, limit)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            slots.extend(child.value)
            pos += n
            node = child
        return node, slots

    def _common(self, key: list[int], tokens: Sequence[int], pos: int, limit: int) -> int:
        """Tokens of ``key`` equal to ``tokens[pos:limit]``, cut to whole pages (>= page_size here)."""
        page_size = self.page_size
        end = min(len(key), limit - pos)
        if list(tokens[pos : pos + end]) == key[:end]:
            return end - end % page_size
        n = page_size  # the first page matched (it is the child's dict key)
        while n + page_size <= end and list(tokens[pos + n : pos + n + page_size]) == key[n : n + page_size]:
            n += page_size
        return n

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after ``n`` tokens; return the new upper node (which ends there)."""
        page_size = self.page_size
        parent = child.up
        upper = TreeNode(child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref  # every lock through child passes through upper
        upper.last_access = child.last_access
        parent.children[tuple(child.key[:page_size])] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[tuple(child.key[:page_size])] = child
        return upper

    # --------------------------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache ``tokens[:n]`` with ``slots[:n]``, ``n = len(tokens) // page_size * page_size``.

        Returns how many leading tokens were already cached (a multiple of ``page_size``). Those
        slots stay the tree's; the caller frees its own duplicate pages for that part (except the
        prefix it got from ``match_prefix``, which are the tree's own). ``slots[num_cached:n]``
        now belong to the tree. Disabled: caches nothing and returns 0.
        """
        if self.disabled:
            return 0
        if len(slots) < len(tokens):
            raise ValueError(f"insert: {len(tokens)} tokens but only {len(slots)} slots")
        page_size = self.page_size
        n = len(tokens) // page_size * page_size
        node, matched = self._walk(tokens, n)
        pos = len(matched)
        if pos < n:
            leaf = TreeNode(list(tokens[pos:n]), list(slots[pos:n]), node)
            leaf.last_access = self._clock
            node.children[tuple(tokens[pos : pos + page_size])] = leaf
            self.evictable_size += n - pos  # a new leaf is unlocked
        return pos

    # ---------------------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction while a request uses them."""
        if self.disabled or node is self.root:
            return
        node.held += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.up

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``."""
        if self.disabled or node is self.root:
            return
        if node.held <= 0:
            raise RuntimeError(f"unlock of {node!r} that holds no lock")
        node.held -= 1
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.up

    # -------------------------------------------------------------------------------- evict
    def evict(self, num_tokens: int, free_fn: FreeFn) -> int:
        """Free at least ``num_tokens`` cached tokens (fewer if not that many are evictable).

        Least recently used unlocked leaves go first; a parent left without children becomes a
        candidate. ``free_fn(pages)`` receives the page ids of each removed node. Returns the
        number of tokens freed (whole nodes, so it may exceed ``num_tokens``).
        """
        if self.disabled or num_tokens <= 0:
            return 0
        heap: list[TreeNode] = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        page_size = self.page_size
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            free_fn([s // page_size for s in node.value[::page_size]])
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            parent = node.up
            del parent.children[tuple(node.key[:page_size])]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    # ------------------------------------------------------------------- request lifecycle
    def finish_request(
        self, tokens: Sequence[int], pages: Sequence[int], prefix_len: int, node: TreeNode, free_fn: FreeFn
    ) -> None:
        """Hand a finished (or aborted) request's KV to the cache and unlock its prefix.

        ``tokens``: the token ids whose K/V are in the cache (prompt + generated, those computed).
        ``pages``: the request's block-table pages (``pages[:prefix_len // page_size]`` from
        ``match_prefix``).
        ``prefix_len``/``node``: what ``match_prefix`` gave (and ``lock`` took) at admission.
        Every page not kept by the tree goes to ``free_fn``.
        """
        page_size = self.page_size
        n = 0 if self.disabled else len(tokens) // page_size * page_size
        if n:
            cached = self.insert(tokens[:n], self._slots(pages, n))
            dup = pages[prefix_len // page_size : cached // page_size]
            if dup:
                free_fn(list(dup))
        rest = pages[n // page_size :]  # past the cached part: partial page, unused pages
        if rest:
            free_fn(list(rest))
        self.unlock(node)

    def cache_unfinished(
        self, tokens: Sequence[int], pages: Sequence[int], prefix_len: int, node: TreeNode, free_fn: FreeFn
    ) -> tuple[list[int], int, TreeNode]:
        """Cache a running request's computed whole pages (e.g. after a prefill chunk).

        Same arguments as ``finish_request``; the request keeps running. Returns ``(pages,
        prefix_len, node)`` to use from now on: its block-table row must be reassigned to
        ``pages`` (duplicates replaced by the tree's pages), and the lock has moved to ``node``.
        """
        if self.disabled:
            return list(pages), prefix_len, node
        page_size = self.page_size
        n = len(tokens) // page_size * page_size
        if n <= prefix_len:
            return list(pages), prefix_len, node
        cached = self.insert(tokens[:n], self._slots(pages, n))
        dup = pages[prefix_len // page_size : cached // page_size]
        if dup:
            free_fn(list(dup))
        new_node, slots = self._walk(tokens, n)
        assert len(slots) == n, "cache_unfinished: inserted prefix not found"
        self.lock(new_node)
        self.unlock(node)
        return [s // page_size for s in slots[::page_size]] + list(pages[n // page_size :]), n, new_node

    def _slots(self, pages: Sequence[int], n: int) -> list[int]:
        page_size = self.page_size
        if n > len(pages) * page_size:
            raise ValueError(
                f"{n} tokens to cache but the request holds only {len(pages)} pages of {page_size}"
            )
        if page_size == 1:
            return list(pages[:n])
        return [pages[i // page_size] * page_size + i % page_size for i in range(n)]

    # ---------------------------------------------------------------------------- inspection
    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_pages(self) -> list[int]:
        """Page ids held by the tree (free them before ``reset()`` to return them to the pool)."""
        page_size = self.page_size
        return [s // page_size for node in self._nodes() for s in node.value[::page_size]]

    def check_integrity(self, is_allocated: Callable[[int], bool] | None = None) -> None:
        """Raise ``AssertionError`` unless the tree is consistent.

        Checks: sizes add up; no page in two nodes; every page's slots are its ``page_size``
        consecutive slots; lock counts equal own locks plus the children's; children keyed by their first
        page; parent links; with ``is_allocated`` (e.g. ``KVPool.is_allocated``), every page held.
        """
        page_size = self.page_size
        evictable = protected = 0
        seen: set[int] = set()
        if self.disabled:
            assert not self.root.children and self.total_size == 0, "disabled cache holds tokens"
            return
        for node in self._nodes():
            assert node.key and len(node.key) % page_size == 0, (
                f"{node!r}: key of {len(node.key)} tokens, not whole pages"
            )
            assert len(node.key) == len(node.value), (
                f"{node!r}: {len(node.key)} keys, {len(node.value)} slots"
            )
            parent = node.parent
            assert parent is not None and parent.children.get(tuple(node.key[:page_size])) is node, (
                f"{node!r} is not its parent's child under its first page"
            )
            want = node.held + sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref == want, f"{node!r}: lock_ref {node.lock_ref}, locks below sum to {want}"
            assert node.held >= 0
            for i in range(0, len(node.value), page_size):
                first = node.value[i]
                assert first % page_size == 0 and node.value[i : i + page_size] == list(
                    range(first, first + page_size)
                ), f"{node!r}: slots {node.value[i : i + page_size]} are not one page"
                page = first // page_size
                assert page != 0, f"{node!r} holds the sink page 0"
                assert page not in seen, f"page {page} is held by two nodes"
                seen.add(page)
                if is_allocated is not None:
                    assert is_allocated(page), f"page {page} is in the tree but free in the pool"
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self.evictable_size, (
            f"evictable_size {self.evictable_size}, tree holds {evictable}"
        )
        assert protected == self.protected_size, (
            f"protected_size {self.protected_size}, tree holds {protected}"
        )
