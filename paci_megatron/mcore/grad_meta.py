"""What travels back with each activation gradient under --fp16 and --calculate-per-token-loss.

Two numbers, from the last stage towards stage 0, as a separate tiny message right after the
gradient in the same exchange (both sides post in that order), so it is part of the SB/RB
actions: the loss scale the gradient is expressed in, and the micro-batch's token count.

fp16: each stage has its own dynamic loss scaler and skips its own overflowing steps, so the
scalers drift apart. A gradient leaves a stage scaled by that stage's current scale (the last
stage's loss is scaled by its own, as stock does); the receiver rescales it by (own scale /
sender's scale), a power of two, so exact, before its backward. A scale changes only at a
local step, so all backwards of a group use one scale.

Per-token loss: the last stage counts each micro-batch's tokens; every stage sums the counts of
its group and divides its gradients by the sum (all-reduced over data-parallel ranks, as
stock) when the group is finished: stock broadcasts the count over the pipeline group instead.

Everything stays on the device: the scale and the count travel as a two-element tensor, the
rescale and the division take device tensors, and no number is read back by the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..features.base import sub_optimizers


class GradMeta:
    def __init__(self, *, fp16: bool, per_token: bool):
        self.fp16 = fp16
        self.per_token = per_token
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.group_tokens = 0  # this stage's tokens since its last step (then a device tensor)

    def before_backward(self, state, mb: int, own_scale, *, is_first: bool,
                        is_last: bool) -> None:
        """``own_scale``: this stage's loss scale on the device (None: 1)."""
        scale = self._as_meta(1.0 if own_scale is None else own_scale)
        if is_last:
            tokens = self._as_meta(state.tokens.pop(mb))
        else:
            sender, tokens = state.meta_in.pop(mb)
            if self.fp16:  # a power of two: exact (1 where the scales agree)
                with torch.no_grad():  # Megatron's receive buffers require grad
                    state.output_grads[mb].mul_(scale / sender)
        self.group_tokens = self.group_tokens + tokens
        if not is_first:
            state.meta_out[mb] = torch.stack([scale, tokens])

    def _as_meta(self, value) -> torch.Tensor:
        """A 0-d float64 on this stage's device (a number, or a tensor kept there)."""
        if torch.is_tensor(value):
            return value.to(device=self.device, dtype=torch.float64).reshape(())
        return torch.full((), value, dtype=torch.float64, device=self.device)  # no copy

    def send(self, meta: torch.Tensor, dst: int, group) -> tuple:
        work = torch.distributed.isend(meta, dst=dst, group=group)
        return work, meta  # the tensor stays referenced until the send is waited for

    def receive(self, src: int, group) -> tuple:
        """(the sender's scale, the tokens), as device tensors: the wait orders the device
        stream (NCCL) without holding the host."""
        buf = torch.empty(2, dtype=torch.float64, device=self.device)
        torch.distributed.irecv(buf, src=src, group=group).wait()
        return buf[0], buf[1]

    def _count(self, dp_cp_group) -> torch.Tensor:
        count = self._as_meta(self.group_tokens)
        if dp_cp_group is not None and dp_cp_group.size() > 1:
            torch.distributed.all_reduce(count, group=dp_cp_group)
        return count

    def divide_by_tokens(self, model, dp_cp_group) -> None:
        """What stock finalize_model_grads does with num_tokens, minus the pipeline broadcast
        (a group without tokens has no gradient: dividing by 1 leaves its zeros)."""
        count = self._count(dp_cp_group)
        self.reset()
        model.scale_gradients(torch.where(count > 0, count.reciprocal(), 1.0))

    def reset(self) -> None:
        self.group_tokens = 0


def grad_meta_for(config, optimizer) -> Optional[GradMeta]:
    """A GradMeta when fp16 or per-token loss is on; None otherwise (no extra message)."""
    # fp16 always has a grad scaler (bf16 only with --loss-scale)
    fp16 = any(getattr(opt, "grad_scaler", None) is not None for opt in sub_optimizers(optimizer))
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    return GradMeta(fp16=fp16, per_token=per_token) if fp16 or per_token else None
