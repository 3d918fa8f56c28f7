"""Timing the engine's device work: perf_counter on the CPU, CUDA events on a GPU.

Host work (prompt lookup, the policy) is timed with ``time.perf_counter`` where it runs; only
device work goes through a ``Clock``, whose CUDA events are read after the iteration's one
host sync has completed them, never before.
"""

from __future__ import annotations

import time

import torch

__all__ = ["Clock"]


class Clock:
    """perf_counter on the CPU (ops there are synchronous); CUDA events on a GPU, whose
    elapsed times are read only after the loop's own per-iteration sync has completed them.

    Events are reused: ``recycle`` hands marks whose times have been read back to the clock,
    and later marks record those events again instead of creating new ones (a request makes
    as many events as one iteration uses, not a few per iteration). ``event``: the event
    type (default ``torch.cuda.Event``; given, the clock uses events whatever the device)."""

    def __init__(self, device: torch.device, event=None):
        self.cuda = device.type == "cuda" or event is not None
        self._event = event
        self._free: list = []
        self.created = 0  # events made over the clock's life

    def mark(self):
        if self.cuda:
            if self._free:
                event = self._free.pop()
            else:
                event = (self._event or torch.cuda.Event)(enable_timing=True)
                self.created += 1
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def recycle(self, *marks) -> None:
        """Marks whose times were read (their events completed): record them again later."""
        if self.cuda:
            known = {id(e) for e in self._free}
            for m in marks:
                if m is not None and id(m) not in known:
                    known.add(id(m))
                    self._free.append(m)
