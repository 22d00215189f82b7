"""kiln: compile a Hugging Face checkpoint once into an artifact; load and serve it in seconds.

The import namespace maps onto the repository's top-level folders: ``kiln.ops`` (ops/),
``kiln.weights`` (weights/), ``kiln.compiler`` (compiler/) and ``kiln.runtime`` (runtime/).
"""

from importlib import metadata

try:
    __version__ = metadata.version("kiln")
except metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"

__all__ = ["__version__"]
