"""PACI on Megatron-Core: one never-flushing stream of micro-batches across forward-backward
calls, and Megatron's forward-backward signature around it.

The order of work comes from ``schedule.plan_stream`` (checked by ``simulate`` when the stream
starts, ``admission.admit_plan``) and is run by ``executor.StageExecutor``; ``handlers.py``
turns each action into Megatron-Core calls, ``local_step.py`` runs the group-closing R and T,
``grad_meta.py`` carries loss scales and token counts with the gradients, ``tied.py`` the tied
weight. Convergence methods are stage features (``features/``); the plan's accumulation
factor comes from a plan policy (``plan_policy.py``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_model_config, get_model_type

from ..autograd_versions import keep_version_counters
from ..executor import DriftStats, ReplayIterator, StageExecutor
from ..features.base import StageContext, StageFeature, sub_optimizers
from ..features.timer import SpanTimer
from ..plan_policy import PlanPolicy
from ..schedule import Op, StreamPlan, check_max_drift, check_per_call
from ..shape import closes_group, drift_bound, tied_lag
from . import admission, aux_losses, expert_bias, main_params, param_gather, warmup
from .grad_meta import GradMeta, grad_meta_for
from .handlers import MegatronHandlers
from .local_step import StepRecord
from .tied import TiedEmbedding, shared_weight, shares_first_and_last, tied_sha256

STOCK_GET_FORWARD_BACKWARD_FUNC = mcore_schedules.get_forward_backward_func


@dataclass
class StageState:
    """Tensors a stage holds between actions, keyed by micro-batch."""

    inputs: Dict[int, Any] = field(default_factory=dict)
    outputs: Dict[int, Any] = field(default_factory=dict)
    output_grads: Dict[int, Any] = field(default_factory=dict)
    input_grads: Dict[int, Any] = field(default_factory=dict)
    # (work, tensor to free or None, Op.SEND_F or Op.SEND_B)
    pending_sends: List[tuple] = field(default_factory=list)
    # --fp16 / --calculate-per-token-loss: what travels back with each gradient (GradMeta):
    # received from the next stage, and to send to the previous one
    meta_in: Dict[int, Any] = field(default_factory=dict)
    meta_out: Dict[int, Any] = field(default_factory=dict)
    tokens: Dict[int, Any] = field(default_factory=dict)  # last stage: each forward's count

    def in_flight(self) -> int:
        return len(self.outputs)


class PaciRuntime:
    """Keeps one never-flushing pipeline stream across forward-backward calls.

    kind="paci" runs PACI; kind="flush" runs the same executor on the flush baseline (stock
    1F1B with a drain before each step), which must equal stock Megatron bit for bit.
    ``policy`` picks each call's plan (a fixed or an automatic accumulation factor); ``features`` are the stage features (plain PACI: none).
    """

    def __init__(self, *, accumulation: int, kind: str = "paci", max_drift: Optional[int] = None,
                 on_nonfinite: str = "skip",
                 policy: Optional[PlanPolicy] = None, features: Sequence[StageFeature] = ()):
        if kind not in ("paci", "flush"):
            raise ValueError(f"unknown runtime kind {kind!r}")
        if on_nonfinite not in ("skip", "abort"):
            raise ValueError(f"--paci-on-nonfinite must be skip or abort, got {on_nonfinite!r}")
        self.kind = kind
        self.accumulation = accumulation  # the a that lr_increment counts
        self.on_nonfinite = on_nonfinite
        self.max_drift = max_drift
        self.accumulation_follows = False  # a = M when M changes (use_microbatches)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.num_stages = parallel_state.get_pipeline_model_parallel_world_size()
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1
        if kind == "paci":
            check_max_drift(self.num_stages, accumulation, max_drift)
        bound = drift_bound(self.num_stages, self.stage, accumulation) if kind == "paci" else 0
        self.drift = DriftStats(self.stage, bound if max_drift is None else max_drift)
        self.policy = policy or PlanPolicy(kind, self.num_stages, accumulation)
        self.user_features = list(features) if kind == "paci" else []
        self.pg = admission.pipeline_groups()
        self.optimizer = self.lr_scheduler = self.lr_increment = None
        self._stock_grad_groups: list = []
        self.plan: Optional[StreamPlan] = None
        self.call_index = 0  # calls of this stream
        self.calls_done = 0  # training calls since the start of the run (drains keep it)
        self.forwards_in_call = 0  # this stage's forwards in the last training call
        self.aux_losses = False  # MoE or MTP losses: their scales set before each backward
        self.bias_pace: Optional[expert_bias.BiasPace] = None  # the expert bias's rate per step
        self.state = StageState()
        self.data: Optional[ReplayIterator] = None
        self.steps: List[StepRecord] = []
        self.skipped_steps = 0
        self.model = None
        self.params: tuple = ()
        self.fresh_weights = True
        self.gathers_params = False  # --overlap-param-gather: see param_gather.py
        self.tied: Optional[TiedEmbedding] = None  # the tied-weight exchange of this stream
        self.tied_histogram: Counter = Counter()  # last stage: staleness -> micro-batches
        # the stage's own forwards (not the features' work around them), for the cost lines:
        # an uneven pipeline runs at its slowest stage's pace; the first holds one-off work
        self.forward_time = SpanTimer(cuda=torch.cuda.is_available(), skip=1)
        self._stage_pg = None  # groups without the tied all-reduce (made once)
        self.grad_groups = self.pg
        self.meta: Optional[GradMeta] = None  # --fp16 / --calculate-per-token-loss
        self.features: List[StageFeature] = []
        self.ctx = StageContext(self.stage, self.num_stages, self.drift)
        self._drift_plans: dict = {}  # planned_drift's cache
        self._layout = None  # the weight prediction's flat state (main_params.StageLayout)
        self._warmed: Optional[list] = None  # what the start-up exchange ran over

    # wiring ----------------------------------------------------------------------------------
    def bind(self, optimizer, lr_scheduler=None, lr_increment: Optional[int] = None) -> None:
        """Attach the stage's optimizer; PACI's grad-norm / found-inf stay in the stage."""
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.lr_increment = lr_increment
        self.ctx.optimizer = optimizer
        admission.make_instance_groups()  # every rank binds: --num-distributed-optimizer-instances
        self._wire_flat_state(optimizer)
        for feature in self.user_features:
            feature.on_bind(self.ctx)
        self._stock_grad_groups = [getattr(opt, "grad_stats_parallel_group", None)
                                   for opt in sub_optimizers(optimizer)]
        self._use_stage_grad_stats(self.kind == "paci")

    def _wire_flat_state(self, optimizer) -> None:
        """The services a method that moves the weights reads of this stage
        (features/base.StageContext)."""
        ctx = self.ctx
        ctx.check_flat_state = lambda: main_params.check_optimizer(optimizer)
        ctx.flat_state = self.flat_state
        ctx.layer_mover = self.layer_mover
        ctx.settle_pass = self.settle_pass
        ctx.lr_sum = lambda group, steps: main_params.lr_sum(
            self.lr_scheduler, self.lr_increment_now(), group, steps)
        ctx.loss_scale_tensor = lambda: main_params.loss_scale_tensor(optimizer)
        ctx.reduce_stage_sumsq = lambda t: main_params.reduce_over(
            t, admission.stage_grad_stats_group(optimizer))
        ctx.gather_weights = lambda: main_params.gather_weights(optimizer)

    def flat_state(self):
        """The stage's flat state (weights, main copies, moments): made at the first stream,
        its replaced tensors (a --load) re-homed at each later one."""
        if self._layout is None:
            partial = [shared_weight(self.model)] if self.is_first \
                and self._tied_in_plans(self.model) else []
            self._layout = main_params.StageLayout(self.model, self.optimizer, partial=partial,
                                                   cp_size=self.pg.cp.size(), tp_group=self.pg.tp)
        else:
            self._layout.rehome()
        return self._layout

    def layer_mover(self):
        """--paci-weight-prediction-overlap: the layer-by-layer move, or None (with a line
        saying why) where the stage moves whole."""
        from .prediction_overlap import LayerwiseMove

        why = LayerwiseMove.supported(self._layout, self.model)
        if why:
            print(f"> PACI stage {self.stage}: --paci-weight-prediction-overlap moves the whole "
                  f"stage before each predicted forward: {why}", flush=True)
            return None
        return LayerwiseMove(self._layout, self.model)

    def settle_pass(self, piece_sets=(), folds=(True, False), inv_scale=None) -> None:
        """The pass's kernel for the whole run, at the first stream's start (before its
        first action, so before any collective of the training loop): every fused variant
        compiled on this stage's tensors, the stage's ranks agreeing (``Pass.settle``); a
        line says why where the stage runs the plain pass. Later streams: nothing."""
        stage_pass = self._layout.stage_pass
        if stage_pass.settled:
            return
        with keep_version_counters(self.params):
            why = stage_pass.settle(piece_sets, folds, inv_scale, agree=self._stage_agrees)
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        if why and torch.distributed.get_rank(group) == 0:
            print(f"> PACI stage {self.stage}: the weight prediction's pass runs plain (the "
                  f"same formulas as eager torch ops, chunked) for this run: {why}", flush=True)

    @staticmethod
    def _stage_agrees(ok: bool) -> bool:
        """True where every rank of this stage (tensor x data x context parallel) says so:
        one all-reduce of a flag, at start-up."""
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        if group.size() == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=warmup._device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        # the host picks the kernel from this: read once a run, at the first stream's start
        # (Pass.settle is guarded by `settled`), never on the per-forward path
        return bool(flag.item())

    def _use_stage_grad_stats(self, stage_local: bool) -> None:
        """PACI reduces grad norm / found-inf within the stage; stock 1F1B (and the sync
        warm-up) over all stages, as Megatron does."""
        for opt, stock in zip(sub_optimizers(self.optimizer), self._stock_grad_groups):
            group = admission.stage_grad_stats_group(opt) if stage_local else None
            if group is not None:
                opt.grad_stats_parallel_group = group
            elif stock is not None:
                opt.grad_stats_parallel_group = stock
            elif hasattr(opt, "grad_stats_parallel_group"):
                del opt.grad_stats_parallel_group  # Megatron's default: the model-parallel group

    def lr_increment_now(self) -> Optional[int]:
        """``lr_increment`` counts the samples of ``accumulation`` backwards; a step of the
        sync warm-up closes a whole batch."""
        if self.lr_increment is None:
            return None
        return self.lr_increment * self.plan.accumulation // self.accumulation

    def resume_at(self, iteration: int, local_steps: int) -> None:
        """After --load at ``iteration``: the calls and local steps already taken."""
        self.calls_done = iteration
        self.drift.version = local_steps

    def describe_peers(self, actions) -> str:
        """'pipeline stage 2 (global rank 5)' for the neighbours these actions talk to."""
        stages = sorted({self.stage + (1 if op in (Op.SEND_F, Op.RECV_B) else -1)
                         for op in actions})
        return " and ".join(
            f"pipeline stage {s} (global rank {torch.distributed.get_global_rank(self.pg.pp, s)})"
            for s in stages)

    @property
    def primed(self) -> bool:
        """True between a training call and the next drain (forwards may be in flight)."""
        return self.plan is not None

    @property
    def in_flight(self) -> int:
        return self.state.in_flight()

    def plan_closes_group(self, mb: int) -> bool:
        return closes_group(mb, self.plan.accumulation)

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool):
        """DDP reduces grads only on the backward that closes a group (as stock does for the
        last micro-batch of a batch)."""
        if enabled or not hasattr(self.model, "no_sync"):
            yield
            return
        with self.model.no_sync():
            yield

    def loss_scale(self):
        """This stage's current loss scale on the device, None without a scaler (1); it
        changes only at a step. Never read back by the host."""
        return main_params.loss_scale_tensor(self.optimizer) if self.optimizer is not None \
            else None

    def skip_nonfinite_step(self, mb: int) -> None:
        """A NaN/Inf gradient reached this stage's step: skip the update (default) or stop."""
        self.skipped_steps += 1
        where = (f"stage {self.stage}: non-finite gradient at the local step after micro-batch "
                 f"{mb} (step {self.drift.version + 1})")
        if self.on_nonfinite == "abort":
            raise FloatingPointError(f"{where}; stopping (--paci-on-nonfinite abort)")
        print(f"[paci] {where}; update skipped ({self.skipped_steps} so far)", flush=True)

    # the stream ------------------------------------------------------------------------------
    def _start(self, model, data_iterator, num_microbatches: int, seq_length: int,
               micro_batch_size: int, decoder_seq_length: Optional[int]) -> None:
        """A new stream from an empty (or drained) pipeline: admit the model and the plan,
        then set up what its actions need."""
        config = get_model_config(model)
        if config.finalize_model_grads_func is None:
            config.finalize_model_grads_func = finalize_model_grads
        if self.kind == "paci":
            admission.check_paci_model(model, self.pg)
        self.model, self.model_config, self.model_type = model, config, get_model_type(model)
        self.aux_losses = aux_losses.has_aux_losses(config)
        if self.bias_pace is None:  # the flag's rate, before any plan changed it
            self.bias_pace = expert_bias.BiasPace(config)
        self.params = self.ctx.params = tuple(model.parameters())
        self.meta = grad_meta_for(config, self.optimizer)
        tied = self._tied_in_plans(model)
        self.plan = self.policy.plan(self.calls_done, num_microbatches, tied)
        if self.kind == "paci":
            # Megatron ends each batched exchange with torch.cuda.synchronize() by default, to
            # guard a race torch fixed in 1.13 (pytorch PR 82450): on NCCL it would also wait
            # for a pending tied message its peer cannot yet receive (nccl_model, rule 5)
            config.batch_p2p_sync = False
        admission.admit_plan(self.plan, config, warmed=self.kind == "paci")
        self._use_stage_grad_stats(self.plan.kind == "paci")
        self.tied = self._tied_exchange(model) if self.plan.tied else None
        self.grad_groups = self._stage_pg if self.tied is not None else self.pg
        # the tied copy is restored first: later hooks see the stage's weights as they stay
        self.features = ([self.tied] if self.tied is not None else []) + self.user_features \
            + list(self.policy.features)
        self._tell_features()
        for feature in self.features:
            feature.on_start(self.ctx)
        self.call_index = 0
        self.gathers_params = self.kind == "paci" and param_gather.overlaps_param_gather(model)
        self.data = ReplayIterator(data_iterator) if self.data is None else self.data
        if self.data.base is not data_iterator:
            self.data.base = data_iterator
        self.p2p = P2PCommunicator(pp_group=self.pg.pp, config=config)
        self.tensor_shape = mcore_schedules.get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length, config=config,
            tp_group=self.pg.tp, cp_group=self.pg.cp,
        )[0]
        if self.kind == "paci" and self._warmed is None:
            # every communicator made before the stream's first action (warmup.py)
            self._warmed = warmup.warm_up(self)
        model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _tell_features(self) -> None:
        """What the features may read of this stream."""
        ctx = self.ctx
        ctx.features = self.features
        ctx.accumulation = self.plan.accumulation
        ctx.per_token = self.meta is not None and self.meta.per_token
        ctx.planned_drift = self.planned_drift
        self._drift_plans = {}
        self.bias_pace.apply(self.model_config, self.plan.accumulation, self.plan.per_call)

    def planned_drift(self, mb: int) -> int:
        """The local steps this stage takes between F mb (of the current call) and B mb, as
        the plan's lists say; cached per position in the periodic stream."""
        plan, call = self.plan, self.call_index
        if plan.kind != "paci":
            return 0
        shift = max(0, call - len(plan.first)) * plan.per_call
        key = (call - shift // plan.per_call, mb - shift)
        if key not in self._drift_plans:
            self._drift_plans[key] = plan.steps_before_backward(key[0], self.stage, key[1])
        return self._drift_plans[key]

    def _tied_in_plans(self, model) -> bool:
        """Stage 0 and the last stage of a PACI plan that share a weight (tied embeddings, or
        MTP's copy of the embedding) exchange its gradient and values point to point (SG/RG,
        SW/RW); the flush baseline keeps Megatron's all-reduce. Every stage knows: the lists
        of all stages must agree."""
        return self.kind == "paci" and self.num_stages > 1 and shares_first_and_last(model)

    def _tied_exchange(self, model) -> Optional[TiedEmbedding]:
        if self.policy.features:
            raise ValueError("--paci-accumulation-factor auto does not support a weight shared "
                             "by the first and the last stage yet (tied embeddings: add "
                             "--untie-embeddings-and-output-weights; or drop --mtp-num-layers)")
        if shared_weight(model) is None:
            return None  # a middle stage: the lists give it no tied action
        if self._stage_pg is None:
            self._stage_pg = admission.stage_local_groups(self.pg)
        meta = self.meta
        return TiedEmbedding(
            model=model, optimizer=self.optimizer, stage=self.stage, num_stages=self.num_stages,
            accumulation=self.plan.accumulation, group=self.pg.embd,
            histogram=self.tied_histogram,
            loss_scale=self.loss_scale if meta is not None and meta.fp16 else None)

    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches: int,
                         seq_length: int, micro_batch_size: int,
                         decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                         collect_non_loss_data: bool = False, first_val_step=None, **kwargs):
        """Megatron's forward-backward signature. Training calls advance the stream by
        ``num_microbatches`` backwards per stage (and their local steps). A forward-only call
        (evaluation) runs stock Megatron between two training calls: every stage has then
        taken the same number of local steps and no message is in transit, so the in-flight
        forwards are kept and training goes on as if the evaluation had not happened."""
        if isinstance(model, list):
            if len(model) != 1:
                raise ValueError("PACI does not support virtual pipeline stages (model chunks); "
                                 "drop --num-layers-per-virtual-pipeline-stage")
            model = model[0]
        if isinstance(data_iterator, list):
            data_iterator = data_iterator[0]
        if forward_only:
            with contextlib.ExitStack() as stack:
                if self.tied is not None:
                    stack.enter_context(self.tied.current_weight())
                if self.plan is not None:  # the features' true weights (a look-ahead's)
                    for feature in self.user_features:
                        stack.enter_context(feature.evaluating(self.ctx))
                return STOCK_GET_FORWARD_BACKWARD_FUNC()(
                    forward_step_func=forward_step_func, data_iterator=data_iterator,
                    model=[model], num_microbatches=num_microbatches, seq_length=seq_length,
                    micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                    forward_only=True, collect_non_loss_data=collect_non_loss_data,
                    first_val_step=first_val_step)
        if self.plan is None:
            self._start(model, data_iterator, num_microbatches, seq_length, micro_batch_size,
                        decoder_seq_length)
        elif model is not self.model or num_microbatches != self.plan.per_call:
            raise RuntimeError("the model or number of micro-batches changed while micro-batches "
                               "were in flight; call drain() first")
        elif data_iterator is not self.data.base:
            raise RuntimeError("the data iterator changed while micro-batches were in flight; "
                               "call drain() first")
        plan = self.policy.before_call(self, self.plan)
        if plan is not self.plan:  # --paci-accumulation-factor auto took another a
            admission.admit_plan(plan, self.model_config, warmed=True)
            self.plan = plan
            self._tell_features()
        store: list = []
        handlers = MegatronHandlers(self, forward_step_func=forward_step_func, data=self.data,
                                    forward_data_store=store)
        actions = self.plan.call(self.call_index)[self.stage]
        # the first call after a start or a drain runs the in-flight forwards too (MoE metrics)
        self.forwards_in_call = sum(1 for action in actions if action.op is Op.FORWARD)
        StageExecutor(self.stage, handlers, self.drift).run(actions)
        handlers.reap_sends(wait=True)
        self.call_index += 1
        self.calls_done += 1
        self.policy.after_call(self)
        return store

    def drain(self) -> int:
        """Bring the stage to a clean state at the last group boundary: forwards still in
        flight are dropped and their data is served again by the next forwards, so what follows
        is as if the schedule had flushed here. Touches no other stage. Returns the number of
        micro-batches dropped."""
        if self.plan is None:
            return 0
        self.policy.finish()
        dropped = self.drift.forget_in_flight()
        if self.data is not None:
            self.data.rewind(dropped)
        if self.state.pending_sends:
            raise RuntimeError("drain with sends still pending (drain between calls only)")
        for feature in self.features:
            feature.on_drain(self.ctx)  # the tied copy catches up: both copies bit-identical
        self.tied = None
        self.state = StageState()
        self.plan = None
        if self.gathers_params:  # a checkpoint or the final weights read every shard
            param_gather.complete_param_gather(self.model)
        if self.meta is not None:
            self.meta.reset()  # a drain stops at a group boundary: nothing counted
        return len(dropped)

    def use_microbatches(self, num_microbatches: int) -> Optional[int]:
        """--rampup-batch-size: the next call has ``num_microbatches``; with
        ``accumulation_follows`` (no explicit --paci-accumulation-factor) a local step closes
        each call, i.e. a becomes that number too. Every stage knows the iteration where the
        number changes, so each drains there without communicating (the next call starts a
        new stream, as after a flush). The LR increment per local step follows a (it stays
        ``a x micro-batch x data-parallel`` samples); the drift bound reported and enforced is
        the largest of the accumulation factors' bounds. Returns the forwards dropped, or None
        where nothing changed."""
        accumulation = num_microbatches if self.accumulation_follows else self.accumulation
        if accumulation == self.accumulation and not (
                self.primed and self.plan.per_call != num_microbatches):
            return None
        check_per_call(num_microbatches, accumulation)
        dropped = self.drain()
        if accumulation != self.accumulation:
            if self.lr_increment is not None:
                self.lr_increment = self.lr_increment // self.accumulation * accumulation
            self.accumulation = accumulation
            self.policy.factor = accumulation  # auto is refused with a ramp
            if self.kind == "paci" and self.max_drift is None:
                self.drift.bound = max(self.drift.bound,
                                       drift_bound(self.num_stages, self.stage, accumulation))
        return dropped

    # reporting ---------------------------------------------------------------------------------
    def tied_digest(self) -> Optional[str]:
        """SHA-256 of this stage's tied-weight copy (see tied.tied_sha256); None if it holds
        none or has not trained yet."""
        if self.model is None or self.optimizer is None:
            return None
        return tied_sha256(self.model, self.optimizer)

    def describe(self) -> str:
        """The stage features in force, for the start-up line."""
        return ", ".join(filter(None, (f.describe() for f in self.user_features)))

    def drift_summary(self) -> dict:
        row = {"stage": self.stage, "max": self.drift.max, "bound": self.drift.bound,
               "histogram": dict(sorted(self.drift.histogram.items())),
               "steps": self.drift.version, "skipped_steps": self.skipped_steps}
        forward = self.forward_time.mean_ms()
        if forward is not None:
            row["stage_forward_ms"] = round(forward, 3)
        row.update(self.policy.summary(self.calls_done))
        if self._warmed is not None:
            row["startup_exchange"] = self._warmed
        for feature in self.user_features:
            row.update(feature.summary())
        if self.tied_histogram:  # last stage, tied embeddings: staleness of its tied copy
            row["tied"] = {"max": max(self.tied_histogram),
                           "bound": tied_lag(self.num_stages, self.accumulation),
                           "histogram": dict(sorted(self.tied_histogram.items()))}
        return row


# --- wiring into Megatron -------------------------------------------------------------------

def install_schedule(forward_backward: Callable) -> Callable[[], None]:
    """Make Megatron's get_forward_backward_func() return ``forward_backward``."""
    from ..patches.schedule_hook import install_forward_backward_func

    return install_forward_backward_func(forward_backward)


def get_forward_backward_func() -> Callable:
    """What Megatron-Core hands out now (stock, or the installed schedule)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as current

    return current()


def gather_across_pipeline(obj: Any) -> List[Any]:
    """Collect one object per pipeline stage (a cross-stage collective: report time only)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    out: List[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def take_rank0s(obj: Any) -> Any:
    """Every rank returns global rank 0's ``obj`` (one small broadcast over the whole job: a
    sync point, so callers use it at agreed iterations only)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
