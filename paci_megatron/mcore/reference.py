"""A one-process numerical reference for PACI: every pipeline stage in one process.

``PipelineEmulator`` holds the P stage modules of one Megatron-Core GPT (stage s built as
Megatron builds pipeline rank s: same layers, same initial weights), each with its own DDP
wrapper, optimizer, LR scheduler, RNG streams and data. It runs the per-stage action lists of
``schedule.plan_stream`` (the lists the multi-process runtime runs) in one valid global order
(``emulate.global_order``), handing activations and gradients over in memory, and implements
each action itself: Megatron's stock ``forward_step``/``backward_step`` for the compute, and
its own local step (data-parallel gradient reduction, optimizer step, LR step, zeroing). So it
shares no orchestration code with ``runtime.py``: a multi-process run that equals it bit for
bit (every micro-batch loss, every stage's weights after every step) steps on the right
gradients with the right scale, LR and clipping norm.

Only the pipeline is emulated. Tensor and data parallelism stay real: launch one emulator per
(tensor, data) rank, i.e. TP x DP processes, so their collectives are the same operations as in
the multi-process run. Each process then plays every pipeline stage of its coordinate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.utils import get_model_config, get_model_type

from ..autograd_versions import keep_version_counters
from ..emulate import run_global
from ..schedule import Action, StreamPlan, plan_stream
from ..shape import StreamShape, closes_group, tied_lag
from . import build, compat
from . import main_params
from .admission import stage_grad_stats_group
from .main_params import gather_weights
from .checkpoint import weights_sha256
from .reference_tied import TiedState
from .tied import shared_weight


class _PipelineGroupView:
    """What Megatron's model builders ask of a pipeline group (rank and size) for a stage
    that does not have a process of its own."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@contextlib.contextmanager
def as_pipeline_stage(stage: int, num_stages: int):
    """Make Megatron-Core build and run as pipeline rank ``stage`` of ``num_stages`` in a
    process whose real pipeline group has one rank (Megatron's own rank/size overrides, plus
    the group that model builders read their layer offset from)."""
    ps = parallel_state
    real_group = ps.get_pipeline_model_parallel_group
    real_size = real_group().size()
    if real_size != 1:
        raise RuntimeError("the emulator needs a process with pipeline-parallel size 1 "
                           f"(found {real_size})")
    saved = ps._MPU_PIPELINE_MODEL_PARALLEL_RANK, ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    view = _PipelineGroupView(stage, num_stages)
    ps.set_pipeline_model_parallel_rank(stage)
    ps.set_pipeline_model_parallel_world_size(num_stages)
    ps.get_pipeline_model_parallel_group = lambda *args, **kwargs: view
    try:
        yield
    finally:
        ps._MPU_PIPELINE_MODEL_PARALLEL_RANK, ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = saved
        ps.get_pipeline_model_parallel_group = real_group


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, tensor_parallel.get_cuda_rng_tracker().get_states()


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state[2]))


@dataclass
class StageParts:
    """What a stage is made of; built by the caller inside ``as_pipeline_stage``."""

    model: Any  # one DDP-wrapped model chunk
    optimizer: Any
    lr_scheduler: Any = None
    data: Optional[Iterator] = None  # first and last stage: the batches, in order


@dataclass
class StepLog:
    mb: int
    ok: bool
    grad_norm: Optional[float]
    lr: Optional[float]
    weights: str  # weights_sha256 after the step


class _Batches:
    """Random access to a stage's batch stream: item i is the i-th batch of the iterator."""

    def __init__(self, iterator: Optional[Iterator]):
        self.iterator, self.items = iterator, []

    def __getitem__(self, index: int):
        while len(self.items) <= index:
            self.items.append(next(self.iterator))
        return self.items[index]


