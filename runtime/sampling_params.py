"""SamplingParams: how one request is sampled and when it stops.

Semantics follow the OpenAI API and vLLM where they agree: ``temperature=0`` is greedy,
``top_k`` of -1 or 0 is off, repetition penalty is Hugging Face's (over prompt and generated
tokens), frequency and presence penalties are OpenAI's (over generated tokens), stop strings are
excluded from the returned text. ``validate()`` raises ``InvalidSamplingParams`` naming the
parameter and its allowed range; the HTTP server maps ``.param`` onto OpenAI's error ``param``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.runtime.grammar import GrammarError, StructuredOutputs

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs


class InvalidSamplingParams(KilnError, ValueError):
    """A sampling parameter out of range. ``param`` names it (OpenAI's error ``param`` field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options.

    max_tokens: new tokens at most (>= 1).  min_tokens: EOS and stop token ids are masked until
    this many tokens exist.  temperature: >= 0, 0 = greedy.  top_p: (0, 1].  top_k: -1/0 = off,
    else >= 1.  min_p: [0, 1], keep tokens with p >= min_p * p_max.  repetition_penalty: > 0, 1 =
    off.  frequency_penalty, presence_penalty: [-2, 2].  seed: same seed, same output.
    stop: strings that end generation (not included in the text unless
    include_stop_str_in_output).  stop_token_ids: token ids
    that end generation (the token is not included in the text).  ignore_eos: keep going past
    EOS.  logprobs: None = off, N >= 0 = the chosen token's logprob plus the top N.
    skip_special_tokens: leave special tokens out of the text.  n: completions per prompt.
    structured: the output follows a JSON schema, a regex, a grammar or a choice
    (runtime/grammar.py); None = free text.  speculative: False = this request decodes without
    speculative decoding (it joins verify steps with no drafts); None = as the engine's
    ``speculative`` setting (docs/speculative.md). The output is the same either way in float32
    (bf16 graphs round differently).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    structured: StructuredOutputs | None = None
    speculative: bool | None = None

    # --------------------------------------------------------------------- derived values
    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    # ------------------------------------------------------------------------- validation
    def validate(self, max_model_len: int | None = None) -> SamplingParams:
        """Check every field; raise ``InvalidSamplingParams`` on the first bad one. Returns self."""
        _int("max_tokens", self.max_tokens, lo=1, hi=max_model_len, what="an integer >= 1")
        _int(
            "min_tokens",
            self.min_tokens,
            lo=0,
            hi=self.max_tokens,
            what=f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        _float("temperature", self.temperature, 0.0, None, "a number >= 0 (0 means greedy)")
        _float("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]")
        if self.top_p <= 0.0:
            raise InvalidSamplingParams("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        _int("top_k", self.top_k, lo=-1, hi=None, what="-1 or 0 (off) or an integer >= 1")
        _float("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")
        _float("repetition_penalty", self.repetition_penalty, 0.0, None, "a number > 0 (1 means off)")
        if self.repetition_penalty <= 0.0:
            raise InvalidSamplingParams(
                "repetition_penalty", f"must be a number > 0 (1 means off), got {self.repetition_penalty!r}"
            )
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "a number in [-2, 2]")
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0, "a number in [-2, 2]")
        if self.seed is not None:
            _int("seed", self.seed, lo=None, hi=None, what="an integer or null")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise InvalidSamplingParams(
                "stop", f"must be a string, a list of strings or null, got {self.stop!r}"
            )
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams(
                    "stop", f"every stop string must be a non-empty string, got {s!r}"
                )
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise InvalidSamplingParams(
                    "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}"
                )
            for t in self.stop_token_ids:
                _int("stop_token_ids", t, lo=0, hi=None, what="a list of integers >= 0")
        if self.logprobs is not None:
            _int(
                "logprobs",
                self.logprobs,
                lo=0,
                hi=MAX_LOGPROBS,
                what=f"null or an integer in [0, {MAX_LOGPROBS}]",
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(name, f"must be true or false, got {getattr(self, name)!r}")
        _int("n", self.n, lo=1, hi=None, what="an integer >= 1")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise InvalidSamplingParams(
                "speculative", f"must be true, false or null, got {self.speculative!r}"
            )
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                raise InvalidSamplingParams(
                    "structured", f"must be a StructuredOutputs or null, got {self.structured!r}"
                )
            try:
                self.structured.kind()
            except GrammarError as e:
                raise InvalidSamplingParams("structured", str(e)) from None
        return self


def _int(param: str, v: object, lo: int | None, hi: int | None, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidSamplingParams(param, f"must be {what}, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        limit = f" (at most {hi})" if hi is not None and v > hi else ""
        raise InvalidSamplingParams(param, f"must be {what}{limit}, got {v}")


def _float(param: str, v: object, lo: float | None, hi: float | None, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidSamplingParams(param, f"must be {what}, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidSamplingParams(param, f"must be {what}, got {v}")
