"""``--overlap-param-gather`` (distributed optimizer) under PACI.

Megatron-Core's DDP keeps each stage's parameters in flat buffers that every data-parallel rank
shares: a step updates only this rank's shard, and an all-gather over the stage's data-parallel
group (stage-local) brings the other shards in. Without overlap the optimizer step runs that
all-gather itself. With overlap it is left to the next forward pass: a forward pre-hook on each
module waits for its bucket's all-gather (starting it, and the next bucket's, when not yet
started).

Under PACI steps happen inside the forward-backward call, also while Megatron-LM keeps the
pre-hooks off (its first iteration; evaluation): then nothing would gather before the next
forward, so the local step gathers at once, as without overlap. With the pre-hooks on, the
forward after a step completes every bucket before the stage's next backward (in every PACI
action list a step is followed by a forward, never by a backward), so a backward reads the
updated weights of every shard. A drain completes the gathers too (checkpoints and the final
weights read every shard).

Completing an all-gather writes the flat buffer, not the parameters: Megatron-Core points each
parameter's ``.data`` at a slice of the buffer, and a parameter keeps its own autograd version
counter, so the backward of a micro-batch in flight is not refused ("modified by an inplace
operation") and reads the gathered values from the same storage.
"""

from __future__ import annotations

from typing import List


def overlaps_param_gather(model) -> bool:
    config = getattr(model, "ddp_config", None)
    return bool(config is not None and config.use_distributed_optimizer
                and config.overlap_param_gather)


def _bucket_groups(model) -> List:
    return (list(getattr(model, "bucket_groups", []))
            + list(getattr(model, "expert_parallel_bucket_groups", [])))


def pre_hooks_enabled(model) -> bool:
    return bool(getattr(model, "remove_forward_pre_hook_handles", None))


def complete_param_gather(model) -> None:
    """Every bucket's all-gather done (started here where nobody started it)."""
    for group in _bucket_groups(model):
        if not group.param_gather_dispatched or group.param_gather_handle is not None:
            group.finish_param_sync(skip_next_bucket_dispatch=True)
