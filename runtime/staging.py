"""Per-step host<->device copies through persistent pinned buffers.

A decode step moves a few hundred integers each way. Building them with ``torch.tensor(...,
device="cuda")`` is a pageable copy, which waits for everything queued on the stream; allocating
fresh pinned memory can call ``cudaHostAlloc``, which is slow and also waits. Either one defeats
overlapped decoding (the host would wait for the step in flight). With ``ring=True`` the stager
keeps a ring of pinned buffers: a value list is written into the next buffer and copied with
``non_blocking``; an event recorded after the copy guards the buffer, and before a buffer is
rewritten that event is waited on (in steady state it completed long ago). Device->host copies use
a second ring. With ``ring=False`` each copy gets a fresh pinned tensor (the simple behaviour the
non-overlapped engine uses). On the CPU the ring uses ordinary memory and no events (tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class _Ring:
    def __init__(self, slots: int, pin: bool):
        self.pin = pin
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.i = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slot's byte buffer (grown to ``nbytes``), safe to overwrite."""
        i = self.i = (self.i + 1) % len(self.bufs)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[i] = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=self.pin)
        return i, buf

    def guard(self, i: int) -> None:
        if self.pin:
            ev = torch.cuda.Event()
            ev.record()
            self.events[i] = ev


class HostStager:
    """Copies small per-step tensors between host and ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device | str, ring: bool = True, slots: int = 8):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.ring = ring
        if ring:
            self._up = _Ring(slots, self.cuda)
            self._down = _Ring(slots, self.cuda)

    def to_device(
        self,
        values: Sequence[int] | Sequence[Sequence[int]] | Sequence[float] | torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``torch.tensor(values, dtype)`` on the device, copied asynchronously. ``values`` may be
        a host tensor of ``dtype`` already (not pinned; it is not modified)."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if not self.ring:
            return host.pin_memory().to(self.device, non_blocking=True) if self.cuda else host
        nbytes = host.numel() * host.element_size()
        i, buf = self._up.take(nbytes)
        staged = buf[:nbytes].view(dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True) if self.cuda else staged.clone()
        self._up.guard(i)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t``, complete once an event recorded after this call has fired. A ring
        buffer is reused ``slots`` calls later, so read it before then."""
        if not self.ring:
            if not self.cuda:
                return t
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            return out
        nbytes = t.numel() * t.element_size()
        i, buf = self._down.take(nbytes)
        out = buf[:nbytes].view(t.dtype).view(t.shape)
        out.copy_(t, non_blocking=self.cuda)
        self._down.guard(i)
        return out
