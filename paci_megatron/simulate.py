"""Run a Schedule's per-stage lists in lockstep, without torch, and check its invariants.

Two communication models. ``run_lockstep`` (the default of ``simulate``; what gloo does here):
a send is posted and never blocks; a receive waits until the matching send was posted (plus
``Costs.comm`` latency). Messages on one channel (sender, receiver, direction) are received in
the order they were sent. ``run_nccl`` (``simulate(..., nccl=NcclModel(...))``): NCCL's
pairing rules as Megatron-Core drives them, batched or unbatched, with or without the
variable-length shape exchange; its rules are listed in ``NcclModel``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from .schedule import (
    COMPUTE_OPS,
    RECV_OPS,
    SEND_OPS,
    TIED_OPS,
    Action,
    Op,
    Schedule,
    StreamPlan,
    channel,
    exchanges,
    peer,
    work_items,
)
from .shape import closes_group, drift_bound, tied_lag


class ScheduleError(ValueError):
    """A schedule breaks an invariant; the message names the stage and the action."""


class DeadlockError(ScheduleError):
    pass


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0
    backward: float = 1.0
    step: float = 0.0
    comm: float = 0.0  # latency from a send to the earliest matching receive

    def of(self, action: Action) -> float:
        if action.op is Op.FORWARD:
            return self.forward
        if action.op is Op.BACKWARD:
            return self.backward
        if action.op is Op.STEP:
            return self.step
        return 0.0


@dataclass
class Event:
    stage: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    schedule: Schedule
    events: List[Event]
    makespan: float
    drift: List[Dict[int, int]]  # per stage: micro-batch -> steps between its F and its B
    max_in_flight: List[int]
    stage_events: List[List[Event]] = field(default_factory=list)

    def max_drift(self) -> List[int]:
        return [max(d.values(), default=0) for d in self.drift]

    def bubble_fraction(self) -> float:
        """Idle share of all stages' time over the whole run (warm-up and cool-down included)."""
        busy = sum(e.end - e.start for e in self.events)
        total = self.makespan * self.schedule.num_stages
        return 0.0 if total == 0 else 1.0 - busy / total

    def _middle_steps(self, stage: int) -> Tuple[float, float]:
        steps = [e for e in self.stage_events[stage] if e.action.op is Op.STEP]
        if len(steps) < 3:
            raise ScheduleError(f"stage {stage}: need >= 3 steps to measure a steady state")
        k = len(steps) // 2
        return steps[k - 1].end, steps[k].end

    def steady_period(self, stage: int) -> float:
        """Time between two local steps of ``stage`` in the middle of the run (one update)."""
        t0, t1 = self._middle_steps(stage)
        return t1 - t0

    def steady_bubble(self, stage: int) -> float:
        """Idle share at ``stage`` between two local steps in the middle of the run."""
        t0, t1 = self._middle_steps(stage)
        busy = sum(
            min(e.end, t1) - max(e.start, t0)
            for e in self.stage_events[stage]
            if e.end > t0 and e.start < t1
        )
        return 1.0 - busy / (t1 - t0)

    def timeline(self, width: int = 100) -> str:
        """One text row per stage; each cell shows the compute action running then."""
        if self.makespan <= 0:
            return ""
        scale = width / self.makespan
        rows = []
        for s, events in enumerate(self.stage_events):
            cells = ["."] * width
            for e in events:
                if e.action.op not in COMPUTE_OPS and e.action.op is not Op.STEP:
                    continue
                mark = {"F": "F", "B": "b", "T": "|"}[e.action.op.value]
                lo = int(e.start * scale)
                hi = max(lo + 1, int(e.end * scale))
                for i in range(lo, min(hi, width)):
                    cells[i] = mark
            rows.append(f"stage {s}: " + "".join(cells))
        return "\n".join(rows)


