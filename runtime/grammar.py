"""Structured outputs: the grammar a request's tokens must follow, and its per-step token masks.

Protocol. A request asks for a structure with ``SamplingParams.structured`` (a
:class:`StructuredOutputs`: one of a JSON schema, any JSON object, a regular expression, an EBNF
grammar, or a choice among strings). At admission the engine compiles it once
(:class:`GrammarCompiler`, xgrammar; compiled grammars are cached by their text) and gives the
request a :class:`Matcher`. Each step that samples a constrained request:

1. its tokens sampled so far are accepted into its matcher (``Matcher.catch_up``), in order;
2. ``Matcher.fill`` writes the next token's allowed set into row ``i`` of a packed host mask
   ``[n, ceil(V / 32)] int32`` (bit ``j`` of word ``w``: token ``32 w + j`` may come next);
3. the mask goes to the device once and ``ops/sampling/bitmask.py`` sets the other tokens' logits
   to ``-inf`` before sampling, so greedy, sampled and seeded requests alike stay inside the grammar.

When the grammar is complete the mask allows the model's end-of-sequence tokens only, and the
request ends as at any EOS. With overlapped decode (runtime/stepper.py) step ``t + 1``'s forward is
already on the device when the host accepts token ``t`` and fills the mask: the mask work hides
behind the forward. Requests without a structure never touch this module.

A structure that does not compile is a :class:`GrammarError` naming the field (a 400 in the
server). Engine: xgrammar (docs/structured_outputs.md).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError

if TYPE_CHECKING:  # torch only where masks are built: SamplingParams (and the CLI) import this module
    import torch


class GrammarError(KilnError, ValueError):
    """A structured-output request that cannot be compiled (the message names the field)."""


@dataclass(frozen=True)
class ToolCallGrammar:
    """One call of one of ``tools`` (``(name, parameters JSON schema text or None)``), written in
    tool-call format ``fmt`` (runtime/tool_parsers.py ``CALL_SHAPES``): the output of a request
    whose ``tool_choice`` is "required" or names a function."""

    fmt: str
    tools: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class StructuredOutputs:
    """One structure for a request's output; exactly one field is set.

    json_schema: a JSON schema (text) the output must validate against.  json_object: any JSON
    object.  regex: a regular expression the whole output matches.  ebnf: a grammar in xgrammar's
    EBNF (``root ::= ...``).  choice: the output is exactly one of these strings.  tool_call: one
    call of one of a set of tools (:class:`ToolCallGrammar`)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    ebnf: str | None = None
    choice: tuple[str, ...] | None = None
    tool_call: ToolCallGrammar | None = None

    def __post_init__(self) -> None:
        # a schema given as a dict (as in a request's JSON) and choices given as a list are kept as
        # JSON text and a tuple: a spec is hashable (the compiled grammars' cache key)
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_schema", "regex", "ebnf"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise GrammarError(
                    f"{name} must be a string (a JSON schema may also be a dict), got {type(v).__name__}"
                )

    def kind(self) -> str:
        """The field that is set; raises :class:`GrammarError` unless exactly one is."""
        fields = ("json_schema", "regex", "ebnf", "choice", "tool_call")
        set_ = [k for k in fields if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise GrammarError(
                f"structured outputs take exactly one of json_schema, json_object, regex, ebnf, choice; got {set_ or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise GrammarError("choice must be a non-empty list of strings")
        return set_[0]


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` for one tokenizer (``backend``: a ``tokenizers``
    ``Tokenizer``, runtime/tokenizer.py's ``backend_tokenizer``) and vocabulary (``vocab_size``: the
    logits' width, which may exceed the tokenizer's); ``eos_token_ids`` end a complete output."""

    def __init__(self, backend: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        self.vocab_size = vocab_size
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A fresh matcher for one request (compiling ``spec`` unless cached)."""
        spec.kind()  # exactly one field
        return Matcher(self._xgr.GrammarMatcher(self._compile(spec)), self.vocab_size)

    def _compile_uncached(self, spec: StructuredOutputs) -> Any:
        kind = spec.kind()
        c = self._compiler
        try:
            if kind == "json_object":  # (xgrammar's builtin JSON grammar takes any value)
                return c.compile_grammar(self._json_grammar('{"type": "object"}'))
            if kind == "json_schema":
                assert spec.json_schema is not None
                _refuse_unenforced(json.loads(spec.json_schema))  # (not JSON: a clear error)
                return c.compile_grammar(self._json_grammar(spec.json_schema))
            if kind == "regex":
                assert spec.regex is not None
                return c.compile_regex(spec.regex)
            if kind == "ebnf":
                assert spec.ebnf is not None
                return c.compile_grammar(spec.ebnf)
            if kind == "tool_call":
                assert spec.tool_call is not None
                return c.compile_grammar(self._tool_call_grammar(spec.tool_call))
            assert spec.choice is not None  # an EBNF alternation of string literals
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError with its C++ check text
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            detail = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", detail)  # drop xgrammar's source location
            raise GrammarError(f"{kind} does not compile: {detail[:300]}") from None

    def _tool_call_grammar(self, spec: ToolCallGrammar) -> Any:
        """The format's text before a call, one of the tools' call objects, the text after."""
        from kiln.runtime.tool_parsers import CALL_SHAPES, call_schema

        xgr = self._xgr
        before, _, after = CALL_SHAPES[spec.fmt]
        calls = []
        for name, params in spec.tools:
            schema = call_schema(spec.fmt, name, json.loads(params) if params is not None else None)
            _refuse_unenforced(schema)
            calls.append(xgr.Grammar.from_ebnf(self._json_grammar(json.dumps(schema))))
        parts = [xgr.Grammar.union(*calls) if len(calls) > 1 else calls[0]]
        parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(t)}") for t in (before,) if t] + parts
        parts += [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(after)}")] if after else []
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]

    def _json_grammar(self, schema: str) -> str:
        """xgrammar's grammar for ``schema`` (no free whitespace: a random model would emit it
        until max_tokens), its length-bounded strings' characters without the control characters
        JSON forbids (xgrammar 0.2.9 admits them there, which strict parsers refuse)."""
        text = str(self._xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        return text.replace(_BOUNDED_CHAR, _JSON_CHAR)


_BOUNDED_CHAR = r"[^\"\\\r\n]"  # xgrammar's character of a string with minLength / maxLength
_JSON_CHAR = r"[^\0-\x1f\"\\]"  # JSON's: no quote, backslash or control character


def _refuse_unenforced(schema: Any, where: str = "schema") -> None:
    """A :class:`GrammarError` naming a keyword xgrammar would accept but not enforce."""
    if isinstance(schema, dict):
        if schema.get("uniqueItems") is True:
            raise GrammarError(
                f"json_schema: uniqueItems at {where} is not enforced by the grammar; leave it out"
            )
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
            raise GrammarError(
                f"json_schema: allOf with several schemas at {where} is not enforced; merge them"
            )
        for k, v in schema.items():
            _refuse_unenforced(v, f"{where}.{k}")
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            _refuse_unenforced(v, f"{where}[{i}]")


class Matcher:
    """One request's position in its grammar (module docstring)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size  # the mask's tokens (the logits may have padding columns past it)
        self.accepted = 0  # output tokens accepted so far

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Accept ``output_ids[accepted:]`` (the request's tokens sampled since the last call). A
        token the grammar refuses (it cannot be: the mask allowed it) stops the matcher."""
        for tok in output_ids[self.accepted :]:
            if not self._m.is_terminated() and not self._m.accept_token(int(tok)):
                raise GrammarError(f"token {tok} is outside the request's grammar")
            self.accepted += 1

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask`` (host int32) gets the tokens allowed next; a finished
        grammar (its request ends this step) allows every token: its token is discarded."""
        if self._m.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host mask ``[rows, ceil(vocab_size / 32)]`` int32, every token allowed."""
    import torch

    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def mask_logits(
    logits: torch.Tensor, matchers: Sequence[tuple[int, Matcher, Sequence[int]]], stager: Any
) -> None:
    """Steps 1-3 of the protocol for one step: ``matchers`` holds ``(row of logits, matcher, the
    request's tokens so far)`` for its constrained rows; ``logits [B, V']`` (``V' >= V``, padding
    columns left alone) is masked in place. ``stager``: runtime/staging.py's (the host->device copy)."""
    import torch

    from kiln.ops.sampling.bitmask import apply_token_bitmask_

    v = matchers[0][1].vocab_size
    bitmask = allocate_bitmask(len(matchers), v)
    for i, (_, m, ids) in enumerate(matchers):
        m.catch_up(ids)
        m.fill(bitmask, i)
    rows = stager.to_device([r for r, _, _ in matchers], torch.int64)
    apply_token_bitmask_(logits[:, :v], stager.to_device(bitmask, torch.int32), rows)
