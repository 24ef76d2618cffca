"""Aux-loss-free load balancing (``--moe-router-enable-expert-bias``) under PACI: its rate.

Megatron moves each router's expert bias in ``finalize_model_grads``: by the update rate, up for
each expert that got fewer tokens than the mean since the last move and down for each that got
more (the counts summed over tensor, context and data parallel ranks). Under 1F1B that is once an
iteration, over its N micro-batches. PACI runs ``finalize_model_grads`` at every local step of a
stage, N/a times an iteration, each over the a forwards the stage ran since its last step (the
step's group shifted by the forwards in flight; a call ends with a step, so a drain finds no
count: the forwards it drops were counted at that step, and count again when they run after
it, as in a run resumed from the checkpoint the drain precedes). Moving by the
flag's rate there would move the bias N/a times as far per sample; so the rate in force at a
local step is ``rate x a / N``: per sample the bias moves as far as stock's, in N/a smaller
steps, each from the counts of fewer tokens (the sign of a shorter window's imbalance). With
``a = N`` it is Megatron's own update.
"""

from __future__ import annotations

from typing import Optional


class BiasPace:
    """Keeps the flag's rate and sets the local step's in the model config for each plan."""

    def __init__(self, config):
        self.rate: Optional[float] = (config.moe_router_bias_update_rate
                                      if getattr(config, "moe_router_enable_expert_bias", False)
                                      else None)

    def apply(self, config, accumulation: int, per_call: int) -> None:
        if self.rate is not None:
            config.moe_router_bias_update_rate = local_rate(self.rate, accumulation, per_call)


def local_rate(rate: float, accumulation: int, per_call: int) -> float:
    """The rate per local step for the flag's rate per iteration."""
    return rate * accumulation / per_call