def check_lists(schedule: Schedule) -> Tuple[List[Dict[int, int]], List[int]]:
    """Static invariants of each stage's list; returns per-stage drift and peak in-flight."""
    P, a, M = schedule.num_stages, schedule.accumulation, schedule.num_microbatches
    drifts, peaks = [], []
    for s, acts in enumerate(schedule.stages):
        where = f"{schedule.name} stage {s}"
        done_f: Dict[int, int] = {}
        drift: Dict[int, int] = {}
        received = {Op.RECV_F: set(), Op.RECV_B: set()}
        steps = backwards = in_flight = peak = 0
        last = last_work = None  # the previous action; the previous F, B, R or T
        for i, act in enumerate(acts):
            m = act.mb
            if act.op is Op.FORWARD:
                if m in done_f or m in drift:
                    raise ScheduleError(f"{where}: second forward of micro-batch {m} at #{i}")
                if s > 0 and m not in received[Op.RECV_F]:
                    raise ScheduleError(f"{where}: F{m} before its input was received")
                done_f[m] = steps
                in_flight += 1
                peak = max(peak, in_flight)
                if in_flight > P - s:
                    raise ScheduleError(f"{where}: {in_flight} micro-batches in flight at {act}, "
                                        f"limit is P-s = {P - s}")
            elif act.op is Op.BACKWARD:
                if m not in done_f:
                    raise ScheduleError(f"{where}: B{m} without a forward before it")
                if s < P - 1 and m not in received[Op.RECV_B]:
                    raise ScheduleError(f"{where}: B{m} before its output gradient was received")
                drift[m] = steps - done_f.pop(m)
                in_flight -= 1
                backwards += 1
            elif act.op is Op.REDUCE:
                if last_work != Action(Op.BACKWARD, m):  # communication may come between
                    raise ScheduleError(f"{where}: {act} does not follow B{m}")
                if backwards % a or backwards // a != steps + 1:
                    raise ScheduleError(f"{where}: {act} after {backwards} backwards with a={a}")
            elif act.op is Op.STEP:
                if last_work != Action(Op.REDUCE, m):
                    raise ScheduleError(f"{where}: {act} does not follow R{m}")
                steps += 1
            elif act.op in TIED_OPS:
                _check_tied(schedule, s, act, last_work, steps, where)
            elif act.op in RECV_OPS:
                if (act.op is Op.RECV_F and s == 0) or (act.op is Op.RECV_B and s == P - 1):
                    raise ScheduleError(f"{where}: {act} has no sender")
                received[act.op].add(m)
            elif act.op is Op.SEND_F:
                if s == P - 1 or Action(Op.FORWARD, m) != last:
                    raise ScheduleError(f"{where}: {act} must follow F{m} on a non-last stage")
            elif act.op is Op.SEND_B:
                if s == 0 or Action(Op.BACKWARD, m) != last and \
                        Action(Op.SEND_TIED_GRAD, m) != last:
                    raise ScheduleError(f"{where}: {act} must follow B{m} on a non-first stage")
            last = act
            if act.op in COMPUTE_OPS or act.op in (Op.REDUCE, Op.STEP):
                last_work = act
        missing = sorted(set(range(M)) - set(drift))
        if missing or done_f:
            raise ScheduleError(f"{where}: micro-batches without F and B: {missing or sorted(done_f)}")
        if steps != M // a:
            raise ScheduleError(f"{where}: {steps} steps for {M} backwards with a={a}")
        bound = drift_bound(P, s, a)
        worst = max(drift.values(), default=0)
        if worst > bound:
            m = max(drift, key=drift.get)
            raise ScheduleError(f"{where}: drift {worst} of micro-batch {m} exceeds "
                                f"ceil((P-1-s)/a) = {bound}")
        drifts.append(drift)
        peaks.append(peak)
    return drifts, peaks


