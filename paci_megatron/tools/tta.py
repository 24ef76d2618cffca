"""Time to accuracy: where a validation curve first reaches a target loss, and how long that
takes on accelerators, projected with the lockstep simulator.

Pure Python, no torch. ``compare.py`` feeds it the curves of real runs; the projection runs
each schedule's own action lists (``schedule.plan_stream``) through ``simulate.run_lockstep``
with per-action costs, so a schedule's bubble is what its lists imply for this P and M.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence, Tuple

from .. import interleaved
from ..schedule import Op, Schedule, plan_stream
from ..shape import local_steps, stock_iterations
from ..simulate import Costs, run_lockstep

# A curve point: (x values, loss). The x values (samples, updates, seconds, ...) all grow with
# training, so one fraction between two points interpolates every one of them.
Point = Tuple[Sequence[float], float]


def reach(points: Sequence[Point], target: float) -> Optional[Tuple[float, ...]]:
    """The x values where the curve first gets to ``target`` or below, interpolated linearly
    between the last point above it and the first one at or below it; the first point's own
    x values when it is already there (nothing is known before it); None when never reached.
    A curve that goes down, up and down again counts its first crossing."""
    previous = None
    for xs, loss in points:
        if loss <= target:
            if previous is None:
                return tuple(float(x) for x in xs)
            (xs0, loss0) = previous
            frac = (loss0 - target) / (loss0 - loss)
            return tuple(x0 + frac * (x1 - x0) for x0, x1 in zip(xs0, xs))
        previous = (xs, loss)
    return None


def mean_and_spread(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


# --- the projection -------------------------------------------------------------------------

@dataclass(frozen=True)
class RunShape:
    """What the simulator needs of a run: schedule, stages, micro-batches per iteration (M),
    backwards per local step (a), stock-1F1B warm-up iterations and virtual chunks."""

    schedule: str  # "1f1b", "interleaved" or "paci"
    num_stages: int
    microbatches: int
    accumulation: int
    sync_iters: int = 0
    cooldown_start: Optional[int] = None  # --paci-cooldown-iters: stock 1F1B from here on
    virtual_chunks: int = 1
    predicts: bool = False  # --paci-weight-prediction: stale forwards cost Costs.predict more

    def updates(self, iterations: float) -> float:
        """Optimizer steps per stage after ``iterations`` iterations."""
        if self.schedule != "paci":
            return iterations
        return local_steps(iterations, self.microbatches, self.accumulation, self.sync_iters,
                           self.cooldown_start)


@dataclass(frozen=True)
class _PredictedCosts(Costs):
    """Costs with ``predict`` added to the forwards the weight prediction moves weights for."""

    forwards: FrozenSet[Tuple[int, int]] = frozenset()  # (stage, micro-batch)

    def at(self, stage, action) -> float:
        stale = action.op is Op.FORWARD and (stage, action.mb) in self.forwards
        return self.of(action) + (self.predict if stale else 0.0)


def seconds_per_call(kind: str, num_stages: int, accumulation: int, per_call: int,
                     costs: Costs, warmup: int = 2, timed: int = 4,
                     predicts: bool = False) -> float:
    """Steady-state time of one forward-backward call: the calls of ``plan_stream`` run in
    lockstep; per stage, the time from the end of its warm-up calls to its last action, over
    ``timed`` calls; the slowest stage. ``predicts``: every forward whose backward comes
    after a local step (the lists say which) costs ``costs.predict`` more."""
    plan = plan_stream(kind, num_stages, accumulation, per_call)
    calls = warmup + timed
    lists = tuple(tuple(act for k in range(calls) for act in plan.call(k)[s])
                  for s in range(num_stages))
    if predicts and costs.predict:
        stale = frozenset((s, act.mb) for k in range(calls) for s in range(num_stages)
                          for act in plan.call(k)[s] if act.op is Op.FORWARD
                          and plan.steps_before_backward(k, s, act.mb))
        costs = _PredictedCosts(**dataclasses.asdict(costs), forwards=stale)
    events = run_lockstep(Schedule(f"{kind}-stream", num_stages, accumulation,
                                   calls * per_call, lists), costs)
    worst = 0.0
    for s, evs in enumerate(events):
        before = sum(len(plan.call(k)[s]) for k in range(warmup))
        start = evs[before - 1].end if before else 0.0
        worst = max(worst, evs[-1].end - start)
    return worst / timed


def seconds_per_iteration(shape: RunShape, costs: Costs) -> Tuple[float, float]:
    """(stock 1F1B, this schedule) projected seconds per iteration. Stock 1F1B is the flush
    list with one step per iteration; interleaved 1F1B is Megatron-Core's own order per rank,
    timed by its dependencies (``interleaved.py``)."""
    P, M = shape.num_stages, shape.microbatches
    flush = seconds_per_call("flush", P, M, M, costs)
    if shape.schedule == "paci":
        return flush, seconds_per_call("paci", P, shape.accumulation, M, costs,
                                       predicts=shape.predicts)
    if shape.schedule == "interleaved":
        return flush, interleaved.seconds_per_iteration(P, M, shape.virtual_chunks, costs)
    return flush, flush


def projected_seconds(shape: RunShape, costs: Costs, iterations: float,
                      per_iteration: Optional[Tuple[float, float]] = None) -> float:
    """Projected accelerator time of ``iterations`` iterations (the stock-1F1B warm-up and
    cool-down iterations at stock 1F1B's pace)."""
    sync_s, main_s = per_iteration or seconds_per_iteration(shape, costs)
    sync = stock_iterations(iterations, shape.sync_iters, shape.cooldown_start) \
        if shape.schedule == "paci" else 0
    return sync * sync_s + (iterations - sync) * main_s


def loss_at(points: Sequence[Point], x_index: int, x: float) -> Optional[float]:
    """The loss at ``x`` (``x_index`` picks which x), interpolated linearly along the curve;
    the first point's loss before it, the last one's after it; None for an empty curve."""
    if not points:
        return None
    prev = None
    for xs, loss in points:
        if xs[x_index] >= x:
            if prev is None:
                return loss
            x0, l0 = prev
            frac = (x - x0) / (xs[x_index] - x0) if xs[x_index] > x0 else 1.0
            return l0 + frac * (loss - l0)
        prev = (xs[x_index], loss)
    return points[-1][1]


def run_fraction_target(points: Sequence[Point], x_index: int, fraction: float
                        ) -> Optional[float]:
    """The loss at ``fraction`` of the last point's x (1: the final loss); None for an empty
    curve."""
    if not points:
        return None
    return loss_at(points, x_index, points[-1][0][x_index] * fraction)


def mid_run_target(points: Sequence[Point], x_index: int) -> Optional[float]:
    """The loss at half the last point's x; None for an empty curve."""
    return run_fraction_target(points, x_index, 0.5)


def interleaved_seconds_per_iteration(num_stages: int, microbatches: int, costs: Costs,
                                      chunks: int = 2) -> Optional[float]:
    """Megatron-Core's interleaved 1F1B with ``chunks`` virtual stages at this P and M, or
    None where it cannot run (P < 2, or M not a multiple of P)."""
    if num_stages < 2 or microbatches % num_stages:
        return None
    shape = RunShape("interleaved", num_stages, microbatches, microbatches,
                     virtual_chunks=chunks)
    return seconds_per_iteration(shape, costs)[1]


def gaps_at(base: Sequence[Point], run: Sequence[Point], x_index: int,
            fractions: Sequence[float]) -> List[Optional[float]]:
    """The run's loss over the baseline's minus 1, in percent, at each fraction of the
    baseline's last x (equal samples when x is samples); None where a curve is empty."""
    if not base or not run:
        return [None] * len(fractions)
    out = []
    for f in fractions:
        x = f * base[-1][0][x_index]
        b, r = loss_at(base, x_index, x), loss_at(run, x_index, x)
        out.append(100.0 * (r / b - 1.0))
    return out


def speedups(base: List[Optional[float]], run: List[Optional[float]]) -> List[float]:
    """Per seed: the baseline's time over the run's, where both reached the target."""
    return [b / r for b, r in zip(base, run) if b is not None and r is not None and r > 0]
