"""One stage's action handlers: each action of the lists becomes Megatron-Core's
``forward_step``, ``backward_step``, ``P2PCommunicator`` traffic, a tied-weight message, or one
of the group-closing actions of ``local_step.py``."""

from __future__ import annotations

from typing import Dict, List, Sequence

from megatron.core.pipeline_parallel import schedules as mcore_schedules

from ..executor import ReplayIterator
from ..schedule import Action, Op, exchanges
from . import aux_losses, compat, local_step


class PeerFailure(RuntimeError):
    """A send or receive with a neighbouring stage failed: that stage most likely died."""

    def __init__(self, peers: str, exc: Exception):
        super().__init__(f"communication with {peers} failed ({exc}); that stage most likely "
                         "died or raised: its own log says why")


class MegatronHandlers:
    """Turns schedule actions into Megatron-Core calls for the local pipeline stage."""

    def __init__(self, runtime, *, forward_step_func, data: ReplayIterator, forward_data_store):
        self.rt = runtime
        self.forward_step_func = forward_step_func
        self.data = data
        self.store = forward_data_store
        self.state = runtime.state

    # compute
    def forward(self, mb: int) -> None:
        rt, state = self.rt, self.state
        self.data.current = mb
        for feature in rt.features:
            feature.before_forward(rt.ctx, mb)
        rt.forward_time.start()
        output, num_tokens = mcore_schedules.forward_step(
            self.forward_step_func, self.data, rt.model, rt.plan.accumulation,
            state.inputs.get(mb), self.store, rt.model_config,
            cp_group_size=rt.pg.cp.size(),
            # weights changed (a step, or a feature moved them): refresh caches
            is_first_microbatch=rt.fresh_weights or rt.ctx.weights_moved,
            current_microbatch=mb, is_last_stage=rt.is_last,
        )
        rt.forward_time.stop()
        rt.ctx.weights_moved = False
        for feature in rt.features:
            feature.after_forward(rt.ctx, mb)
        rt.fresh_weights, rt.ctx.weights_moved = rt.ctx.weights_moved, False
        state.outputs[mb] = output
        if rt.meta is not None and rt.is_last:
            state.tokens[mb] = num_tokens

    def backward(self, mb: int) -> None:
        rt, state = self.rt, self.state
        self.finish_send_of(mb)  # long done: the next stage already sent this one's gradient
        if rt.meta is not None:
            rt.meta.before_backward(state, mb, rt.loss_scale(), is_first=rt.is_first,
                                    is_last=rt.is_last)
        if rt.aux_losses:  # their scale for this micro-batch, not the latest forward's
            aux_losses.set_for_backward(rt.model_config, rt.plan.accumulation, rt.pg.cp.size())
        with rt.grad_sync(enabled=rt.plan_closes_group(mb)):
            grad = compat.backward_step(
                state.inputs.pop(mb, None), state.outputs.pop(mb), state.output_grads.pop(mb, None),
                rt.model_type, rt.model_config,
            )
        self.data.release(mb)
        if not rt.is_first:
            state.input_grads[mb] = grad

    # the group-closing actions
    def reduce(self, mb: int) -> None:
        local_step.finish_grads(self.rt)

    def step(self, mb: int) -> None:
        local_step.take_step(self.rt, mb)

    # the tied weight
    def send_tied_grad(self, mb: int) -> None:
        self.rt.tied.send_output_grad()

    def recv_tied_grad(self, mb: int) -> None:
        """Received here; the R that follows adds it (``TiedEmbedding.after_reduction``)."""
        self.rt.tied.receive_output_grad()

    def send_tied_weight(self, mb: int) -> None:
        self.rt.tied.send_weight()

    def recv_tied_weight(self, mb: int) -> None:
        self.rt.tied.install_weight(mb)

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
        rt, state = self.rt, self.state
        send_next = batch.get(Op.SEND_F)
        send_prev = batch.get(Op.SEND_B)
        out = state.outputs[send_next.mb] if send_next else None
        grad = state.input_grads.pop(send_prev.mb) if send_prev else None
        wait_all = bool(rt.model_config.batch_p2p_comm)  # batched p2p must complete together
        try:
            recv_prev, recv_next, reqs = rt.p2p._communicate(
                tensor_send_next=out, tensor_send_prev=grad,
                recv_prev=Op.RECV_F in batch, recv_next=Op.RECV_B in batch,
                tensor_shape=rt.tensor_shape, wait_on_reqs=wait_all,
            )
            reqs = reqs or {}
            for key in ("recv_prev", "recv_next"):
                if key in reqs:
                    reqs[key].wait()
            meta = rt.meta
            if meta is not None and send_prev:  # posted after the gradient on both sides
                state.pending_sends.append(
                    meta.send(state.meta_out.pop(send_prev.mb), rt.p2p.prev_rank, rt.pg.pp)
                    + (Op.SEND_B,))
            if meta is not None and Op.RECV_B in batch:
                state.meta_in[batch[Op.RECV_B].mb] = meta.receive(rt.p2p.next_rank, rt.pg.pp)
        except RuntimeError as exc:
            raise PeerFailure(rt.describe_peers(batch), exc) from exc
        if Op.RECV_F in batch:
            state.inputs[batch[Op.RECV_F].mb] = recv_prev
        if Op.RECV_B in batch:
            state.output_grads[batch[Op.RECV_B].mb] = recv_next
        if "send_next" in reqs:
            state.pending_sends.append((reqs["send_next"], out, Op.SEND_F))
        elif out is not None:
            mcore_schedules.deallocate_output_tensor(out, rt.model_config.deallocate_pipeline_outputs)
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
                    tensor, self.rt.model_config.deallocate_pipeline_outputs)
        self.state.pending_sends = still

    def wait_sends(self, sends: List[tuple]) -> None:
        for work, tensor, op in sends:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerFailure(self.rt.describe_peers([op]), exc) from exc
            if tensor is not None:
                mcore_schedules.deallocate_output_tensor(
                    tensor, self.rt.model_config.deallocate_pipeline_outputs)
