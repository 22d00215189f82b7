"""Grammar engines for structured outputs, measured on a 128k byte-level BPE vocabulary (CPU only).

    python bench/grammar_engines.py --engines xgrammar,llguidance,outlines-core --batch 64 \
        [--tokenizer tokenizer.json | --llama3-js data-converted.js] [--json-out FILE]

Runs in its own environment (the engines are not kiln dependencies): ``pip install xgrammar llguidance
outlines-core tokenizers jsonschema numpy`` (xgrammar also pulls torch, transformers and triton). Kiln does
not import this file and this file does not import kiln.

Tokenizer: ``--tokenizer`` takes a Hugging Face ``tokenizer.json``. Without a hub, ``--llama3-js`` rebuilds
the Llama 3 tokenizer (128,000 BPE tokens + 256 specials, 280,147 merges) from the data file of the npm
package ``llama3-tokenizer-js`` (``npm pack llama3-tokenizer-js``; ``package/src/data-converted.js``).

What is measured, per engine:
  * setup: building the engine's tokenizer object from the vocabulary (once per model);
  * compile: JSON schemas, a regex, a choice list and an EBNF grammar, each compiled cold; ``ready`` adds
    creating one matcher and computing its first mask (llguidance compiles lazily, so compile alone
    understates it);
  * masks: requests advanced token by token through valid outputs. At each step every active request's
    int32 bitmask row [ceil(V/32)] is filled (timed), then a token is drawn uniformly among the allowed
    ones and accepted (timed apart). So that requests end, EOS (when allowed) is taken with probability
    0.5, and with probability 0.3 the draw is among the allowed tokens holding one of ``"}],`` (pure
    uniform draws on a 128k vocabulary almost never close a string or number in 256 tokens).
    Batch 1 runs the schemas one after another; batch B runs B matchers over the schemas together,
    filled one by one (``seq``) and through the engine's threaded batch call (``par``) where it has one;
  * coverage: one small schema per feature, compiled and sampled; every finished output must parse and
    validate (``jsonschema``), else the feature counts as not enforced.
Each finished output of the mask runs is validated too (``valid`` column). Timings are wall clock on
whatever machine runs this; the seed is fixed.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

EOS_NAME = "<|eot_id|>"
STOP_P = 0.5
CLOSE_P = 0.3
CLOSERS = b'"}],'

# ---------------------------------------------------------------- workloads

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "total": {"type": "number", "minimum": 0, "maximum": 10000},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "handle": {"type": "string", "maxLength": 16},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 20},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["handle", "address"],
                "additionalProperties": False,
            },
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 1},
                "maxItems": 3,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "maxLength": 32},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["location", "unit"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

REGEX = r"\(\d{3}\) \d{3}-\d{4}( x\d{1,5})?"
CHOICES = ["positive", "negative", "neutral", "mixed"]
EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
"""
EBNF_LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUM | "(" expr ")"
NUM: /[0-9]|[1-9][0-9]|[1-9][0-9][0-9]/
"""


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props), **extra}


FEATURES: dict[str, dict[str, Any]] = {
    "nested objects": _obj({"a": _obj({"b": _obj({"c": {"type": "boolean"}})})}),
    "array min/maxItems": _obj(
        {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}}
    ),
    "enum": _obj({"e": {"enum": ["red", "green", 3, None]}}),
    "const": _obj({"k": {"const": "fixed"}}),
    "integer min/max": _obj({"n": {"type": "integer", "minimum": 10, "maximum": 99}}),
    "number min/max": _obj({"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}),
    "exclusiveMin/Max": _obj({"x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    "required + optional": _obj(
        {"r": {"type": "boolean"}, "o1": {"type": "integer"}, "o2": {"type": "boolean"}}, ["r"]
    ),
    "string pattern": _obj({"p": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    "string min/maxLength": _obj({"s": {"type": "string", "minLength": 3, "maxLength": 5}}),
    "format date-time": _obj({"t": {"type": "string", "format": "date-time"}}),
    "format email": _obj({"m": {"type": "string", "format": "email"}}),
    "format uuid": _obj({"u": {"type": "string", "format": "uuid"}}),
    "anyOf": _obj({"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}),
    "oneOf": _obj({"v": {"oneOf": [_obj({"cat": {"const": True}}), _obj({"dog": {"const": 1}})]}}),
    "type list + null": _obj({"v": {"type": ["string", "null"], "maxLength": 4}}),
    "allOf": _obj({"v": {"allOf": [{"type": "integer"}, {"minimum": 5, "maximum": 9}]}}),
    "$ref/$defs": {
        "$defs": {"pt": _obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
        **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}),
    },
    "recursive $ref": {
        "$defs": {
            "node": _obj(
                {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                ["v"],
            )
        },
        "$ref": "#/$defs/node",
    },
    "additionalProperties schema": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 3,
    },
    "multipleOf": _obj({"m": {"type": "integer", "multipleOf": 5}}),
    "uniqueItems": _obj({"u": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}}),
}

# ---------------------------------------------------------------- tokenizer


def _byte_decoder() -> dict[str, int]:
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def llama3_tokenizer_json(js_path: Path) -> str:
    """Rebuild Llama 3's tokenizer.json from llama3-tokenizer-js's data file (vocab + 17-bit packed merges)."""
    src = js_path.read_text(encoding="utf-8")
    vocab = base64.b64decode(re.search(r'llama_vocab_base64 = "([^"]+)"', src).group(1)).decode().split("\n")
    raw = base64.b64decode(re.search(r'llama_merges_binary = "([^"]+)"', src).group(1))
    packed, nbits = int.from_bytes(raw, "big"), len(raw) * 8
    ids = [(packed >> (nbits - 17 * (i + 1))) & 0x1FFFF for i in range(nbits // 17)]
    merges = [[vocab[ids[i]], vocab[ids[i + 1]]] for i in range(0, len(ids) - 1, 2)]
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ] + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(vocab) + i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, s in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {t: i for i, t in enumerate(vocab)},
            "merges": merges,
        },
    }
    return json.dumps(doc, ensure_ascii=False)


@dataclass
class Vocab:
    """A byte-level BPE vocabulary as the engines need it."""

    tokenizer_json: str
    size: int  # ids 0..size-1, specials included
    token_bytes: list[bytes]  # b"" for special tokens
    special: set[int]
    eos: int
    closer: np.ndarray  # bool [size]: token holds one of CLOSERS
    ascii: np.ndarray  # bool [size]: token is printable ASCII only (the `ascii` sampler)

    @property
    def words(self) -> int:
        return (self.size + 31) // 32


def load_vocab(tokenizer_json: str) -> Vocab:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    size = tok.get_vocab_size(with_added_tokens=True)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    dec = _byte_decoder()
    token_bytes = [b""] * size
    for s, i in tok.get_vocab(with_added_tokens=False).items():
        token_bytes[i] = bytes(dec[ch] for ch in s)
    eos = tok.token_to_id(EOS_NAME)
    if eos is None:
        sys.exit(f"tokenizer: no {EOS_NAME} token; this bench expects a Llama 3 style tokenizer")
    closer = np.array([any(c in b for c in CLOSERS) for b in token_bytes], dtype=bool)
    printable = np.array([bool(b) and all(32 <= c < 127 for c in b) for b in token_bytes], dtype=bool)
    return Vocab(tokenizer_json, size, token_bytes, special, eos, closer, printable)


# ---------------------------------------------------------------- engines


class Unsupported(Exception):
    pass


class Engine:
    """Adapter protocol: compile(kind, spec) -> grammar; matcher(grammar) -> per-request state;
    fill(matchers, rows, bitmask) writes each matcher's next-token mask into bitmask[row];
    accept(m, token) -> bool; done(m) -> bool (terminated: EOS accepted)."""

    name = ""
    dist = ""
    has_par = False

    def setup(self, vocab: Vocab) -> None:
        raise NotImplementedError

    def compile(self, kind: str, spec: Any) -> Any:
        raise NotImplementedError

    def matcher(self, grammar: Any) -> Any:
        raise NotImplementedError

    def fill(self, ms: list[Any], rows: list[int], bitmask: np.ndarray, par: bool) -> None:
        raise NotImplementedError

    def accept(self, m: Any, token: int) -> bool:
        raise NotImplementedError

    def done(self, m: Any) -> bool:
        raise NotImplementedError


class XGrammar(Engine):
    name, dist, has_par = "xgrammar", "xgrammar", True

    def setup(self, vocab: Vocab) -> None:
        import torch
        import xgrammar as xgr

        self.xgr, self.torch = xgr, torch
        self.info = xgr.TokenizerInfo(
            vocab.token_bytes, xgr.VocabType.RAW, vocab_size=vocab.size, stop_token_ids=[vocab.eos]
        )
        self.batch = xgr.BatchGrammarMatcher(max_threads="auto")

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_regex("|".join(re.escape(s) for s in spec))
        return c.compile_grammar(spec)

    def matcher(self, grammar: Any) -> Any:
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, ms: list[Any], rows: list[int], bitmask: np.ndarray, par: bool) -> None:
        t = self.torch.from_numpy(bitmask)
        if par:
            self.batch.batch_fill_next_token_bitmask(ms, t, rows)
        else:
            for m, r in zip(ms, rows, strict=True):
                m.fill_next_token_bitmask(t, r)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()


class LLGuidance(Engine):
    name, dist, has_par = "llguidance", "llguidance", True

    def setup(self, vocab: Vocab) -> None:
        import llguidance as llg
        import llguidance.numpy as lnp

        self.llg, self.lnp = llg, lnp
        self.tok = llg.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.size, eos_token=vocab.eos)
        self.executor = llg.LLExecutor()

    def compile(self, kind: str, spec: Any) -> Any:
        M = self.llg.LLMatcher
        if kind == "json":
            opts = {
                "whitespace_flexible": False,
                "item_separator": ", ",
                "key_separator": ": ",
                "coerce_one_of": True,
            }
            g = M.grammar_from_json_schema(json.dumps(spec), defaults=opts)
        elif kind == "regex":
            g = M.grammar_from_regex(spec)
        elif kind == "choice":
            g = M.grammar_from_regex("|".join(re.escape(s) for s in spec))
        else:
            g = M.grammar_from_lark(EBNF_LARK if spec == EBNF else spec)
        m = M(self.tok, g)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m  # a fresh matcher is the compiled form; requests get deep copies

    def matcher(self, grammar: Any) -> Any:
        return grammar.deep_copy()

    def fill(self, ms: list[Any], rows: list[int], bitmask: np.ndarray, par: bool) -> None:
        if par:
            self.lnp.fill_next_token_bitmask_par(self.executor, list(zip(ms, rows, strict=True)), bitmask)
        else:
            for m, r in zip(ms, rows, strict=True):
                self.lnp.fill_next_token_bitmask(m, bitmask, r)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_stopped()


class OutlinesCore(Engine):
    name, dist = "outlines-core", "outlines_core"

    def setup(self, vocab: Vocab) -> None:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.to_regex = oc, build_regex_from_schema
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if i not in vocab.special and i != vocab.eos:
                table.setdefault(b, []).append(i)
        self.vocabulary = oc.Vocabulary(vocab.eos, table)
        self.words, self.eos = vocab.words, vocab.eos

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            regex = self.to_regex(json.dumps(spec))
        elif kind == "regex":
            regex = spec
        elif kind == "choice":
            regex = "|".join(re.escape(s) for s in spec)
        else:
            raise Unsupported("no EBNF/CFG support (regex only)")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, grammar: Any) -> Any:
        return [self.oc.Guide(grammar), False]  # [guide, EOS accepted]

    def fill(self, ms: list[Any], rows: list[int], bitmask: np.ndarray, par: bool) -> None:
        base, stride = bitmask.ctypes.data, bitmask.strides[0]
        for m, r in zip(ms, rows, strict=True):
            m[0].write_mask_into(base + r * stride, self.words, 4)

    def accept(self, m: Any, token: int) -> bool:
        if token == self.eos:  # Guide.advance(eos) raises; EOS is legal exactly in final states
            m[1] = m[0].is_finished()
            return m[1]
        try:
            m[0].advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def done(self, m: Any) -> bool:
        return m[1]


ENGINES: dict[str, Callable[[], Engine]] = {
    "xgrammar": XGrammar,
    "llguidance": LLGuidance,
    "outlines-core": OutlinesCore,
}

# ---------------------------------------------------------------- running requests


@dataclass
class Run:
    fill_step_us: list[float] = field(default_factory=list)  # one batch step
    fill_tok_us: list[float] = field(default_factory=list)  # one step / active requests
    accept_us: list[float] = field(default_factory=list)
    outputs: list[bytes] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    rejected: int = 0


def generate(
    eng: Engine,
    vocab: Vocab,
    grammars: list[Any],
    batch: int,
    par: bool,
    max_tokens: int,
    rng: np.random.Generator,
    ascii_only: bool = False,
) -> Run:
    """Advance `batch` matchers (grammars cycled) to EOS or max_tokens, sampling uniformly under the mask
    (`ascii_only`: among the allowed printable-ASCII tokens when there are any, a stand-in for plain text)."""
    ms = [eng.matcher(grammars[i % len(grammars)]) for i in range(batch)]
    out: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    active = list(range(batch))
    bitmask = np.zeros((batch, vocab.words), dtype=np.int32)
    run = Run()
    while active:
        t0 = time.perf_counter()
        eng.fill([ms[i] for i in active], active, bitmask, par)
        dt = (time.perf_counter() - t0) * 1e6
        run.fill_step_us.append(dt)
        run.fill_tok_us.append(dt / len(active))
        still = []
        for i in active:
            allowed = np.flatnonzero(
                np.unpackbits(bitmask[i].view(np.uint8), bitorder="little")[: vocab.size]
            )
            if allowed.size == 0:
                run.rejected += 1
                continue
            eos_ok = bool(np.any(allowed == vocab.eos))
            if ascii_only and vocab.ascii[allowed].any():
                allowed = np.concatenate([allowed[vocab.ascii[allowed]], allowed[allowed == vocab.eos]])
            closers = allowed[vocab.closer[allowed]]
            if eos_ok and (allowed.size == 1 or rng.random() < STOP_P):
                tok = vocab.eos
            elif closers.size and rng.random() < CLOSE_P:
                tok = int(closers[rng.integers(closers.size)])
            else:
                others = allowed[allowed != vocab.eos]
                tok = int(others[rng.integers(others.size)])
            t0 = time.perf_counter()
            ok = eng.accept(ms[i], tok)
            run.accept_us.append((time.perf_counter() - t0) * 1e6)
            if not ok:
                run.rejected += 1
                continue
            if tok == vocab.eos:
                done[i] = eng.done(ms[i])
                continue
            out[i].append(tok)
            if len(out[i]) < max_tokens:
                still.append(i)
        active = still
    run.outputs = [b"".join(vocab.token_bytes[t] for t in o) for o in out]
    run.finished = done
    return run


def check(kind: str, spec: Any, text: bytes) -> bool:
    try:
        s = text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if kind == "json":
        import jsonschema

        try:
            jsonschema.validate(json.loads(s), spec, format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(spec, s) is not None
    if kind == "choice":
        return s in spec
    return _arith(s)


def _arith(s: str) -> bool:
    """Recognise the EBNF's language: expr := term (+|- term)*, term := factor (*|/ factor)*."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"0|[1-9][0-9]{0,2}", s[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def chain(sub: Callable[[], bool], ops: str) -> bool:
        nonlocal pos
        if not sub():
            return False
        while pos < len(s) and s[pos] in ops:
            pos += 1
            if not sub():
                return False
        return True

    def expr() -> bool:
        return chain(lambda: chain(factor, "*/"), "+-")

    return expr() and pos == len(s)


