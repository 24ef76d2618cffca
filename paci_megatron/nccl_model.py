"""What a Schedule's lists do on NCCL, as Megatron-Core 0.16.1 and torch's ProcessGroupNCCL
drive it: which communicator each message takes, the CUDA stream it runs on, when the host
blocks (a communicator built or a pair connected on first use, a synchronize), and what each
stream waits for. ``NcclModel`` lists the rules and their sources; its defaults are the
settings PACI's runtime uses on NCCL, ``NcclModel(batch_sync=True, warmed=False)`` what it
gets from Megatron and torch without them. ``warmup_programs`` is the start-up exchange that
connects every communicator first, ``run_warmup`` runs it under the same rules. Pure Python,
no torch."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import (Callable, Deque, Dict, FrozenSet, Hashable, List, Optional, Sequence, Set,
                    Tuple)

from .lockstep import Costs, DeadlockError, Event, ScheduleError
from .schedule import (SEND_OPS, TIED_OPS, Action, Op, Schedule, StreamPlan, channel, exchanges,
                       install_step, peer, work_items)


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
       (``eager`` False: no ``device_id`` to ``init_process_group``, as
       ``mcore/distributed.py`` does today), a batched operation uses its group's
       communicator, an unbatched one a 2-rank communicator of its pair. ``eager``
       (``device_id`` given: the default group binds the device and every ``new_group``
       builds its communicator at once, ``distributed_c10d._new_process_group_helper``): every
       point-to-point operation uses its group's communicator, unbatched ones included.
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


# --- communicators, streams and matching ----------------------------------------------------

@dataclass(frozen=True)
class Comm:
    """One NCCL communicator: a name, the ranks it spans, and whether the run posts single
    ``isend``/``irecv`` on it (a pair's communicator, the embedding group's)."""

    name: str
    members: FrozenSet[Hashable]
    single: bool = False

    def __str__(self) -> str:
        return self.name


@dataclass(eq=False)
class _Op:
    rank: Hashable
    label: str  # what a deadlock message prints: an action, or a warm-up operation
    comm: Comm
    peer: Optional[Hashable]  # None for a collective
    is_send: bool = False
    action: Optional[Action] = None
    layer: str = "data"
    start: Optional[float] = None  # its kernel runs
    done: Optional[float] = None

    def __str__(self) -> str:
        return self.label


@dataclass(eq=False)
class _Kernel:
    ops: List[_Op]
    ready: Optional[float] = None  # the compute stream reached its posting point
    start: Optional[float] = None


# what a compute stream holds, in order, each with the host time it was queued at
@dataclass(eq=False)
class _Run:
    action: Action


@dataclass(eq=False)
class _Posted:  # the posting point of a kernel (rule 8)
    kernel: _Kernel


@dataclass(eq=False)
class _Wait:  # Work.wait(): the stream waits for these operations (rule 1)
    ops: List[_Op]


@dataclass(eq=False)
class _Note:  # a communication action done on this stream, for the timeline
    action: Action


@dataclass(eq=False)
class _Meeting:
    """First use of a communicator or a pair by ``rank`` (rule 10): done once every other
    party has reached its own."""

    what: str
    parties: FrozenSet[Hashable]
    arrivals: Dict[Hashable, float]

    @property
    def done(self) -> Optional[float]:
        if not self.parties <= set(self.arrivals):
            return None
        return max(self.arrivals.values())

    def __str__(self) -> str:
        missing = sorted(map(str, self.parties - set(self.arrivals)))
        return f"{self.what} (until stage {', '.join(missing)} gets there)"


class _NcclWorld:
    """Each rank's compute stream and communicator streams, their kernels and matching, and
    the first uses its hosts meet at."""

    def __init__(self, model: NcclModel, comm_latency: float,
                 costs: Callable[[Hashable, Action], float] = lambda rank, action: 0.0):
        self.model, self.latency, self.cost = model, comm_latency, costs
        self.compute: Dict[Hashable, Deque[Tuple[float, object]]] = defaultdict(deque)
        self.clock: Dict[Hashable, float] = defaultdict(float)  # compute stream time
        self.finished: Dict[Hashable, float] = defaultdict(float)  # latest op completion
        self.events: Dict[Hashable, List[Event]] = defaultdict(list)
        self.streams: Dict[Tuple[Hashable, Comm], Deque[_Kernel]] = defaultdict(deque)
        self.stream_free: Dict[Tuple[Hashable, Comm], float] = defaultdict(float)
        self.p2p: Dict[tuple, Tuple[Deque[_Op], Deque[_Op]]] = defaultdict(
            lambda: (deque(), deque()))
        self.collectives: Dict[Tuple[Comm, Hashable], Deque[_Op]] = defaultdict(deque)
        self.posted: Dict[Hashable, List[_Op]] = defaultdict(list)
        self.arrivals: Dict[tuple, Dict[Hashable, float]] = defaultdict(dict)

    # the host (rules 1, 10)
    def first_uses(self, rank: Hashable, ops: Sequence[_Op], now: float) -> List[_Meeting]:
        """The meetings ``ops`` block their host at: creating a communicator not built yet,
        connecting a pair not connected yet."""
        if self.model.warmed:
            return []
        meetings = []
        for op in ops:
            keys = []
            if not self.model.eager:
                keys.append((("create", op.comm), op.comm.members, f"creating {op.comm}"))
            if op.peer is None:
                keys.append((("connect", op.comm), op.comm.members, f"connecting {op.comm}"))
            else:
                pair = (rank, op.peer) if op.is_send else (op.peer, rank)
                keys.append((("connect", op.comm) + pair, frozenset(pair),
                             f"connecting {pair[0]}->{pair[1]} on {op.comm}"))
            for key, parties, what in keys:
                if rank not in self.arrivals[key]:
                    self.arrivals[key][rank] = now
                    meetings.append(_Meeting(what, parties, self.arrivals[key]))
        return meetings

    def post(self, rank: Hashable, ops: Sequence[_Op], now: float) -> List[_Op]:
        """Enqueue ``ops`` as one kernel on their communicator's stream of ``rank``, posted by
        its host at ``now``."""
        kernel = _Kernel(list(ops))
        self.streams[(rank, ops[0].comm)].append(kernel)
        self.compute[rank].append((now, _Posted(kernel)))
        for op in ops:
            self.posted[rank].append(op)
            if op.peer is None:
                self.collectives[(op.comm, rank)].append(op)
            else:
                pair = (rank, op.peer) if op.is_send else (op.peer, rank)
                self.p2p[(op.comm,) + pair][0 if op.is_send else 1].append(op)
        return list(ops)

    def queue(self, rank: Hashable, entry: object, now: float) -> None:
        self.compute[rank].append((now, entry))

    def idle(self, rank: Hashable, everything: bool, now: float) -> "_Idle":
        """What the host waits for at a stream sync (its compute stream drained) or, with
        ``everything``, a device-wide synchronize (rule 7)."""
        return _Idle(self, rank, everything, now)

    # the device (rule 8)
    def settle(self) -> None:
        """Run what can run: compute streams up to their next unmet wait, kernels at the head
        of their streams, matched operations; until nothing changes."""
        changed = True
        while changed:
            changed = False
            for rank, entries in self.compute.items():
                changed |= self._run_compute(rank, entries)
            for key, kernels in self.streams.items():
                changed |= self._run_stream(key, kernels)
            for sends, recvs in self.p2p.values():
                while sends and recvs and sends[0].start is not None \
                        and recvs[0].start is not None:
                    self._complete([sends.popleft(), recvs.popleft()])
                    changed = True
            changed |= self._complete_collectives()

    def _run_compute(self, rank: Hashable, entries: Deque[Tuple[float, object]]) -> bool:
        ran = False
        while entries:
            queued, head = entries[0]
            self.clock[rank] = max(self.clock[rank], queued)
            if isinstance(head, _Wait):
                if any(op.done is None for op in head.ops):
                    break
                self.clock[rank] = max([self.clock[rank]] + [op.done for op in head.ops])
            elif isinstance(head, _Run):
                start = self.clock[rank]
                self.clock[rank] = start + self.cost(rank, head.action)
                self.events[rank].append(Event(rank, head.action, start, self.clock[rank]))
            elif isinstance(head, _Posted):
                head.kernel.ready = self.clock[rank]
            else:
                clock = self.clock[rank]
                self.events[rank].append(Event(rank, head.action, clock, clock))
            entries.popleft()
            ran = True
        return ran

    def _run_stream(self, key: Tuple[Hashable, Comm], kernels: Deque[_Kernel]) -> bool:
        ran = False
        while kernels and kernels[0].start is not None \
                and all(op.done is not None for op in kernels[0].ops):
            self.stream_free[key] = max(op.done for op in kernels.popleft().ops)
            ran = True
        if kernels and kernels[0].start is None and kernels[0].ready is not None:
            head = kernels[0]
            head.start = max(head.ready, self.stream_free[key])
            for op in head.ops:
                op.start = head.start
            ran = True
        return ran

    def _complete_collectives(self) -> bool:
        changed = False
        for comm in {c for c, _ in self.collectives}:
            queues = [self.collectives[(comm, r)] for r in comm.members]
            while all(q and q[0].start is not None for q in queues):
                self._complete([q.popleft() for q in queues])
                changed = True
        return changed

    def _complete(self, ops: List[_Op]) -> None:
        sender = next((op for op in ops if op.is_send), None)
        if sender is not None:
            receiver = next(op for op in ops if not op.is_send)
            if (sender.layer, sender.action and sender.action.mb) != \
                    (receiver.layer, receiver.action and receiver.action.mb):
                raise ScheduleError(f"stage {receiver.rank}: {receiver} got {sender} from stage "
                                    f"{sender.rank} (messages out of order)")
        done = max(op.start for op in ops) + self.latency
        for op in ops:
            op.done = done

    def pending(self, rank: Hashable) -> List[_Op]:
        """The operations ``rank`` posted that have not completed."""
        for op in self.posted[rank]:
            if op.done is not None:
                self.finished[rank] = max(self.finished[rank], op.done)
        self.posted[rank] = [op for op in self.posted[rank] if op.done is None]
        return list(self.posted[rank])


@dataclass(eq=False)
class _Idle:
    """A host blocked until its compute stream has drained (and, for a device-wide sync,
    every operation it posted has completed)."""

    world: _NcclWorld
    rank: Hashable
    everything: bool
    since: float

    @property
    def done(self) -> Optional[float]:
        if self.world.compute[self.rank]:
            return None
        if not self.everything:
            return max(self.since, self.world.clock[self.rank])
        if self.world.pending(self.rank):
            return None
        return max(self.since, self.world.clock[self.rank], self.world.finished[self.rank])

    def blocking(self) -> List[str]:
        entries = self.world.compute[self.rank]
        head = entries[0][1] if entries else None
        waits = [op for op in head.ops if op.done is None] if isinstance(head, _Wait) else []
        if self.everything:
            waits += [op for op in self.world.pending(self.rank) if op not in waits]
        return [str(op) for op in waits]

    def __str__(self) -> str:
        return " ".join(self.blocking()) or "its stream"


def _drive(world: _NcclWorld, programs: Dict[Hashable, object], name: str,
           host: Dict[Hashable, float], last_posted: Dict[Hashable, str]) -> None:
    """Run host programs that yield what they block on (meetings, idle conditions), resuming
    each once all of it is done, its host clock moved to then, the device run as far as it
    goes in between; raises DeadlockError naming what each blocked host waits for."""
    waits: Dict[Hashable, list] = {rank: [] for rank in programs}
    running = list(programs)
    while running:
        progressed = False
        for rank in list(running):
            world.settle()
            while all(w.done is not None for w in waits[rank]):
                host[rank] = max([host[rank]] + [w.done for w in waits[rank]])
                try:
                    waits[rank] = next(programs[rank])
                except StopIteration:
                    running.remove(rank)
                    break
                progressed = True
        if running and not progressed:
            stuck = "; ".join(
                f"stage {rank} waits for "
                + " ".join(str(w) for w in waits[rank] if w.done is None)
                + f" (after {last_posted.get(rank, 'nothing')})" for rank in running)
            raise DeadlockError(f"{name} under {world.model}: deadlock: {stuck}")


# --- one pipeline's communicators (rules 4, 9, 11) ------------------------------------------

class _Comms:
    """The communicators one pipeline's actions use under ``model``; ``rank`` maps a stage to
    its rank, ``suffix`` names the pipeline's groups apart (the warm-up's grid)."""

    def __init__(self, num_stages: int, model: NcclModel,
                 rank: Callable[[int], Hashable] = lambda s: s, suffix: str = "",
                 world: Optional[FrozenSet[Hashable]] = None):
        self.num_stages, self.model, self.rank, self.suffix = num_stages, model, rank, suffix
        self.world = world if world is not None else frozenset(map(rank, range(num_stages)))
        self.built: Dict[str, Comm] = {}

    def _comm(self, name: str, members: FrozenSet[Hashable], single: bool = False) -> Comm:
        name += self.suffix
        if name not in self.built:
            self.built[name] = Comm(name, members, single)
        return self.built[name]

    def of(self, stage: int, action: Action, layer: str = "data") -> Comm:
        P, model = self.num_stages, self.model
        if action.op in TIED_OPS:
            direction = channel(stage, action, P)[2] if model.tied_groups == 2 else ""
            return self._comm(f"embedding{' ' + direction if direction else ''}",
                              frozenset({self.rank(0), self.rank(P - 1)}), single=True)
        unbatched = layer == "data" and not model.batched
        world = unbatched and P == 2 and channel(stage, action)[2] == "B"
        group = "world" if world else "pipeline"
        if not unbatched or model.eager:
            members = self.world if world else frozenset(map(self.rank, range(P)))
            return self._comm(group, members)
        lo, hi = sorted((stage, peer(stage, action.op)))
        return self._comm(f"{group} {lo}-{hi}", frozenset({self.rank(lo), self.rank(hi)}),
                          single=True)

    def op(self, stage: int, action: Action, layer: str = "data", label: str = "") -> _Op:
        other = peer(stage, action.op, self.num_stages)
        return _Op(self.rank(stage), label or f"{action}{'(shape)' if layer == 'shape' else ''}",
                   self.of(stage, action, layer), self.rank(other), action.op in SEND_OPS,
                   action, layer)


_CALL_END = None  # marks the end of a forward-backward call in a stage's item list


def _stage_program(world: _NcclWorld, comms: _Comms, s: int, items: Sequence[object],
                   accumulation: int, host: Dict[int, float], last_posted: Dict[int, str]):
    """One stage's host as a generator: posts its items and yields what it blocks on."""
    model = world.model
    sends: List[_Op] = []  # unbatched sends not yet waited for
    weights: Deque[_Op] = deque()  # tied weights whose receive is posted, not installed

    def post(ops: List[_Op]):
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
            queue(_Wait(sends))
            sends = []
            yield sync(everything=model.sync_anywhere)  # rule 12
            continue
        last_posted[s] = str(item if isinstance(item, Action) else item[-1])
        if isinstance(item, Action) and item.op in TIED_OPS:  # rule 11
            (op,) = yield from post([comms.op(s, item)])
            if item.op is Op.RECV_TIED_WEIGHT:
                weights.append(op)
            elif not op.is_send:
                queue(_Wait([op]))
            queue(_Note(item))
        elif isinstance(item, Action):
            if item.op is Op.BACKWARD:  # the runtime frees the output: its send must be done
                mine = [op for op in sends if op.action == Action(Op.SEND_F, item.mb)]
                queue(_Wait(mine))
                sends = [op for op in sends if op not in mine]
            queue(_Run(item))
            if item.op is Op.STEP:
                yield sync(everything=False)  # rule 12
                if weights and item.mb == install_step(weights[0].action.mb,
                                                       comms.num_stages, accumulation):
                    queue(_Wait([weights.popleft()]))  # the install after the step
        else:
            earlier, sends = sends, []
            for batch in exchanges(item):
                if model.shapes:  # rule 6
                    queue(_Wait((yield from post(
                        [comms.op(s, act, "shape") for act in batch]))))
                    yield sync()
                if model.batched:  # rules 3, 5
                    queue(_Wait((yield from post([comms.op(s, act) for act in batch]))))
                    if model.batch_sync:
                        yield sync()
                else:  # rule 4
                    order = _POST_ORDER[s % 2]
                    ops: List[_Op] = []
                    for act in sorted(batch, key=lambda x: order.index(x.op)):
                        ops += yield from post([comms.op(s, act)])
                    sends += [op for op in ops if op.is_send]
                    queue(_Wait([op for op in ops if not op.is_send]))
                for act in batch:
                    queue(_Note(act))
            queue(_Wait(earlier))
        if model.sync_anywhere:
            yield sync()
    queue(_Wait(sends + list(weights)))  # the end of a finite list (a drain)
    yield sync()


