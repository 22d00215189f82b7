"""The local-expert map of an expert-parallel rank, built inside the graph from the process's rank.

Op ``torch.ops.kiln.ep_expert_map(like, num_experts, num_local, expert_tp) -> map [E] int32``:

* ``like``: any tensor on the device the map goes to (the graph passes its input ids);
* ``num_experts`` (``E``), ``num_local`` (``E / ep``, the experts a rank holds) and ``expert_tp``
  (``tp / ep``, the ranks that split each expert's intermediate dim): constants of the graph;
* ``map[g]`` is global expert ``g``'s slot in this rank's ``w13``/``w2`` (``g - ep_rank *
  num_local`` for the rank's own experts) or -1 (another rank's expert: ``fused_moe`` gives it
  nothing here), with ``ep_rank = tp_rank // expert_tp`` (the packs' placement,
  compiler/mappings.py ``_moe``).

The artifact's graph is the same on every rank (``kiln compile --tp N --ep M``); the rank comes
from the process's tensor-parallel group (ops/common/collective.py ``tp_world``) when the graph
runs, as the collectives' does, never from the trace. Without a group (one process: the compile's
warm-up) the rank is 0. The map is a few elementwise kernels, built once per forward by the model
(compiler/models/moe.py) and shared by its MoE layers.
"""

from __future__ import annotations

import torch

from kiln.ops.common.collective import tp_world
from kiln.ops.common.op import kiln_op


def ep_expert_map_ref(like: torch.Tensor, num_experts: int, num_local: int, expert_tp: int) -> torch.Tensor:
    """``[num_experts]`` int32 on ``like``'s device (module docstring)."""
    rank, _ = tp_world()
    first = (rank // expert_tp) * num_local  # this rank's first global expert
    local = torch.arange(num_experts, device=like.device, dtype=torch.int32) - first
    return torch.where((local >= 0) & (local < num_local), local, -1)


def _check(like: torch.Tensor, num_experts: int, num_local: int, expert_tp: int) -> None:
    if num_local < 1 or num_experts % num_local or expert_tp < 1:
        raise ValueError(
            f"ep_expert_map: num_local ({num_local}) must divide num_experts ({num_experts}) and "
            f"expert_tp ({expert_tp}) be >= 1"
        )


def _fake(like: torch.Tensor, num_experts: int, num_local: int, expert_tp: int) -> torch.Tensor:
    return like.new_empty(num_experts, dtype=torch.int32)


# The reference is the launch as well: a handful of elementwise ops on every device.
ep_expert_map = kiln_op("ep_expert_map", ref=ep_expert_map_ref, check=_check, fake=_fake)(ep_expert_map_ref)

__all__ = ["ep_expert_map", "ep_expert_map_ref"]
