"""kiln: compile a Hugging Face checkpoint once into an artifact; load and serve it in seconds.

The import namespace maps onto the repository's top-level folders: ``kiln.ops`` (ops/),
``kiln.weights`` (weights/), ``kiln.compiler`` (compiler/) and ``kiln.runtime`` (runtime/).

    from kiln import LLM, SamplingParams
"""

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

# A source checkout used without installing (PYTHONPATH=repo): map kiln.ops, kiln.weights,
# kiln.compiler and kiln.runtime onto the top-level folders, as the installed package does.
_SRC_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_SRC_ROOT, "ops", "__init__.py")) and _SRC_ROOT not in __path__:
    __path__.append(_SRC_ROOT)

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees memory); the
    collector's previous state after. For start-up work that allocates many long-lived objects
    (importing torch and the kernels, loading an artifact): each collection there walks every
    object alive. On a 2-core CPU the collector took 0.22 s of the runtime's import (median 1.51
    -> 1.28 s without it) and 0.10-0.15 s of an artifact's load.

    On leaving, the objects made inside go to the oldest generation unexamined (``gc.freeze()``
    then ``gc.unfreeze()``: two list splices): otherwise the next allocation would walk them all
    at once as the youngest generation (0.1 s after an import of the runtime). A garbage cycle
    among them is found by the next full collection, as any old object's is. Not when the
    process froze objects itself (``gc.freeze()`` before a fork): those stay frozen. Nests (only
    the outermost pause acts on leaving); the collector is process-wide, so a pause holds for
    every thread while it lasts."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _version() -> str:
    from importlib import metadata  # (importing it costs about 25 ms: only when asked)

    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return "0.0.0+src"


def __getattr__(name: str) -> Any:  # lazy: `import kiln` stays light (no torch) for the CLI
    if name == "__version__":
        globals()["__version__"] = version = _version()
        return version
    if name == "LLM":
        with gc_paused():  # torch, the kernels and the runtime
            from kiln.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kiln.runtime.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from kiln.runtime.grammar import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
