"""Time spans on the stage's own device without making the host wait for it.

On a CPU a span is the wall clock. On a GPU the work is queued, so a span is a pair of CUDA
events, read once the device has passed the second one: reading never synchronises, and a
span still running when someone asks is simply not counted yet.
"""

from __future__ import annotations

import time
from collections import deque


class SpanTimer:
    """The total and count of finished spans (``start`` ... ``stop``), the first ``skip``
    left out (a span known to hold one-off work; the prediction's and the look-ahead's
    kernels are compiled at start-up, before any span, so theirs count from the first)."""

    def __init__(self, cuda: bool = False, skip: int = 0):
        self.cuda = cuda
        self.skip = skip
        self.seconds = 0.0
        self.count = 0
        self._open = None
        self._queued = deque()  # CUDA event pairs the device has not reached yet

    def start(self) -> None:
        self._open = self._event() if self.cuda else time.perf_counter()

    def stop(self) -> None:
        begin, self._open = self._open, None
        if begin is None:
            return
        if not self.cuda:
            self._add(time.perf_counter() - begin)
            return
        self._queued.append((begin, self._event()))
        self._collect()

    def mean_ms(self):
        """Milliseconds a finished span, or None before the first."""
        self._collect()
        return 1000.0 * self.seconds / self.count if self.count else None

    def _add(self, seconds: float) -> None:
        if self.skip:
            self.skip -= 1
            return
        self.seconds += seconds
        self.count += 1

    def _collect(self) -> None:
        while self._queued and self._queued[0][1].query():
            begin, end = self._queued.popleft()
            self._add(begin.elapsed_time(end) / 1000.0)

    @staticmethod
    def _event():
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
