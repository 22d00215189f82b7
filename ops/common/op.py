"""One way to define an op: :func:`kiln_op`.

An op is a ``torch.library.custom_op`` in the ``kiln`` namespace (``torch.ops.kiln.<name>``), made of
pieces written in one file, its signature written once:

* the **launch** (the decorated function): what runs on CUDA tensors, the Triton kernels or the
  backend it picks (named ``<name>_triton`` when it launches the file's kernels, ``<name>_forward``
  when it chooses between backends). Its typed positional parameters are the op's: the schema is
  inferred from them, defaults included (a default drops an argument equal to it from an exported
  graph, so an op the graphs call keeps the defaults it has). Keyword-only parameters after ``*``
  (with defaults) are extras for direct callers, a launch config for a benchmark, and not part of
  the op. An op that only mutates its arguments is annotated ``-> None`` (the schema's ``-> ()``).
* the **reference** (``ref``): plain torch with the same parameters (names, kinds, defaults, in
  order; annotations may be left off, those it has must be the launch's). It is the CPU
  implementation, the tests' oracle, and, run on fake tensors, the shape rule ``torch.export``
  needs.
* ``check`` (optional): validation that both paths run first; called with the op's arguments, it
  may name only the leading ones and take the rest as ``*_``. Errors name the argument and what it
  must be.
* ``fake`` (optional): an explicit shape rule, for a reference that cannot run on fake tensors (it
  reads data on the host: ``.tolist()``, ``.item()``, a data-dependent shape). Called like
  ``check``.

``kiln_op(name, ref=...)`` checks at import that the reference (and ``check`` and ``fake``) take the
op's parameters, raising a ``TypeError`` that names both functions, then registers ``kiln::<name>``
with the body::

    check(*args)
    return launch(*args) if use_triton(args[0]) else ref(*args)

(the op's first parameter is the tensor that decides: ops/common/launch.py ``use_triton``),
registers ``fake`` (else ``ref``) as the fake implementation, records the body in :data:`DIRECT`
and returns the launch unchanged. Mutated arguments are named in ``mutates_args``. The body takes
positional arguments, as the dispatcher passes them (those left at their default omitted) and as
the graphs' generated code calls it. A mutated argument has no default (torch 2.11 indexes the
arguments as passed to bump the versions of the mutated ones).

``DIRECT`` maps each op's name to that body: the runtime calls the bodies straight from the graphs
it loads (runtime/graph_code.py), skipping the dispatcher, whose first custom-op call imports
``torch._dynamo`` (seconds on a slow host) and whose every call costs tens of microseconds of Python
in eager steps. The body is a couple of calls: the check, ``use_triton`` and the launch.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from kiln.ops.common.launch import use_triton

DIRECT: dict[str, Callable[..., Any]] = {}  # op name (no namespace) -> its Python body

F = TypeVar("F", bound=Callable[..., Any])
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def kiln_op(
    name: str,
    *,
    ref: Callable[..., Any],
    mutates_args: Sequence[str] = (),
    check: Callable[..., None] | None = None,
    fake: Callable[..., Any] | None = None,
) -> Callable[[F], F]:
    """Register the decorated launch as ``torch.ops.kiln.<name>`` (see the module docstring)."""

    def register(launch: F) -> F:
        signature = op_signature(name, launch)
        names = list(signature.parameters)
        _require_same_parameters(name, launch, signature, ref)
        _require_mutated_without_default(name, launch, signature, mutates_args)
        for role, fn in (("check", check), ("fake", fake)):
            if fn is not None:
                _require_takes(name, role, fn, launch, names)
        body = _body(launch, ref, check)
        body.__name__ = body.__qualname__ = name
        body.__module__ = launch.__module__
        body.__doc__ = launch.__doc__
        body.__signature__ = signature  # type: ignore[attr-defined]  # the schema torch infers
        op = torch.library.custom_op(f"kiln::{name}", body, mutates_args=tuple(mutates_args))
        op.register_fake(fake if fake is not None else ref)
        DIRECT[name] = body
        return launch

    return register


def op_signature(name: str, launch: Callable[..., Any]) -> inspect.Signature:
    """The op's signature: the launch's positional parameters with their annotations resolved
    (keyword-only extras left out). Raises ``TypeError`` for a launch that cannot be an op."""
    where = f"kiln_op {name!r}: launch {_named(launch)}"
    hints = typing.get_type_hints(launch)
    params = []
    for p in inspect.signature(launch).parameters.values():
        if p.kind in _POSITIONAL:
            if p.name not in hints:
                raise TypeError(f"{where}: parameter {p.name!r} needs a type annotation (the op's schema)")
            params.append(p.replace(annotation=hints[p.name]))
        elif p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty:
            raise TypeError(
                f"{where}: parameter {p.name!r} must be positional (the op's) or keyword-only with a "
                "default (an extra for direct callers)"
            )
    if not params or hints.get(params[0].name) is not torch.Tensor:
        raise TypeError(f"{where}: the first parameter must be a torch.Tensor (it picks the device path)")
    if "return" not in hints:
        raise TypeError(f"{where}: needs a return annotation (the op's schema)")
    return inspect.Signature(params, return_annotation=_schema_return(hints["return"]))


def _schema_return(hint: Any) -> Any:
    """A resolved return annotation as ``torch.library.infer_schema`` takes it: ``-> None`` (which
    ``typing.get_type_hints`` resolves to ``NoneType``) is ``None``, the schema's ``-> ()``."""
    return None if hint is type(None) else hint


