"""Loading an artifact onto a device: manifest checks, precompiled kernels, graphs, weights.

Start-up is loading files, nothing else: the Triton cache shipped in ``kernels/`` is used as is
(no JIT compilation), the exported graphs are deserialized, and the rank's weight pack is copied
to the device. Each phase is timed and reported.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.runtime.artifact import Artifact, open_artifact


@dataclass
class LoadedModel:
    artifact: Artifact
    device: torch.device
    weights: dict[str, torch.Tensor]
    graphs: dict[str, Any]  # name -> callable module from torch.export
    cos_sin: torch.Tensor  # [max_seq_len, rotary_dim] f32
    phases: dict[str, float] = field(default_factory=dict)


def use_artifact_kernels(art: Artifact) -> None:
    """Point Triton at the artifact's precompiled kernel cache."""
    os.environ["TRITON_CACHE_DIR"] = str((art.root / "kernels").resolve())


def load_model(
    path: str, device: str | torch.device = "cpu", rank: int = 0, verify: bool = False, log: bool = False
) -> LoadedModel:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    phases: dict[str, float] = {}
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = now - t
        t = now
        if log:
            print(f"[kiln] {name}: {phases[name]:.2f} s", flush=True)

    art = open_artifact(path, dev, verify=verify)
    use_artifact_kernels(art)
    import kiln.ops  # noqa: F401  (registers torch.ops.kiln.* before graphs deserialize)
    from kiln.ops.rope import rope_cos_sin_cache
    from kiln.weights import load_pack

    mark("manifest")
    graphs = {}
    for name, g in art.graphs.items():
        graphs[name] = torch.export.load(art.root / g["file"]).module()
    mark("graphs")
    weights = load_pack(art.root / "weights", rank, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    mark("weights")
    r = art.rope
    cos_sin = rope_cos_sin_cache(r["rotary_dim"], art.max_seq_len, r["base"], r["scaling"], device=dev)
    mark("rope")
    return LoadedModel(art, dev, weights, graphs, cos_sin, phases)
