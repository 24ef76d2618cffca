"""What a method's own cost leaves of PACI's throughput gain over 1F1B, for the end-of-run
report. Every method with a cost of its own (the prediction, the look-ahead) reads its stages'
summaries through this, and it projects them as compare does: the same mean of the cost over
the stages, the stream's own lists in lockstep (``simulate.seconds_per_call``), so a run's
line and compare's report agree. Pure, no torch: compare imports it too."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from .lockstep import Costs
from .simulate import seconds_per_call


def mean_ratio(costs: Sequence[Optional[float]], forwards: Sequence[Optional[float]]
               ) -> Optional[float]:
    """Per stage, a method's cost over the same stage's forward; the mean over the stages that
    timed both (a stage without either, or at 0, left out); None when none did. Compare reads a
    run's final record through it, the run's end-of-run line its stages' summaries."""
    ratios = [c / f for c, f in zip(costs, forwards) if c and f]
    return sum(ratios) / len(ratios) if ratios else None


def mean_forwards(rows: List[dict], key: str) -> float:
    """``mean_ratio`` of the stages' summaries under ``key``; 0 when no stage timed a cost."""
    return mean_ratio([r.get(key) for r in rows], [r.get("forward_ms") for r in rows]) or 0.0


def stage_scale(forwards: Sequence[Optional[float]]) -> Tuple[float, ...]:
    """Each stage's forward time over the mean of the stages' (an uneven pipeline runs at its
    slowest stage's pace); () where a stage timed none, so all count alike."""
    if not forwards or not all(forwards):
        return ()
    mean = sum(forwards) / len(forwards)
    return tuple(f / mean for f in forwards)


def projected_throughput(rows: List[dict], per_predicted_forward: float = 0.0,
                         per_step: float = 0.0) -> Tuple[float, float]:
    """(with the method, plain PACI) throughput over 1F1B's, M = a, a backward costing two
    forwards: the method's cost, in forwards, on each forward it predicts and each local
    step. In 1F1B's tight steady state a stage's extra
    work stalls its neighbours too, so the lists, not the slowest stage, say what it costs.
    Each stage's forward and backward take its own measured forward time (``stage_scale``)."""
    steps = max(r["steps"] for r in rows)
    backwards = max(sum(r["histogram"].values()) for r in rows)
    a = max(1, round(backwards / steps)) if steps else 1
    P = len(rows)
    # a forward, a backward; no step cost but the method's; each stage at its own pace
    unit = Costs(1.0, 2.0, stage_scale=stage_scale([r.get("stage_forward_ms") for r in rows]))
    costs = dataclasses.replace(unit, step=per_step, predict=per_predicted_forward)
    flush = seconds_per_call("flush", P, a, a, unit)
    plain = flush / seconds_per_call("paci", P, a, a, unit)
    with_it = flush / seconds_per_call("paci", P, a, a, costs, predicts=True)
    return with_it, plain
