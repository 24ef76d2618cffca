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
any flush) is untouched, and so is a step with no first moment yet. An optimizer that never
keeps one (SGD without momentum) is refused: the flag would do nothing there.

It scales with the LR on purpose: the error it corrects is proportional to the step; what it
gains, and where, is in docs/convergence.md.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from ..flag import ConfigError, Flag
from .base import StageContext, StageFeature, sub_optimizers

# off unless asked for: it wins at LR 2e-3 but not at 1e-3 (docs/convergence.md)
DEFAULT_STRENGTH = 0.0

STRENGTH_FLAG = Flag(
    "--paci-stale-grad-correction", type=float, metavar="K", neutral=0.0,
    help="correct each stage's gradient for its stale micro-batches to first order: g -= K x "
         "lr x mean drift x the optimizer's first moment, before each local step; K estimates "
         "Adam's preconditioned curvature, in 1/LR (default "
         f"{DEFAULT_STRENGTH:g}: off, as in the paper)")


def check_strength(strength: float) -> None:
    if not 0.0 <= strength < float("inf"):
        raise ConfigError(f"--paci-stale-grad-correction {strength:g} must be a finite number "
                          ">= 0 (0: off, plain PACI)")


class StaleGradCorrection(StageFeature):
    """Corrects the gradients inside the stage's optimizer step, by K x its group's mean
    drift (weighted as the gradients are) x the step's LR x the first moment."""

    name = "stale_grad_correction"
    FLAGS = (STRENGTH_FLAG,)

    def __init__(self, strength: float):
        check_strength(strength)
        self.strength = strength

    @staticmethod
    def check(args, layout) -> None:
        strength = getattr(args, STRENGTH_FLAG.dest, None)
        if strength is None:
            return
        check_strength(strength)
        if strength and getattr(args, "optimizer", "adam") == "sgd" \
                and not getattr(args, "sgd_momentum", 0.9):
            raise ConfigError(f"--paci-stale-grad-correction {strength:g} needs an optimizer "
                              "with a first moment: --optimizer sgd with --sgd-momentum 0 has "
                              "none; add momentum or drop the correction")

    @classmethod
    def from_config(cls, cfg) -> Optional["StaleGradCorrection"]:
        return cls(cfg.stale_grad_correction) if cfg.stale_grad_correction else None

    def describe(self) -> str:
        return f"stale gradients corrected with the momentum, K={self.strength:g}"

    def coefficient(self, mean_drift: float) -> float:
        """K x the group's mean drift, to be multiplied by the step's LR; zero for a group
        without stale micro-batches."""
        return self.strength * mean_drift if mean_drift else 0.0

    def on_bind(self, ctx: StageContext) -> None:
        refuse_without_first_moment(ctx.optimizer)

    def around_optimizer(self, ctx: StageContext):
        return momentum_corrected(ctx.optimizer, self.coefficient(ctx.group_mean_drift()))


def _inner_optimizers(optimizer) -> list:
    return [opt.optimizer for opt in sub_optimizers(optimizer)
            if getattr(opt, "optimizer", None) is not None]


def keeps_first_moment(inner) -> bool:
    """Adam's family (betas) or SGD with momentum: what ``first_moment`` reads."""
    return all("betas" in group or group.get("momentum", 0) > 0 for group in inner.param_groups)


def refuse_without_first_moment(optimizer) -> None:
    """The runtime's check once the optimizer exists (any entry point, any optimizer)."""
    for inner in _inner_optimizers(optimizer):
        if not keeps_first_moment(inner):
            raise ConfigError(
                f"--paci-stale-grad-correction needs an optimizer with a first moment "
                f"(Adam's exp_avg or SGD's momentum buffer); {type(inner).__name__} as "
                "configured keeps none, so the correction would do nothing: add momentum or "
                "drop the correction")


def first_moment(inner, param):
    """The optimizer's momentum of ``param`` in the gradient's units, None before its first
    step: Adam's exp_avg, SGD's momentum_buffer (TE's FusedAdam may keep it scaled)."""
    state = inner.state.get(param)
    if not state:
        return None
    if "exp_avg" in state:
        m = state["exp_avg"]
        if m.dtype != param.grad.dtype and hasattr(inner, "get_unscaled_state"):
            m = inner.get_unscaled_state(param, "exp_avg")
        return m
    return state.get("momentum_buffer")


def subtract_momentum(inner, coefficient: float) -> None:
    """g -= coefficient x lr x m, per param group (the LR of the step about to be taken)."""
    for group in inner.param_groups:
        kappa = coefficient * group["lr"]
        for param in group["params"]:
            m = None if param.grad is None else first_moment(inner, param)
            if m is not None:
                param.grad.sub_(m.to(param.grad.dtype), alpha=kappa)


@contextlib.contextmanager
def momentum_corrected(optimizer, coefficient: float):
    """Correct the gradients inside ``optimizer.step()``, right before each inner step: after
    Megatron unscaled, checked and clipped them, and only if it steps at all."""
    if not coefficient:
        yield
        return
    inners = _inner_optimizers(optimizer)

    def corrected(inner, step):
        def run(*args, **kwargs):
            subtract_momentum(inner, coefficient)
            return step(*args, **kwargs)
        return run

    own = [inner.__dict__.get("step") for inner in inners]  # an instance's own step, if any
    for inner in inners:
        inner.step = corrected(inner, inner.step)  # shadows the class's step for this call
    try:
        yield
    finally:
        for inner, step in zip(inners, own):
            if step is None:
                del inner.step
            else:
                inner.step = step
