"""The machine the NCCL model runs lists on (``nccl_model.py`` has the rules): each rank's
compute stream and one stream per communicator, kernels and how NCCL matches their
operations, the first uses a host blocks at, and the communicators one pipeline's actions
take. Pure Python, no torch."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import (Callable, Deque, Dict, FrozenSet, Hashable, List, Optional, Protocol,
                    Sequence, Tuple)

from .lockstep import DeadlockError, Event, ScheduleError
from .schedule import SEND_OPS, TIED_OPS, Action, channel, peer



class CommSettings(Protocol):
    """What the world reads of the rules (``nccl_model.NcclModel`` has them): named here so
    that the world, below the rules, does not import them."""

    warmed: bool
    eager: bool
    batched: bool
    tied_groups: int


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
class CommOp:
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
class Kernel:
    ops: List[CommOp]
    ready: Optional[float] = None  # the compute stream reached its posting point
    start: Optional[float] = None


# what a compute stream holds, in order, each with the host time it was queued at
@dataclass(eq=False)
class Run:
    action: Action


@dataclass(eq=False)
class Posted:  # the posting point of a kernel (rule 8)
    kernel: Kernel


@dataclass(eq=False)
class Wait:  # Work.wait(): the stream waits for these operations (rule 1)
    ops: List[CommOp]


@dataclass(eq=False)
class Note:  # a communication action done on this stream, for the timeline
    action: Action


@dataclass(eq=False)
class Meeting:
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


class NcclWorld:
    """Each rank's compute stream and communicator streams, their kernels and matching, and
    the first uses its hosts meet at."""

    def __init__(self, model: CommSettings, comm_latency: float,
                 costs: Callable[[Hashable, Action], float] = lambda rank, action: 0.0):
        self.model, self.latency, self.cost = model, comm_latency, costs
        self.compute: Dict[Hashable, Deque[Tuple[float, object]]] = defaultdict(deque)
        self.clock: Dict[Hashable, float] = defaultdict(float)  # compute stream time
        self.finished: Dict[Hashable, float] = defaultdict(float)  # latest op completion
        self.events: Dict[Hashable, List[Event]] = defaultdict(list)
        self.streams: Dict[Tuple[Hashable, Comm], Deque[Kernel]] = defaultdict(deque)
        self.stream_free: Dict[Tuple[Hashable, Comm], float] = defaultdict(float)
        self.p2p: Dict[tuple, Tuple[Deque[CommOp], Deque[CommOp]]] = defaultdict(
            lambda: (deque(), deque()))
        self.collectives: Dict[Tuple[Comm, Hashable], Deque[CommOp]] = defaultdict(deque)
        self.posted: Dict[Hashable, List[CommOp]] = defaultdict(list)
        self.arrivals: Dict[tuple, Dict[Hashable, float]] = defaultdict(dict)
        self.unsettled = False  # something posted or queued since the last settle

    # the host (rules 1, 10)
    def first_uses(self, rank: Hashable, ops: Sequence[CommOp], now: float) -> List[Meeting]:
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
                    meetings.append(Meeting(what, parties, self.arrivals[key]))
        return meetings

    def post(self, rank: Hashable, ops: Sequence[CommOp], now: float) -> List[CommOp]:
        """Enqueue ``ops`` as one kernel on their communicator's stream of ``rank``, posted by
        its host at ``now``."""
        kernel = Kernel(list(ops))
        self.unsettled = True
        self.streams[(rank, ops[0].comm)].append(kernel)
        self.compute[rank].append((now, Posted(kernel)))
        for op in ops:
            self.posted[rank].append(op)
            if op.peer is None:
                self.collectives[(op.comm, rank)].append(op)
            else:
                pair = (rank, op.peer) if op.is_send else (op.peer, rank)
                self.p2p[(op.comm,) + pair][0 if op.is_send else 1].append(op)
        return list(ops)

    def queue(self, rank: Hashable, entry: object, now: float) -> None:
        self.unsettled = True
        self.compute[rank].append((now, entry))

    def idle(self, rank: Hashable, everything: bool, now: float) -> "Idle":
        """What the host waits for at a stream sync (its compute stream drained) or, with
        ``everything``, a device-wide synchronize (rule 7)."""
        return Idle(self, rank, everything, now)

    # the device (rule 8)
    def settle(self) -> None:
        """Run what can run: compute streams up to their next unmet wait, kernels at the head
        of their streams, matched operations; until nothing changes. Only posting and queueing
        change what can run, so with neither since the last settle there is nothing to do."""
        if not self.unsettled:
            return
        self.unsettled = False
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
            if isinstance(head, Wait):
                if any(op.done is None for op in head.ops):
                    break
                self.clock[rank] = max([self.clock[rank]] + [op.done for op in head.ops])
            elif isinstance(head, Run):
                start = self.clock[rank]
                self.clock[rank] = start + self.cost(rank, head.action)
                self.events[rank].append(Event(rank, head.action, start, self.clock[rank]))
            elif isinstance(head, Posted):
                head.kernel.ready = self.clock[rank]
            else:
                clock = self.clock[rank]
                self.events[rank].append(Event(rank, head.action, clock, clock))
            entries.popleft()
            ran = True
        return ran

    def _run_stream(self, key: Tuple[Hashable, Comm], kernels: Deque[Kernel]) -> bool:
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

    def _complete(self, ops: List[CommOp]) -> None:
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

    def pending(self, rank: Hashable) -> List[CommOp]:
        """The operations ``rank`` posted that have not completed."""
        for op in self.posted[rank]:
            if op.done is not None:
                self.finished[rank] = max(self.finished[rank], op.done)
        self.posted[rank] = [op for op in self.posted[rank] if op.done is None]
        return list(self.posted[rank])


@dataclass(eq=False)
class Idle:
    """A host blocked until its compute stream has drained (and, for a device-wide sync,
    every operation it posted has completed)."""

    world: NcclWorld
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
        waits = [op for op in head.ops if op.done is None] if isinstance(head, Wait) else []
        if self.everything:
            waits += [op for op in self.world.pending(self.rank) if op not in waits]
        return [str(op) for op in waits]

    def __str__(self) -> str:
        return " ".join(self.blocking()) or "its stream"


def drive(world: NcclWorld, programs: Dict[Hashable, object], name: str,
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

class PipelineComms:
    """The communicators one pipeline's actions use under ``model``; ``rank`` maps a stage to
    its rank, ``suffix`` names the pipeline's groups apart (the warm-up's grid)."""

    def __init__(self, num_stages: int, model: CommSettings,
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

    def op(self, stage: int, action: Action, layer: str = "data", label: str = "") -> CommOp:
        other = peer(stage, action.op, self.num_stages)
        return CommOp(self.rank(stage), label or f"{action}{'(shape)' if layer == 'shape' else ''}",
                   self.of(stage, action, layer), self.rank(other), action.op in SEND_OPS,
                   action, layer)


