"""Check a Schedule's per-stage lists and time them, without torch: the front door to the two
communication models. ``run_lockstep`` (``lockstep.py``, the default; what gloo does here):
a send never blocks, a receive waits for its send. ``run_nccl`` (``nccl_model.py``,
``simulate(..., nccl=NcclModel(...))``): NCCL as Megatron-Core and torch drive it.
``check_plan`` is what a run's own plan passes before it starts. ``seconds_per_call`` times a
stream's steady state with a method's costs, for compare's projection and a run's end-of-run
line alike. ``python -m paci_megatron.simulate`` prints and checks a schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import FrozenSet, Optional, Sequence, Tuple

from .lockstep import (Costs, DeadlockError, Event, ScheduleError, SimResult, check_lists,
                       run_lockstep)
from .nccl_model import NcclModel, run_nccl, run_stream_nccl
from .schedule import Op, Schedule, StreamPlan, build, plan_stream

__all__ = ["Costs", "DeadlockError", "Event", "NcclModel", "ScheduleError", "SimResult",
           "check_lists", "check_plan", "run_lockstep", "run_nccl", "run_stream_nccl",
           "seconds_per_call", "simulate"]


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


@dataclass(frozen=True)
class _PredictedCosts(Costs):
    """Costs with ``predict`` added to the forwards the weight prediction moves weights for."""

    forwards: FrozenSet[Tuple[int, int]] = frozenset()  # (stage, micro-batch)

    def at(self, stage, action) -> float:
        stale = action.op is Op.FORWARD and (stage, action.mb) in self.forwards
        scale = self.stage_scale[stage] if self.stage_scale else 1.0
        return super().at(stage, action) + (self.predict * scale if stale else 0.0)


def _predicted_forwards(plan, calls: int, num_stages: int):
    """(stage, micro-batch) of every forward whose backward comes after a local step (the
    lists say which)."""
    return frozenset((s, act.mb) for s in range(num_stages) for k in range(calls)
                     for act in plan.call(k)[s]
                     if act.op is Op.FORWARD and plan.steps_before_backward(k, s, act.mb))


def seconds_per_call(kind: str, num_stages: int, accumulation: int, per_call: int,
                     costs: Costs, warmup: int = 2, timed: int = 4,
                     predicts: bool = False) -> float:
    """Steady-state time of one forward-backward call: the calls of ``plan_stream`` run in
    lockstep; per stage, the time from the end of its warm-up calls to its last action, over
    ``timed`` calls; the slowest stage. ``predicts``: every forward whose backward comes
    after a local step costs ``costs.predict`` more."""
    plan = plan_stream(kind, num_stages, accumulation, per_call)
    calls = warmup + timed
    lists = plan.lists(calls)
    if predicts and costs.predict:
        stale = _predicted_forwards(plan, calls, num_stages)
        costs = _PredictedCosts(**dataclasses.asdict(costs), forwards=stale)
    events = run_lockstep(Schedule(f"{kind}-stream", num_stages, accumulation,
                                   calls * per_call, lists), costs)
    worst = 0.0
    warm = plan.lists(warmup)
    for s, evs in enumerate(events):
        before = len(warm[s])
        start = evs[before - 1].end if before else 0.0
        worst = max(worst, evs[-1].end - start)
    return worst / timed


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Print and check a pipeline schedule.")
    parser.add_argument("--kind", default="paci", choices=["paci", "flush"])
    parser.add_argument("-P", "--stages", type=int, default=4)
    parser.add_argument("-a", "--accumulation", type=int, default=4)
    parser.add_argument("-M", "--microbatches", type=int, default=16)
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0)
    parser.add_argument("--tied", action="store_true",
                        help="tied embeddings: the tied-weight actions SG/RG, SW/RW")
    args = parser.parse_args(argv)
    sched = build(args.kind, args.stages, args.accumulation, args.microbatches, args.tied)
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
    the schedule the stream is cut from keeps every invariant of ``check_lists``; the plan's
    own first calls (its warm-up and two steady calls) run in lockstep without deadlock and
    with every message in order, and with ``nccl`` under NCCL's pairing rules too. Raises
    ScheduleError saying why not."""
    calls = len(plan.first) + 2
    whole = calls + -(-plan.num_stages // plan.per_call)
    simulate(build(plan.kind, plan.num_stages, plan.accumulation, whole * plan.per_call,
                   plan.tied))
    lists = plan.lists(calls)
    run_lockstep(Schedule(f"{plan.kind} plan (first {calls} calls)", plan.num_stages,
                          plan.accumulation, calls * plan.per_call, lists, plan.tied))
    if nccl is not None:
        run_stream_nccl(plan, calls, Costs(), nccl)