@dataclass
class _Stage:
    index: int
    parts: StageParts
    batches: _Batches
    rng: tuple
    version: int = 0
    fresh_weights: bool = True
    fwd_version: Dict[int, int] = field(default_factory=dict)
    drift: Dict[int, int] = field(default_factory=dict)  # drift -> count
    inputs: Dict[int, Any] = field(default_factory=dict)
    outputs: Dict[int, Any] = field(default_factory=dict)
    output_grads: Dict[int, Any] = field(default_factory=dict)
    input_grads: Dict[int, Any] = field(default_factory=dict)
    steps: List[StepLog] = field(default_factory=list)
    # fp16 / per-token loss: (loss scale, tokens) of each gradient; tokens counted since a step
    tokens: Dict[int, int] = field(default_factory=dict)
    grad_meta: Dict[int, tuple] = field(default_factory=dict)
    meta_out: Dict[int, tuple] = field(default_factory=dict)
    group_tokens: int = 0
    group_backwards: int = 0  # since the step
    layout: Any = None  # the methods' flat state of the stage (main_params), made once


class PipelineEmulator:
    """P stages in one process, running PACI's (or the flush baseline's) action lists.

    ``build_stage(s)`` returns the stage's ``StageParts``; it runs as pipeline rank s with the
    RNG seeded as Megatron-LM seeds rank s (``build.set_random_seed``), so the stage is built
    exactly as the multi-process run builds it. Each stage then keeps its own RNG streams.
    """

    def __init__(self, *, num_stages: int, accumulation: int, micro_batch_size: int,
                 seq_length: int, build_stage: Callable[[int], StageParts], seed: int = 1234,
                 kind: str = "paci", lr_increment: Optional[int] = None,
                 forward_step_func: Callable = build.gpt_forward_step,
                 methods: Sequence[Any] = ()):
        self.num_stages, self.accumulation, self.kind = num_stages, accumulation, kind
        # each method's emulated step (Method.emulated), in features.METHODS' order: PACI's
        self.methods = list(methods) if kind == "paci" else []
        self.micro_batch_size, self.seq_length = micro_batch_size, seq_length
        self.forward_step_func = forward_step_func
        dp = parallel_state.get_data_parallel_world_size()
        self.lr_increment = lr_increment or StreamShape(
            num_stages, accumulation, accumulation, micro_batch_size, dp).lr_increment
        self.stages: List[_Stage] = []
        for s in range(num_stages):
            with as_pipeline_stage(s, num_stages):
                build.set_random_seed(seed)
                parts = build_stage(s)
                self.stages.append(_Stage(s, parts, _Batches(parts.data), _rng_state()))
        self.messages: Dict[tuple, List] = {}
        self.mailbox: Dict[tuple, Any] = {}  # micro-batches in transit per channel (global order)
        self.plan: Optional[StreamPlan] = None
        self.call_index = 0
        self.consumed = 0  # micro-batches whose backward ran on every stage, before this plan
        self.losses: List[Dict] = []
        self.hooks: List[Callable[[int, Action, str], None]] = []  # (stage, action, "before"|"after")
        self.tied = TiedState(self.stages) if kind == "paci" and num_stages > 1 \
            and shared_weight(self.stages[0].parts.model) is not None else None

    # one action of one stage ---------------------------------------------------------------
    def _run(self, s: int, act: Action) -> None:
        stage = self.stages[s]
        with as_pipeline_stage(s, self.num_stages):
            _set_rng_state(stage.rng)
            for hook in self.hooks:
                hook(s, act, "before")
            getattr(self, "_" + act.op.name.lower())(stage, act.mb)
            for hook in self.hooks:
                hook(s, act, "after")
            stage.rng = _rng_state()

    def _forward(self, stage: _Stage, mb: int) -> None:
        model = stage.parts.model
        is_last = stage.index == self.num_stages - 1
        reads = stage.index in (0, self.num_stages - 1)
        data = iter([stage.batches[self.consumed + mb]]) if reads else None
        store: list = []
        view = _MethodView(self, stage)
        moved = [method.before_forward(view, mb) for method in self.methods]
        output, tokens = mcore_schedules.forward_step(
            self.forward_step_func, data, model, self.accumulation, stage.inputs.get(mb),
            store, get_model_config(model), cp_group_size=1,
            is_first_microbatch=stage.fresh_weights or any(moved), current_microbatch=mb,
            is_last_stage=is_last)
        stage.fresh_weights = any(moved)
        for method, was_moved in zip(self.methods, moved):
            method.after_forward(view, was_moved)
        stage.outputs[mb] = output
        stage.fwd_version[mb] = stage.version
        if is_last and self.tied is not None:
            stale = mb // self.accumulation - self.tied.installed
            self.tied.histogram[stale] = self.tied.histogram.get(stale, 0) + 1
        if is_last:
            self.losses += store
            stage.tokens[mb] = int(tokens)

    def _send_f(self, stage: _Stage, mb: int) -> None:
        out = stage.outputs[mb]
        self.messages.setdefault((stage.index, "F"), []).append((mb, out.detach().clone()))
        config = get_model_config(stage.parts.model)
        mcore_schedules.deallocate_output_tensor(out, config.deallocate_pipeline_outputs)

    def _recv_f(self, stage: _Stage, mb: int) -> None:
        sent_mb, tensor = self.messages[(stage.index - 1, "F")].pop(0)
        assert sent_mb == mb, (sent_mb, mb)
        stage.inputs[mb] = tensor.requires_grad_()

    def _backward(self, stage: _Stage, mb: int) -> None:
        model = stage.parts.model
        drift = stage.version - stage.fwd_version.pop(mb)
        stage.drift[drift] = stage.drift.get(drift, 0) + 1
        stage.group_backwards += 1
        sync = contextlib.nullcontext() if closes_group(mb, self.accumulation) else model.no_sync()
        scale = float(stage.parts.optimizer.get_loss_scale())  # 1 without a loss scaler
        if stage.index == self.num_stages - 1:
            tokens = stage.tokens.pop(mb)  # this stage scales its loss by its own scale
        else:  # the gradient came at the next stage's scale: bring it to this stage's
            sender_scale, tokens = stage.grad_meta.pop(mb)
            with torch.no_grad():
                stage.output_grads[mb].mul_(scale / sender_scale)
        stage.group_tokens += tokens
        if stage.index > 0:
            stage.meta_out[mb] = (scale, tokens)
        self._scale_aux_losses(model, scale)
        with sync:
            grad = compat.backward_step(
                stage.inputs.pop(mb, None), stage.outputs.pop(mb), stage.output_grads.pop(mb, None),
                get_model_type(model), get_model_config(model))
        if stage.index > 0:
            stage.input_grads[mb] = grad

    def _scale_aux_losses(self, model, scale: float) -> None:
        """The MoE auxiliary losses' and the MTP losses' gradient scales for this backward (one
        value each for the whole process, so for all stages here): this stage's loss scale
        over the accumulation factor its main loss was divided by, as 1F1B's forward sets
        them just before."""
        config = get_model_config(model)
        value = torch.tensor([scale], dtype=torch.float32)
        if not config.calculate_per_token_loss:
            value = value / self.accumulation
        if getattr(config, "num_moe_experts", None) is not None:
            MoEAuxLossAutoScaler.set_loss_scale(value)
        if getattr(config, "mtp_num_layers", None) is not None:
            MTPLossAutoScaler.set_loss_scale(value)

    def _move_expert_bias(self, model) -> None:
        """Aux-loss-free balancing at the local step: each router's bias moves by the flag's
        rate x a / N, up for each expert that got fewer of the group's tokens than the mean
        (counts summed over tensor and data parallel ranks) and down for each that got more;
        then the counts start again (``expert_bias``: per sample, as far as stock moves it)."""
        config = get_model_config(model)
        if not getattr(config, "moe_router_enable_expert_bias", False):
            return
        rate = config.moe_router_bias_update_rate * self.accumulation / self.plan.per_call
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        for module in model.modules():
            if getattr(module, "expert_bias", None) is None:
                continue
            tokens = module.local_tokens_per_expert.clone()
            torch.distributed.all_reduce(tokens, group=group)
            below = tokens.sum() / tokens.numel() - tokens  # > 0: fewer tokens than the mean
            module.expert_bias.add_(torch.sign(below) * rate)
            module.local_tokens_per_expert.zero_()

    def _send_b(self, stage: _Stage, mb: int) -> None:
        grad = stage.input_grads.pop(mb)
        self.messages.setdefault((stage.index, "B"), []).append(
            (mb, grad.detach().clone(), stage.meta_out.pop(mb)))

    def _recv_b(self, stage: _Stage, mb: int) -> None:
        sent_mb, tensor, meta = self.messages[(stage.index + 1, "B")].pop(0)
        assert sent_mb == mb, (sent_mb, mb)
        stage.output_grads[mb] = tensor
        stage.grad_meta[mb] = meta

    def _send_tied_grad(self, stage: _Stage, mb: int) -> None:
        self.tied.grads.append(self.tied.kept)
        self.tied.kept = None

    def _recv_tied_grad(self, stage: _Stage, mb: int) -> None:
        self.tied.received = self.tied.grads.pop(0)

    def _add_tied_half(self, stage: _Stage) -> None:
        """Stage 0, its own gradient reduced: the last stage's reduced half joins as stock's
        all-reduce sums it, brought to this stage's loss scale."""
        grad, sender_scale = self.tied.received
        self.tied.received = None
        # the emulator reads scales on the host: it is the CPU reference, never the runtime
        scale = float(stage.parts.optimizer.get_loss_scale())
        if scale != sender_scale:
            grad = grad * (scale / sender_scale)
        self.tied.grad(self.tied.owner).add_(grad)

    def _reduce(self, stage: _Stage, mb: int) -> None:
        """Data-parallel reduction within the stage, the tied gradient's halves (kept on the
        last stage, added on stage 0), the per-token count."""
        model = stage.parts.model
        model.finish_grad_sync()
        tied = self.tied
        if tied is not None and stage.index == self.num_stages - 1:
            tied.kept = (tied.grad(tied.last).detach().clone(),
                         float(stage.parts.optimizer.get_loss_scale()))
        if tied is not None and stage.index == 0:
            self._add_tied_half(stage)
        self._move_expert_bias(model)
        if get_model_config(model).calculate_per_token_loss:  # this stage's group's tokens
            count = torch.tensor(stage.group_tokens, dtype=torch.int)
            if parallel_state.get_data_parallel_world_size() > 1:
                torch.distributed.all_reduce(count, group=parallel_state.get_data_parallel_group())
            if count > 0:
                model.scale_gradients(1.0 / count)
        stage.group_tokens = 0

    def _step(self, stage: _Stage, mb: int) -> None:
        """The stage's optimizer and LR step; the last stage's tied copy stays where it was
        for the stream's first tied_lag steps (later ones install stage 0's weight at RW)."""
        model, optimizer, scheduler = (stage.parts.model, stage.parts.optimizer,
                                       stage.parts.lr_scheduler)
        tied = self.tied if stage.index == self.num_stages - 1 else None
        undo = None
        if tied is not None and tied.last_steps < self.tied_lag:
            undo = tied.last_main.detach().clone()
        elif tied is not None:  # stage 0's weight after its step last_steps - lag
            undo = tied.inbox.pop(0)
            tied.installed = tied.last_steps - self.tied_lag + 1
        with keep_version_counters(list(model.parameters())):
            ok, grad_norm, _ = optimizer.step()
        stage.group_backwards = 0
        if stage.layout is not None:
            stage.layout.on_step(bool(ok))
        if tied is not None:
            tied.install_last(undo)
            tied.last_steps += 1
        if ok and scheduler is not None:
            scheduler.step(increment=self.lr_increment)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        view = _MethodView(self, stage)
        for method in self.methods:
            method.after_step(view, bool(ok))
        stage.version += 1
        stage.fresh_weights = True
        lr = optimizer.param_groups[0]["lr"] if scheduler is not None else None
        stage.steps.append(StepLog(mb, bool(ok), None if grad_norm is None else float(grad_norm),
                                   lr, weights_sha256([model])))

    def _send_tied_weight(self, stage: _Stage, mb: int) -> None:
        self.tied.weights.append(self.tied.owner_main.detach().clone())

    def _recv_tied_weight(self, stage: _Stage, mb: int) -> None:
        """The last stage receives stage 0's weight after its step closing ``mb``; its own
        step tied_lag steps later installs it."""
        self.tied.inbox.append(self.tied.weights.pop(0))

    # calls, like Megatron's forward-backward function -----------------------------------------
    def set_accumulation(self, accumulation: int) -> None:
        """--paci-accumulation-factor auto between two calls: the next calls run the plan of
        ``accumulation`` (the same messages), scale losses by its 1/a and step the LR by a x
        micro-batch x DP samples."""
        self.lr_increment = self.lr_increment * accumulation // self.accumulation
        self.accumulation = accumulation
        if self.plan is not None:
            self.plan = plan_stream(self.kind, self.num_stages, accumulation, self.plan.per_call,
                                    tied=self.tied is not None)

    def train_call(self, num_microbatches: int) -> List[Dict]:
        """One training iteration: every stage runs its list up to its next N backwards.
        Returns the last stage's loss records of this call, in micro-batch order."""
        if self.plan is None:
            self.plan = plan_stream(self.kind, self.num_stages, self.accumulation, num_microbatches,
                                    tied=self.tied is not None)
            self.call_index = 0
            for stage in self.stages:
                stage.parts.model.zero_grad_buffer()
                stage.parts.optimizer.zero_grad()
                for method in self.methods:
                    method.on_stream_start(_MethodView(self, stage))
        elif num_microbatches != self.plan.per_call:
            raise ValueError("the number of micro-batches changed while micro-batches are in "
                             "flight; drain() first")
        self.losses = []
        run_global(self.plan.call(self.call_index), self._run, self.mailbox)
        self.call_index += 1
        return self.losses

    def drain(self) -> int:
        """Drop every in-flight forward; the next forwards take their batches again (a flush
        at this iteration boundary). Returns the forwards dropped at stage 0."""
        if self.plan is None:
            return 0
        dropped = len(self.stages[0].fwd_version)
        self.consumed += self.call_index * self.plan.per_call
        for stage in self.stages:
            for method in self.methods:
                method.on_drain(_MethodView(self, stage))
            stage.fwd_version.clear()
            stage.inputs.clear()
            stage.outputs.clear()
            stage.output_grads.clear()
            stage.input_grads.clear()
            stage.tokens.clear()
            stage.grad_meta.clear()
            stage.meta_out.clear()
            stage.group_tokens = 0
        if any(self.messages.values()):
            raise RuntimeError("drain with messages in transit (drain between calls only)")
        self.mailbox.clear()  # stage 0's last tied weights: the catch-up takes the newest
        if self.tied is not None:
            self.tied.catch_up()
        self.plan = None
        return dropped

    @property
    def tied_lag(self) -> int:
        return tied_lag(self.num_stages, self.accumulation)

    def stage_model(self, s: int):
        return self.stages[s].parts.model


