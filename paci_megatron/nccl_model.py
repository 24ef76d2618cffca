"""NCCL's pairing rules as Megatron-Core drives them, batched or unbatched, with or without
the variable-length shape exchange (``NcclModel`` lists the rules), over a Schedule's lists.
Pure Python, no torch."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from .lockstep import Costs, DeadlockError, Event, ScheduleError
from .schedule import (SEND_OPS, TIED_OPS, Action, Op, Schedule, StreamPlan, channel, exchanges,
                       peer, work_items)


@dataclass(frozen=True)
class NcclModel:
    """How Megatron-Core 0.16.1's ``P2PCommunicator._communicate`` meets NCCL.

    Rules (``run_nccl``):

    1. The executor hands each run of consecutive communication actions to the runtime, which
       splits it into exchanges (``schedule.exchanges``); one exchange is one ``_communicate``.
    2. ``batched`` (``batch_p2p_comm``, the default): an exchange is one
       ``batch_isend_irecv`` group. A send and its receive complete together once both are
       posted; the stage waits until every op of its group has completed.
    3. Unbatched (``_p2p_ops``): each op is queued on the link to its neighbour, even stages
       posting send-next, recv-prev, send-prev, recv-next, odd stages recv-prev, send-next,
       recv-next, send-prev. A link's queue runs in order (one NCCL stream per pair): an op
       completes only with the op at the head of the neighbour's queue for the same link, and
       it must be its counterpart (a send facing a send waits forever). Both directions share
       one link for P >= 3; at P = 2 Megatron puts the two directions on different groups.
       The stage waits for the exchange's receives; sends stay pending until the backward of
       that micro-batch (its activation is freed then) or the end of the call.
    4. ``shapes`` (``variable_seq_lengths``): before its data, every exchange runs a batched
       shape exchange of the same ops, waits for it, then ``torch.cuda.synchronize()``, which
       also waits for this stage's pending sends.
    5. At the end of each call the stage waits for all its pending sends.
    6. The tied-weight messages (SG/RG, SW/RW) go over the embedding group as plain
       isend/irecv: a receive waits for its send; a send never holds its sender up (the
       runtime waits for it only once the receiver has taken it, ``mcore/tied.py``).
    """

    batched: bool = True
    shapes: bool = False

    def __str__(self) -> str:
        return (f"NCCL {'batched' if self.batched else 'unbatched'} p2p"
                f"{' with shape exchange' if self.shapes else ''}")


@dataclass(eq=False)
class _P2POp:
    stage: int
    action: Action
    layer: str  # "data" or "shape"
    posted: float
    done: Optional[float] = None

    @property
    def is_send(self) -> bool:
        return self.action.op in SEND_OPS

    def __str__(self) -> str:
        return f"{self.action}{'(shape)' if self.layer == 'shape' else ''}"


_POST_ORDER = {  # _p2p_ops' order for even and odd pipeline ranks
    0: (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B),
    1: (Op.RECV_F, Op.SEND_F, Op.RECV_B, Op.SEND_B),
}


class _NcclWorld:
    """Posted ops and their matching, under the rules of ``NcclModel``."""

    def __init__(self, num_stages: int, model: NcclModel, comm: float):
        self.P, self.model, self.comm = num_stages, model, comm
        self.unmatched: Dict[tuple, Tuple[Deque[_P2POp], Deque[_P2POp]]] = defaultdict(
            lambda: (deque(), deque()))
        self.links: Dict[tuple, Deque[_P2POp]] = defaultdict(deque)
        self.link_free: Dict[tuple, float] = defaultdict(float)  # last completion on the link

    def post(self, stage: int, action: Action, layer: str, now: float) -> _P2POp:
        op = _P2POp(stage, action, layer, now)
        if layer in ("shape", "tied") or self.model.batched:
            sender, receiver, direction = channel(stage, action, self.P)
            sends, recvs = self.unmatched[(sender, receiver, direction, layer)]
            (sends if op.is_send else recvs).append(op)
            while sends and recvs:
                self._complete(sends.popleft(), recvs.popleft(), 0.0)
        else:
            key = self._link(stage, action)
            self.links[key].append(op)
            self._advance_link(key)
        return op

    def _link(self, stage: int, action: Action) -> tuple:
        other = peer(stage, action.op)
        direction = channel(stage, action)[2] if self.P == 2 else ""
        return (stage, other, direction)

    def _advance_link(self, key: tuple) -> None:
        stage, other, direction = key
        mine, theirs = self.links[key], self.links[(other, stage, direction)]
        while mine and theirs and mine[0].is_send != theirs[0].is_send \
                and channel(stage, mine[0].action) == channel(other, theirs[0].action):
            ready = max(self.link_free[key], self.link_free[(other, stage, direction)])
            a, b = mine.popleft(), theirs.popleft()
            self._complete(a, b, ready)
            self.link_free[key] = self.link_free[(other, stage, direction)] = a.done

    def _complete(self, a: _P2POp, b: _P2POp, ready: float) -> None:
        if a.action.mb != b.action.mb:
            receiver = b if a.is_send else a
            raise ScheduleError(f"stage {receiver.stage}: {receiver.action} got micro-batch "
                                f"{(a if a.is_send else b).action.mb} (messages out of order)")
        a.done = b.done = max(a.posted, b.posted, ready) + self.comm

    def leftovers(self, open_weights: bool = False) -> List[str]:
        """Ops never completed; ``open_weights``: a stream cut short leaves stage 0's last
        tied weights unreceived, by design."""
        ops = [op for pair in self.unmatched.values() for q in pair for op in q]
        ops += [op for q in self.links.values() for op in q]
        return [f"stage {op.stage} {op}" for op in ops
                if not (open_weights and op.action.op is Op.SEND_TIED_WEIGHT)]


_CALL_END = None  # marks the end of a forward-backward call in a stage's item list


def _stage_program(world: _NcclWorld, s: int, items: Sequence[object], costs: Costs,
                   clock: List[float], events: List[Event]):
    """One stage as a generator: yields the ops it waits for; the driver resumes it when they
    have completed and has moved ``clock[s]`` to their completion."""
    model = world.model
    pending: List[_P2POp] = []  # unbatched sends not yet waited for
    for item in items:
        if item is _CALL_END:
            yield pending
            pending = []
        elif isinstance(item, Action) and item.op in TIED_OPS:
            op = world.post(s, item, "tied", clock[s])
            if not op.is_send:
                yield [op]
            events.append(Event(s, item, clock[s], clock[s]))
        elif isinstance(item, Action):
            if item.op is Op.BACKWARD:  # the runtime frees the output: its send must be done
                mine = [op for op in pending if op.action == Action(Op.SEND_F, item.mb)]
                yield mine
                pending = [op for op in pending if op not in mine]
            start = clock[s]
            clock[s] = start + costs.at(s, item)
            events.append(Event(s, item, start, clock[s]))
        else:
            for batch in exchanges(item):
                if model.shapes:
                    yield [world.post(s, act, "shape", clock[s]) for act in batch]
                    yield pending  # torch.cuda.synchronize()
                    pending = []
                if model.batched:
                    yield [world.post(s, act, "data", clock[s]) for act in batch]
                else:
                    order = _POST_ORDER[s % 2]
                    ops = [world.post(s, act, "data", clock[s])
                           for act in sorted(batch, key=lambda x: order.index(x.op))]
                    pending += [op for op in ops if op.is_send]
                    yield [op for op in ops if not op.is_send]
                for act in batch:
                    events.append(Event(s, act, clock[s], clock[s]))
    yield pending


def run_nccl(schedule: Schedule, costs: Costs = Costs(), model: NcclModel = NcclModel(),
             call_ends: Optional[Sequence[Sequence[int]]] = None) -> List[List[Event]]:
    """Time every action under NCCL's pairing rules (``NcclModel``); raises DeadlockError
    naming what each stuck stage waits for. ``call_ends[s]`` lists the indices in stage s's
    list where a forward-backward call ends (rule 5); by default the list is one call."""
    P = schedule.num_stages
    world = _NcclWorld(P, model, costs.comm)
    clock = [0.0] * P
    events: List[List[Event]] = [[] for _ in range(P)]
    programs, waits = [], []
    for s, acts in enumerate(schedule.stages):
        bounds = [0] + sorted(call_ends[s] if call_ends else []) + [len(acts)]
        items: List[object] = []
        for lo, hi in zip(bounds, bounds[1:]):
            items += work_items(acts[lo:hi]) + [_CALL_END]
        programs.append(_stage_program(world, s, items, costs, clock, events[s]))
        waits.append([])
    running = set(range(P))
    while running:
        progressed = False
        for s in sorted(running):
            while all(op.done is not None for op in waits[s]):
                clock[s] = max([clock[s]] + [op.done for op in waits[s]])
                try:
                    waits[s] = next(programs[s])
                except StopIteration:
                    running.discard(s)
                    break
                progressed = True
        if running and not progressed:
            stuck = "; ".join(
                f"stage {s} waits for " + " ".join(str(op) for op in waits[s] if op.done is None)
                + f" (after {events[s][-1].action if events[s] else 'nothing'})"
                for s in sorted(running))
            raise DeadlockError(f"{schedule.name} under {model}: deadlock: {stuck}")
    left = world.leftovers(open_weights=call_ends is not None)
    if left:
        raise ScheduleError(f"{schedule.name} under {model}: never completed: {left}")
    return events


def run_stream_nccl(plan: StreamPlan, calls: int, costs: Costs = Costs(),
                    model: NcclModel = NcclModel()) -> List[List[Event]]:
    """Run the first ``calls`` calls of a stream plan back to back under ``model``, each
    stage waiting for its pending sends at every call end, as the runtime does (but for the
    tied weights, which cross calls by design)."""
    rows: List[List[Action]] = [[] for _ in range(plan.num_stages)]
    ends: List[List[int]] = [[] for _ in range(plan.num_stages)]
    for k in range(calls):
        for s, acts in enumerate(plan.call(k)):
            rows[s] += acts
            ends[s].append(len(rows[s]))
    stream = Schedule(f"{plan.kind} stream (P={plan.num_stages} a={plan.accumulation} "
                      f"N={plan.per_call}, {calls} calls)", plan.num_stages, plan.accumulation,
                      calls * plan.per_call, tuple(tuple(r) for r in rows), plan.tied)
    return run_nccl(stream, costs, model, ends)
