"""--paci-stale-grad-weight W: weigh each micro-batch's gradient by W ** drift at its stage.

A micro-batch whose backward runs after its stage's step (drift d > 0) brings a gradient
computed from activations of the previous weights, a stale gradient whose error grows with
the step size. Giving them less weight (and the fresh ones more, so that the step still
applies a mean over a micro-batches) trades some of that error for noise. What it gains, and
where, is in docs/convergence.md.

No copy of the gradient is needed because the schedule fixes the order: between two steps a
stage runs its backwards in micro-batch order, and their forwards in the same order, so the
drift never rises within a group. The buffer is scaled by W ** (d_prev - d) whenever the
drift falls, and once more when the group is finished (by W ** d_last and the
renormalisation), which leaves W ** d_i on every contribution.
"""

from __future__ import annotations

from typing import Optional

from ..flag import ConfigError, Flag
from .base import StageContext, StageFeature

# 1 (no weighting, the paper's): the paper-regime study ruled W = 0.2 out (docs/convergence.md)
DEFAULT_WEIGHT = 1.0

WEIGHT_FLAG = Flag(
    "--paci-stale-grad-weight", type=float, metavar="W", neutral=1.0,
    help="weigh each micro-batch's gradient at a stage by W ** its drift there, renormalised "
         f"so each step still applies a mean over a micro-batches; 0 < W <= 1 (default "
         f"{DEFAULT_WEIGHT:g}: no weighting, as the paper; 0.2 helps at aggressive learning "
         "rates)")


class StaleGradWeights(StageFeature):
    """One stage's bookkeeping for the group of backwards its next step applies."""

    name = "stale_grad_weight"
    FLAGS = (WEIGHT_FLAG,)

    def __init__(self, weight: float):
        check_weight(weight)
        self.weight = weight
        self._level: Optional[int] = None  # drift of the buffer's latest contribution
        self._total = 0.0  # sum of weight ** drift over the group so far
        self._drift_total = 0.0  # sum of weight ** drift x drift (the weighted mean's numerator)
        self._count = 0

    @staticmethod
    def check(args, layout) -> None:
        weight = getattr(args, WEIGHT_FLAG.dest, None)
        if weight is not None:
            check_weight(weight)

    @classmethod
    def from_config(cls, cfg) -> Optional["StaleGradWeights"]:
        return cls(cfg.stale_grad_weight) if cfg.stale_grad_weight != 1.0 else None

    def describe(self) -> str:
        return f"stale gradients weighted {self.weight:g} ** drift"

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

    def finish(self, renormalize: bool = True) -> float:
        """The factor that completes the weights and, with ``renormalize``, makes the buffer
        a weighted mean again (the scale of the unweighted sum of ``count`` backwards).
        Per-token loss renormalises by weighted token counts instead. The group stays until
        ``reset``: the step still reads its mean drift."""
        if not self._count:
            return 1.0
        factor = self.weight ** self._level
        if renormalize:
            factor *= self._count / self._total
        return factor

    def reset(self) -> None:
        self._level, self._total, self._drift_total, self._count = None, 0.0, 0.0, 0

    # hooks
    def backward_factor(self, ctx: StageContext, drift: int) -> float:
        return self.before_backward(drift)

    def token_weight(self, drift: int) -> float:
        return self.weight_of(drift)

    def finish_factor(self, ctx: StageContext, per_token: bool) -> float:
        return self.finish(renormalize=not per_token)

    def weighted_mean_drift(self) -> Optional[float]:
        return self.mean_drift

    def after_step(self, ctx: StageContext, record) -> None:
        self.reset()

    def on_drain(self, ctx: StageContext) -> None:
        self.reset()


def check_weight(weight: float) -> None:
    if not 0.0 < weight <= 1.0:
        raise ConfigError(f"--paci-stale-grad-weight {weight:g} must be in (0, 1] "
                          "(1: plain PACI)")