class _MethodView:
    """One emulated stage as a method's emulated step sees it (``features.base.Method``):
    its place, its group so far, and the services a method uses, made here from the stage's
    own parts (the flat state is made once, on first use)."""

    def __init__(self, emu: PipelineEmulator, stage: _Stage):
        self._emu, self._stage = emu, stage
        self.index, self.num_stages = stage.index, emu.num_stages
        self.accumulation = emu.accumulation
        self.group_backwards = stage.group_backwards
        self.per_token = get_model_config(stage.parts.model).calculate_per_token_loss

    def layout(self):
        stage, tied = self._stage, self._emu.tied
        if stage.layout is None:
            partial = [tied.owner] if tied is not None and stage.index == 0 else []
            stage.layout = main_params.StageLayout(
                stage.parts.model, stage.parts.optimizer, partial=partial,
                tp_group=parallel_state.get_tensor_model_parallel_group())
        return stage.layout

    def lr_sum(self, group: dict, steps: int) -> float:
        return main_params.lr_sum(self._stage.parts.lr_scheduler, self._emu.lr_increment, group,
                                  steps)

    def loss_scale(self):
        return main_params.loss_scale_tensor(self._stage.parts.optimizer)

    def reduce_sumsq(self, tensor) -> None:
        optimizer = self._stage.parts.optimizer
        main_params.reduce_over(tensor, stage_grad_stats_group(optimizer))

    def gather(self) -> None:
        gather_weights(self._stage.parts.optimizer)

    def keep_versions(self):
        return keep_version_counters(list(self._stage.parts.model.parameters()))
