"""What a method's own cost leaves of PACI's throughput gain over 1F1B, for the end-of-run
report. Every method with a cost of its own (the prediction, the look-ahead) reads its stages'
summaries through this, and it projects them as compare does: the stream's own lists in
lockstep (``simulate.seconds_per_call``), so a run's line and compare's report agree."""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..lockstep import Costs
from ..simulate import seconds_per_call


def mean_forwards(rows: List[dict], key: str) -> Optional[float]:
    """The cost a stage's summary times under ``key``, over that stage's forward, the mean over
    the stages that timed both (compare's reading of the same figures); None when none did."""
    ratios = [r[key] / r["forward_ms"] for r in rows
              if r.get(key) is not None and r.get("forward_ms")]
    return sum(ratios) / len(ratios) if ratios else None


def projected_throughput(rows: List[dict], per_predicted_forward: float = 0.0,
                         per_step: float = 0.0, per_group: bool = False
                         ) -> Tuple[float, float]:
    """(with the method, plain PACI) throughput over 1F1B's, M = a, a backward costing two
    forwards: the method's cost, in forwards, on each forward it predicts (``per_group``: the
    first of each group) and each local step. In 1F1B's tight steady state a stage's extra
    work stalls its neighbours too, so the lists, not the slowest stage, say what it costs."""
    steps = max(r["steps"] for r in rows)
    backwards = max(sum(r["histogram"].values()) for r in rows)
    a = max(1, round(backwards / steps)) if steps else 1
    P = len(rows)
    costs = Costs(1.0, 2.0, per_step, predict=per_predicted_forward)
    flush = seconds_per_call("flush", P, a, a, Costs(1.0, 2.0))
    plain = flush / seconds_per_call("paci", P, a, a, Costs(1.0, 2.0))
    with_it = flush / seconds_per_call("paci", P, a, a, costs, predicts=True,
                                       per_group=per_group)
    return with_it, plain
