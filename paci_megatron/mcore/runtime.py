"""PACI on Megatron-Core: action handlers and the forward-backward function.

This module and ``build.py`` are the only importers of Megatron internals. The order of work
comes from ``schedule.plan_stream`` (validated by ``simulate``) and is run by
``executor.StageExecutor``; here each action becomes Megatron's ``forward_step``,
``backward_step``, ``P2PCommunicator`` traffic or a stage-local optimizer step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, get_model_type

from ..autograd_versions import keep_version_counters
from ..executor import DriftStats, ReplayIterator, StageExecutor
from ..schedule import Action, Op, StreamPlan, check_max_drift, drift_bound, plan_stream

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
    pending_sends: List[tuple] = field(default_factory=list)  # (work, tensor to free or None)

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
        output, _num_tokens = mcore_schedules.forward_step(
            self.forward_step_func, self.data, self.model, self.rt.accumulation,
            state.inputs.get(mb), self.store, self.config,
            cp_group_size=self.rt.pg.cp.size(),
            is_first_microbatch=self.rt.fresh_weights,  # weights changed: refresh caches
            current_microbatch=mb, is_last_stage=self.rt.is_last,
        )
        self.rt.fresh_weights = False
        state.outputs[mb] = output

    def backward(self, mb: int) -> None:
        state = self.state
        closes_group = (mb + 1) % self.rt.accumulation == 0
        self.finish_send_of(mb)  # long done: the next stage already sent this one's gradient
        with self.rt.grad_sync(enabled=closes_group):
            grad = mcore_schedules.backward_step(
                state.inputs.pop(mb, None), state.outputs.pop(mb), state.output_grads.pop(mb, None),
                self.model_type, self.config,
            )
        self.data.release(mb)
        if not self.rt.is_first:
            state.input_grads[mb] = grad

    def step(self, mb: int) -> None:
        self.rt.local_step(mb)

    # communication
    def communicate(self, actions: Sequence[Action]) -> None:
        batch: Dict[Op, Action] = {}
        for act in actions:
            if act.op in batch:
                self._exchange(batch)
                batch = {}
            batch[act.op] = act
        if batch:
            self._exchange(batch)
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
        except RuntimeError as exc:
            raise PeerFailure(self.rt.describe_peers(batch), exc) from exc
        if Op.RECV_F in batch:
            state.inputs[batch[Op.RECV_F].mb] = recv_prev
        if Op.RECV_B in batch:
            state.output_grads[batch[Op.RECV_B].mb] = recv_next
        if "send_next" in reqs:
            state.pending_sends.append((reqs["send_next"], out))
        elif out is not None:
            mcore_schedules.deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)
        if "send_prev" in reqs:
            state.pending_sends.append((reqs["send_prev"], None))

    def finish_send_of(self, mb: int) -> None:
        output = self.state.outputs.get(mb)
        for work, tensor in self.state.pending_sends:
            if tensor is output and tensor is not None:
                work.wait()
        self.reap_sends(wait=False)

    def reap_sends(self, wait: bool) -> None:
        """Free sent activations whose send completed (all of them if ``wait``)."""
        still = []
        for work, tensor in self.state.pending_sends:
            if wait:
                work.wait()
            elif not work.is_completed():
                still.append((work, tensor))
                continue
            if tensor is not None:
                mcore_schedules.deallocate_output_tensor(
                    tensor, self.config.deallocate_pipeline_outputs)
        self.state.pending_sends = still


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
    """finalize_model_grads crosses stages only for tied word embeddings (first <-> last stage)
    and for position embeddings split over stages; PACI refuses both instead of stalling."""
    if pg.pp.size() == 1:
        return
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    if getattr(inner, "share_embeddings_and_output_weights", False):
        raise ValueError(
            "PACI with tied input/output embeddings would all-reduce their gradients between "
            "the first and last stage at every step, stalling the pipeline; use "
            "--untie-embeddings-and-output-weights")
    if pg.pos_embd is not None and pg.pos_embd.size() > 1:
        raise ValueError("PACI does not support position embeddings shared across stages")


def grads_are_finite(model, group) -> bool:
    """One reduction per gradient buffer of Megatron's DDP (per parameter without one), then
    agreed on over ``group`` (the stage's grad-stats group), so that the tensor- and
    data-parallel ranks of a stage all skip or all step."""
    buffers = [b.grad_data for b in getattr(model, "buffers", [])]
    if not buffers:
        buffers = [getattr(p, "main_grad", p.grad) for p in model.parameters()]
    flags = [torch.isfinite(g).all() for g in buffers if g is not None]
    finite = torch.stack(flags).all().float() if flags else torch.ones(())
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(finite)


def stage_grad_stats_group(optimizer) -> Any:
    """Grad-norm / found-inf reductions restricted to this stage (tensor x data parallel for
    the distributed optimizer, whose grads are sharded over data parallel; tensor otherwise)."""
    if getattr(optimizer.config, "use_distributed_optimizer", False):
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return parallel_state.get_tensor_model_parallel_group()


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


class PaciRuntime:
    """Keeps one never-flushing pipeline stream across forward-backward calls.

    kind="paci" runs PACI; kind="flush" runs the same executor on the flush baseline (stock
    1F1B with a drain before each step), which must equal stock Megatron bit for bit.
    """

    def __init__(self, *, accumulation: int, kind: str = "paci", max_drift: Optional[int] = None,
                 on_nonfinite: str = "skip"):
        if kind not in ("paci", "flush"):
            raise ValueError(f"unknown runtime kind {kind!r}")
        self.kind = kind
        self.accumulation = accumulation
        if on_nonfinite not in ("skip", "abort"):
            raise ValueError(f"--paci-on-nonfinite must be skip or abort, got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self.optimizer = None
        self.lr_scheduler = None
        self.lr_increment = None
        self.plan: Optional[StreamPlan] = None
        self.call_index = 0
        self.state = StageState()
        self.data: Optional[ReplayIterator] = None
        self.steps: List[StepRecord] = []
        self._model = None
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
        self.pg = pipeline_groups()
        self.p2p: Optional[P2PCommunicator] = None

    # wiring ----------------------------------------------------------------------------------
    def bind(self, optimizer, lr_scheduler=None, lr_increment: Optional[int] = None) -> None:
        """Attach the stage's optimizer; PACI's grad-norm / found-inf stay in the stage."""
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.lr_increment = lr_increment
        if self.kind == "paci":
            group = stage_grad_stats_group(optimizer)
            for opt in _sub_optimizers(optimizer):
                opt.grad_stats_parallel_group = group

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
        config = get_model_config(model)
        config.finalize_model_grads_func([model], None, pg_collection=self.pg)
        if grads_are_finite(model, stage_grad_stats_group(self.optimizer)):
            with keep_version_counters(list(model.parameters())):
                ok, grad_norm, _zeros = self.optimizer.step()
        else:
            self.skip_nonfinite_step(mb)
            ok, grad_norm = False, float("nan")
        lr = None
        if ok and self.lr_scheduler is not None:
            self.lr_scheduler.step(increment=self.lr_increment)
        if self.lr_scheduler is not None:
            lr = self.optimizer.param_groups[0]["lr"]
        model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.fresh_weights = True
        self.steps.append(StepRecord(mb, bool(ok), None if grad_norm is None else float(grad_norm), lr))

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
        if config.calculate_per_token_loss and self.kind == "paci":
            raise ValueError("PACI does not support calculate_per_token_loss (its token count "
                             "is broadcast across all pipeline stages at every step)")
        if self.kind == "paci":
            check_no_cross_stage_grad_reduction(model, self.pg)
        self.plan = plan_stream(self.kind, self.num_stages, self.accumulation, num_microbatches)
        self.call_index = 0
        self._model = model
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
            return stock(forward_step_func=forward_step_func, data_iterator=data_iterator,
                         model=[model], num_microbatches=num_microbatches, seq_length=seq_length,
                         micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                         forward_only=True, collect_non_loss_data=collect_non_loss_data,
                         first_val_step=first_val_step)
        if self.plan is None:
            self._start(model, data_iterator, num_microbatches, seq_length, micro_batch_size,
                        decoder_seq_length)
        elif model is not self._model or num_microbatches != self.plan.per_call:
            raise RuntimeError("the model or number of micro-batches changed while micro-batches "
                               "were in flight; call drain() first")
        elif data_iterator is not self.data.base:
            raise RuntimeError("the data iterator changed while micro-batches were in flight; "
                               "call drain() first")
        store: list = []
        handlers = MegatronHandlers(self, forward_step_func=forward_step_func, data=self.data,
                                    model=model, tensor_shape=self.tensor_shape,
                                    forward_data_store=store)
        actions = self.plan.call(self.call_index)[self.stage]
        StageExecutor(self.stage, handlers, self.drift).run(actions)
        handlers.reap_sends(wait=True)
        self.call_index += 1
        return store

    def drain(self) -> int:
        """Bring the stage to a clean state at the last group boundary: forwards still in
        flight are dropped and their data is served again by the next forwards, so what follows
        is as if the schedule had flushed here. Touches no other stage. Returns the number of
        micro-batches dropped."""
        if self.plan is None:
            return 0
        dropped = self.drift.forget_in_flight()
        if self.data is not None:
            self.data.rewind(dropped)
        if self.state.pending_sends:
            raise RuntimeError("drain with sends still pending (drain between calls only)")
        self.state = StageState()
        self.plan = None
        return len(dropped)

    # reporting ---------------------------------------------------------------------------------
    def drift_summary(self) -> dict:
        return {"stage": self.stage, "max": self.drift.max, "bound": self.drift.bound,
                "histogram": dict(sorted(self.drift.histogram.items())),
                "steps": self.drift.version, "skipped_steps": self.skipped_steps}


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
