"""Issue 31's acceptance for structured outputs (runtime/grammar.py), through the official ``openai``
client (``AsyncOpenAI``, ``CONCURRENCY`` requests in flight) on the random-weight demo model, whose free
text is noise. ``REQUESTS`` requests per mode, greedy and seeded-sampled, chat and completions:

* ``json_schema`` (as many different generated schemas), ``regex``, ``choice``, ``ebnf``: every one
  ends with ``finish_reason == "stop"`` (the grammar ends it, never ``max_tokens``) and its output
  parses and validates (``jsonschema``; ``re.fullmatch``; membership; an independent regex written
  for each grammar);
* ``json_object``: "any JSON object" has unbounded strings, which a random model rarely closes
  (measured on these requests: 15 of 100 end within 32 tokens, all ``{}``; 21 of 100 within 320; 18
  of 40 within 960; greedy chat ones never), so the ones that stop parse to an object and the ones cut
  at ``max_tokens`` are a prefix of a JSON object (:func:`is_json_object_prefix`, a parser
  independent of the grammar engine);
* a subset of each mode is streamed too: the joined deltas equal the non-streamed text exactly.

Schemas come from :func:`random_schema` (a seeded ``random.Random``): nested objects with required and
optional properties and ``additionalProperties: false``, arrays with ``minItems``/``maxItems`` (of
scalars or of objects), enums (mixed types too), consts, integers and numbers with inclusive and
exclusive (integral and fractional) bounds, strings with ``maxLength`` and ``minLength``, booleans.
Every value is bounded (numbers on both sides, strings by length, arrays by count) so a complete
object always fits ``MAX_TOKENS``; the keywords runtime/grammar.py refuses (``uniqueItems``, ``allOf``
with several schemas) are left out."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest

REQUESTS = 100  # per mode (the number)
STREAMED = 20  # of the json_schema requests, also streamed and compared (other modes: STREAMED // 4)
CONCURRENCY = 16  # requests in flight (the CPU demo engine runs 8 at once; the rest wait in its queue)
MAX_TOKENS = 320  # the generated schemas' longest output is ~150 tokens (a cut one would not parse)
JSON_OBJECT_MAX_TOKENS = 32  # json_object requests that do not close run to it (see the docstring)
PROMPTS = ["Describe it.", "Once upon a time", "Give me the data.", "x", "Answer:", "Tell me a story"]

WORDS = ["alpha", "beta", "gamma", "delta", "id", "name", "kind", "size", "tags", "ok", "x", "y", "meta"]
ENUM_WORDS = ["red", "green", "blue", "cat", "dog", "on", "off", "a b", 'q"t', "é", "日本"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "integer", "number", "number", "string", "boolean", "enum", "const"])
    if kind in ("integer", "number"):
        lo = rng.randint(-500, 500)
        hi = lo + rng.choice([2, 7, 50, 999] if kind == "integer" else [1, 2, 7, 50, 999])  # never empty
        s: dict[str, Any] = {"type": kind}
        if kind == "number" and rng.random() < 0.5:  # fractional bounds
            lo, hi = lo + rng.choice([0.25, 0.5, 0.125]), hi + rng.choice([0.0, 0.75, 0.5])
        s["exclusiveMinimum" if rng.random() < 0.35 else "minimum"] = lo
        s["exclusiveMaximum" if rng.random() < 0.35 else "maximum"] = hi
        return s
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 10)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, s["maxLength"])
        return s
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "const":
        return {"const": rng.choice([7, "fixed", True, None, -1.5])}
    values: list[Any] = rng.sample(ENUM_WORDS, rng.randint(1, 4))
    if rng.random() < 0.3:  # mixed types
        values += [rng.randint(-9, 9), None]
    return {"enum": values}


def _array(rng: random.Random, depth: int) -> dict[str, Any]:
    lo = rng.randint(0, 2)
    items = _object(rng, depth + 1, max_props=2) if depth < 2 and rng.random() < 0.3 else _leaf(rng)
    return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}


def _object(rng: random.Random, depth: int, max_props: int = 4) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, max_props))
    props: dict[str, Any] = {}
    for name in names:
        r = rng.random()
        if depth < 2 and r < 0.2:
            props[name] = _object(rng, depth + 1, max_props=3)
        elif depth < 2 and r < 0.4:
            props[name] = _array(rng, depth)
        else:
            props[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schema(rng: random.Random) -> dict[str, Any]:
    """One bounded schema: an object of 1-4 properties, objects nested at most three deep (module
    docstring)."""
    return _object(rng, 0)


def _walk(node: Any):
    yield node
    for v in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
        yield from _walk(v)


# regex mode: re.ASCII in the check, so \d is [0-9] as in the grammar
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
REGEXES = [
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",  # a date
    r"\(\d{3}\) \d{3}-\d{4}",  # a phone number
    r"[A-Za-z_][A-Za-z0-9_]{0,11}",  # an identifier
    rf"({_OCTET}\.){{3}}{_OCTET}",  # an IPv4 address
    r"#[0-9a-fA-F]{6}",  # a colour
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",  # an e-mail address
    r"v(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})",  # a version
    r"(yes|no|maybe)( [0-9]{1,2}%)?",
]

CHOICES = [
    ["yes", "no"],
    ["yes", "yes please", "y", "no"],  # prefixes of each other
    ["red", "green", "blue", "dark blue", "light green"],
    ["café", "日本語", "naïve ok", 'say "hi"', "tab\there"],
    [str(i) for i in range(10, 30)],
]

_TERM = r"([0-9]{1,3}|\([0-9]{1,3}[-+*][0-9]{1,3}\))"
_PAIR = r"[a-z]{1,5}=(true|false|[0-9]{1,4})"
EBNFS = [  # (grammar, an independent regex for its language)
    (
        'root ::= greeting " " name punct\ngreeting ::= "hello" | "hi" | "hey"\n'
        'name ::= [A-Z] [a-z]{1,6}\npunct ::= "!" | "." | ""',
        r"(hello|hi|hey) [A-Z][a-z]{1,6}[!.]?",
    ),
    (
        'root ::= "[" num ("," num){0,3} "]"\nnum ::= "0" | [1-9] [0-9]{0,2}',
        r"\[(0|[1-9][0-9]{0,2})(,(0|[1-9][0-9]{0,2})){0,3}\]",
    ),
    (
        'root ::= term (op term){0,3}\nterm ::= num | "(" num op num ")"\nop ::= "+" | "-" | "*"\n'
        "num ::= [0-9]{1,3}",
        rf"{_TERM}([-+*]{_TERM}){{0,3}}",
    ),
    (
        'root ::= pair (";" pair){0,2}\npair ::= key "=" value\nkey ::= [a-z]{1,5}\n'
        'value ::= "true" | "false" | [0-9]{1,4}',
        rf"{_PAIR}(;{_PAIR}){{0,2}}",
    ),
]


class _End(Exception):
    """The text ended inside a JSON value: what came before is a valid prefix."""


def is_json_object_prefix(text: str) -> bool:
    """Whether ``text`` opens with ``{`` and is a (possibly complete) prefix of a JSON object text
    (RFC 8259: no control characters in strings, no leading zeros, ...): a small parser that accepts
    the text ending anywhere inside a value, and nothing invalid before that."""
    n = len(text)

    def at(i: int) -> str:
        if i >= n:
            raise _End
        return text[i]

    def ws(i: int) -> int:
        while i < n and text[i] in " \t\n\r":
            i += 1
        return i

    def expect(i: int, ch: str) -> int:
        if at(i) != ch:
            raise ValueError(f"{ch!r} expected at {i}")
        return i + 1

    def string(i: int) -> int:
        i = expect(i, '"')
        while (c := at(i)) != '"':
            if c == "\\":
                e = at(i + 1)
                if e == "u":
                    for k in range(i + 2, i + 6):
                        if at(k) not in "0123456789abcdefABCDEF":
                            raise ValueError(f"bad \\u escape at {i}")
                    i += 6
                elif e in '"\\/bfnrt':
                    i += 2
                else:
                    raise ValueError(f"bad escape at {i}")
            elif ord(c) < 0x20:
                raise ValueError(f"control character in a string at {i}")
            else:
                i += 1
        return i + 1

    def number(i: int) -> int:
        j = i
        while j < n and text[j] in "+-.eE0123456789":
            j += 1
        run = text[i:j]
        full = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
        if j == n and (re.fullmatch(full, run) or re.fullmatch(full, run + "0")):
            raise _End
        if not re.fullmatch(full, run):
            raise ValueError(f"bad number {run!r} at {i}")
        return j

    def container(i: int, close: str) -> int:
        i = ws(i + 1)
        if at(i) == close:
            return i + 1
        while True:
            if close == "}":
                i = ws(expect(ws(string(i)), ":"))
            i = ws(value(i))
            if at(i) == close:
                return i + 1
            i = ws(expect(i, ","))

    def value(i: int) -> int:
        c = at(i)
        if c in "{[":
            return container(i, "}" if c == "{" else "]")
        if c == '"':
            return string(i)
        if c == "-" or c.isdigit():
            return number(i)
        for word in ("true", "false", "null"):
            if c == word[0]:
                for k, w in enumerate(word):
                    if at(i + k) != w:
                        raise ValueError(f"bad literal at {i}")
                return i + len(word)
        raise ValueError(f"unexpected {c!r} at {i}")

    try:
        i = ws(0)
        if i == n or text[i] != "{":
            return False
        return ws(value(i)) == n
    except _End:
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Case:
    """One request: its structure (``extra``: ``response_format`` or an extension field), endpoint,
    prompt and sampling, and ``check`` (True when the output is inside the structure; may raise)."""

    label: str
    extra: dict[str, Any]
    check: Callable[[str], bool]
    chat: bool
    prompt: str
    sampling: dict[str, Any]
    max_tokens: int = MAX_TOKENS


def _case(i: int, label: str, extra: dict[str, Any], check: Callable[[str], bool], **kw: Any) -> Case:
    """Request ``i``: greedy and seeded-sampled alternate, chat and completions alternate in pairs."""
    sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 1000 + i}
    return Case(label, extra, check, (i // 2) % 2 == 0, PROMPTS[i % len(PROMPTS)], sampling, **kw)


def _schema_check(schema: dict[str, Any]) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)  # raises when it does not validate
        return True

    return check


def schema_cases() -> list[Case]:
    rng = random.Random(31)
    cases = []
    for i in range(REQUESTS):
        schema = random_schema(rng)
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        label = f"schema {i}: {json.dumps(schema)}"
        cases.append(_case(i, label, {"response_format": rf}, _schema_check(schema)))
    return cases


def mode_cases(mode: str) -> list[Case]:
    cases = []
    for i in range(REQUESTS):
        if mode == "json_object":
            rf = {"response_format": {"type": "json_object"}}
            check = is_json_object_prefix  # a complete one must also parse: test_json_object_...
            cases.append(_case(i, "json_object", rf, check, max_tokens=JSON_OBJECT_MAX_TOKENS))
        elif mode == "regex":
            pat = REGEXES[i % len(REGEXES)]
            check = lambda t, p=pat: bool(re.fullmatch(p, t, re.ASCII))
            cases.append(_case(i, f"regex {pat}", {"regex": pat}, check))
        elif mode == "choice":
            opts = CHOICES[i % len(CHOICES)]
            cases.append(_case(i, f"choice {opts}", {"choice": opts}, lambda t, o=opts: t in o))
        else:
            grammar, pat = EBNFS[i % len(EBNFS)]
            check = lambda t, p=pat: bool(re.fullmatch(p, t))
            cases.append(_case(i, f"ebnf {grammar!r}", {"ebnf": grammar}, check))
    return cases


async def _one(client: Any, model: str, case: Case, stream: bool) -> tuple[str, str | None]:
    """``(text, finish_reason)`` of one request (a stream's deltas joined)."""
    body: dict[str, Any] = dict(model=model, max_tokens=case.max_tokens, **case.sampling)
    if case.chat:
        body["messages"] = [{"role": "user", "content": case.prompt}]
        create = client.chat.completions.create
    else:
        body["prompt"] = case.prompt
        create = client.completions.create
    if case.chat and "response_format" in case.extra:  # a parameter of the chat API itself
        body["response_format"] = case.extra["response_format"]
    elif case.extra:
        body["extra_body"] = case.extra
    if not stream:
        ch = (await create(**body)).choices[0]
        return (ch.message.content if case.chat else ch.text) or "", ch.finish_reason
    parts, finish = [], None
    async for chunk in await create(**body, stream=True):
        for ch in chunk.choices:
            parts.append((ch.delta.content if case.chat else ch.text) or "")
            finish = ch.finish_reason or finish
    return "".join(parts), finish


Result = tuple[str, str | None, tuple[str, str | None] | None]  # text, finish_reason, streamed ones


def run_cases(server: Any, cases: list[Case], streamed: int = 0) -> list[Result]:
    """Every case's :data:`Result`, ``CONCURRENCY`` requests at a time; the first ``streamed`` cases
    are also sent streaming, concurrently with the rest."""

    async def main() -> list[Result]:
        client = server.async_client()
        gate = asyncio.Semaphore(CONCURRENCY)

        async def gated(case: Case, stream: bool) -> tuple[str, str | None]:
            async with gate:
                return await _one(client, server.model, case, stream)

        async with client:
            plain = [gated(c, False) for c in cases]
            results = await asyncio.gather(*plain, *[gated(c, True) for c in cases[:streamed]])
        streams = results[len(cases) :] + [None] * (len(cases) - streamed)
        return [(t, f, s) for (t, f), s in zip(results[: len(cases)], streams, strict=True)]

    results = asyncio.run(main())
    server.wait_idle()
    return results


def _failures(cases: list[Case], results: list[Result], must_stop: bool = True) -> list[str]:
    """One line per request whose output is outside its structure, that did not stop (when
    ``must_stop``), or whose stream disagrees."""
    bad = []
    for case, (text, finish, streamed) in zip(cases, results, strict=True):
        where = f"{case.label} ({'chat' if case.chat else 'completions'}, {case.sampling}): {text!r}"
        if streamed is not None and streamed != (text, finish):
            bad.append(f"stream {streamed[0]!r} ({streamed[1]}) != non-stream ({finish}) for {where}")
        if finish != "stop" and (must_stop or finish != "length"):
            bad.append(f"finish_reason {finish!r} for {where}")
            continue
        try:
            if case.check(text) is not True:
                bad.append(f"outside the structure: {where}")
        except (ValueError, jsonschema.ValidationError) as e:  # json.JSONDecodeError is a ValueError
            bad.append(f"{type(e).__name__}: {str(e).splitlines()[0]} for {where}")
    return bad


def test_schema_generator_is_varied_and_valid():
    schemas = [json.loads(c.label.split(": ", 1)[1]) for c in schema_cases()]
    assert [c.label for c in schema_cases()] == [c.label for c in schema_cases()]  # seeded
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == REQUESTS
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
    nodes = [n for s in schemas for n in _walk(s) if isinstance(n, dict)]
    assert not any("uniqueItems" in n or "allOf" in n for n in nodes)  # refused by runtime/grammar.py
    seen = {k for n in nodes for k in n}
    want = {"enum", "const", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum"}
    want |= {"exclusiveMaximum", "maxLength", "minLength", "additionalProperties", "required"}
    assert want <= seen, want - seen
    assert {"object", "array", "integer", "number", "string", "boolean"} <= {n.get("type") for n in nodes}
    nested = [s for s in schemas if any(p.get("type") == "object" for p in s["properties"].values())]
    optional = [s for s in schemas if set(s["required"]) < set(s["properties"])]
    object_items = [n for n in nodes if n.get("type") == "array" and n["items"].get("type") == "object"]
    assert nested and optional and object_items


def test_json_object_prefix_check():
    good = ['{"a": 1}', '{"a": [1, -2.5e+3, true, null, {"b": "\\u00e9\\n"}]}', "{}", '{"a": tr', '{"a": -']
    good += ['{"a": 1.', '{"a": "x\\', '{"a": "\\u00', '{"', '{"a": [{"b": {}}, ']
    bad = ['{"a": 1}x', '{"a": trx', '{"a\x01', "[1]", '{"a": 01', '{"a": 1,}', '{"a" 1', '{"a": "\\q"']
    bad += ['{"a": 1.e', '{"a": .5', "{1: 2}", '"a"', "", '{"a": [1 2]']
    assert [t for t in good if not is_json_object_prefix(t)] == []
    assert [t for t in bad if is_json_object_prefix(t)] == []


def test_json_schema_outputs_validate_and_streams_agree(server):
    cases = schema_cases()
    results = run_cases(server, cases, streamed=STREAMED)
    bad = _failures(cases, results)
    assert not bad, f"{len(bad)} of {len(cases)} failed:\n" + "\n".join(bad)
    # the structure is what makes them valid: the same greedy requests without one give other text
    free = [Case("free", {}, json.loads, c.chat, c.prompt, c.sampling, max_tokens=48) for c in cases[:8:2]]
    assert not any(f[0] == r[0] for f, r in zip(run_cases(server, free), results[:8:2], strict=True))


@pytest.mark.parametrize("mode", ["regex", "choice", "ebnf"])
def test_mode_outputs_are_in_their_structure(server, mode):
    cases = mode_cases(mode)
    results = run_cases(server, cases, streamed=STREAMED // 4)
    bad = _failures(cases, results)
    assert not bad, f"{len(bad)} of {len(cases)} failed:\n" + "\n".join(bad)
    assert len({r[0] for r in results}) >= 20  # varied outputs reached the checks


def test_json_object_outputs_are_objects(server):
    cases = mode_cases("json_object")
    results = run_cases(server, cases, streamed=STREAMED // 4)
    bad = _failures(cases, results, must_stop=False)
    stopped = [text for text, finish, _ in results if finish == "stop"]
    bad += [f"not an object: {t!r}" for t in stopped if not isinstance(json.loads(t), dict)]
    assert not bad, f"{len(bad)} of {len(cases)} failed:\n" + "\n".join(bad)
    assert stopped and len(stopped) < len(results)  # both kinds were checked


def _small_schema(rng: random.Random) -> dict[str, Any]:
    """A generated schema short enough that its prompt and its longest call fit the demo's
    1024-token context together (a call cut by the context would not parse)."""
    while len(json.dumps(schema := random_schema(rng))) > 300:
        pass
    return schema


def test_required_tool_calls_name_a_declared_tool_with_valid_arguments(server):
    """``tool_choice="required"`` (runtime/server_tools.py): REQUESTS requests, one tool each (the
    small demo tokenizer spends ~400 of the 1024-token context on a tool's schema in the prompt) whose parameters are generated schemas, greedy and sampled: every answer is one call
    of a declared tool whose arguments validate, finish_reason "tool_calls"."""
    rng = random.Random(31)
    bodies = []
    for i in range(REQUESTS):
        tools = [
            {"type": "function", "function": {"name": f"tool_{i}_{k}", "parameters": _small_schema(rng)}}
            for k in range(1)
        ]
        sampling = {"temperature": 0.0} if i % 3 == 0 else {"temperature": 1.0, "seed": 500 + i}
        bodies.append({"tools": tools, "tool_choice": "required", **sampling})

    async def main() -> list[Any]:
        client = server.async_client()
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(body: dict[str, Any]) -> Any:
            async with gate:
                return await client.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": "Use a tool."}], **body
                )  # no max_tokens: the rest of the context

        async with client:
            return await asyncio.gather(*(one(b) for b in bodies))

    bad = []
    for body, r in zip(bodies, asyncio.run(main()), strict=True):
        ch = r.choices[0]
        declared = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
        calls = ch.message.tool_calls or []
        if ch.finish_reason != "tool_calls" or len(calls) != 1 or calls[0].function.name not in declared:
            bad.append(f"{ch.finish_reason}: {ch.message}")
            continue
        try:
            jsonschema.validate(json.loads(calls[0].function.arguments), declared[calls[0].function.name])
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{calls[0].function.arguments!r}: {e}")
    server.wait_idle()
    assert not bad, f"{len(bad)} of {REQUESTS} failed:\n" + "\n".join(bad[:10])
