"""How much memory a block of code adds at its peak, on the device it computes on.

On a GPU the caching allocator's peak counter answers exactly (`max_memory_allocated` above
the level at entry). On a CPU there is no such counter for one block, so resident memory is
sampled from /proc every millisecond by a thread while the block runs (a spike shorter than
that can be missed). Used to show that a weight sync stays within its stated memory bound.
"""

from __future__ import annotations

import os
import threading

import torch


class PeakMemory:
    """`with PeakMemory() as peak: ...`, then `peak.extra_bytes`."""

    def __init__(self):
        self.extra_bytes = 0
        self._on_gpu = torch.cuda.is_available()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        if self._on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            self._start = self._peak = _resident_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._on_gpu:
            torch.cuda.synchronize()
            self.extra_bytes = torch.cuda.max_memory_allocated() - self._start
            return
        self._stop.set()
        self._thread.join()
        self.extra_bytes = max(self._peak, _resident_bytes()) - self._start

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, _resident_bytes())


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE
