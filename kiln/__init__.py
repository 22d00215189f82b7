"""kiln: compile a Hugging Face checkpoint once into an artifact; load and serve it in seconds.

The import namespace maps onto the repository's top-level folders: ``kiln.ops`` (ops/),
``kiln.weights`` (weights/), ``kiln.compiler`` (compiler/) and ``kiln.runtime`` (runtime/).

    from kiln import LLM, SamplingParams
"""

import os
from importlib import metadata
from typing import Any

# A source checkout used without installing (PYTHONPATH=repo): map kiln.ops, kiln.weights,
# kiln.compiler and kiln.runtime onto the top-level folders, as the installed package does.
_SRC_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_SRC_ROOT, "ops", "__init__.py")) and _SRC_ROOT not in __path__:
    __path__.append(_SRC_ROOT)

try:
    __version__ = metadata.version("kiln")
except metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str) -> Any:  # lazy: `import kiln` stays light (no torch) for the CLI
    if name == "LLM":
        from kiln.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kiln.runtime.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from kiln.runtime.grammar import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
