"""--paci-stale-grad-correction K: correct stale gradients to first order with the momentum.

A micro-batch with drift d at a stage brings a gradient taken d local steps back,
g(theta - d * delta), delta the stage's latest update. To first order
g(theta) = g_stale + d * H * delta. Adam's update is delta = -lr * P * m (P its preconditioner
1 / (sqrt(v) + eps), m its first moment), so g(theta) ~ g_stale - d * lr * (H * P) * m. The
preconditioned curvature H * P is unknown; taking it as one constant K (in 1 / LR units), the
stage corrects the mean gradient of a step by

    g <- g - K * lr * mean drift * m

just before its optimizer's inner step (after unscaling and clipping, so that g and m are in the
same units; lr is the LR of that step). Nothing is copied and nothing is sent: m is the
optimizer's own state, the drift is measured. A step with no stale micro-batch (the last stage,
any flush) is untouched, and so is a step with no first moment yet.

Seen from Adam, the correction lowers a stage's momentum in proportion to its drift and the LR
(stale gradients add momentum of their own). It scales with the LR on purpose: the error it
corrects is proportional to the step; a coefficient relative to the peak LR (the first form
tried) over-corrected at a smaller LR (benchmarks/README.md, section 11).

Torch-free: the runtime applies the coefficient; the one-process emulator computes its own.
"""

from __future__ import annotations

from typing import Optional

# off unless asked for: it wins at LR 2e-3 but not at 1e-3 (benchmarks/README.md, section 11)
DEFAULT_STRENGTH = 0.0


def resolve_strength(strength: Optional[float], schedule: str) -> float:
    """The strength in force: the flag's value, else the default for PACI (0 for the others)."""
    if strength is not None:
        return strength
    return DEFAULT_STRENGTH if schedule == "paci" else 0.0


def check_strength(strength: float) -> None:
    if not strength >= 0.0 or strength == float("inf"):
        raise ValueError(f"--paci-stale-grad-correction must be a finite number >= 0, "
                         f"got {strength}")


class StaleGradCorrection:
    """The coefficient of a stage's step; the mean drift comes from what the stage already
    counts (its DriftStats, or its StaleGradWeights when the gradients are weighted)."""

    def __init__(self, strength: float):
        check_strength(strength)
        self.strength = strength

    def coefficient(self, mean_drift: float) -> float:
        """K x the group's mean drift, to be multiplied by the step's LR; zero for a group
        without stale micro-batches."""
        return self.strength * mean_drift if mean_drift else 0.0
