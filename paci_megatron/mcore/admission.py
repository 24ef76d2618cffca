"""What a PACI stream checks and sets up before its first action: the process groups it hands
Megatron, the stage-crossing reductions it refuses, and the plan itself, run through the
simulator's checks and its NCCL model with this run's own P, a, N and communication flags."""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from ..autograd_versions import ZERO_CENTERED_GAMMA
from ..schedule import StreamPlan
from ..simulate import NcclModel, ScheduleError, check_plan


def pipeline_groups() -> ProcessGroupCollection:
    """The groups stock 1F1B hands to finalize_model_grads."""
    pg = ProcessGroupCollection()
    pg.tp = parallel_state.get_tensor_model_parallel_group()
    pg.pp = parallel_state.get_pipeline_model_parallel_group()
    pg.cp = parallel_state.get_context_parallel_group()
    pg.embd = parallel_state.get_embedding_group(check_initialized=False)
    pg.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pg.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    # the expert bias's token counts (megatron-core 0.19 asserts it with the expert bias on)
    pg.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return pg


class ThisRankOnly:
    """The embedding group of a stage that exchanges its tied weight point to point: this rank
    alone. Megatron's finalize_model_grads asks an embedding group its size and skips the
    all-reduce at 1 (``_allreduce_embedding_grad``, megatron-core 0.16-0.19), so no
    communicator is made for it: with the device bound (``device_id``), every ``new_group``
    is a split that all ranks must join, and only stage 0 and the last stage get here."""

    def size(self) -> int:
        return 1


def stage_local_groups(pg: ProcessGroupCollection) -> ProcessGroupCollection:
    """``pg`` with a one-rank embedding group: finalize_model_grads then skips the tied
    embedding all-reduce between the first and last stage (an embd of None would make it
    look the global one up again); the SG/RG and SW/RW actions replace that all-reduce."""
    out = ProcessGroupCollection()
    for name in ("tp", "pp", "cp", "pos_embd", "dp_cp", "tp_dp_cp"):
        setattr(out, name, getattr(pg, name))
    out.embd = ThisRankOnly()
    return out


def stage_grad_stats_group(optimizer) -> Any:
    """Grad-norm / found-inf reductions restricted to this stage: tensor parallel, and for
    the distributed optimizer, whose gradients are sharded over data parallel, tensor x data
    x context parallel within one distributed-optimizer instance (``instance_group``). An
    optimizer that holds MoE experts (Megatron's expert sub-optimizer, or a chained one with
    it) whose experts split over expert parallel: expert-tensor x expert parallel, the
    stage's part of Megatron's expert tp-ep-pp group, so that every rank of the stage clips
    by one norm."""
    if getattr(optimizer.config, "use_distributed_optimizer", False):
        return instance_group()
    if has_split_experts(optimizer):
        return parallel_state.get_expert_tensor_and_model_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def has_split_experts(optimizer) -> bool:
    """MoE experts among the optimizer's parameters, split over more than one
    expert-parallel rank. Megatron marks an expert weight ``allreduce=False`` and its param
    group ``is_expert_parallel``; under bf16 / fp16 the torch optimizer holds fp32 main
    copies, which do not carry the weight's attribute, so the group's mark is what tells."""
    if parallel_state.get_expert_model_parallel_world_size() <= 1:
        return False
    # asked at every step and predicted forward: the parameters are walked once per optimizer
    known = getattr(optimizer, "_paci_split_experts", None)
    if known is None:
        subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        known = any(_holds_experts(group) for sub in subs for group in sub.optimizer.param_groups)
        optimizer._paci_split_experts = known
    return known


def _holds_experts(group: dict) -> bool:
    """Python metadata of one param group (no tensor is read, so no host sync), asked once
    per optimizer: ``has_split_experts`` keeps the answer."""
    return bool(group.get("is_expert_parallel")) or any(
        not getattr(param, "allreduce", True) for param in group["params"])


# --num-distributed-optimizer-instances N > 1: this rank's part of its instance's group, in
# its stage (made by ``make_instance_groups``)
_INSTANCE_GROUP: dict = {}


def _instance_ranks():
    """(this stage's tensor x data x context-parallel group, its ranks that share this rank's
    distributed-optimizer instance). With N instances each holds every shard of the stage's
    gradient (Megatron all-reduces them across instances), so a norm summed over the whole
    stage counts each shard N times; Megatron's own group is the instance's, over all stages
    (``get_intra_distributed_optimizer_instance_group``): its part in this stage."""
    stage = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    instance = parallel_state.get_intra_distributed_optimizer_instance_group(
        check_initialized=False)
    ranks = torch.distributed.get_process_group_ranks(stage)
    if instance is None:
        return stage, tuple(ranks)
    inside = set(torch.distributed.get_process_group_ranks(instance))
    return stage, tuple(r for r in ranks if r in inside)


