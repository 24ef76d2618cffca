"""The scale of the MoE auxiliary losses' and MTP losses' gradients, set before each backward.

Megatron's ``MoEAuxLossAutoScaler`` and ``MTPLossAutoScaler`` hold one scale for the whole
process, which stock Megatron sets at every forward (``forward_step``: the loss scale over the
micro-batches) and the autograd functions read at the backward. In 1F1B nothing changes it
between a micro-batch's forward and its backward. Under PACI later forwards run in between and,
under fp16, a local step may change the stage's loss scale. A micro-batch's backward must scale
its auxiliary gradients as its main-loss gradient arrives: at the stage's loss scale now (the
runtime brings every incoming gradient to it) over the micro-batches its loss was divided by
(the call's accumulation factor: a micro-batch's backwards all fall in the call of its loss).
So the runtime sets both scales again right before each backward, as Megatron computes them.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler


def has_aux_losses(config) -> bool:
    """MoE layers or MTP layers in the model: scales to set before each backward."""
    return (getattr(config, "num_moe_experts", None) is not None
            or getattr(config, "mtp_num_layers", None) is not None)


def set_for_backward(config, accumulation: int, cp_size: int) -> None:
    """Both scales for the next backward (a device tensor op: no host sync)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    scale = torch.ones(1, device=device)
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale)
    per_token = config.calculate_per_token_loss
    if getattr(config, "num_moe_experts", None) is not None:
        MoEAuxLossAutoScaler.set_loss_scale(scale if per_token
                                            else scale * cp_size / accumulation)
    if getattr(config, "mtp_num_layers", None) is not None:
        MTPLossAutoScaler.set_loss_scale(scale if per_token else scale / accumulation)
