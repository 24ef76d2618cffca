"""``--overlap-param-gather`` (distributed optimizer) under PACI.

Megatron-Core's DDP keeps each stage's parameters in flat buffers that every data-parallel rank
shares: a step updates only this rank's shard, and an all-gather over the stage's data-parallel
group (stage-local) brings the other shards in. Without overlap the optimizer step runs that
all-gather itself. With overlap it is left to the next forward pass: a forward pre-hook on each
module waits for its bucket's all-gather (starting it, and the next bucket's, when not yet
started).

Two things differ under PACI:

* completing an all-gather writes the parameter buffer in place and bumps the parameters'
  autograd version counters (torch 2.13 on gloo does it at ``wait()``), outside the local step
  whose counters PACI restores; the backward of a micro-batch still in flight would then refuse
  to run ("modified by an inplace operation"). So every start and finish of a bucket group's
  all-gather keeps the counters (same argument as for the step: the backward reads the current
  values from the same storage, which is what PACI wants);
* steps happen inside the forward-backward call, also while Megatron-LM keeps the pre-hooks off
  (its first iteration, evaluation): then nothing would gather before the next forward, so the
  local step gathers at once (as without overlap).

A backward never runs on half-gathered weights: before each backward (and at a drain) every
bucket's all-gather is completed; in the steady state the forward between a step and the next
backward has done so already, and the check costs nothing.
"""

from __future__ import annotations

import functools
from typing import Callable, ContextManager, List


def overlaps_param_gather(model) -> bool:
    config = getattr(model, "ddp_config", None)
    return bool(config is not None and config.use_distributed_optimizer
                and config.overlap_param_gather)


def _bucket_groups(model) -> List:
    return (list(getattr(model, "bucket_groups", []))
            + list(getattr(model, "expert_parallel_bucket_groups", [])))


def keep_versions_during_gathers(model, guard: Callable[[], ContextManager]) -> None:
    """Run every ``start_param_sync`` / ``finish_param_sync`` of the model's bucket groups
    (whoever calls them: Megatron's pre-hooks, Megatron-LM's forced syncs, ours) inside
    ``guard()``. Instance attributes, installed once per bucket group."""
    for group in _bucket_groups(model):
        if getattr(group, "_paci_keeps_versions", False):
            continue
        for name in ("start_param_sync", "finish_param_sync"):
            setattr(group, name, _guarded(getattr(group, name), guard))
        group._paci_keeps_versions = True


def _guarded(method, guard):
    @functools.wraps(method)
    def run(*args, **kwargs):
        with guard():
            return method(*args, **kwargs)

    return run


def pre_hooks_enabled(model) -> bool:
    return bool(getattr(model, "remove_forward_pre_hook_handles", None))


def complete_param_gather(model) -> None:
    """Every bucket's all-gather done (started here where nobody started it)."""
    for group in _bucket_groups(model):
        if not group.param_gather_dispatched or group.param_gather_handle is not None:
            group.finish_param_sync(skip_next_bucket_dispatch=True)
