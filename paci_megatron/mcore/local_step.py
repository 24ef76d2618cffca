"""A stage's two group-closing actions: R (finish the group's gradients, stage-local) and T
(the optimizer and LR step). Each is one fixed sequence; the stage features plug in at its
hook points (``features/base.py``) and nothing here asks which are on."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.optimizer import clip_grads  # looked up at the call: patches wrap it

from ..autograd_versions import keep_version_counters
from ..features.base import sub_optimizers
from . import param_gather
from .admission import stage_grad_stats_group


@dataclass
class StepRecord:
    mb: int
    update_successful: bool
    grad_norm: Optional[float]
    lr: Optional[float]


def finish_grads(rt) -> None:
    """R: reduce over data-parallel ranks (Megatron's finalize_model_grads with stage-local
    groups), normalise per token. The tied exchange takes the last stage's reduced
    output-layer gradient right after the reduction and adds it to stage 0's, where stock's
    all-reduce sums them."""
    config = rt.model_config
    config.finalize_model_grads_func([rt.model], None, pg_collection=rt.grad_groups)
    for feature in rt.features:
        feature.after_reduction(rt.ctx)
    if rt.meta is not None and rt.meta.per_token:
        rt.meta.divide_by_tokens(rt.model, rt.pg.dp_cp)


def take_step(rt, mb: int) -> None:
    """T: the stage's optimizer step, then its LR step (by this plan's samples per step)."""
    if rt.optimizer is None:
        raise RuntimeError("PaciRuntime.bind(optimizer, ...) must be called before training")
    for feature in rt.features:
        feature.before_step(rt.ctx)
    ok, grad_norm = _update(rt, mb)
    if ok and rt.lr_scheduler is not None:
        rt.lr_scheduler.step(increment=rt.lr_increment_now())
    lr = rt.optimizer.param_groups[0]["lr"] if rt.lr_scheduler is not None else None
    rt.model.zero_grad_buffer()
    rt.optimizer.zero_grad()
    rt.fresh_weights = True
    record = StepRecord(mb, bool(ok), None if grad_norm is None else float(grad_norm), lr)
    for feature in rt.features:
        feature.after_step(rt.ctx, record)
    rt.steps.append(record)


def _update(rt, mb: int):
    """The optimizer step, or a skipped one. fp16: the loss scaler checks for overflow (over
    the stage's grad-stats group), skips and backs off, as stock: routine, not an error.
    Otherwise a non-finite gradient is skipped or stops the job (--paci-on-nonfinite), told
    by the norm Megatron's step reads anyway (``step_unless_nonfinite``)."""
    scaled = rt.meta is not None and rt.meta.fp16
    with contextlib.ExitStack() as stack:
        stack.enter_context(_versions_kept(rt))
        for feature in rt.features:
            stack.enter_context(feature.around_optimizer(rt.ctx))
        if scaled:
            ok, grad_norm, _zeros = rt.optimizer.step()
        else:
            ok, grad_norm = step_unless_nonfinite(rt.optimizer, rt.model,
                                                  stage_grad_stats_group(rt.optimizer))
    if ok is None:
        rt.skip_nonfinite_step(mb)
        return False, float("nan")
    if rt.gathers_params and not param_gather.pre_hooks_enabled(rt.model):
        param_gather.complete_param_gather(rt.model)  # no forward pre-hook would
    if scaled and not ok:
        rt.skipped_steps += 1
    return ok, grad_norm


def _versions_kept(rt):
    """Only graphs of in-flight forwards hold the weights; with none (P=1, the last stage, a
    flush) the step may bump the counters, as stock's does."""
    if not rt.state.outputs:
        return contextlib.nullcontext()
    return keep_version_counters(rt.params)


def step_unless_nonfinite(optimizer, model, group):
    """Megatron's optimizer step (ChainedOptimizer.step / MixedPrecisionOptimizer.step, in
    the same order and numbers) with a gradient that holds NaN or Inf stopping it before the
    update: (True or False, norm) stepped, (None, norm) stopped. The norm is what tells,
    read by the host once, as the step reads it anyway for the clipping and the log, so the
    check costs no sync of its own; only without clipping on a single optimizer, where
    Megatron reads no norm, does it take one (``grads_are_finite``)."""
    if optimizer.prepare_grads():  # a loss scaler's own check (bf16 with --loss-scale)
        return False, None
    subs = sub_optimizers(optimizer)
    if hasattr(optimizer, "chained_optimizers") or any(s.config.clip_grad > 0 for s in subs):
        norm = optimizer.get_grad_norm()
        if not math.isfinite(norm):
            return None, norm
        for sub in subs:
            params = sub.get_parameters()
            if sub.config.clip_grad > 0 and params and not getattr(sub, "is_stub_optimizer",
                                                                   False):
                clip_grads.clip_grad_by_total_norm_fp32(
                    params, max_norm=sub.config.clip_grad, total_norm=norm,
                    use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    else:
        norm = 0.0
        if not grads_are_finite(model, group):
            return None, float("nan")
    return optimizer.step_with_ready_grads(), norm


def grads_are_finite(model, group) -> bool:
    """One reduction per gradient buffer of Megatron's DDP (per parameter without one), then
    agreed on over ``group`` (the stage's grad-stats group), so that the tensor- and
    data-parallel ranks of a stage all skip or all step."""
    buffers = [b.grad_data for b in getattr(model, "buffers", [])]
    if not buffers:
        buffers = [getattr(p, "main_grad", p.grad) for p in model.parameters()]
    # min and max per buffer: NaN propagates into both, +-Inf into one; unlike isfinite() no
    # full-size temporary while P-1-s micro-batches of activations are alive, and one pass
    # about 10x faster on CPU than the inf-norm (bench_overhead's profile)
    extremes = [x.float() for g in buffers if g is not None and g.numel()
                for x in torch.aminmax(g)]
    finite = torch.isfinite(torch.stack(extremes)).all().float() if extremes else torch.ones(())
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(finite)
