"""Pipeline schedules as plain data: one list of actions per stage.

Pure Python, no torch. The same lists are checked by ``simulate.py`` and run by
``executor.py``, so what the tests validate is exactly what the runtime does.

An action is printed like ``F3`` (forward of micro-batch 3), ``B3`` (backward),
``SF3``/``RF3`` (send/receive the activation of micro-batch 3 to/from the next/previous
stage), ``SB3``/``RB3`` (send/receive its gradient to/from the previous/next stage) and
``T7`` (local optimizer step right after the backward of micro-batch 7).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, List, Sequence, Tuple


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    STEP = "T"


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD)
SEND_OPS = (Op.SEND_F, Op.SEND_B)
RECV_OPS = (Op.RECV_F, Op.RECV_B)
_ACTION_RE = re.compile(r"^(SF|RF|SB|RB|F|B|T)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    op: Op
    mb: int  # micro-batch index; for STEP, the micro-batch whose backward closes the group

    def __str__(self) -> str:
        return f"{self.op.value}{self.mb}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. F3, B3, SF3, RB3, T7)")
        return Action(Op(match.group(1)), int(match.group(2)))

    def shifted(self, offset: int) -> "Action":
        return Action(self.op, self.mb + offset)


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists for P stages, M micro-batches, a step every ``a`` backwards."""

    name: str
    num_stages: int
    accumulation: int
    num_microbatches: int
    stages: Tuple[Tuple[Action, ...], ...]

    def __str__(self) -> str:
        head = (
            f"{self.name}: P={self.num_stages} a={self.accumulation} "
            f"M={self.num_microbatches}"
        )
        rows = [f"  stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(self.stages)]
        return "\n".join([head] + rows)

    @staticmethod
    def parse(name: str, accumulation: int, text_rows: Sequence[str]) -> "Schedule":
        stages = tuple(tuple(Action.parse(t) for t in row.split()) for row in text_rows)
        num_mb = 1 + max((a.mb for row in stages for a in row if a.op in COMPUTE_OPS), default=-1)
        return Schedule(name, len(stages), accumulation, num_mb, stages)


def drift_bound(num_stages: int, stage: int, accumulation: int) -> int:
    """Largest number of local steps between a micro-batch's forward and backward at ``stage``."""
    return math.ceil((num_stages - 1 - stage) / accumulation)


def check_max_drift(num_stages: int, accumulation: int, max_drift) -> None:
    """--paci-max-drift below stage 0's bound cannot be honoured by any PACI run."""
    need = drift_bound(num_stages, 0, accumulation)
    if max_drift is not None and max_drift < need:
        raise ValueError(
            f"--paci-max-drift {max_drift} is below the theoretical bound ceil((P-1)/a) = "
            f"{need} for P={num_stages}, a={accumulation}: raise --paci-max-drift or "
            "--paci-accumulation-factor")


def check_params(num_stages: int, accumulation: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"number of pipeline stages must be >= 1, got {num_stages}")
    if accumulation < 1:
        raise ValueError(
            f"--paci-accumulation-factor must be >= 1, got {accumulation}: it is the number of "
            "backward passes a stage accumulates before its optimizer step"
        )
    if num_microbatches < 0:
        raise ValueError(f"number of micro-batches must be >= 0, got {num_microbatches}")


def _forward_actions(stage: int, num_stages: int, mb: int) -> List[Action]:
    acts = [] if stage == 0 else [Action(Op.RECV_F, mb)]
    acts.append(Action(Op.FORWARD, mb))
    if stage < num_stages - 1:
        acts.append(Action(Op.SEND_F, mb))
    return acts


def _backward_actions(stage: int, num_stages: int, mb: int, accumulation: int) -> List[Action]:
    acts = [] if stage == num_stages - 1 else [Action(Op.RECV_B, mb)]
    acts.append(Action(Op.BACKWARD, mb))
    if stage > 0:
        acts.append(Action(Op.SEND_B, mb))
    if (mb + 1) % accumulation == 0:
        acts.append(Action(Op.STEP, mb))
    return acts


def _one_f_one_b(stage: int, num_stages: int, mbs: Sequence[int], accumulation: int) -> List[Action]:
    """1F1B over ``mbs``: P-1-s warm-up forwards, then alternate, then drain the rest."""
    warmup = min(num_stages - 1 - stage, len(mbs))
    acts: List[Action] = []
    for mb in mbs[:warmup]:
        acts += _forward_actions(stage, num_stages, mb)
    for i, mb in enumerate(mbs):
        if i + warmup < len(mbs):
            acts += _forward_actions(stage, num_stages, mbs[i + warmup])
        acts += _backward_actions(stage, num_stages, mb, accumulation)
    return acts


def receive_before_step(actions: Sequence[Action]) -> List[Action]:
    """Move the receive of the next forward input from just after a local step to just before
    it: ``B j SB j T j RF k`` becomes ``B j SB j RF k T j``.

    ``SB j`` and ``RF k`` then form one exchange (Megatron's send_backward_recv_forward), the
    partner of the previous stage's ``SF k``+``RB j``. With NCCL that partner exchange completes
    only once this stage posts ``RF k``; behind the step it would wait for the step (batched
    p2p) or deadlock (unbatched, P >= 3, or with the variable-length shape exchange). Only the
    time the receive buffer is posted changes; F k still runs after the step.
    """
    out = list(actions)
    for i in range(len(out) - 1):
        if out[i].op is Op.STEP and out[i + 1].op is Op.RECV_F:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def build_paci(num_stages: int, accumulation: int, num_microbatches: int) -> Schedule:
    """PACI: one 1F1B stream that never flushes; each stage steps after every a-th backward.

    Stage s keeps P-1-s forwards ahead of its backwards, so it holds at most P-s micro-batches
    in flight, and a micro-batch sees at most ceil((P-1-s)/a) local steps between its forward
    and its backward there. No exchange a neighbour waits on sits behind a step
    (``receive_before_step``), so the lists are safe under NCCL's pairing rules
    (``simulate.run_nccl``).
    """
    check_params(num_stages, accumulation, num_microbatches)
    mbs = list(range(num_microbatches))
    stages = tuple(
        tuple(receive_before_step(_one_f_one_b(s, num_stages, mbs, accumulation)))
        for s in range(num_stages)
    )
    return Schedule("paci", num_stages, accumulation, num_microbatches, stages)


def build_flush(num_stages: int, accumulation: int, num_microbatches: int) -> Schedule:
    """The synchronous baseline: stock 1F1B over each group of a micro-batches, drained
    before every step (what Megatron-Core does with num_microbatches = a per iteration)."""
    check_params(num_stages, accumulation, num_microbatches)
    stages = []
    for s in range(num_stages):
        acts: List[Action] = []
        for start in range(0, num_microbatches, accumulation):
            group = list(range(start, min(start + accumulation, num_microbatches)))
            acts += _one_f_one_b(s, num_stages, group, accumulation)
        stages.append(tuple(acts))
    return Schedule("1f1b-flush", num_stages, accumulation, num_microbatches, tuple(stages))


SCHEDULE_BUILDERS = {"paci": build_paci, "flush": build_flush}


def build(kind: str, num_stages: int, accumulation: int, num_microbatches: int) -> Schedule:
    try:
        builder = SCHEDULE_BUILDERS[kind]
    except KeyError:
        raise ValueError(f"unknown schedule kind {kind!r}; known: {sorted(SCHEDULE_BUILDERS)}")
    return builder(num_stages, accumulation, num_microbatches)


# --- cutting the stream into calls --------------------------------------------------------

def peer(stage: int, op: Op) -> int:
    """The stage on the other end of a communication action."""
    return stage + 1 if op in (Op.SEND_F, Op.RECV_B) else stage - 1


def channel(stage: int, action: Action) -> Tuple[int, int, str]:
    """(sender, receiver, direction) of a communication action."""
    direction = "F" if action.op in (Op.SEND_F, Op.RECV_F) else "B"
    if action.op in SEND_OPS:
        return (stage, peer(stage, action.op), direction)
    return (peer(stage, action.op), stage, direction)


def exchanges(actions: Sequence[Action]) -> List[Tuple[Action, ...]]:
    """Split consecutive communication actions into exchanges (one ``_communicate`` call, so
    one batched NCCL group each): a new exchange starts where an op would repeat."""
    out: List[Tuple[Action, ...]] = []
    batch: List[Action] = []
    for act in actions:
        if any(b.op is act.op for b in batch):
            out.append(tuple(batch))
            batch = []
        batch.append(act)
    if batch:
        out.append(tuple(batch))
    return out


def _index_after_backward(actions: Sequence[Action], count: int) -> int:
    """Index just past the ``count``-th backward and the send/step that close it (with the
    receive that ``receive_before_step`` put before that step)."""
    if count == 0:
        return 0
    seen = 0
    for i, act in enumerate(actions):
        if act.op is Op.BACKWARD:
            seen += 1
            if seen == count:
                j = i + 1
                while j < len(actions) and actions[j].op in (Op.SEND_B, Op.STEP):
                    j += 1
                if j + 1 < len(actions) and actions[j].op is Op.RECV_F \
                        and actions[j + 1] == Action(Op.STEP, act.mb):
                    j += 2
                return j
    raise ValueError(f"stage has fewer than {count} backward passes")


def cut_points(schedule: Schedule, backwards: int) -> Tuple[int, ...]:
    """Where each stage stops so that every stage has done ``backwards`` backward passes and
    every message sent before the cut is also received before it.

    A stage past its last backward may still take the receive of its next forward input if
    the sender already sent it (PACI's steady state); a flush schedule has none such.
    """
    cuts = [_index_after_backward(acts, backwards) for acts in schedule.stages]
    changed = True
    while changed:
        changed = False
        for s, acts in enumerate(schedule.stages):
            i = cuts[s]
            if i < len(acts) and acts[i].op in RECV_OPS:
                src = peer(s, acts[i].op)
                sent = [a for a in schedule.stages[src][: cuts[src]] if a.op in SEND_OPS
                        and channel(src, a) == channel(s, acts[i])]
                got = [a for a in acts[:i] if a.op in RECV_OPS and channel(s, a) == channel(s, acts[i])]
                if len(sent) > len(got):
                    cuts[s] = i + 1
                    changed = True
    return tuple(cuts)


def segments(schedule: Schedule, backwards_per_call: int) -> List[Tuple[Tuple[Action, ...], ...]]:
    """Split every stage's list into consecutive calls of ``backwards_per_call`` backwards."""
    total = schedule.num_microbatches
    if backwards_per_call < 1 or total % backwards_per_call:
        raise ValueError(
            f"{total} micro-batches do not split into calls of {backwards_per_call} backwards"
        )
    starts = [tuple(0 for _ in schedule.stages)]
    for k in range(1, total // backwards_per_call + 1):
        starts.append(cut_points(schedule, k * backwards_per_call))
    ends = list(starts[1:])
    ends[-1] = tuple(len(acts) for acts in schedule.stages)
    segs = [
        tuple(acts[b:e] for acts, b, e in zip(schedule.stages, begin, end))
        for begin, end in zip(starts, ends)
    ]
    for k, seg in enumerate(segs):
        _check_closed(seg, k)
    return segs


def _check_closed(segment: Sequence[Sequence[Action]], k: int) -> None:
    """No message may cross a call boundary: what a call sends, it also receives."""
    sent = sorted((channel(s, a), a.mb) for s, acts in enumerate(segment) for a in acts
                  if a.op in SEND_OPS)
    got = sorted((channel(s, a), a.mb) for s, acts in enumerate(segment) for a in acts
                 if a.op in RECV_OPS)
    if sent != got:
        raise ValueError(f"call {k} leaves messages in transit: sent {sent}, received {got}")


def shift_segment(segment: Iterable[Sequence[Action]], offset: int) -> Tuple[Tuple[Action, ...], ...]:
    return tuple(tuple(a.shifted(offset) for a in acts) for acts in segment)


# --- the runtime's view: an endless stream cut into calls of N micro-batches ---------------

def check_per_call(num_microbatches_per_call: int, accumulation: int) -> None:
    if num_microbatches_per_call < 1:
        raise ValueError(f"number of micro-batches per call must be >= 1, got "
                         f"{num_microbatches_per_call}")
    if num_microbatches_per_call % accumulation:
        raise ValueError(
            f"--paci-accumulation-factor {accumulation} must divide the number of micro-batches "
            f"per global batch ({num_microbatches_per_call} = --global-batch-size / "
            "(--micro-batch-size x data-parallel size)), so that every iteration ends on a "
            "local optimizer step of every stage; pick a divisor or change --global-batch-size"
        )


@dataclass(frozen=True)
class StreamPlan:
    """What each stage runs in the k-th call of an endless stream of N micro-batches a call.

    Call 0 starts from an empty pipeline (warm-up); every later call is the same list shifted
    by N micro-batches. After a call, stage s of PACI holds P-1-s forwards in flight (and, for
    s > 0, the received input of its next forward); a flush plan holds none.
    """

    kind: str
    num_stages: int
    accumulation: int
    per_call: int
    first: Tuple[Tuple[Action, ...], ...]
    steady: Tuple[Tuple[Action, ...], ...]

    def call(self, k: int) -> Tuple[Tuple[Action, ...], ...]:
        if k == 0:
            return self.first
        return shift_segment(self.steady, (k - 1) * self.per_call)

    def __str__(self) -> str:
        rows = [f"{self.kind} stream: P={self.num_stages} a={self.accumulation} "
                f"N={self.per_call} per call"]
        for title, seg in (("call 0", self.first), ("call k>=1 (k-1)*N later", self.steady)):
            rows.append(f" {title}:")
            rows += [f"  stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(seg)]
        return "\n".join(rows)


def plan_stream(kind: str, num_stages: int, accumulation: int, per_call: int) -> StreamPlan:
    check_per_call(per_call, accumulation)
    calls = 3 + math.ceil(num_stages / per_call)
    sched = build(kind, num_stages, accumulation, per_call * calls)
    segs = segments(sched, per_call)
    for k in range(2, calls - math.ceil(num_stages / per_call)):
        if shift_segment(segs[1], (k - 1) * per_call) != segs[k]:
            raise ValueError(f"{kind} schedule is not periodic from call 1 on (call {k} differs)")
    return StreamPlan(kind, num_stages, accumulation, per_call, segs[0], segs[1])