def make_instance_groups() -> None:
    """Every rank, at the same point (``PaciRuntime.bind``): with one instance nothing; with
    N > 1 one gather of every rank's instance ranks over all ranks, then one group per
    distinct list, made by every rank in one order (torch's ``new_group`` wants all)."""
    stage, mine = _instance_ranks()
    if len(mine) == stage.size() or mine in _INSTANCE_GROUP:  # the same on every rank
        return
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    for ranks in sorted(set(every)):
        group = torch.distributed.new_group(list(ranks))
        if ranks == mine:
            _INSTANCE_GROUP[mine] = group


def forget_instance_groups() -> None:
    """Drop the groups ``make_instance_groups`` made (their set-up is being torn down)."""
    _INSTANCE_GROUP.clear()


def instance_group() -> Any:
    """The distributed optimizer's stage-local grad-stats group: the stage's whole tensor x
    data x context-parallel group with one instance, else the part of it in this rank's
    instance (``make_instance_groups`` must have run)."""
    stage, mine = _instance_ranks()
    if len(mine) == stage.size():
        return stage
    if mine not in _INSTANCE_GROUP:
        raise RuntimeError("--num-distributed-optimizer-instances > 1: the stage's "
                           "instance groups are made at PaciRuntime.bind, on every rank")
    return _INSTANCE_GROUP[mine]


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def check_no_cross_stage_grad_reduction(model, pg: ProcessGroupCollection) -> None:
    """finalize_model_grads crosses stages for tied word embeddings and multi-token prediction
    (first <-> last stage), position embeddings split over stages, conditional embedders (all
    stages) and barriered level-1 timers (all ranks); PACI replaces the first two
    (``tied.py``; MTP's layers on the last stage only) and refuses the others instead of
    stalling."""
    if pg.pp.size() == 1:
        return
    if pg.pos_embd is not None and pg.pos_embd.size() > 1:
        raise ValueError("PACI does not support position embeddings shared across stages")
    config = get_model_config(model)
    check_mtp_on_the_last_stage(model, config)
    if getattr(config, "has_cond_embedder", False):
        raise ValueError(
            "PACI does not support conditional embedders replicated on every stage: "
            "finalize_model_grads all-reduces their gradients over the pipeline group at every "
            "step")
    timers = getattr(config, "timers", None)
    if timers is not None and getattr(timers, "_log_level", 0) >= 1 \
            and getattr(config, "barrier_with_L1_time", False):
        raise ValueError(
            "PACI cannot run level-1 timers with barriers: finalize_model_grads and the "
            "optimizer would barrier all ranks inside each stage's local step; use "
            "--timing-log-level 0")


def check_mtp_on_the_last_stage(model, config) -> None:
    """The tied actions pair stage 0 with the last stage, so the MTP layers (and the copy of
    the embedding they read) must sit on the last stage, as Megatron puts them without a
    --pipeline-model-parallel-layout."""
    if not getattr(config, "mtp_num_layers", None):
        return
    inner = unwrap(model)
    if bool(getattr(inner, "mtp_process", False)) != bool(getattr(inner, "post_process", False)):
        raise ValueError(
            "PACI supports multi-token prediction at P > 1 only with every MTP layer on the "
            "last stage (the tied exchange pairs stage 0 with the last stage); move the 'm' "
            "of --pipeline-model-parallel-layout into the last stage or drop the layout")


def check_paci_model(model, pg: ProcessGroupCollection) -> None:
    """Everything PACI refuses about a model, before its stream starts."""
    check_no_cross_stage_grad_reduction(model, pg)
    if getattr(get_model_config(model), "layernorm_zero_centered_gamma", False):
        raise ValueError(ZERO_CENTERED_GAMMA)


def nccl_model_of(config, warmed: bool = False) -> Optional[NcclModel]:
    """How this run's traffic meets NCCL (``nccl_model.NcclModel``), with a device-wide sync
    possible anywhere (the allocator's retries); None on gloo (sends never block).
    ``warmed``: the runtime has run the start-up exchange (``nccl_warmup.warmup_programs``)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_backend() != "nccl":
        return None
    batched = bool(config.batch_p2p_comm)
    default_group = torch.distributed.distributed_c10d._get_default_group()
    return NcclModel(batched=batched,
                     shapes=bool(getattr(config, "variable_seq_lengths", False)),
                     batch_sync=batched and bool(getattr(config, "batch_p2p_sync", True)),
                     eager=getattr(default_group, "bound_device_id", None) is not None,
                     warmed=warmed, sync_anywhere=True)


def admit_plan(plan: StreamPlan, config, warmed: bool = False) -> None:
    """Run the user's actual plan through the simulator's checks and this run's NCCL model;
    refuse it, naming why, if they reject it."""
    model = nccl_model_of(config, warmed)
    try:
        check_plan(plan, model)
    except ScheduleError as exc:
        where = f" under {model}" if model is not None else ""
        raise ValueError(
            f"the {plan.kind} plan P={plan.num_stages} a={plan.accumulation} N={plan.per_call}"
            f"{' with tied embeddings' if plan.tied else ''} fails its checks{where}: {exc}. "
            "Change --paci-accumulation-factor or --global-batch-size (or report it: the "
            "suite checks every plan of P = 2..32 with a dividing N = 16, and P <= 8 more "
            "widely)") from exc
