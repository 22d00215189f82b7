"""Tokenizer loading and the per-request text pipeline (detokenizer -> stop-string matcher)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.detokenizer import IncrementalDetokenizer, StopMatcher
from kiln.runtime.sampling_params import SamplingParams


def load_tokenizer(path: str | Path) -> Any:
    """The artifact's Hugging Face tokenizer (local files only, no remote code)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)


class RequestText:
    """Turns one request's generated token ids into emitted text, honouring stop strings."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        self.stops = StopMatcher(stops)

    @property
    def matched(self) -> str | None:
        return self.stops.matched

    def add(self, token_id: int) -> tuple[str, bool]:
        """Text safe to emit after ``token_id``, and whether a stop string completed."""
        return self.stops.feed(self.detok.add(token_id))

    def flush(self) -> str:
        """Everything still held back, when the request ends for another reason."""
        text, stopped = self.stops.feed(self.detok.flush())
        return text if stopped else text + self.stops.flush()
