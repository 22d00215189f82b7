"""Run an artifact's graphs directly, without the scheduler: for tests and debugging.

runner = DirectRunner("ART", device="cpu")
logits = runner.prefill([[1, 2, 3], [4, 5]])   # [2, V], at each prompt's last token
logits = runner.decode([7, 8])                  # [2, V], one new token per sequence
"""

from __future__ import annotations

import torch

from kiln.runtime.kv_pool import BlockTable, KVPool
from kiln.runtime.loader import LoadedModel, load_model
from kiln.runtime.model_runner import ModelRunner, StepInputs


class DirectRunner:
    def __init__(
        self,
        artifact: str,
        device: str = "cpu",
        num_slots: int = 4096,
        max_running: int = 8,
        cuda_graph: bool = False,
        model: LoadedModel | None = None,
    ):
        self.model = model or load_model(artifact, device)
        m = self.model.artifact.manifest
        page_size = m.kv.page_size
        self.pool = KVPool.for_spec(m.kv, num_slots - num_slots % page_size, self.model.device)
        self.bt = BlockTable(max_running, m.max_blocks, self.model.device, page_size)
        # prefill eagerly: the unpadded extend graph, the reference the tests compare against
        self.runner = ModelRunner(self.model, self.pool, self.bt, cuda_graph=cuda_graph, prefill_graphs=False)
        self.rows: list[int] = []
        self.lens: list[int] = []

    def _grow(self, i: int, new_len: int) -> None:
        if not self.bt.cover(self.rows[i], new_len, self.pool):
            raise MemoryError("DirectRunner: KV pool exhausted; pass a larger num_slots")

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Start one sequence per prompt (dropping earlier ones); logits at each last token."""
        for row in self.rows:
            self.pool.free_pages(self.bt.release(row))
        self.rows, self.lens = [], []
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for i, p in enumerate(prompts):
            row = self.bt.alloc_row()
            assert row is not None, "too many sequences for max_running"
            self.rows.append(row)
            self.lens.append(0)
            self._grow(i, len(p))
            ids += p
            pos += range(len(p))
            slots += self.bt.slots(row, 0, len(p))
            self.lens[i] = len(p)
        step = StepInputs(
            "extend", ids, pos, slots, list(self.rows), list(self.lens), [len(p) for p in prompts]
        )
        return self.runner.extend(step)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per running sequence; logits [B, V]."""
        assert len(tokens) == len(self.rows)
        slots = []
        for i in range(len(tokens)):
            self._grow(i, self.lens[i] + 1)
            slots += self.bt.slots(self.rows[i], self.lens[i], self.lens[i] + 1)
        pos = list(self.lens)
        self.lens = [n + 1 for n in self.lens]
        step = StepInputs("decode", list(tokens), pos, slots, list(self.rows), list(self.lens))
        return self.runner.decode(step)
