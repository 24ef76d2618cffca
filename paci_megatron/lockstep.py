"""Run a Schedule's per-stage lists in lockstep, without torch, and check its invariants.

``check_lists``: the static invariants of each stage's list. ``run_lockstep``: what gloo does
here: a send is posted and never blocks; a receive waits until the matching send was posted
(plus ``Costs.comm`` latency), the tied weight's (RW) at the step that installs it
(``schedule.install_step``). Messages on one channel (sender, receiver, direction) are
received in the order they were sent. NCCL's rules are ``nccl_model.py``; ``simulate.py`` is
the front door to both.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from .schedule import (COMPUTE_OPS, RECV_OPS, SEND_OPS, TIED_OPS, Action, Op, Schedule,
                       channel, install_step)
from .shape import closes_group, drift_bound


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
    predict: float = 0.0  # extra on a predicted forward (simulate.seconds_per_call marks which)
    # Per stage, its forward and backward time over the costs above: uneven stages (the
    # embedding and loss stages, a layout), whose pace is the slowest stage's. () = all 1.
    stage_scale: Tuple[float, ...] = ()

    def at(self, stage: int, action: Action) -> float:
        """What ``action`` costs at ``stage``: its compute scaled by the stage's own pace."""
        cost = self.of(action)
        if self.stage_scale and action.op in (Op.FORWARD, Op.BACKWARD):
            cost *= self.stage_scale[stage]
        return cost

    def slowest(self) -> float:
        """The slowest stage's scale (1 for even stages)."""
        return max(self.stage_scale, default=1.0)

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
                _check_tied(schedule, s, act, last, last_work, where)
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


def _check_tied(schedule: Schedule, s: int, act: Action, previous: Optional[Action],
                last_work: Optional[Action], where: str) -> None:
    """Where the tied messages of a group sit, in the same order at both ends: on the last
    stage SG right after its R (the gradient as its data-parallel reduction left it), then RW
    (the receive of stage 0's weight of that group, installed ``tied_lag`` steps later); on
    stage 0 RG after its closing backward, before its R, and SW right after its T."""
    P, a, m = schedule.num_stages, schedule.accumulation, act.mb
    owner, last = s == 0, s == P - 1
    if not schedule.tied or P < 2 or not closes_group(m, a):
        raise ScheduleError(f"{where}: {act} in a list without a tied weight, or not at a "
                            "group's end")
    if act.op is Op.SEND_TIED_GRAD and last and previous == Action(Op.REDUCE, m):
        return
    if act.op is Op.RECV_TIED_WEIGHT and last and previous == Action(Op.SEND_TIED_GRAD, m):
        return
    if act.op is Op.RECV_TIED_GRAD and owner and last_work == Action(Op.BACKWARD, m):
        return
    if act.op is Op.SEND_TIED_WEIGHT and owner and last_work == Action(Op.STEP, m):
        return
    raise ScheduleError(f"{where}: {act} out of place (after {previous})")


def run_lockstep(schedule: Schedule, costs: Costs = Costs()) -> List[List[Event]]:
    """Time every action; raises DeadlockError naming what each stuck stage waits for."""
    P = schedule.num_stages
    pos = [0] * P
    clock = [0.0] * P
    queues: Dict[Tuple[int, int, str], Deque[Tuple[int, float]]] = defaultdict(deque)
    events: List[List[Event]] = [[] for _ in range(P)]
    unclaimed: List[Deque[Action]] = [deque() for _ in range(P)]  # RW posted, not installed
    remaining = sum(len(acts) + sum(a.op is Op.RECV_TIED_WEIGHT for a in acts)
                    for acts in schedule.stages)
    while remaining:
        progressed = False
        for s, acts in enumerate(schedule.stages):
            while unclaimed[s] and pos[s] == len(acts):  # the end (a drain) takes the rest
                if not _claim_weight(queues, unclaimed[s], s, P, clock, events[s][-1].end):
                    break
                remaining -= 1
                progressed = True
            while pos[s] < len(acts):
                act = acts[pos[s]]
                start = clock[s]
                if act.op is Op.STEP and unclaimed[s] and act.mb == install_step(
                        unclaimed[s][0].mb, P, schedule.accumulation):
                    if not _claim_weight(queues, unclaimed[s], s, P, clock,
                                         start + costs.at(s, act)):
                        break
                    remaining -= 1
                    start = clock[s] - costs.at(s, act)
                elif act.op is Op.RECV_TIED_WEIGHT:
                    unclaimed[s].append(act)
                elif act.op in RECV_OPS:
                    queue = queues[channel(s, act, P)]
                    if not queue:
                        break
                    sent_mb, ready = queue.popleft()
                    if sent_mb != act.mb:
                        raise ScheduleError(
                            f"stage {s}: {act} got micro-batch {sent_mb} (messages out of order)"
                        )
                    start = max(start, ready)
                end = start + costs.at(s, act)
                if act.op in SEND_OPS:
                    queues[channel(s, act, P)].append((act.mb, end + costs.comm))
                events[s].append(Event(s, act, start, end))
                clock[s] = end
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"stage {s} waits at #{pos[s]} "
                f"{acts[pos[s]] if pos[s] < len(acts) else 'the end'}"
                + (f" for {unclaimed[s][0]}" if unclaimed[s] else "")
                for s, acts in enumerate(schedule.stages)
                if pos[s] < len(acts) or unclaimed[s]
            )
            raise DeadlockError(f"{schedule.name}: deadlock: {stuck}")
    leftovers = {ch: list(q) for ch, q in queues.items() if q}
    if leftovers:
        raise ScheduleError(f"{schedule.name}: messages never received: {leftovers}")
    return events


def _claim_weight(queues, unclaimed: Deque[Action], s: int, P: int, clock: List[float],
                  after: float) -> bool:
    """Install the oldest posted tied weight once it has arrived: the stage's clock moves to
    ``after`` or its arrival. False while it has not been sent."""
    queue = queues[channel(s, unclaimed[0], P)]
    if not queue:
        return False
    sent_mb, ready = queue.popleft()
    act = unclaimed.popleft()
    if sent_mb != act.mb:
        raise ScheduleError(f"stage {s}: {act} got micro-batch {sent_mb} (messages out of order)")
    clock[s] = max(after, ready)
    return True