def _check_tied(schedule: Schedule, s: int, act: Action, last_work: Optional[Action],
                steps: int, where: str) -> None:
    """Where the tied-weight exchange may sit: SG right after the last stage's closing
    backward, RG before stage 0's R, SW right after stage 0's T, and RW (the weight of stage
    0's step L = tied_lag steps back) after each later step of the last stage, or after its
    last backward (the drain)."""
    P, a, m = schedule.num_stages, schedule.accumulation, act.mb
    owner, last = s == 0, s == P - 1
    if not schedule.tied or P < 2 or not closes_group(m, a):
        raise ScheduleError(f"{where}: {act} in a list without a tied weight, or not at a "
                            "group's end")
    lag = tied_lag(P, a)
    if act.op is Op.SEND_TIED_GRAD and last and last_work == Action(Op.BACKWARD, m):
        return
    if act.op is Op.RECV_TIED_GRAD and owner and last_work == Action(Op.BACKWARD, m):
        return
    if act.op is Op.SEND_TIED_WEIGHT and owner and last_work == Action(Op.STEP, m):
        return
    if act.op is Op.RECV_TIED_WEIGHT and last and (
            last_work == Action(Op.STEP, m + lag * a) or steps - lag <= m // a < steps):
        return
    raise ScheduleError(f"{where}: {act} out of place (after {last_work}, lag {lag})")


def run_lockstep(schedule: Schedule, costs: Costs = Costs(),
                 open_weights: bool = False) -> List[List[Event]]:
    """Time every action; raises DeadlockError naming what each stuck stage waits for.
    ``open_weights``: the lists are a stream cut short, which leaves stage 0's last tied
    weights unreceived by design."""
    P = schedule.num_stages
    pos = [0] * P
    clock = [0.0] * P
    queues: Dict[Tuple[int, int, str], Deque[Tuple[int, float]]] = defaultdict(deque)
    events: List[List[Event]] = [[] for _ in range(P)]
    remaining = sum(len(acts) for acts in schedule.stages)
    while remaining:
        progressed = False
        for s, acts in enumerate(schedule.stages):
            while pos[s] < len(acts):
                act = acts[pos[s]]
                start = clock[s]
                if act.op in RECV_OPS:
                    queue = queues[channel(s, act, P)]
                    if not queue:
                        break
                    sent_mb, ready = queue.popleft()
                    if sent_mb != act.mb:
                        raise ScheduleError(
                            f"stage {s}: {act} got micro-batch {sent_mb} (messages out of order)"
                        )
                    start = max(start, ready)
                end = start + costs.of(act)
                if act.op in SEND_OPS:
                    queues[channel(s, act, P)].append((act.mb, end + costs.comm))
                events[s].append(Event(s, act, start, end))
                clock[s] = end
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"stage {s} waits at #{pos[s]} {acts[pos[s]]}"
                for s, acts in enumerate(schedule.stages)
                if pos[s] < len(acts)
            )
            raise DeadlockError(f"{schedule.name}: deadlock: {stuck}")
    leftovers = {ch: list(q) for ch, q in queues.items() if q
                 and not (open_weights and ch[2] == "W")}
    if leftovers:
        raise ScheduleError(f"{schedule.name}: messages never received: {leftovers}")
    return events


# --- NCCL's pairing rules ---------------------------------------------------------------------

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
            clock[s] = start + costs.of(item)
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


def simulate(schedule: Schedule, costs: Costs = Costs(),
             nccl: Optional[NcclModel] = None) -> SimResult:
    """Check the lists and time them: with ``nccl``, under NCCL's pairing rules; without,
    sends never block (the gloo-like ideal)."""
    drifts, peaks = check_lists(schedule)
    stage_events = run_lockstep(schedule, costs) if nccl is None else run_nccl(
        schedule, costs, nccl)
    flat = [e for evs in stage_events for e in evs]
    makespan = max((e.end for e in flat), default=0.0)
    return SimResult(schedule, flat, makespan, drifts, peaks, stage_events)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    from .schedule import build

    parser = argparse.ArgumentParser(description="Print and check a pipeline schedule.")
    parser.add_argument("--kind", default="paci", choices=["paci", "flush"])
    parser.add_argument("-P", "--stages", type=int, default=4)
    parser.add_argument("-a", "--accumulation", type=int, default=4)
    parser.add_argument("-M", "--microbatches", type=int, default=16)
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0)
    args = parser.parse_args(argv)
    sched = build(args.kind, args.stages, args.accumulation, args.microbatches)
    result = simulate(sched, Costs(args.forward_cost, args.backward_cost))
    print(sched)
    print(result.timeline())
    print(f"makespan {result.makespan:g}  bubble {result.bubble_fraction():.3f}  "
          f"max drift per stage {result.max_drift()}  peak in flight {result.max_in_flight}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def check_plan(plan: StreamPlan, nccl: Optional[NcclModel] = None) -> None:
    """The checks a run's own plan passes before it runs (the runtime calls this at start-up):
    the schedule the stream is cut from keeps every invariant of ``check_lists`` and runs in
    lockstep without deadlock; with ``nccl``, its first calls also run under NCCL's pairing
    rules. Raises ScheduleError saying why not."""
    from .schedule import build

    calls = len(plan.first) + 2 + -(-plan.num_stages // plan.per_call)
    simulate(build(plan.kind, plan.num_stages, plan.accumulation, calls * plan.per_call,
                   plan.tied))
    if nccl is not None:
        run_stream_nccl(plan, len(plan.first) + 2, Costs(), nccl)