_POST_ORDER = {  # _p2p_ops' order for even and odd pipeline ranks
    0: (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B),
    1: (Op.RECV_F, Op.SEND_F, Op.RECV_B, Op.SEND_B),
}


def _run(schedule: Schedule, costs: Costs, model: NcclModel,
         call_ends: Optional[Sequence[Sequence[int]]]) -> _NcclWorld:
    P = schedule.num_stages
    world = _NcclWorld(model, costs.comm, costs.at)
    comms = _Comms(P, model)
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
    _drive(world, programs, schedule.name, host, last_posted)
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


# --- the start-up exchange ------------------------------------------------------------------

WARMUP_ORDER = ("data-parallel", "grad-stats", "pipeline", "embedding")


def warmup_programs(num_stages: int, tied: bool, model: NcclModel = NcclModel(),
                    data_parallel: int = 1, grad_stats: int = 1,
                    order: Sequence[str] = WARMUP_ORDER
                    ) -> Dict[Hashable, List[List[_Op]]]:
    """The start-up exchange that creates and connects every communicator a PACI stream
    uses, before its first action: per rank, a list of steps, each a list of kernels.

    Every rank takes the groups it is in, in one global ``order``: an all-reduce over its
    data-parallel group, one over its stage's grad-stats group (``admission.
    stage_grad_stats_group``), then one batched exchange with both pipeline neighbours, both
    directions (of data and, with ``shapes``, of shapes), then, on stage 0 and the last
    stage, both directions of the tied messages. A group built for a pair (a 2-rank
    communicator) gets its two operations as separate kernels, the lower rank sending first,
    as an unbatched ``isend``/``irecv`` pair that each end waits for in turn. The groups use
    the communicators of rule 9, so under lazy creation each operation must be of the kind
    the run posts (batched on the pipeline group, ``isend``/``irecv`` on the embedding
    group). Ranks are stages, or ``(stage, data-parallel, grad-stats)`` on a larger grid.
    """
    P, D, G = num_stages, data_parallel, grad_stats
    grid = [(s, d, g) for s in range(P) for d in range(D) for g in range(G)]

    def rank(s, d, g):
        return s if D == G == 1 else (s, d, g)

    everyone = frozenset(rank(*c) for c in grid)
    pipelines = {(d, g): _Comms(P, model, rank=lambda s, d=d, g=g: rank(s, d, g),
                                suffix="" if D == G == 1 else f" d{d} g{g}", world=everyone)
                 for d in range(D) for g in range(G)}
    collective = {  # a stage's group over data parallelism, over its grad-stats ranks
        "data-parallel": lambda s, d, g: (f"s{s} g{g}", [rank(s, x, g) for x in range(D)]),
        "grad-stats": lambda s, d, g: (f"s{s} d{d}", [rank(s, d, x) for x in range(G)])}
    programs: Dict[Hashable, List[List[_Op]]] = {}
    for s, d, g in grid:
        steps = []
        for group in order:
            if group in collective:
                where, members = collective[group](s, d, g)
                if len(members) > 1:
                    comm = Comm(f"{group} {where}", frozenset(members))
                    steps.append([[_Op(rank(s, d, g), f"{group} all-reduce", comm, None)]])
            else:
                steps.append(_p2p_warmup(pipelines[(d, g)], s, group, tied))
        programs[rank(s, d, g)] = [step for step in steps if step]
    return programs


