"""``--paci-accumulation-factor auto``: the accumulation factor chosen at iteration boundaries.

Pure Python, no torch. Why a may change between two training calls: with a dividing the
micro-batches per call N, every call ends on a local step of every stage, so all stages hold
the same number of weight versions there; and the step actions T move no message, so a plan
with another a exchanges exactly the same messages (``same_messages`` checks it). The runtime
therefore swaps ``plan_stream(kind, P, a_new, N)`` in between two calls and keeps going.

Drift across a change. A micro-batch in flight over a change counts the old factor's steps
before the boundary and the new one's after it; boundaries fall on multiples of both factors,
so its drift is at most ``ceil((P-1-s) / min(a over the calls it spans))``: after a change the
bound is the larger of the two bounds for ``ceil((P-1-s)/N)`` calls, then the new factor's
(``bound_in_call``; ``stream_drift`` measures it on the simulator, P <= 8, every pair).

The policy (``choose_factor``): the error of a stale gradient grows with how far the weights
moved between its forward and its backward, i.e. with (relative weight change per local step)
x (local steps in flight). Stage s sees about (P-1-s)/a steps between a forward and its
backward, so the staleness of stage s at factor a is ``r x (P-1-s) / a``, with r the stage's
measured relative weight change per step (Adam-like optimisers move each weight by about the
learning rate per step whatever the batch, so r is taken as independent of a). The policy
takes the smallest candidate a (the most updates per sample) whose predicted staleness stays
within a tolerance: ``--paci-adapt-tolerance``, or by default the largest staleness plain PACI
(a = N) would have had so far, i.e. the peak signal / N. So a = N early, while the weights
move fast (the early gap to 1F1B is what it damps), and smaller a later, as the learning rate
decays and the weights settle: auto never lets a stale gradient get worse than plain PACI's
worst, and spends the slack on more (smaller) updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .schedule import COMPUTE_OPS, Op, drift_bound, plan_stream

POLICIES = ("staleness", "cycle")


def candidates(num_stages: int, per_call: int, max_drift: Optional[int]) -> Tuple[int, ...]:
    """The divisors of N whose stage-0 bound is within --paci-max-drift, largest first."""
    divisors = [a for a in range(per_call, 0, -1) if per_call % a == 0]
    if max_drift is None:
        return tuple(divisors)
    return tuple(a for a in divisors if drift_bound(num_stages, 0, a) <= max_drift)


def window_calls(num_stages: int, stage: int, per_call: int) -> int:
    """How many calls before this one can hold the forward of a micro-batch backwarded in it."""
    return math.ceil((num_stages - 1 - stage) / per_call)


def bound_in_call(num_stages: int, stage: int, per_call: int, factors: Sequence[int],
                  k: int) -> int:
    """Largest drift at ``stage`` of a backward in call ``k`` when call j runs ``factors[j]``."""
    lo = max(0, k - window_calls(num_stages, stage, per_call))
    return drift_bound(num_stages, stage, min(factors[lo:k + 1]))


def staleness(weight_change_per_step: float, num_stages: int, stage: int) -> float:
    """A stage's signal, before dividing by a: relative weight change per step x (P-1-s)."""
    return weight_change_per_step * (num_stages - 1 - stage)


def choose_factor(signal: float, options: Sequence[int], tolerance: float) -> int:
    """The smallest a among ``options`` with ``signal / a <= tolerance``; the largest option
    when none qualifies (or the signal is not finite: the weights blew up, go closest to
    1F1B)."""
    if not options:
        raise ValueError("no accumulation factor to choose from")
    if not math.isfinite(signal):
        return max(options)
    fitting = [a for a in options if signal <= tolerance * a]
    return min(fitting) if fitting else max(options)


def cycle_factor(decision: int, options: Sequence[int]) -> int:
    """--paci-adapt-policy cycle (a test policy): the options in turn, largest first."""
    return options[decision % len(options)]


