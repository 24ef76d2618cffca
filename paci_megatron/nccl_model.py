"""What a Schedule's lists do on NCCL, as Megatron-Core 0.16.1 and torch's ProcessGroupNCCL
drive it: which communicator each message takes, the CUDA stream it runs on, when the host
blocks (a communicator built or a pair connected on first use, a synchronize), and what each
stream waits for. ``NcclModel`` lists the rules and their sources; its defaults are the
settings PACI's runtime uses on NCCL, ``NcclModel(batch_sync=True, warmed=False)`` what it
gets from Megatron and torch without them. The machine the lists run on is
``nccl_world.py``; the start-up exchange that connects every communicator first is
``nccl_warmup.py``. Pure Python, no torch."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, List, Optional, Sequence, Set, Tuple

from .lockstep import Costs, Event
from .nccl_world import CommOp, NcclWorld, Note, PipelineComms, Run, Wait, drive
from .schedule import (TIED_OPS, Action, Op, Schedule, StreamPlan, exchanges, install_step,
                       work_items)


@dataclass(frozen=True)
class NcclModel:
    """How a stage's actions meet NCCL. Each rule names what it models; "MC" is
    Megatron-Core 0.16.1's ``pipeline_parallel/p2p_communication.py``, "PGNCCL" torch's
    ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``.

    1. Host and device. A stage's host posts its actions in list order; its device runs them
       on the compute stream in that order. A wait for a communication (``Work.wait()``)
       makes the compute stream wait for the work's end event, not the host (PGNCCL
       ``WorkNCCL::wait``, unless ``TORCH_NCCL_BLOCKING_WAIT`` is set). The host blocks only
       where rules 5, 6, 7, 10 and 12 say.
    2. Exchanges. The executor hands each run of consecutive point-to-point actions to the
       runtime, which splits it into exchanges (``schedule.exchanges``), one
       ``P2PCommunicator._communicate`` each (``mcore/handlers.py``).
    3. ``batched`` (``batch_p2p_comm``, what ``mcore/build.py`` sets on NCCL): an exchange is
       one ``batch_isend_irecv`` (MC ``_batched_p2p_ops``), one NCCL group whose operations
       progress independently (NCCL user guide, "Point-to-point communication");
       ``_communicate`` waits for all of them (``wait_on_reqs``).
    4. Unbatched (MC ``_p2p_ops``): one ``isend``/``irecv`` per operation, even stages
       posting send-next, recv-prev, send-prev, recv-next, odd stages recv-prev, send-next,
       recv-next, send-prev; at P = 2 the backward direction goes over the WORLD group. The
       stream waits for the exchange's receives; for its sends once the next exchange is
       posted (``MegatronHandlers.communicate``), before the backward of that micro-batch
       (``finish_send_of``) and at the end of the call (``reap_sends``).
    5. ``batch_sync`` (``batch_p2p_sync``, True by default in ``ModelParallelConfig``, which
       nothing in ``mcore/`` changes): a batched ``_communicate`` ends with
       ``torch.cuda.synchronize()``, Megatron's guard against a ``batch_isend_irecv`` race
       that torch fixed in PR 82450 (2022: the work now waits for the streams recorded after
       ``ncclGroupEnd``).
    6. ``shapes`` (``variable_seq_lengths``): before its data every exchange runs a batched
       shape exchange of the same operations, then ``torch.cuda.synchronize()`` and reads
       the shapes on the host (MC ``_communicate_shapes``, unconditionally).
    7. A device-wide synchronize (``cudaDeviceSynchronize``) blocks the host until every
       operation its rank posted has completed, on every stream: the compute stream and
       every communicator's, the tied messages included. ``sync_anywhere``: one may come
       after any action and at any call end (the caching allocator's ``cudaFree`` when it
       retries after running out of memory, ``torch.cuda.empty_cache()``, which Megatron-LM's
       ``train_step`` calls between calls with ``--empty-unused-memory-level``). A run safe
       with it is safe with any placement of syncs and waits, since each only adds waits.
    8. Streams. Each communicator has one CUDA stream per rank (PGNCCL ``ncclStreams_``,
       ``pointToPoint``); each posted operation (unbatched) or group (batched) is one kernel
       on it, which starts once the compute stream has reached the posting point (PGNCCL
       ``syncStream``) and the stream's previous kernel has finished. NCCL pairs a sender's
       and a receiver's operations on one communicator in posting order, and a send
       completes only once its receive runs (messages larger than NCCL's buffers, as
       activations and tied weights are; a small one may finish early, which only removes
       waits).
    9. Which communicator (PGNCCL ``pointToPoint``, since PR 132900 of 2024). Built lazily
       (``eager`` False: no ``device_id`` to ``init_process_group``, as Megatron-LM's
       ``_initialize_distributed`` under the drop-in), a batched operation uses its group's
       communicator, an unbatched one a 2-rank communicator of its pair. ``eager``
       (``device_id`` given, as ``mcore/distributed.py`` does on NCCL: the default group
       binds the device and every ``new_group`` builds its communicator at once,
       ``distributed_c10d._new_process_group_helper``): every point-to-point operation uses
       its group's communicator, unbatched ones included.
    10. First use blocks the host. A lazily built communicator is created by the first
        operation of each member, which blocks until every member has reached its own
        (``ncclCommInitRank`` is collective; PR 74701: a batched first call needs the whole
        group). NCCL also connects a sender to a receiver on the first operation between
        them, each host blocking in ``ncclGroupEnd`` until the other has reached its own
        (NCCL ``src/transport.cc``, ``ncclTransportP2pSetup``, a ``bootstrapSend`` and
        ``bootstrapRecv`` with the peer); eager creation does not connect pairs (torchcomms
        issue 20). ``warmed``: the start-up exchange (``warmup_programs``) has created and
        connected every communicator the run uses, so nothing in the stream blocks on a
        first use.
    11. Tied messages (SG/RG, SW/RW) are plain ``isend``/``irecv`` (``mcore/tied.py``) over
        the embedding group: ``tied_groups`` 1 carries both directions on one communicator
        (Megatron's embedding group), 2 gives each direction its own. The stream waits for
        the gradient's receive (RG) at once, for the weight's (RW) at the step that installs
        it (``schedule.install_step``). A send holds its sender up only at a device-wide
        sync, or at the runtime's own wait for it (``TiedEmbedding._wait_sends``), which
        ``sync_anywhere`` covers.
    12. The host waits for its compute stream at each local step (Megatron's optimizer reads
        the gradient norm and found-inf on the host: ``.item()`` in
        ``clip_grads.get_grad_norm_fp32`` and ``MixedPrecisionOptimizer``) and at the end of
        each call (the training loop reads the losses), after the runtime's wait for its
        pending pipeline sends (rule 4).
    """

    batched: bool = True
    shapes: bool = False
    batch_sync: bool = False
    eager: bool = False
    warmed: bool = True
    tied_groups: int = 1
    sync_anywhere: bool = False

    def __str__(self) -> str:
        default = NcclModel(self.batched, self.shapes)
        extras = [text for name, text in (
            ("batch_sync", "batch_p2p_sync"),
            ("eager", "eager communicators"),
            ("warmed", "no warm-up"),
            ("tied_groups", f"{self.tied_groups} embedding groups"),
            ("sync_anywhere", "device syncs anywhere"),
        ) if getattr(self, name) != getattr(default, name)]
        return (f"NCCL {'batched' if self.batched else 'unbatched'} p2p"
                f"{' with shape exchange' if self.shapes else ''}"
                + "".join(f", {text}" for text in extras))


_CALL_END = None  # marks the end of a forward-backward call in a stage's item list


def _stage_program(world: NcclWorld, comms: PipelineComms, s: int, items: Sequence[object],
                   accumulation: int, host: Dict[int, float], last_posted: Dict[int, str]):
    """One stage's host as a generator: posts its items and yields what it blocks on."""
    model = world.model
    sends: List[CommOp] = []  # unbatched sends not yet waited for
    weights: Deque[CommOp] = deque()  # tied weights whose receive is posted, not installed

    def post(ops: List[CommOp]):
        meetings = world.first_uses(s, ops, host[s])
        if meetings:
            yield meetings
        return world.post(s, ops, host[s])

    def queue(entry: object) -> None:
        world.queue(s, entry, host[s])

    def sync(everything: bool = True):
        return [world.idle(s, everything, host[s])]

    for item in items:
        if item is _CALL_END:
            queue(Wait(sends))
            sends = []
            yield sync(everything=model.sync_anywhere)  # rule 12
            continue
        last_posted[s] = str(item if isinstance(item, Action) else item[-1])
        if isinstance(item, Action) and item.op in TIED_OPS:  # rule 11
            (op,) = yield from post([comms.op(s, item)])
            if item.op is Op.RECV_TIED_WEIGHT:
                weights.append(op)
            elif not op.is_send:
                queue(Wait([op]))
            queue(Note(item))
        elif isinstance(item, Action):
            if item.op is Op.BACKWARD:  # the runtime frees the output: its send must be done
                mine = [op for op in sends if op.action == Action(Op.SEND_F, item.mb)]
                queue(Wait(mine))
                sends = [op for op in sends if op not in mine]
            queue(Run(item))
            if item.op is Op.STEP:
                yield sync(everything=False)  # rule 12
                if weights and item.mb == install_step(weights[0].action.mb,
                                                       comms.num_stages, accumulation):
                    queue(Wait([weights.popleft()]))  # the install after the step
        else:
            earlier, sends = sends, []
            for batch in exchanges(item):
                if model.shapes:  # rule 6
                    queue(Wait((yield from post(
                        [comms.op(s, act, "shape") for act in batch]))))
                    yield sync()
                if model.batched:  # rules 3, 5
                    queue(Wait((yield from post([comms.op(s, act) for act in batch]))))
                    if model.batch_sync:
                        yield sync()
                else:  # rule 4
                    order = _POST_ORDER[s % 2]
                    ops: List[CommOp] = []
                    for act in sorted(batch, key=lambda x: order.index(x.op)):
                        ops += yield from post([comms.op(s, act)])
                    sends += [op for op in ops if op.is_send]
                    queue(Wait([op for op in ops if not op.is_send]))
                for act in batch:
                    queue(Note(act))
            queue(Wait(earlier))
        if model.sync_anywhere:
            yield sync()
    queue(Wait(sends + list(weights)))  # the end of a finite list (a drain)
    yield sync()


_POST_ORDER = {  # _p2p_ops' order for even and odd pipeline ranks
    0: (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B),
    1: (Op.RECV_F, Op.SEND_F, Op.RECV_B, Op.SEND_B),
}


def _run(schedule: Schedule, costs: Costs, model: NcclModel,
         call_ends: Optional[Sequence[Sequence[int]]]) -> NcclWorld:
    P = schedule.num_stages
    world = NcclWorld(model, costs.comm, costs.at)
    comms = PipelineComms(P, model)
    host = {s: 0.0 for s in range(P)}
    last_posted: Dict[int, str] = {}
    programs = {}
    for s, acts in enumerate(schedule.stages):
        bounds = [0] + sorted(call_ends[s] if call_ends else []) + [len(acts)]
        items: List[object] = []
        for lo, hi in zip(bounds, bounds[1:]):
            items += work_items(acts[lo:hi]) + [_CALL_END]
        programs[s] = _stage_program(world, comms, s, items, schedule.accumulation, host,
                                     last_posted)
    drive(world, programs, schedule.name, host, last_posted)
    return world


def run_nccl(schedule: Schedule, costs: Costs = Costs(), model: NcclModel = NcclModel(),
             call_ends: Optional[Sequence[Sequence[int]]] = None) -> List[List[Event]]:
    """Time every action on its stage's compute stream under ``model``'s rules; raises
    DeadlockError naming what each blocked stage waits for. ``call_ends[s]`` lists the
    indices in stage s's list where a forward-backward call ends (rule 12); by default the
    list is one call."""
    world = _run(schedule, costs, model, call_ends)
    return [world.events[s] for s in range(schedule.num_stages)]


def _stream_schedule(plan: StreamPlan, calls: int) -> Tuple[Schedule, List[List[int]]]:
    rows: List[List[Action]] = [[] for _ in range(plan.num_stages)]
    ends: List[List[int]] = [[] for _ in range(plan.num_stages)]
    for k in range(calls):
        for s, acts in enumerate(plan.call(k)):
            rows[s] += acts
            ends[s].append(len(rows[s]))
    stream = Schedule(f"{plan.kind} stream (P={plan.num_stages} a={plan.accumulation} "
                      f"N={plan.per_call}, {calls} calls)", plan.num_stages, plan.accumulation,
                      calls * plan.per_call, tuple(tuple(r) for r in rows), plan.tied)
    return stream, ends


def run_stream_nccl(plan: StreamPlan, calls: int, costs: Costs = Costs(),
                    model: NcclModel = NcclModel()) -> List[List[Event]]:
    """Run the first ``calls`` calls of a stream plan back to back under ``model``, each
    stage waiting for its pending sends at every call end, as the runtime does."""
    stream, ends = _stream_schedule(plan, calls)
    return run_nccl(stream, costs, model, ends)


def channels_used(plan: StreamPlan, calls: int, model: NcclModel = NcclModel()
                  ) -> Set[Tuple[str, Hashable, Hashable]]:
    """(communicator, sender, receiver) of every message the plan's first calls post."""
    stream, ends = _stream_schedule(plan, calls)
    return {(comm.name, a, b) for comm, a, b in _run(stream, Costs(), model, ends).p2p}


