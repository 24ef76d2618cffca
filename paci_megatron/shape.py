"""Every quantity PACI derives from the shape of a run, computed here and nowhere else.

Pure Python, no torch. P stages, a backwards per local step, N micro-batches per iteration
(one forward-backward call), micro-batch size and data-parallel size. The schedule builder,
the runtime, the one-process emulator, the Megatron-LM hooks and the time-to-accuracy
projection all ask this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional


def closes_group(mb: int, accumulation: int) -> bool:
    """True when the backward of micro-batch ``mb`` is the a-th of its group: the data-parallel
    sync and the local step follow it."""
    return (mb + 1) % accumulation == 0


def drift_bound(num_stages: int, stage: int, accumulation: int) -> int:
    """Largest number of local steps between a micro-batch's forward and backward at ``stage``."""
    return math.ceil((num_stages - 1 - stage) / accumulation)


def steps_in_flight(num_stages: int, stage: int, accumulation: int, mb: int) -> int:
    """The drift PACI's 1F1B order gives micro-batch ``mb`` of a stream at ``stage``: the
    stage's steps between its forward and its backward. Those backwards are the P-1-s that
    come after the forward (fewer in the warm-up), mb-(P-1-s) .. mb-1, each closing a group
    or not."""
    first = max(0, mb - (num_stages - 1 - stage))
    return sum(closes_group(k, accumulation) for k in range(first, mb))


def tied_lag(num_stages: int, accumulation: int) -> int:
    """Owner steps by which the last stage's copy of a tied weight trails stage 0's (its
    staleness bound): the smallest lag at which stage 0 has sent the weight before the last
    stage needs it (see mcore/tied.py)."""
    return math.ceil(num_stages / accumulation)


def local_steps(iterations: float, per_call: int, accumulation: int) -> float:
    """Optimizer steps a stage takes in ``iterations`` iterations of N = ``per_call``
    micro-batches: N / a an iteration. Fractional iterations give fractional steps (the
    projection interpolates)."""
    return iterations * (per_call // accumulation)


def local_steps_ramped(microbatches: Iterable[int], accumulation: Optional[int]) -> int:
    """Local steps over iterations whose micro-batch counts are ``microbatches`` (in order,
    --rampup-batch-size); ``accumulation`` None: a follows N (one step per iteration)."""
    return sum(1 if accumulation is None else num_mb // accumulation for num_mb in microbatches)


@dataclass(frozen=True)
class StreamShape:
    """One PACI stream: P stages, a backwards per local step, N micro-batches per call."""

    num_stages: int
    accumulation: int
    per_call: int
    micro_batch_size: int = 1
    data_parallel_size: int = 1

    def closes_group(self, mb: int) -> bool:
        return closes_group(mb, self.accumulation)

    @property
    def lr_increment(self) -> int:
        """Samples one local step advances the LR scheduler by: a x micro-batch x DP (an
        iteration's N/a steps add up to stock's N x micro-batch x DP)."""
        return self.accumulation * self.micro_batch_size * self.data_parallel_size

    @property
    def steps_per_call(self) -> int:
        return self.per_call // self.accumulation

    def local_steps_before(self, iteration: int) -> int:
        """Local steps every stage has taken when ``iteration`` iterations are done."""
        return int(local_steps(iteration, self.per_call, self.accumulation))

    def drift_bound(self, stage: int) -> int:
        return drift_bound(self.num_stages, stage, self.accumulation)

    @property
    def tied_lag(self) -> int:
        return tied_lag(self.num_stages, self.accumulation)
