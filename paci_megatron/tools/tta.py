"""Time to accuracy: where a validation curve first reaches a target loss, and how long that
takes on accelerators, projected with the lockstep simulator.

Pure Python, no torch. ``compare.py`` feeds it the curves of real runs; the projection runs
each schedule's own action lists (``schedule.plan_stream``) through ``simulate.seconds_per_call``
with per-action costs, so a schedule's bubble is what its lists imply for this P and M.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .. import interleaved
from ..features import METHODS
from ..features.base import PassCost
from ..shape import local_steps
from ..simulate import Costs, seconds_per_call

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
    backwards per local step (a) and virtual chunks."""

    schedule: str  # "1f1b", "interleaved" or "paci"
    num_stages: int
    microbatches: int
    accumulation: int
    virtual_chunks: int = 1
    passes: Tuple[PassCost, ...] = ()  # the run's methods' own passes (features.base.PassCost)
    # uneven stages: each stage's layers over the largest stage's (the costs are timed on a
    # stage of that size); the ends' embedding and loss are left out, which shortens 1F1B's
    # ramp a little, so the projection errs against PACI. () = even stages
    stage_scale: Tuple[float, ...] = ()

    @property
    def predicts(self) -> bool:
        """A pass before each stale forward: those forwards cost Costs.predict more."""
        return any(p.per == "stale forward" for p in self.passes)

    def updates(self, iterations: float) -> float:
        """Optimizer steps per stage after ``iterations`` iterations."""
        if self.schedule != "paci":
            return iterations
        return local_steps(iterations, self.microbatches, self.accumulation)


def seconds_per_iteration(shape: RunShape, costs: Costs) -> Tuple[float, float]:
    """(stock 1F1B, this schedule) projected seconds per iteration. Stock 1F1B is the flush
    list with one step per iteration; interleaved 1F1B is Megatron-Core's own order per rank,
    timed by its dependencies (``interleaved.py``)."""
    P, M = shape.num_stages, shape.microbatches
    if shape.stage_scale:
        costs = dataclasses.replace(costs, stage_scale=shape.stage_scale)
    flush = seconds_per_call("flush", P, M, M, costs)
    if shape.schedule == "paci":
        return flush, seconds_per_call("paci", P, shape.accumulation, M, costs,
                                       predicts=shape.predicts)
    if shape.schedule == "interleaved":
        return flush, interleaved.seconds_per_iteration(P, M, shape.virtual_chunks, costs)
    return flush, flush


# --- a method's own cost -----------------------------------------------------------------

@dataclass(frozen=True)
class MethodCost:
    """What a run's methods add to a stage's work, in forwards of that stage: per stale
    forward (the weight prediction's move and restore), per local step (the look-ahead's
    pass). ``source`` says where the figures come from."""

    per_predicted_forward: float = 0.0
    per_step: float = 0.0
    source: str = ""

    @property
    def free(self) -> bool:
        return not (self.per_predicted_forward or self.per_step)


def with_method(costs: Costs, method: Optional[MethodCost]) -> Costs:
    """The projection's per-action costs with the method's own added, stated in the
    projection's forward (None: every method's cost left out)."""
    if method is None:
        return dataclasses.replace(costs, predict=0.0)
    return dataclasses.replace(costs, step=costs.step + method.per_step * costs.forward,
                               predict=method.per_predicted_forward * costs.forward)


# --- the costs of a GPU, by stated arithmetic ---------------------------------------------

GPU_BYTES_PER_S = 4e12  # HBM bandwidth a fused elementwise pass reaches on an H200
GPU_FLOPS = 0.4 * 990e12  # 40% of an H200's dense bf16 peak
# bytes per parameter, bf16 weights with fp32 main copies and Adam's two moments:
STEP_BYTES = 30  # the step: reads grad, main, m, v (16), writes main, m, v (12), weight (2)


@dataclass(frozen=True)
class GpuModel:
    """A named GPT whose transformer layers split evenly over the stages (the embedding and
    output layer left out), at ``micro_batch`` sequences of ``seq`` tokens."""

    name: str
    layers: int
    hidden: int
    seq: int
    micro_batch: int

    def layer_params(self) -> int:
        return 12 * self.hidden ** 2 + 13 * self.hidden

    def layer_forward_flops(self) -> float:
        """2 flops a weight a token, plus attention's two (seq x seq) matmuls."""
        tokens = self.micro_batch * self.seq
        return 2.0 * tokens * 12 * self.hidden ** 2 + 4.0 * tokens * self.seq * self.hidden

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} layers of hidden {self.hidden}, micro-batch "
                f"{self.micro_batch} x {self.seq} tokens; forwards at 40% of 990 TFLOP/s "
                f"(backward 2x), steps and the methods' passes at "
                f"{GPU_BYTES_PER_S / 1e12:g} TB/s ({STEP_BYTES} B a parameter a step; "
                + ", ".join(f"{m.name} {m.COST.gpu_bytes} a pass" for m in METHODS if m.COST)
                + ")")


GPU_MODELS = {m.name: m for m in (GpuModel("gpt2-medium", 24, 1024, 1024, 4),
                                  GpuModel("gpt-1.3b", 24, 2048, 2048, 2))}


def gpu_costs(model: GpuModel, num_stages: int) -> Costs:
    """Seconds of one stage's forward, backward and step on an H200, by the arithmetic
    above (no method's cost)."""
    layers = model.layers / num_stages
    forward = layers * model.layer_forward_flops() / GPU_FLOPS
    step = layers * model.layer_params() * STEP_BYTES / GPU_BYTES_PER_S
    return Costs(forward, 2.0 * forward, step)


def gpu_method_cost(shape: RunShape, model: GpuModel) -> MethodCost:
    """The run's method's cost on that GPU, in forwards of a stage."""
    costs = gpu_costs(model, shape.num_stages)
    moved = model.layers / shape.num_stages * model.layer_params() / GPU_BYTES_PER_S
    per = {kind: sum(p.gpu_bytes for p in shape.passes if p.per == kind) * moved / costs.forward
           for kind in ("stale forward", "step")}
    return MethodCost(per["stale forward"], per["step"], source=f"arithmetic ({model.name})")


def projected_seconds(shape: RunShape, costs: Costs, iterations: float,
                      per_iteration: Optional[Tuple[float, float]] = None) -> float:
    """Projected accelerator time of ``iterations`` iterations."""
    return iterations * (per_iteration or seconds_per_iteration(shape, costs))[1]


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
