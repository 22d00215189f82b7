"""Scheduler: continuous batching with chunked prefill, a radix prefix cache and preemption.

Each step is either an *extend* (prefill chunks of running or newly admitted requests, under a
token budget) or a *decode* (one token for every running request that has finished prefill).
When both kinds of work are pending, steps alternate so that decoding requests keep streaming
while long prompts are prefilled chunk by chunk.

Memory: a request holds a block-table row and KV pages. Its leading pages may belong to the radix
cache (matched at admission, or inserted by the request itself after each extend), locked while it
runs. When the pool runs out, unlocked cache leaves are evicted (LRU); if that is not enough, the
most recently admitted running request is retracted: its computed tokens go into the cache, it
returns to the front of the waiting queue, and it is recomputed later. Nothing is dropped.

Progress: every request fits the pool alone (the engine refuses one whose prompt plus
``max_tokens`` does not, before it is queued), so while requests run or wait ``schedule()`` always
returns a step: when none of the running requests can take its next chunk or token, the newest is
retracted until one can. A lone request that still cannot is a broken invariant and raises.

Fairness: while the queue is short, waiting requests are served longest cached prefix first; a
request passed over by ``max_overtakes`` later arrivals goes first, so none waits without bound
behind a stream of cache-hitting newcomers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.runtime.kv_pool import BlockTable, KVPool, KVPoolError
from kiln.runtime.model_runner import StepInputs
from kiln.runtime.radix_cache import RadixCache
from kiln.runtime.request import Req, Status

if TYPE_CHECKING:
    from kiln.runtime.spec_tree import TreeDraft


@dataclass
class SchedulerConfig:
    max_running: int = 256  # the engine's max_running (at most the artifact's max_batch_size)
    chunk_size: int = 4096  # extend token budget per step
    max_seq_len: int = 32768
    fcfs_threshold: int = 128  # longer queues are served first-come-first-served
    max_overtakes: int = 16  # later arrivals admitted ahead of a waiting request, at most
    mixed_steps: bool = False  # decode rows and a prefill chunk in one extend step (schedule())


@dataclass
class ScheduledBatch:
    mode: str  # "decode" | "extend"
    reqs: list[Req]
    extend_lens: list[int]  # tokens each request processes this step (1 for decode)
    decode_rows: int = 0  # extend mode: the first this many requests decode (a mixed step)

    def completes(self, i: int) -> bool:
        """Whether request ``i``'s logits are used (its step reaches the newest token)."""
        r = self.reqs[i]
        return r.kv_len + self.extend_lens[i] == r.seq_len


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: KVPool, block_table: BlockTable, radix: RadixCache):
        self.cfg = cfg
        self.pool = pool
        self.bt = block_table
        self.radix = radix
        self.page_size = pool.page_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._last_mode = "decode"
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue management
    def add(self, req: Req) -> None:
        """Queue ``req``; it must fit the pool alone (:meth:`fits_alone`)."""
        if not self.fits_alone(req):
            raise self._stuck(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Req) -> None:
        """Stop ``req`` wherever it is; its KV is released (its cached prefix stays cached)."""
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        req.status = Status.FINISHED

    def finish(self, req: Req) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        req.status = Status.FINISHED

    # ----------------------------------------------------------------- memory
    def _pages_needed(self, req: Req, upto: int) -> int:
        """Extra pages ``req`` needs so that tokens ``0..upto-1`` have slots."""
        return max(0, -(-upto // self.page_size) - len(self.bt.pages(req.row)))

    def _alloc(self, n: int) -> list[int] | None:
        pages = self.pool.alloc_pages(n)
        if pages is None and self.radix.evictable_size > 0:
            self.radix.evict(n * self.page_size, self.pool.free_pages)
            pages = self.pool.alloc_pages(n)
        return pages

    def _cache_prefix(self, req: Req) -> None:
        """Insert ``req``'s computed whole pages into the radix cache; the lock moves to them and
        pages the cache already held for the same tokens replace ours (ours are freed)."""
        pages, req.cached_len, req.last_node = self.radix.cache_unfinished(
            req.tokens(0, req.kv_len),
            self.bt.pages(req.row),
            req.cached_len,
            req.last_node,
            self.pool.free_pages,
        )
        self.bt.assign(req.row, pages)

    def _release(self, req: Req) -> None:
        """Give back ``req``'s row and pages, caching what it computed."""
        self._cache_prefix(req)
        pages = self.bt.release(req.row)
        own = pages[req.cached_len // self.page_size :]
        if own:
            self.pool.free_pages(own)
        if req.last_node is not None:
            self.radix.unlock(req.last_node)
        req.row, req.last_node, req.cached_len, req.kv_len = -1, None, 0, 0
        req.sampler_row = -1  # a resumed request's sampler row starts over, even in the same row

    def _retract_one(self, protect: set[int]) -> bool:
        """Preempt the most recently admitted running request not in ``protect``."""
        for req in reversed(self.running):
            if id(req) not in protect:
                self.running.remove(req)
                self._release(req)
                req.status = Status.WAITING
                req.num_preemptions += 1
                self.num_preemptions += 1
                self.waiting.appendleft(req)
                return True
        return False

    # ----------------------------------------------------------------- admission
    def _order_waiting(self) -> bool:
        """Longest cached prefix first, but requests overtaken ``max_overtakes`` times first of
        all (in queue order); True when the queue was ordered (later arrivals may overtake)."""
        if len(self.waiting) <= 1 or self.radix.disabled or len(self.waiting) > self.cfg.fcfs_threshold:
            return False
        limit = self.cfg.max_overtakes
        aged = [r for r in self.waiting if r.overtaken >= limit]
        scored = [
            (-len(self.radix.match_prefix(r.fill_ids)[0]), i, r)
            for i, r in enumerate(self.waiting)
            if r.overtaken < limit
        ]
        scored.sort(key=lambda x: (x[0], x[1]))
        self.waiting = deque(aged + [r for _, _, r in scored])
        return True

    def _count_overtakes(self, admitted: Req) -> None:
        """Every request still waiting that arrived before ``admitted`` was overtaken once more."""
        for r in self.waiting:
            if r.arrival < admitted.arrival:
                r.overtaken += 1

    def _admit(self, req: Req, budget: int) -> int | None:
        """Give ``req`` a row, its cached prefix and pages for up to ``budget`` tokens; the number
        of tokens it extends this step, or None if memory does not allow it now."""
        row = self.bt.alloc_row()
        if row is None:
            return None
        slots, node = self.radix.match_prefix(req.fill_ids)
        n_cached = len(slots)
        prefix_pages = (
            [s // self.page_size for s in slots[:: self.page_size]] if self.page_size > 1 else list(slots)
        )
        self.radix.lock(node)
        n = min(req.seq_len - n_cached, budget)
        extra = -(-(n_cached + n) // self.page_size) - len(prefix_pages)
        pages = self._alloc(extra)
        if pages is None:
            self.radix.unlock(node)
            self.bt.release(row)
            return None
        self.bt.assign(row, prefix_pages + pages)
        req.row, req.last_node, req.cached_len, req.kv_len = row, node, n_cached, n_cached
        if not req.num_preemptions:
            req.prefix_hit = n_cached
        req.status = Status.RUNNING
        self.running.append(req)
        return n

    # ----------------------------------------------------------------- step formation
    def _schedule_extend(self, admit: bool = True, budget: int | None = None) -> ScheduledBatch | None:
        """Prefill chunks under the token budget (default the chunk size): running prefills first,
        then (``admit``) new requests from the queue."""
        budget = self.cfg.chunk_size if budget is None else budget
        reqs: list[Req] = []
        lens: list[int] = []
        for req in self.running:  # continue chunked prefills first
            if not req.prefilling or budget <= 0:
                continue
            n = min(req.seq_len - req.kv_len, budget)
            pages = self._alloc(self._pages_needed(req, req.kv_len + n))
            if pages is None:
                continue
            self.bt.append(req.row, pages)
            reqs.append(req)
            lens.append(n)
            budget -= n
        ordered = admit and self._order_waiting()
        while admit and self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            n = self._admit(self.waiting[0], budget)
            if n is None:
                break
            req = self.waiting.popleft()
            if ordered:
                self._count_overtakes(req)
            reqs.append(req)
            lens.append(n)
            budget -= n
        return ScheduledBatch("extend", reqs, lens) if reqs else None

    def decode_ready(self) -> list[Req]:
        """Running requests whose only token without K/V is the newest one."""
        return [r for r in self.running if not r.prefilling]

    def _rows_starting_a_page(self, reqs: list[Req]) -> list[int]:
        """Rows of ``reqs`` whose next token (position ``kv_len``) needs a new page: their pages
        always cover the ``kv_len`` computed tokens, so it is one page, iff they end there."""
        page_size, tables = self.page_size, self.bt.row_pages
        return [r.row for r in reqs if len(tables[r.row]) * page_size <= r.kv_len]

    def _schedule_decode(self, ready: list[Req] | None = None) -> ScheduledBatch | None:
        reqs = self.decode_ready() if ready is None else ready
        if not reqs:
            return None
        # Common case: the free pages cover every request's next token. One allocation for the
        # whole batch hands out the same pages, in the same order, as one per request would.
        grow = self._rows_starting_a_page(reqs)
        if len(grow) <= self.pool.num_free_pages:
            return self._decode_every(reqs, grow)
        batch: list[Req] = []
        for req in reqs:
            if req.status is not Status.RUNNING:  # retracted while making room for an earlier one
                continue
            need = self._pages_needed(req, req.kv_len + 1)
            pages = self._alloc(need) if need else []
            while pages is None:
                if not self._retract_one({id(r) for r in batch} | {id(req)}):
                    break
                pages = self._alloc(need)
            if pages is None:
                continue  # cannot grow this step; it waits (never dropped)
            self.bt.append(req.row, pages)
            batch.append(req)
        return ScheduledBatch("decode", batch, [1] * len(batch)) if batch else None

    def _decode_every(self, reqs: list[Req], grow: list[int]) -> ScheduledBatch:
        """A decode step of all ``reqs`` when the free pages cover ``grow`` (the rows starting a
        page): one allocation for the batch hands out the same pages, in the same order, as one
        per request would."""
        if grow:
            pages = self.pool.alloc_pages(len(grow))
            assert pages is not None
            self.bt.append_each(grow, pages)
        return ScheduledBatch("decode", reqs, [1] * len(reqs))

    def schedule_decode_all(self) -> ScheduledBatch | None:
        """The overlapped decode step: every running request decodes next, nobody waits, and the
        free pages cover the step (what launching before the previous step is read needs); else
        None and nothing changes."""
        if self.waiting:
            return None
        ready = self.decode_ready()
        if not ready or len(ready) < len(self.running):
            return None
        grow = self._rows_starting_a_page(ready)
        if len(grow) > self.pool.num_free_pages:
            return None
        self._last_mode = "decode"
        return self._decode_every(ready, grow)

    def schedule(self) -> ScheduledBatch | None:
        """The next step to run; None only when no request runs or waits (module docstring:
        while there is work, some step always runs)."""
        admit = True
        while True:
            batch = self._schedule_once(admit)
            if batch is not None:
                self._last_mode = batch.mode
                return batch
            if not self.running:
                if self.waiting:  # the head of the queue does not fit even an empty pool
                    raise self._stuck(self.waiting[0])
                return None
            if len(self.running) == 1:
                raise self._stuck(self.running[0])
            # No running request can take its next chunk or token: each waits for pages the
            # others hold. Retract the newest (its KV goes to the cache) and try again without
            # admitting anyone, so the one retracted is not taken straight back.
            self._retract_one(set())
            admit = False

    def _schedule_once(self, admit: bool) -> ScheduledBatch | None:
        ready = self.decode_ready()  # still valid after an extend attempt that found nothing

        def decode() -> ScheduledBatch | None:
            return self._schedule_decode(ready)

        def extend() -> ScheduledBatch | None:
            return self._schedule_extend(admit)

        if ready and self.cfg.mixed_steps and (self.waiting or len(ready) < len(self.running)):
            order: tuple = (lambda: self._schedule_mixed(ready, admit), extend)
        elif ready and self._last_mode == "extend":
            order = (decode, extend)
        elif ready and len(ready) == len(self.running) and not self.waiting:
            order = (decode,)  # steady decoding: no prefill to continue, nobody to admit
        else:
            order = (extend, decode)
        for fn in order:
            batch = fn()
            if batch is not None:
                return batch
        return None

    def _schedule_mixed(self, ready: list[Req], admit: bool) -> ScheduledBatch | None:
        """A mixed step: every decode-ready request's token (pages grown as for a decode step),
        then prefill chunks in what is left of the chunk size, as one extend batch whose first
        ``decode_rows`` requests decode. Only a decode step when no chunk fits."""
        dec = self._schedule_decode(ready)
        if dec is None:
            return None
        ext = self._schedule_extend(admit, self.cfg.chunk_size - len(dec.reqs))
        if ext is None:
            return dec
        k = len(dec.reqs)
        return ScheduledBatch("extend", dec.reqs + ext.reqs, [1] * k + ext.extend_lens, decode_rows=k)

    def _stuck(self, req: Req) -> KVPoolError:
        return KVPoolError(
            f"request {req.rid} cannot run even alone: it holds {req.seq_len} tokens and may reach "
            f"{self.max_len(req)}, the KV pool holds {self.pool.capacity_tokens} (requests that do "
            "not fit are refused when added; this is a scheduler bug)"
        )

    def max_len(self, req: Req) -> int:
        """Tokens ``req`` may reach: its prompt plus ``max_tokens``, or the context if shorter."""
        return min(len(req.prompt_ids) + req.params.max_tokens, self.cfg.max_seq_len)

    def fits_alone(self, req: Req) -> bool:
        """Whether the pool can hold ``req`` at its longest with nothing else running."""
        return self.max_len(req) <= self.pool.capacity_tokens

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        reqs = batch.reqs
        rows = [r.row for r in reqs]
        if batch.mode == "decode":
            # One token per request: its newest (position kv_len == seq_len - 1).
            kv = [r.kv_len for r in reqs]
            slots = self.bt.slot_each(rows, kv)
            return StepInputs(
                mode="decode",
                input_ids=[r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs],
                positions=kv,
                out_slots=slots,
                req_rows=rows,
                seq_lens=[k + 1 for k in kv],
            )
        ids: list[int] = []
        pos: list[int] = []
        slots = []
        for req, n in zip(reqs, batch.extend_lens):
            ids += req.tokens(req.kv_len, req.kv_len + n)
            pos += range(req.kv_len, req.kv_len + n)
            slots += self.bt.slots(req.row, req.kv_len, req.kv_len + n)
        return StepInputs(
            mode="extend",
            input_ids=ids,
            positions=pos,
            out_slots=slots,
            req_rows=rows,
            seq_lens=[r.kv_len + n for r, n in zip(reqs, batch.extend_lens)],
            extend_lens=list(batch.extend_lens),
        )

    def reserve_drafts(self, reqs: list[Req], drafts: list[list[int]]) -> list[list[int]]:
        """Pages for a verify step (docs/speculative.md section 3): request ``i`` of a scheduled
        decode step (pages for ``kv_len + 1`` tokens held) writes ``1 + len(drafts[i])`` tokens
        from ``kv_len``. Allocates what the drafts need (evicting cache leaves, never retracting);
        a request whose pages cannot grow keeps only the drafts its pages hold. Returns the drafts
        that have slots."""
        out = []
        for req, d in zip(reqs, drafts):
            if d:
                need = self._pages_needed(req, req.kv_len + 1 + len(d))
                pages = self._alloc(need) if need else []
                if pages is None:
                    room = len(self.bt.pages(req.row)) * self.page_size - req.kv_len - 1
                    d = d[: max(room, 0)]
                else:
                    self.bt.append(req.row, pages)
            out.append(d)
        return out

    def verify_inputs(self, reqs: list[Req], drafts: list[list[int]]) -> StepInputs:
        """An extend step in which request ``i`` brings its newest token (position ``kv_len``, whose
        K/V no step wrote yet) and ``drafts[i]`` after it (pages from :meth:`reserve_drafts`)."""
        return self._verify_inputs(reqs, drafts, [range(1 + len(d)) for d in drafts])

    def tree_verify_inputs(self, reqs: list[Req], trees: list[TreeDraft]) -> StepInputs:
        """A verify step of token trees (runtime/spec_tree.py): request ``i`` brings its newest token
        (node 0) and ``trees[i]``'s draft nodes in index order, node ``j``'s K/V into the slot of
        position ``kv_len + j`` (pages from :meth:`reserve_drafts` for the node count), its RoPE
        position ``kv_len + depth(j)``, its attention by ``tree_mask`` (ancestors and itself)."""
        masks = [m for t in trees for m in t.masks()]
        return self._verify_inputs(reqs, [list(t.tokens) for t in trees], [t.depths() for t in trees], masks)

    def _verify_inputs(
        self,
        reqs: list[Req],
        drafts: list[list[int]],
        depths: list[Sequence[int]],
        tree_mask: list[int] | None = None,
    ) -> StepInputs:
        """Request ``i``'s newest token and ``drafts[i]``: token ``j`` at position ``kv_len +
        depths[i][j]``, its K/V into the slot of position ``kv_len + j``."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens = []
        for req, d, depth in zip(reqs, drafts, depths):
            n = 1 + len(d)
            ids.append(req.output_ids[-1] if req.output_ids else req.prompt_ids[-1])
            ids += d
            pos += [req.kv_len + x for x in depth]
            slots += self.bt.slots(req.row, req.kv_len, req.kv_len + n)
            lens.append(n)
        return StepInputs(
            mode="verify",
            input_ids=ids,
            positions=pos,
            out_slots=slots,
            req_rows=[r.row for r in reqs],
            seq_lens=[r.kv_len + n for r, n in zip(reqs, lens)],
            extend_lens=lens,
            tree_mask=tree_mask,
        )

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance KV lengths; extended requests put their new whole pages in the cache."""
        if batch.mode == "decode":
            for req in batch.reqs:
                req.kv_len += 1
            return
        k = batch.decode_rows
        for req in batch.reqs[:k]:  # a mixed step's decode rows: as in a decode step
            req.kv_len += 1
        for req, n in zip(batch.reqs[k:], batch.extend_lens[k:]):
            req.kv_len += n
            self._cache_prefix(req)

    def check_integrity(self) -> None:
        """Pool, block table and radix cache agree (tests and idle loops call this)."""
        self.radix.check_integrity()
        for r in self.running:  # a request's pages cover the tokens whose K/V it computed
            assert len(self.bt.pages(r.row)) * self.page_size >= r.kv_len, f"{r.rid}: KV without slots"
        held = sum(len(self.bt.pages(r.row)) - r.cached_len // self.page_size for r in self.running)
        cached_pages = self.radix.total_size // self.page_size
        free = self.pool.num_free_pages
        assert held + cached_pages + free == self.pool.capacity_pages, (
            f"page accounting: running {held} + cached {cached_pages} + free {free} "
            f"!= capacity {self.pool.capacity_pages}"
        )
        if not self.running:
            assert self.radix.protected_size == 0, "idle but radix cache holds locked nodes"
