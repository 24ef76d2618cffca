"""PACI on Megatron-Core: action handlers and the forward-backward function.

This module and ``build.py`` are the only importers of Megatron internals. The order of work
comes from ``schedule.plan_stream`` (validated by ``simulate``) and is run by
``executor.StageExecutor``; here each action becomes Megatron's ``forward_step``,
``backward_step``, ``P2PCommunicator`` traffic or a stage-local optimizer step.
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
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, get_model_type

from ..adapt import Adaptive, bound_in_call, staleness
from ..autograd_versions import ZERO_CENTERED_GAMMA, keep_version_counters
from ..executor import DriftStats, ReplayIterator, StageExecutor
from ..schedule import (Action, Op, StreamPlan, check_max_drift, check_per_call, drift_bound,
                        exchanges, plan_stream)
from ..stale_correction import StaleGradCorrection
from ..stale_weights import StaleGradWeights
from . import param_gather
from .tied import TiedEmbedding, shared_weight, tied_lag, tied_sha256

STOCK_GET_FORWARD_BACKWARD_FUNC = mcore_schedules.get_forward_backward_func


# --- one stage's handlers -------------------------------------------------------------------

@dataclass
class StepRecord:
    mb: int
    update_successful: bool
    grad_norm: Optional[float]
    lr: Optional[float]


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


class PeerFailure(RuntimeError):
    """A send or receive with a neighbouring stage failed: that stage most likely died."""

    def __init__(self, peers: str, exc: Exception):
        super().__init__(f"communication with {peers} failed ({exc}); that stage most likely "
                         "died or raised: its own log says why")


class MegatronHandlers:
    """Turns schedule actions into Megatron-Core calls for the local pipeline stage."""

    def __init__(self, runtime: "PaciRuntime", *, forward_step_func, data: ReplayIterator,
                 model, tensor_shape, forward_data_store: list):
        self.rt = runtime
        self.model = model
        self.config = get_model_config(model)
        self.model_type = get_model_type(model)
        self.forward_step_func = forward_step_func
        self.data = data
        self.tensor_shape = tensor_shape
        self.store = forward_data_store
        self.state = runtime.state

    # compute
    def forward(self, mb: int) -> None:
        state = self.state
        self.data.current = mb
        if self.rt.tied is not None and self.rt.is_last:
            self.rt.tied.on_forward(mb)
        output, num_tokens = mcore_schedules.forward_step(
            self.forward_step_func, self.data, self.model, self.rt.plan.accumulation,
            state.inputs.get(mb), self.store, self.config,
            cp_group_size=self.rt.pg.cp.size(),
            is_first_microbatch=self.rt.fresh_weights,  # weights changed: refresh caches
            current_microbatch=mb, is_last_stage=self.rt.is_last,
        )
        self.rt.fresh_weights = False
        state.outputs[mb] = output
        if self.rt.meta is not None and self.rt.is_last:
            state.tokens[mb] = num_tokens

    def backward(self, mb: int) -> None:
        state = self.state
        closes_group = (mb + 1) % self.rt.plan.accumulation == 0
        self.finish_send_of(mb)  # long done: the next stage already sent this one's gradient
        stale, token_weight = self.rt.stale, 1.0
        if stale is not None:
            _mb, fwd_version, version = self.rt.drift.log[-1]  # the executor logged this one
            drift = version - fwd_version
            token_weight = stale.weight_of(drift)
            scale_grads(self.model, stale.before_backward(drift))
        if self.rt.meta is not None:
            self.rt.meta.before_backward(self.rt, state, mb, token_weight=token_weight)
        with self.rt.grad_sync(enabled=closes_group):
            grad = mcore_schedules.backward_step(
                state.inputs.pop(mb, None), state.outputs.pop(mb), state.output_grads.pop(mb, None),
                self.model_type, self.config,
            )
        self.data.release(mb)
        if closes_group and self.rt.tied is not None and self.rt.is_last:
            self.rt.tied.send_output_grad()  # before SB mb: stage 0 needs it at its step
        if not self.rt.is_first:
            state.input_grads[mb] = grad

    def step(self, mb: int) -> None:
        self.rt.local_step(mb)

    # communication
    def communicate(self, actions: Sequence[Action]) -> None:
        earlier, self.state.pending_sends = self.state.pending_sends, []
        for batch in exchanges(actions):
            self._exchange({act.op: act for act in batch})
        # Sends posted by an earlier exchange are waited for now, after this one is posted:
        # each neighbour receives on a channel in order and needs nothing we send later to
        # get there, so this cannot deadlock; it frees their buffers one exchange later. (gloo
        # reports a send complete only once waited for, so reaping by is_completed() alone
        # kept every message of an iteration alive until its end.)
        self.wait_sends(earlier)
        self.reap_sends(wait=False)

    def _exchange(self, batch: Dict[Op, Action]) -> None:
        state = self.state
        send_next = batch.get(Op.SEND_F)
        send_prev = batch.get(Op.SEND_B)
        out = state.outputs[send_next.mb] if send_next else None
        grad = state.input_grads.pop(send_prev.mb) if send_prev else None
        wait_all = bool(self.config.batch_p2p_comm)  # batched p2p must complete together
        try:
            recv_prev, recv_next, reqs = self.rt.p2p._communicate(
                tensor_send_next=out, tensor_send_prev=grad,
                recv_prev=Op.RECV_F in batch, recv_next=Op.RECV_B in batch,
                tensor_shape=self.tensor_shape, wait_on_reqs=wait_all,
            )
            reqs = reqs or {}
            for key in ("recv_prev", "recv_next"):
                if key in reqs:
                    reqs[key].wait()
            meta = self.rt.meta
            if meta is not None and send_prev:  # posted after the gradient on both sides
                state.pending_sends.append(
                    meta.send(self.rt, state.meta_out.pop(send_prev.mb)) + (Op.SEND_B,))
            if meta is not None and Op.RECV_B in batch:
                state.meta_in[batch[Op.RECV_B].mb] = meta.receive(self.rt)
        except RuntimeError as exc:
            raise PeerFailure(self.rt.describe_peers(batch), exc) from exc
        if Op.RECV_F in batch:
            state.inputs[batch[Op.RECV_F].mb] = recv_prev
        if Op.RECV_B in batch:
            state.output_grads[batch[Op.RECV_B].mb] = recv_next
        if "send_next" in reqs:
            state.pending_sends.append((reqs["send_next"], out, Op.SEND_F))
        elif out is not None:
            mcore_schedules.deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)
        if "send_prev" in reqs:
            state.pending_sends.append((reqs["send_prev"], None, Op.SEND_B))

    def finish_send_of(self, mb: int) -> None:
        output = self.state.outputs.get(mb)
        for work, tensor, _ in self.state.pending_sends:
            if tensor is output and tensor is not None:
                work.wait()
        self.reap_sends(wait=False)

    def reap_sends(self, wait: bool) -> None:
        """Free sent activations whose send completed (all of them if ``wait``)."""
        if wait:
            pending, self.state.pending_sends = self.state.pending_sends, []
            self.wait_sends(pending)
            return
        still = []
        for work, tensor, op in self.state.pending_sends:
            if not work.is_completed():
                still.append((work, tensor, op))
            elif tensor is not None:
                mcore_schedules.deallocate_output_tensor(
                    tensor, self.config.deallocate_pipeline_outputs)
        self.state.pending_sends = still

    def wait_sends(self, sends: List[tuple]) -> None:
        for work, tensor, op in sends:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerFailure(self.rt.describe_peers([op]), exc) from exc
            if tensor is not None:
                mcore_schedules.deallocate_output_tensor(
                    tensor, self.config.deallocate_pipeline_outputs)


# --- what travels back with each gradient (--fp16, --calculate-per-token-loss) --------------

class GradMeta:
    """Two numbers sent with each activation gradient, from the last stage towards stage 0, as
    a separate tiny message right after the gradient in the same exchange (both sides post in
    that order): the loss scale the gradient is expressed in, and the micro-batch's token count.

    fp16: each stage has its own dynamic loss scaler and skips its own overflowing steps, so the
    scalers drift apart. A gradient leaves a stage scaled by that stage's current scale (the
    last stage's loss is scaled by its own, as stock does); the receiver rescales it by (own
    scale / sender's scale), a power of two, so exact, before its backward. A scale changes
    only at a local step, so all backwards of a group use one scale.

    Per-token loss: the last stage counts each micro-batch's tokens; every stage sums the
    counts of its group and divides its gradients by the sum (all-reduced over data-parallel
    ranks, as stock) at its step: stock broadcasts the count over the pipeline group instead."""

    def __init__(self, *, fp16: bool, per_token: bool):
        self.fp16 = fp16
        self.per_token = per_token
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.group_tokens = 0  # this stage's tokens since its last step

    def before_backward(self, rt: "PaciRuntime", state: StageState, mb: int,
                        token_weight: float = 1.0) -> None:
        own = rt.loss_scale()
        if rt.is_last:
            sender, tokens = own, int(state.tokens.pop(mb))
        else:
            sender, tokens = state.meta_in.pop(mb)
            if sender != own:
                with torch.no_grad():  # Megatron's receive buffers require grad
                    state.output_grads[mb].mul_(own / sender)
        # --paci-stale-grad-weight: the count is weighted as the gradient is
        self.group_tokens += tokens if token_weight == 1.0 else token_weight * tokens
        if not rt.is_first:
            state.meta_out[mb] = torch.tensor([own, tokens], dtype=torch.float64,
                                              device=self.device)

    def send(self, rt: "PaciRuntime", meta: torch.Tensor) -> tuple:
        work = torch.distributed.isend(meta, dst=rt.p2p.prev_rank, group=rt.pg.pp)
        return work, meta  # the tensor stays referenced until the send is waited for

    def receive(self, rt: "PaciRuntime") -> tuple:
        buf = torch.empty(2, dtype=torch.float64, device=self.device)
        torch.distributed.irecv(buf, src=rt.p2p.next_rank, group=rt.pg.pp).wait()
        scale, tokens = buf.tolist()
        return scale, int(tokens)

    def divide_by_tokens(self, model, dp_cp_group) -> None:
        """What stock finalize_model_grads does with num_tokens, minus the pipeline broadcast."""
        weighted = not isinstance(self.group_tokens, int)  # --paci-stale-grad-weight
        count = torch.tensor(self.group_tokens, device=self.device,
                             dtype=torch.float64 if weighted else torch.int)
        self.group_tokens = 0
        if dp_cp_group is not None and dp_cp_group.size() > 1:
            torch.distributed.all_reduce(count, group=dp_cp_group)
        if count > 0:
            model.scale_gradients(1.0 / count)


def grad_meta_for(config, optimizer) -> Optional[GradMeta]:
    """A GradMeta when fp16 or per-token loss is on; None otherwise (no extra message)."""
    fp16 = _has_grad_scaler(optimizer)  # fp16 always has one (bf16 only with --loss-scale)
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    return GradMeta(fp16=fp16, per_token=per_token) if fp16 or per_token else None


def _has_grad_scaler(optimizer) -> bool:
    return any(getattr(opt, "grad_scaler", None) is not None
               for opt in _sub_optimizers(optimizer))


# --- the runtime: one stream per training run -----------------------------------------------

def pipeline_groups() -> ProcessGroupCollection:
    """The groups stock 1F1B hands to finalize_model_grads."""
    pg = ProcessGroupCollection()
    pg.tp = parallel_state.get_tensor_model_parallel_group()
    pg.pp = parallel_state.get_pipeline_model_parallel_group()
    pg.cp = parallel_state.get_context_parallel_group()
    pg.embd = parallel_state.get_embedding_group(check_initialized=False)
    pg.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pg.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return pg


def check_no_cross_stage_grad_reduction(model, pg: ProcessGroupCollection) -> None:
    """finalize_model_grads crosses stages for tied word embeddings and multi-token prediction
    (first <-> last stage), position embeddings split over stages, conditional embedders (all
    stages) and barriered level-1 timers (all ranks); PACI refuses them instead of stalling."""
    if pg.pp.size() == 1:
        return
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    if getattr(inner, "share_embeddings_and_output_weights", False):
        check_tied_supported(model)
    if pg.pos_embd is not None and pg.pos_embd.size() > 1:
        raise ValueError("PACI does not support position embeddings shared across stages")
    config = get_model_config(model)
    if getattr(config, "mtp_num_layers", None):
        raise ValueError(
            "PACI does not support multi-token prediction across pipeline stages: "
            "finalize_model_grads all-reduces the embedding between the first and last stage "
            "at every step; drop --mtp-num-layers or use one pipeline stage")
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


def check_tied_supported(model) -> None:
    """Tied embeddings under PACI exchange the output layer's raw gradient and stage 0's
    stepped weight (``tied.py``); refuse what that exchange does not cover."""
    ddp = getattr(model, "ddp_config", None)
    if ddp is not None and ddp.use_distributed_optimizer:
        raise ValueError(
            "PACI with tied input/output embeddings does not support the distributed optimizer "
            "yet (the last stage installs stage 0's weight into its own optimizer's copy); drop "
            "--use-distributed-optimizer or add --untie-embeddings-and-output-weights")
    if ddp is not None and ddp.overlap_grad_reduce:
        raise ValueError(
            "PACI with tied input/output embeddings does not support --overlap-grad-reduce yet "
            "(the last stage sends its output-layer gradient before the data-parallel "
            "reduction, which --overlap-grad-reduce starts during the backward); drop "
            "--overlap-grad-reduce or add --untie-embeddings-and-output-weights")


def stage_local_groups(pg: ProcessGroupCollection, solo) -> ProcessGroupCollection:
    """``pg`` with a one-rank embedding group: finalize_model_grads then skips the tied
    embedding all-reduce between the first and last stage (an embd of None would make it
    look the global one up again); ``tied.py`` replaces that all-reduce."""
    out = ProcessGroupCollection()
    for name in ("tp", "pp", "cp", "pos_embd", "dp_cp"):
        setattr(out, name, getattr(pg, name))
    out.embd = solo
    return out


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


def stage_grad_stats_group(optimizer) -> Any:
    """Grad-norm / found-inf reductions restricted to this stage (tensor x data parallel for
    the distributed optimizer, whose grads are sharded over data parallel; tensor otherwise)."""
    if getattr(optimizer.config, "use_distributed_optimizer", False):
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return parallel_state.get_tensor_model_parallel_group()


class WeightChange:
    """The relative weight change of a local step, ||w_new - w_old|| / ||w_old||, estimated on
    a fixed strided sample of about 256 entries per parameter (no copy of the weights), and
    averaged over the steps since the last ``take``."""

    SAMPLE = 256

    def __init__(self):
        self._old: list = []
        self._sum = 0.0
        self._count = 0

    def _sample(self, params) -> list:
        return [p.detach().reshape(-1)[::max(1, p.numel() // self.SAMPLE)].float().clone()
                for p in params]

    def before(self, params) -> None:
        self._old = self._sample(params)

    def after(self, params) -> None:
        new = self._sample(params)
        moved = sum(float((n - o).square().sum()) for n, o in zip(new, self._old))
        size = sum(float(o.square().sum()) for o in self._old)
        self._sum += (moved / size) ** 0.5 if size > 0 else 0.0
        self._count += 1
        self._old = []

    def take(self) -> float:
        mean = self._sum / self._count if self._count else 0.0
        self._sum, self._count = 0.0, 0
        return mean


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def scale_grads(model, factor: float) -> None:
    """Scale the stage's accumulated gradients in place (Megatron's DDP buffers)."""
    if factor != 1.0:
        model.scale_gradients(factor)


def first_moment(inner, param) -> Optional[torch.Tensor]:
    """The optimizer's momentum of ``param`` in the gradient's units, None before its first
    step: Adam's exp_avg, SGD's momentum_buffer (TE's FusedAdam may keep it scaled)."""
    state = inner.state.get(param)
    if not state:
        return None
    if "exp_avg" in state:
        m = state["exp_avg"]
        if m.dtype != param.grad.dtype and hasattr(inner, "get_unscaled_state"):
            m = inner.get_unscaled_state(param, "exp_avg")
        return m
    return state.get("momentum_buffer")


def subtract_momentum(inner, coefficient: float) -> None:
    """--paci-stale-grad-correction: g -= coefficient x lr x m, per param group (the LR of
    the step about to be taken; stale_correction.py says why)."""
    for group in inner.param_groups:
        kappa = coefficient * group["lr"]
        for param in group["params"]:
            m = None if param.grad is None else first_moment(inner, param)
            if m is not None:
                param.grad.sub_(m.to(param.grad.dtype), alpha=kappa)


@contextlib.contextmanager
def momentum_corrected(optimizer, coefficient: float):
    """Correct the gradients inside ``optimizer.step()``, right before each inner step: after
    Megatron unscaled, checked and clipped them, and only if it steps at all."""
    if not coefficient:
        yield
        return
    inners = [opt.optimizer for opt in _sub_optimizers(optimizer)
              if getattr(opt, "optimizer", None) is not None]

    def corrected(inner, step):
        def run(*args, **kwargs):
            subtract_momentum(inner, coefficient)
            return step(*args, **kwargs)
        return run

    own = [inner.__dict__.get("step") for inner in inners]  # an instance's own step, if any
    for inner in inners:
        inner.step = corrected(inner, inner.step)  # shadows the class's step for this call
    try:
        yield
    finally:
        for inner, step in zip(inners, own):
            if step is None:
                del inner.step
            else:
                inner.step = step


class PaciRuntime:
    """Keeps one never-flushing pipeline stream across forward-backward calls.

    kind="paci" runs PACI; kind="flush" runs the same executor on the flush baseline (stock
    1F1B with a drain before each step), which must equal stock Megatron bit for bit.
    ``sync_calls`` K (--paci-sync-iters): a PACI runtime runs its first K training calls as
    stock 1F1B (the flush plan with one step per call), then PACI.
    """

    def __init__(self, *, accumulation: int, kind: str = "paci", max_drift: Optional[int] = None,
                 on_nonfinite: str = "skip", sync_calls: int = 0,
                 adaptive: Optional[Adaptive] = None, stale_grad_weight: float = 1.0,
                 stale_grad_correction: float = 0.0):
        if kind not in ("paci", "flush"):
            raise ValueError(f"unknown runtime kind {kind!r}")
        self.kind = kind
        self.accumulation = accumulation
        if on_nonfinite not in ("skip", "abort"):
            raise ValueError(f"--paci-on-nonfinite must be skip or abort, got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.max_drift = max_drift
        self.skipped_steps = 0
        self.gathers_params = False  # --overlap-param-gather: see param_gather.py
        self.accumulation_follows = False  # a = M when M changes (use_microbatches)
        self.optimizer = None
        self.lr_scheduler = None
        self.lr_increment = None
        self.plan: Optional[StreamPlan] = None
        self.call_index = 0
        self.sync_calls = sync_calls
        self.calls_done = 0  # training calls since the start of the run (drains keep it)
        self._stock_grad_groups: list = []
        self.state = StageState()
        self.data: Optional[ReplayIterator] = None
        self.steps: List[StepRecord] = []
        self._model = None
        self._params: tuple = ()
        self.fresh_weights = True
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.num_stages = pp
        self.is_first = self.stage == 0
        self.is_last = self.stage == pp - 1
        bound = drift_bound(pp, self.stage, accumulation) if kind == "paci" else 0
        if kind == "paci":
            check_max_drift(pp, accumulation, max_drift)
        self.drift = DriftStats(self.stage, bound if max_drift is None else max_drift)
        self.max_drift = max_drift
        self.pg = pipeline_groups()
        self.p2p: Optional[P2PCommunicator] = None
        # --paci-accumulation-factor auto: ``accumulation`` stays the base that lr_increment
        # counts (N); ``factor`` is the a in force
        self.adaptive = adaptive if kind == "paci" else None
        self.factor = adaptive.current if self.adaptive else accumulation
        self._pending = None  # (all-reduce work, its tensor, the call it applies from)
        self._change = WeightChange() if self.adaptive else None
        self.call_drift: Dict[int, int] = {}  # --paci-accumulation-factor auto: call -> max
        self.tied: Optional[TiedEmbedding] = None  # the tied-weight exchange of this stream
        self.tied_histogram: Counter = Counter()  # last stage: staleness -> micro-batches
        self._stage_pg: Optional[ProcessGroupCollection] = None
        self.meta: Optional[GradMeta] = None  # --fp16 / --calculate-per-token-loss
        self._loss_scale: Optional[float] = None  # read once per step (a device sync on GPU)
        # --paci-stale-grad-weight: None leaves gradients as plain PACI sums them
        self.stale = (StaleGradWeights(stale_grad_weight)
                      if kind == "paci" and stale_grad_weight != 1.0 else None)
        # --paci-stale-grad-correction: None leaves the optimizer's gradients as they are
        self.correction = (StaleGradCorrection(stale_grad_correction)
                           if kind == "paci" and stale_grad_correction else None)

    # wiring ----------------------------------------------------------------------------------
    def bind(self, optimizer, lr_scheduler=None, lr_increment: Optional[int] = None) -> None:
        """Attach the stage's optimizer; PACI's grad-norm / found-inf stay in the stage."""
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.lr_increment = lr_increment
        self._stock_grad_groups = [getattr(opt, "grad_stats_parallel_group", None)
                                   for opt in _sub_optimizers(optimizer)]
        self._use_stage_grad_stats(self.kind == "paci")

    def _use_stage_grad_stats(self, stage_local: bool) -> None:
        """PACI reduces grad norm / found-inf within the stage; stock 1F1B (and the sync
        warm-up) over all stages, as Megatron does."""
        group = stage_grad_stats_group(self.optimizer) if stage_local else None
        for opt, stock in zip(_sub_optimizers(self.optimizer), self._stock_grad_groups):
            if group is not None:
                opt.grad_stats_parallel_group = group
            elif stock is not None:
                opt.grad_stats_parallel_group = stock
            elif hasattr(opt, "grad_stats_parallel_group"):
                del opt.grad_stats_parallel_group  # Megatron's default: the model-parallel group

    def _next_kind(self) -> str:
        """"flush" during the sync warm-up (--paci-sync-iters), else this runtime's kind."""
        return "flush" if self.kind == "paci" and self.calls_done < self.sync_calls else self.kind

    def _next_plan(self, per_call: int) -> StreamPlan:
        """The warm-up runs the flush plan with one step per call: stock 1F1B (loss scaled by
        1/N, LR advanced by the whole batch, grad norm over all stages)."""
        if self._next_kind() != self.kind:
            return plan_stream("flush", self.num_stages, per_call, per_call)
        return plan_stream(self.kind, self.num_stages, self.factor, per_call)

    def _lr_increment_now(self) -> Optional[int]:
        """``lr_increment`` counts the samples of ``accumulation`` backwards; a step of the
        sync warm-up closes a whole batch."""
        if self.lr_increment is None:
            return None
        return self.lr_increment * self.plan.accumulation // self.accumulation

    def resume_at(self, iteration: int, per_call: int) -> None:
        """After --load at ``iteration``: the calls and local steps already taken."""
        self.calls_done = iteration
        sync = min(iteration, self.sync_calls) if self.kind == "paci" else 0
        self.drift.version = sync + (iteration - sync) * (per_call // self.accumulation)

    def describe_peers(self, actions) -> str:
        """'pipeline stage 2 (global rank 5)' for the neighbours these actions talk to."""
        group = self.pg.pp
        stages = sorted({self.stage + (1 if op in (Op.SEND_F, Op.RECV_B) else -1) for op in actions})
        return " and ".join(
            f"pipeline stage {s} (global rank {torch.distributed.get_global_rank(group, s)})"
            for s in stages)

    @property
    def primed(self) -> bool:
        """True between a training call and the next drain (forwards may be in flight)."""
        return self.plan is not None

    @property
    def in_flight(self) -> int:
        return self.state.in_flight()

    # grad accumulation -------------------------------------------------------------------------
    @contextlib.contextmanager
    def grad_sync(self, enabled: bool):
        """DDP reduces grads only on the backward that closes a group (as stock does for the
        last micro-batch of a batch)."""
        if enabled:
            yield
            return
        ctx = self._model.no_sync() if hasattr(self._model, "no_sync") else contextlib.nullcontext()
        with ctx:
            yield

    def local_step(self, mb: int) -> None:
        """This stage's optimizer (and LR) step; reductions stay within the stage for PACI."""
        if self.optimizer is None:
            raise RuntimeError("PaciRuntime.bind(optimizer, ...) must be called before training")
        model = self._model
        tied = self.tied
        coefficient = self._correction_now()  # before _finish_grads resets the weights' group
        self._finish_grads(model)
        # fp16: the loss scaler checks for overflow (over the stage's grad-stats group), skips
        # and backs off, as stock; an overflow is routine there, not an error
        scaler = self.meta is not None and self.meta.fp16
        if scaler or grads_are_finite(model, stage_grad_stats_group(self.optimizer)):
            if self._change is not None:
                self._change.before(self._params)
            with self._keep_versions_if_in_flight(), \
                    momentum_corrected(self.optimizer, coefficient):
                ok, grad_norm, _zeros = self.optimizer.step()
            if scaler and not ok:
                self.skipped_steps += 1
            if self._change is not None:
                self._change.after(self._params)
            if self.gathers_params and not param_gather.pre_hooks_enabled(model):
                param_gather.complete_param_gather(model)  # no forward pre-hook would
        else:
            self.skip_nonfinite_step(mb)
            ok, grad_norm = False, float("nan")
        if tied is not None and tied.is_owner:  # also after a skipped step: both count alike
            tied.send_weight()
        elif tied is not None:
            tied.after_last_step()
        lr = None
        if ok and self.lr_scheduler is not None:
            self.lr_scheduler.step(increment=self._lr_increment_now())
        if self.lr_scheduler is not None:
            lr = self.optimizer.param_groups[0]["lr"]
        model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.fresh_weights = True
        self._loss_scale = None  # the scaler may have grown or backed off
        self.steps.append(StepRecord(mb, bool(ok), None if grad_norm is None else float(grad_norm), lr))

    def _correction_now(self) -> float:
        """--paci-stale-grad-correction: K x the mean drift of the group about to be applied,
        weighted as its gradients are."""
        if self.correction is None:
            return 0.0
        mean = self.stale.mean_drift if self.stale else self.drift.group_mean_drift
        return self.correction.coefficient(mean)

    def _finish_grads(self, model) -> None:
        """Weigh the group's gradients (--paci-stale-grad-weight), add the tied output-layer
        gradient, reduce over data-parallel ranks and normalise per token, all stage-local."""
        tied = self.tied
        owner = tied is not None and tied.is_owner
        per_token = self.meta is not None and self.meta.per_token
        weights = self.stale.at_step(renormalize=not per_token) if self.stale else 1.0
        if owner:  # before the last stage's output-layer gradient joins (no overlap with tied)
            scale_grads(model, weights)
            tied.add_output_grad()
        pg = self._stage_pg if tied is not None else self.pg
        get_model_config(model).finalize_model_grads_func([model], None, pg_collection=pg)
        if not owner:  # after the reduction, which --overlap-grad-reduce may still be running
            scale_grads(model, weights)
        if per_token:
            self.meta.divide_by_tokens(model, self.pg.dp_cp)
        if tied is not None and not tied.is_owner:
            tied.before_last_step()

    def loss_scale(self) -> float:
        """This stage's current loss scale (1 without a scaler); it changes only at a step."""
        if self._loss_scale is None:
            scale = self.optimizer.get_loss_scale() if self.optimizer is not None else None
            self._loss_scale = 1.0 if scale is None else float(scale)
        return self._loss_scale

    def _keep_versions_if_in_flight(self):
        """Only graphs of in-flight forwards hold the weights; with none (P=1, the last
        stage, a flush) the step may bump the counters, as stock's does."""
        if not self.state.outputs:
            return contextlib.nullcontext()
        return keep_version_counters(self._params)

    def skip_nonfinite_step(self, mb: int) -> None:
        """A NaN/Inf gradient reached this stage's step: skip the update (default) or stop."""
        self.skipped_steps += 1
        where = (f"stage {self.stage}: non-finite gradient at the local step after micro-batch "
                 f"{mb} (step {self.drift.version + 1})")
        if self.on_nonfinite == "abort":
            raise FloatingPointError(f"{where}; stopping (--paci-on-nonfinite abort)")
        print(f"[paci] {where}; update skipped ({self.skipped_steps} so far)", flush=True)

    # the forward-backward function -------------------------------------------------------------
    def _start(self, model, data_iterator, num_microbatches: int, seq_length: int,
               micro_batch_size: int, decoder_seq_length: Optional[int]) -> None:
        config = get_model_config(model)
        if config.finalize_model_grads_func is None:
            config.finalize_model_grads_func = finalize_model_grads
        if self.kind == "paci":
            check_no_cross_stage_grad_reduction(model, self.pg)
            if getattr(config, "layernorm_zero_centered_gamma", False):
                raise ValueError(ZERO_CENTERED_GAMMA)
        self.plan = self._next_plan(num_microbatches)
        self._use_stage_grad_stats(self.plan.kind == "paci")
        self.meta = grad_meta_for(config, self.optimizer)
        self._loss_scale = None  # a --load may have brought another scale
        self.call_index = 0
        self._model = model
        self.tied = self._tied_exchange(model)
        self._params = tuple(model.parameters())
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
        model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _tied_exchange(self, model) -> Optional[TiedEmbedding]:
        """Stage 0 and the last stage of a PACI plan with tied embeddings exchange the tied
        weight's gradient and values point to point (``tied.py``); stock plans (the flush
        baseline, the --paci-sync-iters warm-up) keep Megatron's all-reduce."""
        if self.plan.kind != "paci" or self.num_stages == 1 or shared_weight(model) is None:
            return None
        if self.adaptive is not None:
            raise ValueError("--paci-accumulation-factor auto does not support tied embeddings "
                             "yet; add --untie-embeddings-and-output-weights")
        if self.meta is not None and self.meta.fp16:
            raise ValueError("PACI with tied embeddings does not support fp16 loss scaling yet "
                             "(the output layer's gradient reaches stage 0 at the last stage's "
                             "scale); use bf16, or add --untie-embeddings-and-output-weights")
        if self._stage_pg is None:
            solo = torch.distributed.new_group([torch.distributed.get_rank()],
                                               use_local_synchronization=True)
            self._stage_pg = stage_local_groups(self.pg, solo)
        return TiedEmbedding(model=model, optimizer=self.optimizer, stage=self.stage,
                             num_stages=self.num_stages, accumulation=self.accumulation,
                             group=self.pg.embd, histogram=self.tied_histogram)

    @contextlib.contextmanager
    def _current_tied_weight(self):
        """Evaluation without a drain: the last stage reads stage 0's current tied weight
        (already sent; kept for the steps that install it) and gets its lagging copy back."""
        latest = self.tied.latest_for_eval() if self.tied is not None else None
        if latest is None:
            yield
            return
        weight = self.tied.weight
        lagging = weight.detach().clone()
        with torch.no_grad():
            weight.data.copy_(latest)
        try:
            yield
        finally:
            with torch.no_grad():
                weight.data.copy_(lagging)

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
            stock = STOCK_GET_FORWARD_BACKWARD_FUNC()
            with self._current_tied_weight():
                return stock(forward_step_func=forward_step_func, data_iterator=data_iterator,
                             model=[model], num_microbatches=num_microbatches,
                             seq_length=seq_length, micro_batch_size=micro_batch_size,
                             decoder_seq_length=decoder_seq_length,
                             forward_only=True, collect_non_loss_data=collect_non_loss_data,
                             first_val_step=first_val_step)
        if self.plan is not None and self.plan.kind != self._next_kind():
            self.plan = None  # end of the sync warm-up: the flush call left the pipeline empty
        if self.plan is None:
            self._start(model, data_iterator, num_microbatches, seq_length, micro_batch_size,
                        decoder_seq_length)
        elif model is not self._model or num_microbatches != self.plan.per_call:
            raise RuntimeError("the model or number of micro-batches changed while micro-batches "
                               "were in flight; call drain() first")
        elif data_iterator is not self.data.base:
            raise RuntimeError("the data iterator changed while micro-batches were in flight; "
                               "call drain() first")
        if self.adaptive is not None:
            self._adapt_before_call()
        store: list = []
        handlers = MegatronHandlers(self, forward_step_func=forward_step_func, data=self.data,
                                    model=model, tensor_shape=self.tensor_shape,
                                    forward_data_store=store)
        actions = self.plan.call(self.call_index)[self.stage]
        before = dict(self.drift.histogram) if self.adaptive is not None else None
        StageExecutor(self.stage, handlers, self.drift).run(actions)
        handlers.reap_sends(wait=True)
        self.call_index += 1
        self.calls_done += 1
        if self.adaptive is not None:
            self._adapt_after_call(before)
        return store

    # --paci-accumulation-factor auto -----------------------------------------------------------
    def _adapt_before_call(self) -> None:
        """Apply a decision that is due (every rank applies it at the same call), swap in the
        plan of the new a (same messages, steps elsewhere) and set the drift guard to the bound
        of this call: the smaller a's while micro-batches forwarded under it are in flight."""
        ad = self.adaptive
        if self._pending is not None and self._pending[2] <= self.calls_done:
            work, signal, _ = self._pending
            work.wait()
            self._pending = None
            ad.current = ad.decide(float(signal.item()))
        if self.plan.kind == "paci" and ad.current != self.plan.accumulation:
            self.factor = ad.current
            self.plan = plan_stream("paci", self.num_stages, self.factor, self.plan.per_call)
        factor = self.plan.accumulation
        ad.record_call(self.calls_done, factor)
        if self.max_drift is None and self.plan.kind == "paci":
            self.drift.bound = bound_in_call(self.num_stages, self.stage, self.plan.per_call,
                                             ad.factors, self.calls_done)

    def _adapt_after_call(self, before: Dict[int, int]) -> None:
        """Record this call's largest drift; every ``interval`` calls send this stage's
        staleness into a non-blocking MAX all-reduce over all ranks (applied two calls later:
        see ``adapt.Adaptive``)."""
        ad = self.adaptive
        grown = [d for d, n in self.drift.histogram.items() if n > before.get(d, 0)]
        self.call_drift[self.calls_done - 1] = max(grown, default=0)
        if self._pending is not None or not ad.request_due(self.calls_done) \
                or self._next_kind() != "paci":
            return
        value = staleness(self._change.take(), self.num_stages, self.stage)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        signal = torch.tensor([value], dtype=torch.float64, device=device)
        work = torch.distributed.all_reduce(signal, op=torch.distributed.ReduceOp.MAX,
                                            async_op=True)
        self._pending = (work, signal, self.calls_done + 1)

    def drain(self) -> int:
        """Bring the stage to a clean state at the last group boundary: forwards still in
        flight are dropped and their data is served again by the next forwards, so what follows
        is as if the schedule had flushed here. Touches no other stage. Returns the number of
        micro-batches dropped."""
        if self.plan is None:
            return 0
        if self._pending is not None:  # every rank sent its part: finishing it waits on none
            self._pending[0].wait()
        dropped = self.drift.forget_in_flight()
        if self.data is not None:
            self.data.rewind(dropped)
        if self.state.pending_sends:
            raise RuntimeError("drain with sends still pending (drain between calls only)")
        if self.tied is not None:
            self.tied.drain()  # the last stage catches up: both copies bit-identical
            self.tied = None
        self.state = StageState()
        self.plan = None
        if self.gathers_params:  # a checkpoint or the final weights read every shard
            param_gather.complete_param_gather(self._model)
        if self.meta is not None:
            self.meta.group_tokens = 0  # a drain stops at a group boundary: nothing counted
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
            self.factor = accumulation  # the a of the next plan (auto is refused with a ramp)
            if self.kind == "paci" and self.max_drift is None:
                self.drift.bound = max(self.drift.bound,
                                       drift_bound(self.num_stages, self.stage, accumulation))
        return dropped

    # reporting ---------------------------------------------------------------------------------
    def tied_digest(self) -> Optional[str]:
        """SHA-256 of this stage's tied-weight copy (see tied.tied_sha256); None if it holds
        none or has not trained yet."""
        if self._model is None or self.optimizer is None:
            return None
        return tied_sha256(self._model, self.optimizer)

    def drift_summary(self) -> dict:
        row = {"stage": self.stage, "max": self.drift.max, "bound": self.drift.bound,
               "histogram": dict(sorted(self.drift.histogram.items())),
               "steps": self.drift.version, "skipped_steps": self.skipped_steps}
        if self.adaptive is not None:  # a per call, as (first call, a) runs; max drift per call
            row["factor_changes"] = list(self.adaptive.changes)
            row["call_drift"] = [self.call_drift.get(k) for k in range(self.calls_done)]
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
