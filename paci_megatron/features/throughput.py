"""What a method's own cost leaves of PACI's throughput gain over 1F1B, for the end-of-run
report. Every method with a cost of its own (the prediction, the look-ahead) reads its stages'
summaries through these, so the projection is the same arithmetic whichever method ran."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple


def per_micro_batch(row: dict, pass_ms: Optional[float], passes: int) -> float:
    """``passes`` passes of ``pass_ms`` each, spread over the stage's micro-batches."""
    return (pass_ms or 0.0) * passes / max(1, sum(row["histogram"].values()))


def projected_throughput(rows: List[dict], method_ms: Callable[[dict], float]
                         ) -> Tuple[float, float]:
    """(with the method, plain PACI) throughput over 1F1B's, M = a: per micro-batch a stage
    spends 3 forwards (f + b, b = 2f) plus ``method_ms`` of it; the slowest stage sets PACI's
    pace, 1F1B's is (a + P - 1) / a of the slowest compute."""
    steps = max(r["steps"] for r in rows)
    backwards = max(sum(r["histogram"].values()) for r in rows)
    a = backwards / steps if steps else 1.0
    plain = (a + len(rows) - 1) / a
    work = [3.0 * r["forward_ms"] for r in rows if r.get("forward_ms")]
    paced = [3.0 * r["forward_ms"] + method_ms(r) for r in rows if r.get("forward_ms")]
    return plain * max(work) / max(paced), plain
