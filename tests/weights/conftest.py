"""Tiny synthetic Hugging Face checkpoints (written by transformers with a small max_shard_size,
so an index and several shards exist), built once per session per variant."""

from __future__ import annotations

from pathlib import Path

import pytest
from weights_helpers import CONFIGS

from kiln.compiler.synth import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(name, **make_checkpoint kwargs) -> Path``, built once per session per variant."""
    cache: dict[tuple, Path] = {}

    def make(name: str, **kw) -> Path:
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{name}")
            kw.setdefault("max_shard_size", "24KB")  # several shards and an index
            kw.setdefault("dtype", "float32")
            kw.setdefault("seed", len(cache))
            cache[key] = make_checkpoint(out, CONFIGS[name], with_tokenizer=False, **kw)
        return cache[key]

    return make