def _p2p_warmup(comms: _Comms, s: int, group: str, tied: bool) -> List[List[_Op]]:
    """Stage ``s``'s kernels that connect both directions of every pair it talks to over
    ``group`` ("pipeline" or "embedding")."""
    P, model = comms.num_stages, comms.model
    if group == "pipeline":
        acts = ([Action(Op.RECV_F, -1), Action(Op.SEND_B, -1)] if s > 0 else []) + \
               ([Action(Op.SEND_F, -1), Action(Op.RECV_B, -1)] if s < P - 1 else [])
        layers = ("data", "shape") if model.shapes else ("data",)
        ops = [comms.op(s, act, layer, f"warm-up {act.op.value}{'(shape)' * (layer == 'shape')}")
               for layer in layers for act in acts]
        once = {(op.comm, op.peer, op.is_send): op for op in reversed(ops)}  # data's first
        ops = [op for op in ops if once[(op.comm, op.peer, op.is_send)] is op]
    elif tied and P > 1 and s in (0, P - 1):
        acts = [Action(Op.RECV_TIED_GRAD, -1), Action(Op.SEND_TIED_WEIGHT, -1)] if s == 0 else \
            [Action(Op.SEND_TIED_GRAD, -1), Action(Op.RECV_TIED_WEIGHT, -1)]
        ops = [comms.op(s, act, label=f"warm-up {act.op.value}") for act in acts]
    else:
        return []
    kernels: List[List[_Op]] = []
    for comm in sorted({op.comm for op in ops}, key=lambda c: c.name):
        mine = [op for op in ops if op.comm is comm]
        if not comm.single:
            kernels.append(mine)
        else:  # a pair's communicator: the lower rank sends first, the other receives first
            low = s < peer(s, mine[0].action.op, P)
            for first_send in (low, not low):
                kernels += [[op] for op in mine if op.is_send == first_send]
    return kernels


def run_warmup(programs: Dict[Hashable, List[List[_Op]]], model: NcclModel = NcclModel()
               ) -> Set[Tuple[str, Hashable, Hashable]]:
    """Run the start-up exchange under ``model``'s first-use rules (rule 10, as if nothing
    were connected yet), each kernel waited for before the next; raises DeadlockError if it
    cannot complete. Returns the (communicator, sender, receiver) pairs it connected."""
    cold = NcclModel(model.batched, model.shapes, eager=model.eager, warmed=False,
                     tied_groups=model.tied_groups)
    world = _NcclWorld(cold, 0.0)
    host = {rank: 0.0 for rank in programs}
    labels: Dict[Hashable, str] = {}

    def program(rank, steps):
        for step in steps:
            for kernel in step:
                labels[rank] = str(kernel[-1])
                meetings = world.first_uses(rank, kernel, host[rank])
                if meetings:
                    yield meetings
                world.queue(rank, _Wait(world.post(rank, kernel, host[rank])), host[rank])
                yield [world.idle(rank, False, host[rank])]

    _drive(world, {rank: program(rank, steps) for rank, steps in programs.items()},
           "warm-up", host, labels)
    return {(comm.name, a, b) for comm, a, b in world.p2p}
