"""Per-step host<->device copies through persistent pinned buffers.

A decode step moves a few hundred integers each way. Building them with ``torch.tensor(...,
device="cuda")`` is a pageable copy, which waits for everything queued on the stream; allocating
fresh pinned memory can call ``cudaHostAlloc``, which is slow and also waits. Either one defeats
overlapped decoding (the host would wait for the step in flight). The stager keeps a ring of
pinned buffers: a value list is written into the next buffer and copied with ``non_blocking``; an
event recorded after the copy guards the buffer, and before a buffer is rewritten that event is
waited on (in steady state it completed long ago). Device->host copies use a second ring.

On the CPU everything is a plain tensor and no event exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class _Ring:
    def __init__(self, device: torch.device, slots: int):
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.i = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slot's pinned byte buffer (grown to ``nbytes``), safe to overwrite."""
        i = self.i = (self.i + 1) % len(self.bufs)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[i] = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        return i, buf

    def guard(self, i: int) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self.events[i] = ev


class HostStager:
    """Copies small per-step tensors between host and ``device`` without synchronizing."""

    def __init__(self, device: torch.device | str, slots: int = 8):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self._up = _Ring(self.device, slots)
            self._down = _Ring(self.device, slots)

    def to_device(
        self, values: Sequence[int] | Sequence[Sequence[int]] | Sequence[float], dtype: torch.dtype
    ) -> torch.Tensor:
        """``torch.tensor(values, dtype)`` on the device, copied asynchronously."""
        host = torch.tensor(values, dtype=dtype)
        if not self.cuda:
            return host
        i, buf = self._up.take(host.numel() * host.element_size())
        staged = buf[: host.numel() * host.element_size()].view(dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        self._up.guard(i)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` that is complete once the caller's event after it has fired. The
        buffer is reused ``slots`` calls later, so read it before then."""
        if not self.cuda:
            return t
        nbytes = t.numel() * t.element_size()
        i, buf = self._down.take(nbytes)
        out = buf[:nbytes].view(t.dtype).view(t.shape)
        out.copy_(t, non_blocking=True)
        self._down.guard(i)
        return out
