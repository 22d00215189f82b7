"""kiln: compile a Hugging Face checkpoint once into an artifact; load and serve it in seconds.

The import namespace maps onto the repository's top-level folders: ``kiln.ops`` (ops/),
``kiln.weights`` (weights/), ``kiln.compiler`` (compiler/) and ``kiln.runtime`` (runtime/).

    from kiln import LLM, SamplingParams
"""

from importlib import metadata
from typing import Any

try:
    __version__ = metadata.version("kiln")
except metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:  # lazy: `import kiln` stays light (no torch) for the CLI
    if name == "LLM":
        from kiln.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kiln.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
