"""Frozen dataclasses to and from JSON, refusing a bad document field by field.

A :class:`JsonRecord` subclass is a frozen dataclass whose fields are typed with ``int``, ``float``
(an integer is accepted), ``str``, ``bool``, ``Any``, ``X | None``, ``tuple[X, ...]`` (a JSON
list), ``dict[str, X]``, ``dict[int, X]`` (a JSON object with decimal keys) or another record.
JSON keys are the field names. A field whose default is ``None`` is left out of
:meth:`~JsonRecord.to_json` when it is None (and may be absent); every other field is always
written, ``null`` included. :meth:`~JsonRecord.from_json` raises :class:`RecordError` for a missing
field, a value of another type or a key the record does not have, naming the field by its path
(``'kv.page_size' is missing``, ``'eos_token_ids[1]' is a string, not an integer``).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Union

from kiln.errors import KilnError


class RecordError(KilnError, ValueError):
    """A field that is missing, of another type, unknown or out of range; the message names it."""


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "an object", type(None): "null"}  # fmt: skip
_DECODERS: dict[Any, Callable[[Any, str, str], Any]] = {}


def _wrong(parent: str, key: str, value: Any, want: str) -> RecordError:
    got = _KINDS.get(type(value), type(value).__name__)
    return RecordError(f"'{_at(parent, key) or 'the document'}' is {got}, not {want}")


# A decoder is ``decode(json_value, parent_path, key) -> value``: the field's path is built only for
# an error message (a GPU artifact lists thousands of kernel files, each decoded at every load).
Decoder = Callable[[Any, str, str], Any]


def _scalar(kind: type, want: str) -> Decoder:
    def dec(v: Any, parent: str, key: str) -> Any:
        if type(v) is kind or (kind is float and type(v) is int):
            return v
        raise _wrong(parent, key, v, want)

    return dec


def _decoder(tp: Any) -> Decoder:
    """The decoder of the type ``tp`` (built once per type)."""
    if tp in _DECODERS:
        return _DECODERS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    dec: Decoder
    if tp is Any:
        dec = lambda v, parent, key: v
    elif tp in (int, float, str, bool):
        dec = _scalar(tp, _KINDS[tp])
    elif origin in (Union, types.UnionType):  # X | None
        inner = _decoder(next(a for a in args if a is not type(None)))
        dec = lambda v, parent, key: None if v is None else inner(v, parent, key)
    elif origin is tuple:  # tuple[X, ...]
        item = _decoder(args[0])

        def dec(v: Any, parent: str, key: str) -> Any:
            if type(v) is not list:
                raise _wrong(parent, key, v, "a list")
            p = _at(parent, key)
            return tuple(item(x, p, f"[{i}]") for i, x in enumerate(v))

    elif origin is dict:  # dict[str, X] or dict[int, X] (JSON keys are strings)
        int_keys, value = args[0] is int, _decoder(args[1])

        def dec(v: Any, parent: str, key: str) -> Any:
            if type(v) is not dict:
                raise _wrong(parent, key, v, "an object")
            p = _at(parent, key)
            if int_keys and not all(k.isdigit() for k in v):
                raise RecordError(f"'{p}' must have integer keys, has {sorted(v)!r}")
            return {(int(k) if int_keys else k): value(x, p, k) for k, x in v.items()}

    elif is_dataclass(tp):
        dec = _record_decoder(tp)
    else:  # a field type this module cannot read: a bug in the record's declaration, not in a document
        raise TypeError(f"kiln.json_record: no decoder for {tp!r}")
    _DECODERS[tp] = dec
    return dec


def _record_decoder(cls: Any) -> Decoder:
    hints = typing.get_type_hints(cls)
    flds = fields(cls)
    names = frozenset(f.name for f in flds)
    required = [f.name for f in flds if f.default is MISSING and f.default_factory is MISSING]
    specs: list[tuple[str, Decoder]] = []  # resolved on first use (records may nest)

    def dec(v: Any, parent: str, key: str) -> Any:
        if type(v) is not dict:
            raise _wrong(parent, key, v, "an object")
        p = _at(parent, key)
        if not names.issuperset(v):
            raise RecordError(f"'{_at(p, min(v.keys() - names))}' is not a field this kiln knows")
        if not specs:
            specs.extend((f.name, _decoder(hints[f.name])) for f in flds)
        kw = {name: d(v[name], p, name) for name, d in specs if name in v}
        if len(kw) < len(names):
            for name in required:
                if name not in kw:
                    raise RecordError(f"'{_at(p, name)}' is missing")
        return cls(**kw)

    return dec


def _at(path: str, key: str) -> str:
    if key.startswith("["):
        return path + key
    return f"{path}.{key}" if path else key


def _encode(v: Any) -> Any:
    if is_dataclass(v) and not isinstance(v, type):
        return {
            f.name: _encode(x)
            for f in fields(v)
            if (x := getattr(v, f.name)) is not None or f.default is not None
        }
    if isinstance(v, tuple | list):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _encode(x) for k, x in v.items()}
    return v


class JsonRecord:
    """Base of a frozen dataclass that reads and writes itself as JSON (the module docstring's rules)."""

    def to_json(self) -> dict[str, Any]:
        return _encode(self)

    @classmethod
    def from_json(cls, doc: Any, path: str = "") -> Any:
        """The record of ``doc`` (``path``: where it sits, for messages); raises :class:`RecordError`
        naming the first bad field."""
        return _decoder(cls)(doc, "", path)