def _require_same_parameters(
    name: str, launch: Callable[..., Any], signature: inspect.Signature, ref: Callable[..., Any]
) -> None:
    """The reference takes the op's parameters: names, kinds and defaults in order; annotations,
    where it has them, the launch's (return annotation included)."""
    got = inspect.signature(ref)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    ref_bare = [p.replace(annotation=inspect.Parameter.empty) for p in got.parameters.values()]
    problem = None if ref_bare == bare else "its parameters differ"
    if problem is None:
        hints = typing.get_type_hints(ref)
        want = {p.name: p.annotation for p in signature.parameters.values()}
        want["return"] = signature.return_annotation
        hints = {k: _schema_return(v) if k == "return" else v for k, v in hints.items()}
        problem = next(
            (f"{k!r} is annotated {v}, not {want[k]}" for k, v in hints.items() if want[k] != v), None
        )
    if problem is not None:
        raise TypeError(
            f"kiln_op {name!r}: the reference {_named(ref)}{got} must take the op's parameters, as the "
            f"launch {_named(launch)}{signature} does ({problem})"
        )


def _require_mutated_without_default(
    name: str, launch: Callable[..., Any], signature: inspect.Signature, mutates_args: Sequence[str]
) -> None:
    """Each mutated argument is one of the op's, without a default: torch 2.11's dispatcher bumps
    the version of ``args[i]`` for each mutated position ``i`` of the arguments as passed, which an
    argument left at its default is not (an ``IndexError`` on CUDA; torch 2.13 fills defaults first)."""
    for arg in mutates_args:
        p = signature.parameters.get(arg)
        if p is None:
            raise TypeError(
                f"kiln_op {name!r}: mutated argument {arg!r} is not a parameter of {_named(launch)}"
            )
        if p.default is not inspect.Parameter.empty:
            raise TypeError(
                f"kiln_op {name!r}: mutated argument {arg!r} of {_named(launch)} must not have a default "
                "(callers pass None for an absent one)"
            )


def _require_takes(
    name: str, role: str, fn: Callable[..., Any], launch: Callable[..., Any], names: list[str]
) -> None:
    try:
        inspect.signature(fn).bind(*names)
    except TypeError as err:
        raise TypeError(
            f"kiln_op {name!r}: {role} {_named(fn)}{inspect.signature(fn)} must take the op's arguments "
            f"({', '.join(names)}) as the launch {_named(launch)} does: {err}"
        ) from None


def _named(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _body(
    launch: Callable[..., Any], ref: Callable[..., Any], check: Callable[..., None] | None
) -> Callable[..., Any]:
    """The op's body (module docstring): a closure, so a call costs the check, ``use_triton`` and
    the chosen function."""
    if check is None:

        def body(*args: Any) -> Any:
            if use_triton(args[0]):
                return launch(*args)
            return ref(*args)

    else:

        def body(*args: Any) -> Any:
            check(*args)
            if use_triton(args[0]):
                return launch(*args)
            return ref(*args)

    return body