# ---------------------------------------------------------------- report


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def installed_mb(dist: str, seen: set[str] | None = None) -> tuple[float, list[str]]:
    """Installed size of a distribution and its required (non-extra) dependency closure."""
    seen = set() if seen is None else seen
    key = dist.lower().replace("_", "-")
    if key in seen:
        return 0.0, []
    seen.add(key)
    try:
        d = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return 0.0, []
    size = sum((f.size or 0) for f in (d.files or []))
    names = [f"{d.metadata['Name']}=={d.version}"]
    for req in d.requires or []:
        if "extra ==" in req:
            continue
        if ";" in req and "platform_system" in req and "Linux" not in req:
            continue
        dep = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]
        s, n = installed_mb(dep, seen)
        size += s
        names += n
    return size, names


def bench_engine(eng: Engine, vocab: Vocab, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"engine": eng.name, "version": metadata.version(eng.dist)}
    t0 = time.perf_counter()
    eng.setup(vocab)
    res["setup_s"] = time.perf_counter() - t0

    work = [("json:" + k, "json", v) for k, v in SCHEMAS.items()]
    work += [("regex", "regex", REGEX), ("choice", "choice", CHOICES), ("ebnf", "ebnf", EBNF)]
    compiled, comp = {}, {}
    for name, kind, spec in work:
        try:
            t0 = time.perf_counter()
            g = eng.compile(kind, spec)
            c_ms = (time.perf_counter() - t0) * 1e3
            m = eng.matcher(g)
            eng.fill([m], [0], np.zeros((1, vocab.words), np.int32), False)
            comp[name] = {"compile_ms": c_ms, "ready_ms": (time.perf_counter() - t0) * 1e3}
            compiled[name] = (kind, spec, g)
        except Exception as e:
            comp[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
    res["compile"] = comp

    rng = np.random.default_rng(args.seed)
    json_names = [n for n in compiled if n.startswith("json:")]
    grammars = [compiled[n][2] for n in json_names]
    specs = [compiled[n][1] for n in json_names]

    def summarize(run: Run, n_specs: list[Any]) -> dict[str, Any]:
        fin = [o for o, f in zip(run.outputs, run.finished, strict=True) if f]
        fin_specs = [n_specs[i % len(n_specs)] for i, f in enumerate(run.finished) if f]
        valid = sum(check("json", s, o) for s, o in zip(fin_specs, fin, strict=True))
        return {
            "steps": len(run.fill_step_us),
            "tokens": len(run.accept_us),
            "tok_mean_us": statistics.fmean(run.fill_tok_us),
            "tok_p99_us": pct(run.fill_tok_us, 99),
            "step_mean_us": statistics.fmean(run.fill_step_us),
            "step_p99_us": pct(run.fill_step_us, 99),
            "accept_mean_us": statistics.fmean(run.accept_us),
            "finished": len(fin),
            "requests": len(run.outputs),
            "valid": valid,
            "rejected": run.rejected,
        }

    masks: dict[str, Any] = {}
    if grammars:
        b1 = Run()
        for g in grammars:
            for _ in range(args.b1_repeats):
                r = generate(eng, vocab, [g], 1, False, args.max_tokens, rng, args.sampler == "ascii")
                b1.fill_step_us += r.fill_step_us
                b1.fill_tok_us += r.fill_tok_us
                b1.accept_us += r.accept_us
                b1.outputs += r.outputs
                b1.finished += r.finished
                b1.rejected += r.rejected
        masks["b1"] = summarize(b1, [s for s in specs for _ in range(args.b1_repeats)])
        modes = ["seq", "par"] if eng.has_par else ["seq"]
        for mode in modes:
            rng_b = np.random.default_rng(args.seed + 1)
            r = generate(
                eng,
                vocab,
                grammars,
                args.batch,
                mode == "par",
                args.max_tokens,
                rng_b,
                args.sampler == "ascii",
            )
            masks[f"b{args.batch}_{mode}"] = summarize(r, specs)
    res["masks"] = masks

    cov: dict[str, str] = {}
    for feat, schema in {} if args.skip_coverage else FEATURES.items():
        try:
            g = eng.compile("json", schema)
        except Exception as e:
            cov[feat] = "compile error: " + (str(e).splitlines()[0][:90] if str(e) else type(e).__name__)
            continue
        r = generate(eng, vocab, [g], args.coverage_samples, False, args.max_tokens, rng)
        fin = [o for o, f in zip(r.outputs, r.finished, strict=True) if f]
        bad = [o for o in fin if not check("json", schema, o)]
        if not fin:
            cov[feat] = f"no output finished in {args.max_tokens} tokens"
        elif bad:
            cov[feat] = (
                f"NOT ENFORCED: {len(bad)}/{len(fin)} invalid, e.g. {bad[0][:60].decode(errors='replace')!r}"
            )
        else:
            cov[feat] = f"ok ({len(fin)}/{len(r.outputs)})"
    for name in () if args.skip_coverage else ("regex", "choice", "ebnf"):
        if name in compiled:
            kind, spec, g = compiled[name]
            r = generate(eng, vocab, [g], args.coverage_samples, False, args.max_tokens, rng)
            fin = [o for o, f in zip(r.outputs, r.finished, strict=True) if f]
            ok = sum(check(kind, spec, o) for o in fin)
            cov[name] = f"ok ({ok}/{len(r.outputs)})" if ok == len(fin) and fin else f"{ok}/{len(fin)} valid"
        else:
            cov[name] = comp[name]["error"]
    res["coverage"] = cov
    size, closure = installed_mb(eng.dist)
    res["installed_mb"] = size / 2**20
    res["closure"] = closure
    return res


def print_report(results: list[dict[str, Any]], vocab: Vocab, args: argparse.Namespace) -> None:
    names = [r["engine"] for r in results]
    w = max(26, *(len(n) + 2 for n in names))
    line = lambda label, vals: print(f"{label:<30}" + "".join(f"{v:>{w}}" for v in vals))
    print(
        f"sampler {args.sampler}; vocab {vocab.size} tokens, bitmask [batch, {vocab.words}] int32; batch {args.batch}; seed {args.seed}"
    )
    line("", names)
    line("version", [r["version"] for r in results])
    line("installed MB (closure)", [f"{r['installed_mb']:.0f}" for r in results])
    line("tokenizer setup s", [f"{r['setup_s']:.2f}" for r in results])
    print("compile ms / ready ms (compile + matcher + first mask)")
    for name in results[0]["compile"]:
        vals = []
        for r in results:
            c = r["compile"][name]
            vals.append("n/a" if "error" in c else f"{c['compile_ms']:.1f} / {c['ready_ms']:.1f}")
        line("  " + name, vals)
    print("mask fill, us: per token per request mean / p99 | per batch step mean / p99")
    for mode in ["b1", f"b{args.batch}_seq", f"b{args.batch}_par"]:
        vals = []
        for r in results:
            m = r["masks"].get(mode)
            vals.append(
                "n/a"
                if m is None
                else f"{m['tok_mean_us']:.1f}/{m['tok_p99_us']:.0f} | {m['step_mean_us']:.0f}/{m['step_p99_us']:.0f}"
            )
        line("  " + mode, vals)
    for mode in ["b1", f"b{args.batch}_seq"]:
        line(
            f"  accept us mean ({mode})",
            [f"{r['masks'][mode]['accept_mean_us']:.1f}" if mode in r["masks"] else "n/a" for r in results],
        )
        line(
            f"  valid/finished/req ({mode})",
            [
                f"{r['masks'][mode]['valid']}/{r['masks'][mode]['finished']}/{r['masks'][mode]['requests']}"
                if mode in r["masks"]
                else "n/a"
                for r in results
            ],
        )
    print("coverage (sampled outputs validated)")
    for feat in results[0]["coverage"]:
        line("  " + feat, [r["coverage"][feat][: w - 2] for r in results])
    for r in results:
        for feat, v in r["coverage"].items():
            if not v.startswith("ok"):
                print(f"  {r['engine']}: {feat}: {v}")
    for r in results:
        print(f"  {r['engine']} closure: {' '.join(r['closure'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="xgrammar,llguidance,outlines-core")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer.json")
    p.add_argument("--llama3-js", type=Path, help="llama3-tokenizer-js's src/data-converted.js")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--b1-repeats", type=int, default=4, help="batch-1 requests per schema")
    p.add_argument("--coverage-samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sampler",
        choices=["uniform", "ascii"],
        default="uniform",
        help="mask runs: draw among all allowed tokens, or among allowed printable-ASCII ones",
    )
    p.add_argument("--skip-coverage", action="store_true")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    if args.tokenizer:
        tj = args.tokenizer.read_text(encoding="utf-8")
    elif args.llama3_js:
        tj = llama3_tokenizer_json(args.llama3_js)
    else:
        p.error("give --tokenizer tokenizer.json or --llama3-js data-converted.js")
    unknown = [e for e in args.engines.split(",") if e not in ENGINES]
    if unknown:
        p.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    vocab = load_vocab(tj)
    results = []
    for name in args.engines.split(","):
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        try:
            results.append(bench_engine(ENGINES[name](), vocab, args))
        except ImportError as e:
            sys.exit(
                f"--engines: {name} is not importable here ({e}); pip install {name} in this environment"
            )
    print_report(results, vocab, args)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
