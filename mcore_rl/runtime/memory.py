"""How much memory a block of code adds at its peak, on the device it computes on.

The process-wide peak counters are never reset here: other measurements in the process read
them (the step's `memory/peak_allocated_mb`, a profiler, a user's own), and a reset would
silently shrink theirs to the time since the last weight sync. Instead a block's peak is read
from the counters as they stand, with samples where they cannot answer:

- when the block raises the process's peak (the counter after it exceeds the counter before
  it), the new peak was reached inside the block, so it is exact: the counter after it;
- otherwise the block stayed below an earlier peak, which the counter cannot separate from
  it: the largest of the current level sampled every millisecond by a thread while the block
  runs (a spike shorter than that, and below the earlier peak, can be missed).

On a GPU the counters are the caching allocator's (`memory_allocated`, `max_memory_allocated`:
host-side reads, no device synchronisation per sample); on a CPU resident memory (/proc) and
the kernel's high-water mark of it (VmHWM). Used to show that a weight sync stays within its
stated memory bound.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import torch

SAMPLE_SECONDS = 0.001
"""How often the current level is sampled while a block runs."""


class PeakMemory:
    """`with PeakMemory() as peak: ...`, then `peak.extra_bytes`: the block's peak above the
    level at its start (module docstring). `current` and `peak`: the counters to read (None:
    the device's: the GPU's allocator when CUDA is available, else this process's resident
    memory); a test passes its own."""

    def __init__(self, current: Callable[[], int] | None = None,
                 peak: Callable[[], int] | None = None):
        self.extra_bytes = 0
        self._on_gpu = current is None and torch.cuda.is_available()
        if self._on_gpu:  # the sampling thread's own current device would be device 0
            index = torch.cuda.current_device()
            current = lambda: torch.cuda.memory_allocated(index)  # noqa: E731
            peak = lambda: torch.cuda.max_memory_allocated(index)  # noqa: E731
        elif current is None:
            current, peak = _resident_bytes, _peak_resident_bytes
        self._current, self._peak = current, peak
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        if self._on_gpu:
            torch.cuda.synchronize()
        self._start = self._sampled = self._current()
        self._peak_before = self._peak()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._on_gpu:
            torch.cuda.synchronize()
        self._stop.set()
        self._thread.join()
        self.extra_bytes = interval_peak(self._start, self._peak_before, self._peak(),
                                         max(self._sampled, self._current())) - self._start

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sampled = max(self._sampled, self._current())


def interval_peak(start: int, peak_before: int, peak_after: int, sampled: int) -> int:
    """A block's peak level from the process-wide peak counter before and after it and the
    largest level sampled during it: the counter after it when the block raised it (exact),
    else the samples (a lower bound), never below the level at the start."""
    if peak_after > peak_before:
        return peak_after
    return max(start, sampled)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _peak_resident_bytes() -> int:
    """The kernel's high-water mark of this process's resident memory (VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