@dataclass
class Adaptive:
    """What every rank keeps to agree on a: the same decisions at the same calls.

    A decision is requested after every ``interval``-th training call (its signal goes out in
    one non-blocking all-reduce) and applied two calls later: by the time any rank finishes the
    next call every rank has finished the one before (neighbours' messages chain them), so the
    reduction is complete by then and waiting for it costs no stall.
    """

    num_stages: int
    per_call: int
    options: Tuple[int, ...]
    interval: int
    tolerance: float
    policy: str = "staleness"
    current: int = 0
    decisions: int = 0
    last_signal: Optional[float] = None  # the latest reduced staleness (all ranks' max)
    peak_signal: float = 0.0  # the largest so far: sets the tolerance when none is given
    factors: List[int] = field(default_factory=list)  # a of every training call so far
    changes: List[Tuple[int, int]] = field(default_factory=list)  # (first call, a)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"--paci-adapt-policy must be one of {POLICIES}, got "
                             f"{self.policy!r}")
        if not self.current:
            self.current = max(self.options)

    def request_due(self, calls_done: int) -> bool:
        return calls_done > 0 and calls_done % self.interval == 0

    def decide(self, signal: float) -> int:
        """The factor for the calls from the next application on (all ranks: same signal)."""
        self.last_signal = signal
        if self.policy == "cycle":
            self.decisions += 1
            return cycle_factor(self.decisions, self.options)
        self.decisions += 1
        if math.isfinite(signal):
            self.peak_signal = max(self.peak_signal, signal)
        tolerance = self.tolerance or self.peak_signal / self.per_call
        return choose_factor(signal, self.options, tolerance)

    def record_call(self, call: int, factor: int) -> None:
        while len(self.factors) < call:  # calls from before a --load: unknown, take this a
            self.factors.append(factor)
        self.factors.append(factor)
        if not self.changes or self.changes[-1][1] != factor:
            self.changes.append((call, factor))


# --- the simulator's view of a stream whose a changes between calls ---------------------------

def stream_with_factors(num_stages: int, per_call: int, factors: Sequence[int],
                        kind: str = "paci") -> List[List[tuple]]:
    """Each stage's actions of calls 0..len(factors)-1, call k cut from a = factors[k]'s plan,
    each action tagged with its call: [(call, action), ...] per stage."""
    plans: Dict[int, object] = {}
    rows: List[List[tuple]] = [[] for _ in range(num_stages)]
    for k, a in enumerate(factors):
        if a not in plans:
            plans[a] = plan_stream(kind, num_stages, a, per_call)
        for s, acts in enumerate(plans[a].call(k)):
            rows[s] += [(k, act) for act in acts]
    return rows


def same_messages(num_stages: int, per_call: int, factors: Sequence[int]) -> bool:
    """True when every factor's plan runs the same actions but for the group-closing R and T,
    call by call."""
    def without_steps(a):
        plan = plan_stream("paci", num_stages, a, per_call)
        return [[tuple(x for x in plan.call(k)[s] if x.op not in (Op.REDUCE, Op.STEP))
                 for s in range(num_stages)] for k in range(3)]

    first = without_steps(factors[0])
    return all(without_steps(a) == first for a in factors[1:])


def stream_drift(rows: Sequence[Sequence[tuple]]) -> List[Dict[int, int]]:
    """Per stage, the largest drift among the backwards of each call (call -> drift), counting
    the steps each stage takes between a micro-batch's forward and its backward."""
    out: List[Dict[int, int]] = []
    for row in rows:
        steps = 0
        fwd: Dict[int, int] = {}
        worst: Dict[int, int] = {}
        for call, act in row:
            if act.op is Op.FORWARD:
                fwd[act.mb] = steps
            elif act.op is Op.BACKWARD:
                worst[call] = max(worst.get(call, 0), steps - fwd.pop(act.mb))
            elif act.op is Op.STEP:
                steps += 1
        out.append(worst)
    return out


def compute_actions(rows: Sequence[Sequence[tuple]]) -> List[List[object]]:
    return [[act for _, act in row if act.op in COMPUTE_OPS] for row in rows]
