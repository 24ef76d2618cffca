"""--paci-stale-grad-weight w: weigh each micro-batch's gradient by w ** drift at its stage.

A micro-batch whose backward runs after its stage's step (drift d > 0) brings a gradient
computed from activations of the previous weights, a stale gradient whose error grows with
the step size. Giving them less weight (and the fresh ones more, so that the step still
applies a mean over a micro-batches) trades some of that error for noise; at LR 2e-3 it took
about half of PACI's loss gap to 1F1B away, at 1e-3 its gain was within the seed spread
(benchmarks/README.md, sections 8-10).

No copy of the gradient is needed because the schedule fixes the order: between two steps a
stage runs its backwards in micro-batch order, and their forwards in the same order, so the
drift never rises within a group. The buffer is scaled by w ** (d_prev - d) whenever the
drift falls, and once more at the step (by w ** d_last and the renormalisation), which
leaves w ** d_i on every contribution. Torch-free: the runtime applies the factors.
"""

from __future__ import annotations

from typing import Optional

# --pipeline-schedule paci's default (the best weight tried, benchmarks/README.md sections 8-10);
# 1 is the paper's plain PACI
DEFAULT_WEIGHT = 0.2


def resolve_weight(weight: Optional[float], schedule: str) -> float:
    """The weight in force: the flag's value, else the default for PACI (1 for the others)."""
    if weight is not None:
        return weight
    return DEFAULT_WEIGHT if schedule == "paci" else 1.0


class StaleGradWeights:
    """One stage's bookkeeping for the group of backwards its next step applies."""

    def __init__(self, weight: float):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"--paci-stale-grad-weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._level: Optional[int] = None  # drift of the buffer's latest contribution
        self._total = 0.0  # sum of weight ** drift over the group so far
        self._drift_total = 0.0  # sum of weight ** drift x drift (the weighted mean's numerator)
        self._count = 0

    def weight_of(self, drift: int) -> float:
        return self.weight ** drift

    def before_backward(self, drift: int) -> float:
        """The factor to scale the gradient buffer by before this micro-batch's backward."""
        factor = 1.0
        if self._level is not None:
            if drift > self._level:
                raise RuntimeError(f"drift rose from {self._level} to {drift} between two "
                                   "steps; --paci-stale-grad-weight relies on it never rising")
            factor = self.weight ** (self._level - drift)
        self._level = drift
        weight = self.weight_of(drift)
        self._total += weight
        self._drift_total += weight * drift
        self._count += 1
        return factor

    @property
    def mean_drift(self) -> float:
        """The group's drift so far, weighted as its gradients (0 before any backward)."""
        return self._drift_total / self._total if self._count else 0.0

    def at_step(self, renormalize: bool = True) -> float:
        """The factor that completes the weights and, with ``renormalize``, makes the buffer
        a weighted mean again (the scale of the unweighted sum of ``count`` backwards); resets
        the group. Per-token loss renormalises by weighted token counts instead."""
        if not self._count:
            return 1.0
        factor = self.weight ** self._level
        if renormalize:
            factor *= self._count / self._total
        self._level, self._total, self._drift_total, self._count = None, 0.0, 0.0, 0
        return factor
