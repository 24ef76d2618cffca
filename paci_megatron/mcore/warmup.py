"""The start-up exchange: one message over every communicator a PACI stream uses, in one
order that every rank follows, before the stream's first action.

NCCL builds a communicator (and connects each sender-receiver pair) on its first use, and
that first use holds the host until every member has reached it. In PACI's own order two
first uses can wait for each other: the last stage's first tied-gradient send waits for stage
0, whose first use of that group comes only after a backward that waits for the last stage
(``nccl_model``, rule 10; ``tests/test_nccl_hazards.py``). Every rank therefore first runs
``nccl_warmup.WARMUP_ORDER``: an all-reduce over its stage's data-parallel group, one over its
stage's grad-stats group, one exchange with both pipeline neighbours in both directions (of
the run's activation shape, through Megatron's own ``_communicate``, so batched or not as
the run is), the fp16 / per-token metadata's messages, and on stage 0 and the last stage both
directions of the tied messages. The model checks that this order is deadlock-free and that
it connects every pair the stream uses. Under gloo it is a few tiny messages.
"""

from __future__ import annotations

import torch

from ..features.base import sub_optimizers
from . import admission


def warm_up(rt) -> list:
    """Run the start-up exchange for ``rt`` (a PaciRuntime whose stream is set up: its p2p
    communicator, tensor shape and tied exchange exist); returns what it exchanged over."""
    device = _device()
    done = []
    groups = [("data-parallel", rt.pg.dp_cp)]
    for sub in sub_optimizers(rt.optimizer):  # MoE: the dense and the expert norm's groups
        group = admission.stage_grad_stats_group(sub)
        if all(group is not known for _name, known in groups):
            groups.append(("grad-stats", group))
    for name, group in groups:
        if group is not None and group.size() > 1:
            torch.distributed.all_reduce(torch.zeros(1, device=device), group=group)
            if name not in done:
                done.append(name)
    if rt.num_stages > 1:
        _pipeline(rt, device)
        done.append("pipeline")
    if rt.meta is not None and rt.num_stages > 1:
        _metadata(rt, device)
        done.append("metadata")
    if rt.tied is not None:
        _tied(rt.tied)
        done.append("embedding")
    return done


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _pipeline(rt, device) -> None:
    """Both directions with both neighbours, run-shaped, in one of Megatron's exchanges."""
    dtype = rt.model_config.pipeline_dtype or torch.float32
    zeros = torch.zeros(rt.tensor_shape, dtype=dtype, device=device)
    _recv_prev, _recv_next, reqs = rt.p2p._communicate(
        tensor_send_next=None if rt.is_last else zeros,
        tensor_send_prev=None if rt.is_first else zeros,
        recv_prev=not rt.is_first, recv_next=not rt.is_last,
        tensor_shape=rt.tensor_shape, wait_on_reqs=True)
    for req in (reqs or {}).values():
        req.wait()


def _metadata(rt, device) -> None:
    """GradMeta's plain isend/irecv towards stage 0: each stage sends before it receives, so
    the first pair to meet is stage 0's, and the chain follows."""
    works = []
    if not rt.is_first:
        works.append(torch.distributed.isend(torch.zeros(2, dtype=torch.float64, device=device),
                                             dst=rt.p2p.prev_rank, group=rt.pg.pp))
    if not rt.is_last:
        works.append(torch.distributed.irecv(torch.empty(2, dtype=torch.float64, device=device),
                                             src=rt.p2p.next_rank, group=rt.pg.pp))
    for work in works:
        work.wait()


def _tied(tied) -> None:
    """Both directions of the tied messages (one element makes the pair's communicator:
    the real messages are a shard, a gradient, a scale): stage 0 sends, then receives; the
    last stage receives, then sends."""
    buf = torch.zeros(1, device=tied.weight.device)
    steps = [("send", "recv"), ("recv", "send")][0 if tied.is_owner else 1]
    for step in steps:
        op = torch.distributed.isend if step == "send" else torch.distributed.irecv
        kwargs = {"dst" if step == "send" else "src": tied.peer, "group": tied.group}
        op(buf, **kwargs).wait()
