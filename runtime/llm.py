"""The offline API: ``from kiln import LLM, SamplingParams``.

llm = LLM("ART")
outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
for piece in llm.stream("Tell me a story"): print(piece.new_text, end="")
out = llm.chat([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, cast

from kiln.runtime.engine import Engine, EngineOptions
from kiln.runtime.request import RequestOutput
from kiln.runtime.sampling_params import InvalidSamplingParams, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class GenerationOutput:
    """One finished completion."""

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None = None
    num_cached_tokens: int = 0
    ttft: float | None = None  # seconds from submission to the first token
    latency: float | None = None  # seconds from submission to the last token
    index: int = 0  # which of the n completions of its prompt
    extra: dict[str, Any] = field(default_factory=dict)


class LLM:
    """Load an artifact and generate. Options are :class:`EngineOptions` fields (``device``,
    ``kv_memory_gib``, ``cuda_graph``, ``radix_cache``, ``max_running``, ``chunk_size``, ...)."""

    def __init__(self, artifact: str, **options: Any):
        options.setdefault("log", False)
        self.engine = Engine(artifact, EngineOptions(**options))
        # The outputs waiting for their reader, by request id: every request of an open generate()
        # call or stream() has a box, and each engine step fills the boxes of every request it
        # advanced, whoever drives it; so several streams and generate() calls interleave without
        # losing outputs (outputs of a request nobody reads any more are dropped).
        self._boxes: dict[str, deque[RequestOutput]] = {}
        # Aborts asked for while a step runs (a stream the garbage collector finalized inside it):
        # done between steps, never inside one.
        self._stepping = False
        self._deferred: list[str] = []

    def _step(self) -> set[str]:
        """One engine step, its outputs put into their requests' boxes; the ids it reached."""
        if not self.engine.has_work():
            raise RuntimeError("engine idle with unfinished requests")  # never expected
        self._stepping = True
        try:
            outs = self.engine.step()
        finally:
            self._stepping = False
        for rid in self._deferred:
            self._abort(rid)
        self._deferred.clear()
        reached = set()
        for out in outs:
            box = self._boxes.get(out.rid)
            if box is not None:
                box.append(out)
                reached.add(out.rid)
        return reached

    def _close(self, rids: Sequence[str]) -> None:
        """Drop these requests' boxes, aborting those not finished (an abandoned stream, an
        interrupted generate); inside a step, after it."""
        for rid in rids:
            self._boxes.pop(rid, None)
            if self._stepping:
                self._deferred.append(rid)
            else:
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        req = self.engine.requests.get(rid)
        if req is not None and not req.finished:
            self.engine.abort(rid)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _submit(
        self, prompts: Sequence[Prompt], params: Sequence[SamplingParams]
    ) -> list[tuple[str, int, int]]:
        """Add every completion of every prompt, or none: one the engine refuses (a bad
        parameter, a prompt too long) withdraws those added before it, then raises."""
        subs: list[tuple[str, int, int]] = []
        for sp in params:
            sp.validate()  # n among the rest: n = 0 would add nothing and so check nothing
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                for k in range(sp.n):
                    req = self.engine.add_request(p, sp, seed_index=k)
                    subs.append((req.rid, i, k))
                    self._boxes[req.rid] = deque()
        except BaseException:
            self._close([rid for rid, _, _ in subs])
            raise
        return subs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (strings or token-id lists); one output per completion, in
        prompt order (n > 1 gives n consecutive outputs for that prompt)."""
        single = (
            isinstance(prompts, str)
            or hasattr(prompts, "tolist")  # a 1-D array of token ids
            or (len(prompts) > 0 and isinstance(prompts[0], Integral) and not isinstance(prompts[0], bool))
        )
        plist: list[Prompt] = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        params = _params_list(sampling_params, len(plist))
        subs = self._submit(plist, params)
        finals: dict[str, RequestOutput] = {}
        reqs = {rid: self.engine.requests[rid] for rid, _, _ in subs}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(subs), desc="generate", unit="req")
        try:
            reached: set[str] = set()  # the boxes the last step filled (none yet: the requests are new)
            while len(finals) < len(subs):
                for rid in reached:
                    box = self._boxes.get(rid)
                    while box:
                        out = box.popleft()
                        if out.finished:
                            finals[rid] = out
                            if bar:
                                bar.update(1)
                if len(finals) < len(subs):
                    reached = self._step() & reqs.keys()
        finally:
            self._close(list(reqs))
            if bar:
                bar.close()
        results = []
        for rid, _, k in subs:
            o, r = finals[rid], reqs[rid]
            results.append(
                GenerationOutput(
                    prompt_token_ids=r.prompt_ids,
                    text=o.text,
                    token_ids=o.token_ids,
                    finish_reason=o.finish_reason,
                    logprobs=r.logprobs if r.params.logprobs is not None else None,
                    num_cached_tokens=o.num_cached_tokens,
                    ttft=o.ttft,
                    latency=o.latency,
                    index=k,
                )
            )
        return results

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a :class:`RequestOutput` per new token of one prompt (``new_text`` is the delta).
        Streams and :meth:`generate` calls may interleave: each gets all of its own outputs."""
        sp = sampling_params or SamplingParams()
        sp.validate()
        if sp.n != 1:
            raise InvalidSamplingParams(
                "n", f"stream() streams one completion (got {sp.n}); use generate() for n > 1"
            )
        req = self.engine.add_request(prompt, sp)
        box = self._boxes[req.rid] = deque()
        try:
            while True:
                while box:
                    out = box.popleft()
                    yield out
                    if out.finished:
                        return
                self._step()
        finally:
            self._close([req.rid])

    def apply_chat_template(self, messages: Sequence[Message]) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this artifact's tokenizer has no chat template")
        return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | None = None,
    ) -> list[GenerationOutput]:
        """Chat completion(s) with the artifact's chat template: one conversation or a list."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        for c in convs:
            for i, m in enumerate(c):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                    raise ValueError(
                        f"messages[{i}] must be a dict with a 'role' (str) and a 'content', got {m!r:.80}"
                    )
        prompts: list[Prompt] = [
            self.engine.tokenizer.encode(
                self.apply_chat_template(c),  # type: ignore[arg-type]
                add_special_tokens=False,
            )
            for c in convs
        ]
        return self.generate(prompts, sampling_params)


def _params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if len(sp) != n:
        raise ValueError(f"{len(sp)} sampling params for {n} prompts")
    return list(sp)
