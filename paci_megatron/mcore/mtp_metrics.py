"""The MTP losses' report under PACI: stage-local, as the MoE metrics' (``moe_metrics.py``).

Megatron's model adds each MTP layer's loss of every training forward to a process-wide
tracker (``MTPLossLoggingHelper``), on the stage that holds the MTP layers: the last, the only
one PACI accepts (``admission.check_mtp_on_the_last_stage``). Megatron-LM's training log reports
it once an iteration (``track_mtp_metrics``): it averages the tracker over the tracker's
``avg_group`` (the stage's data-parallel ranks) and all-reduces it over its ``reduce_group``.
megatron-core 0.16 to 0.19 leave ``reduce_group`` None; one that spanned the pipeline would
hold every stage to the slowest each iteration under PACI. Here the report runs with any
``reduce_group`` replaced by the ``THIS_STAGE`` marker, over which an all-reduce does nothing
(no process group is made); with every MTP layer on this stage, a sum over the other stages
would add nothing to its value. The data-parallel average stays Megatron's.

Megatron-LM scales the sums by 1 / micro-batches, which under PACI is the last stage's own
number of forwards in a call: it never holds a forward in flight across calls.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from .moe_metrics import THIS_STAGE, stage_local_all_reduce


def report(original: Callable, *args, **kwargs):
    """``original(*args, **kwargs)`` (Megatron's ``track_mtp_metrics``) within the stage."""
    tracker = MTPLossLoggingHelper.tracker
    if tracker.get("reduce_group") is not None:
        tracker["reduce_group"] = THIS_STAGE
    with stage_local_all_reduce():
        return original(*args, **kwargs)


def take(loss_scale: float, iteration: int) -> Dict[str, torch.Tensor]:
    """pretrain_gpt_paci.py's once-an-iteration report: this stage's MTP losses of the
    iteration ("mtp_1 loss", ...: device tensors, read at the log interval only); {} on a
    stage without MTP layers."""
    values: Dict[str, torch.Tensor] = {}
    report(MTPLossLoggingHelper.track_mtp_metrics, loss_scale, iteration, None, None, values)
    return values
