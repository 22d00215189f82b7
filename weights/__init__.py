"""From a Hugging Face checkpoint to pre-sharded, verified weight packs, and back onto a device.

Stages (one file each): :mod:`.discover` (which files), :mod:`.stream` (``(name, tensor)`` over
mmapped shards, optional bounded read-ahead), :mod:`.mapping` (names -> packed tensors, skip rules,
FP8 scale names), :mod:`.spec` (sharding and placement, frozen per tensor), :mod:`.pack`
(post-processing and the streaming writer), :mod:`.verify` (checks), :mod:`.integrity` (what is
recorded and checked), :mod:`.checksum` (wsum64, per tensor: numpy, and a Triton kernel that checks
a rank on the GPU after its load) and :mod:`.reader` (loading). The per-architecture
declarations live in ``kiln.compiler.mappings``.
"""

from kiln.weights.discover import CheckpointError, WeightFiles, discover_weights
from kiln.weights.index import PackError, PackIndex, PackProvenance
from kiln.weights.mapping import MappingError
from kiln.weights.pack import pack_checkpoint
from kiln.weights.reader import LoadOptions, load_pack
from kiln.weights.spec import ParamSpec, Piece, Region, even_split, expected_tensors
from kiln.weights.stream import CheckpointStream
from kiln.weights.verify import verify_pack

__all__ = [
    "CheckpointError",
    "CheckpointStream",
    "LoadOptions",
    "MappingError",
    "PackError",
    "PackIndex",
    "PackProvenance",
    "ParamSpec",
    "Piece",
    "Region",
    "WeightFiles",
    "discover_weights",
    "even_split",
    "expected_tensors",
    "load_pack",
    "pack_checkpoint",
    "verify_pack",
]
