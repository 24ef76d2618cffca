"""The one-process reference's tied embeddings (``reference.PipelineEmulator``): the messages
between stage 0 and the last stage held in order in memory, and the install of stage 0's
weight into the last stage's output layer, sharded as the distributed optimizer shards it."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state

from .tied import grad_of, install, main_param, shared_weight


def _shard_span(model, weight) -> tuple:
    """(lo, hi, shard size): the flat range of ``weight`` this data-parallel rank's distributed
    optimizer steps, from the bucket it sits in alone (cut in equal shards over data
    parallel); the whole weight without the distributed optimizer."""
    numel = weight.numel()
    if not model.ddp_config.use_distributed_optimizer:
        return 0, numel, numel
    bucket = next(b for g in model.bucket_groups for b in g.buckets if weight in b.params)
    if len(bucket.params) != 1:
        raise RuntimeError("the tied weight does not have a bucket of its own")
    size = bucket.grad_data.numel() // parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    return min(rank * size, numel), min((rank + 1) * size, numel), size


class TiedState:
    """Tied embeddings: stage 0 owns the weight; the last stage's output-layer gradient of a
    group, as its data-parallel reduction left it (its shard, distributed optimizer), goes to
    stage 0 after its R (SG), which adds it to its own after its reduction and weighting
    (RG, R); the last stage installs stage 0's weight after step i (SW) after its own step
    i + tied_lag (RW); messages held here, in order."""

    def __init__(self, stages: List):  # reference._Stage, stage 0 first
        first, last = stages[0].parts, stages[-1].parts
        self.owner, self.last = shared_weight(first.model), shared_weight(last.model)
        self.owner_main = main_param(first.optimizer, self.owner)
        self.last_main = main_param(last.optimizer, self.last)
        lo, hi, self.shard_size = _shard_span(first.model, self.owner)
        self.span = (lo, hi)
        if _shard_span(last.model, self.last) != (lo, hi, self.shard_size):
            raise RuntimeError("stage 0 and the last stage shard the tied weight differently")
        if self.owner_main.numel() != hi - lo:
            raise RuntimeError("the tied weight's master copy is not the span its bucket gives")
        if not torch.equal(self.owner_main, self.last_main):
            raise RuntimeError("the last stage's output layer does not start equal to stage "
                               "0's word embedding")
        self.sharded = first.model.ddp_config.use_distributed_optimizer
        self.gathers_later = self.sharded and first.model.ddp_config.overlap_param_gather
        self.kept: Optional[tuple] = None  # the last stage's reduced half, for its SG
        self.grads: List[tuple] = []  # (gradient, the last stage's loss scale) in transit
        self.received: Optional[tuple] = None  # stage 0: RG's, added by its R
        self.weights: List[torch.Tensor] = []  # sent by stage 0 (SW), not yet received
        self.inbox: List[torch.Tensor] = []  # received by the last stage (RW), not installed
        self.last_steps = 0
        self.installed = 0
        self.histogram: Dict[int, int] = {}

    def grad(self, weight) -> torch.Tensor:
        return grad_of(weight).view(-1)[self.span[0]:self.span[1]]

    def install_last(self, value: torch.Tensor) -> None:
        """The last stage's master copy (its shard) and its whole model weight from stage 0's
        (shard of the) weight: with the distributed optimizer every rank's shard, gathered
        here over data parallel in fp32, then cast. With --overlap-param-gather only this
        rank's shard of the model weight, as the step leaves every other weight: the next
        forward gathers them."""
        if not self.sharded:
            install(self.last, self.last_main, value.view(self.last_main.shape))
            return
        lo, hi = self.span
        if self.gathers_later:
            with torch.no_grad():
                self.last_main.copy_(value)
                self.last.data.view(-1)[lo:hi].copy_(value)
            return
        group = parallel_state.get_data_parallel_group()
        piece = torch.zeros(self.shard_size, dtype=torch.float32, device=value.device)
        piece[:hi - lo] = value
        pieces = torch.empty(self.shard_size * group.size(), dtype=torch.float32,
                             device=value.device)
        torch.distributed.all_gather_into_tensor(pieces, piece, group=group)
        full = pieces[:self.last.numel()]  # rank r's shard at r x size, padding at the end
        with torch.no_grad():
            self.last_main.copy_(value)
            self.last.data.copy_(full.view(self.last.shape))

    def catch_up(self) -> None:
        """A drain: the last stage takes stage 0's newest weight; a new stream starts."""
        if self.grads or self.weights:
            raise RuntimeError("drain with a tied-embedding message in transit")
        if self.inbox and self.installed < self.last_steps:
            self.install_last(self.inbox[-1])
        self.inbox, self.last_steps, self.installed = [], 0, 0
