"""Run a Schedule's per-stage lists in lockstep, without torch, and check its invariants.

Communication model (the one the executor implements): a send is posted and never blocks;
a receive waits until the matching send was posted (plus ``Costs.comm`` latency). Messages
on one channel (sender, receiver, direction) are received in the order they were sent.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from .schedule import (
    COMPUTE_OPS,
    RECV_OPS,
    SEND_OPS,
    Action,
    Op,
    Schedule,
    channel,
    drift_bound,
)


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

    def steady_bubble(self, stage: int) -> float:
        """Idle share at ``stage`` between two local steps in the middle of the run."""
        steps = [e for e in self.stage_events[stage] if e.action.op is Op.STEP]
        if len(steps) < 3:
            raise ScheduleError(f"stage {stage}: need >= 3 steps to measure a steady state")
        k = len(steps) // 2
        t0, t1 = steps[k - 1].end, steps[k].end
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
        last = None
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
            elif act.op is Op.STEP:
                if last != Action(Op.BACKWARD, m) and last != Action(Op.SEND_B, m):
                    raise ScheduleError(f"{where}: {act} does not follow B{m}")
                if backwards % a or backwards // a != steps + 1:
                    raise ScheduleError(f"{where}: {act} after {backwards} backwards with a={a}")
                steps += 1
            elif act.op in RECV_OPS:
                if (act.op is Op.RECV_F and s == 0) or (act.op is Op.RECV_B and s == P - 1):
                    raise ScheduleError(f"{where}: {act} has no sender")
                received[act.op].add(m)
            elif act.op is Op.SEND_F:
                if s == P - 1 or Action(Op.FORWARD, m) != last:
                    raise ScheduleError(f"{where}: {act} must follow F{m} on a non-last stage")
            elif act.op is Op.SEND_B:
                if s == 0 or Action(Op.BACKWARD, m) != last:
                    raise ScheduleError(f"{where}: {act} must follow B{m} on a non-first stage")
            last = act
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


def run_lockstep(schedule: Schedule, costs: Costs = Costs()) -> List[List[Event]]:
    """Time every action; raises DeadlockError naming what each stuck stage waits for."""
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
                    queue = queues[channel(s, act)]
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
                    queues[channel(s, act)].append((act.mb, end + costs.comm))
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
    leftovers = {ch: list(q) for ch, q in queues.items() if q}
    if leftovers:
        raise ScheduleError(f"{schedule.name}: messages never received: {leftovers}")
    return events


def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    drifts, peaks = check_lists(schedule)
    stage_events = run_lockstep(schedule, costs)
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
