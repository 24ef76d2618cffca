"""Pipeline schedules as plain data: one list of actions per stage.

Pure Python, no torch. The same lists are checked by ``simulate.py`` and run by
``executor.py``, so what the tests validate is exactly what the runtime does.

An action is printed like ``F3`` (forward of micro-batch 3), ``B3`` (backward),
``SF3``/``RF3`` (send/receive the activation of micro-batch 3 to/from the next/previous
stage), ``SB3``/``RB3`` (send/receive its gradient to/from the previous/next stage), ``R7``
(finish the group closed by the backward of micro-batch 7: its data-parallel gradient sync)
and ``T7`` (the local optimizer step after it). With tied embeddings (P > 1), ``SG7``/``RG7``
carry the last stage's output-layer gradient of that group (reduced over data parallel, at its
``R7``) to stage 0, and ``SW7``/``RW7``
stage 0's tied weight after its step ``T7`` to the last stage, which installs it after its
own step ``tied_lag`` steps later (``install_step``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from .shape import closes_group, drift_bound, tied_lag


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    REDUCE = "R"
    STEP = "T"
    SEND_TIED_GRAD = "SG"
    RECV_TIED_GRAD = "RG"
    SEND_TIED_WEIGHT = "SW"
    RECV_TIED_WEIGHT = "RW"


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD)
# point to point between neighbouring stages (Megatron's P2PCommunicator), batched into exchanges
P2P_SENDS = (Op.SEND_F, Op.SEND_B)
P2P_RECVS = (Op.RECV_F, Op.RECV_B)
P2P_OPS = P2P_SENDS + P2P_RECVS
# between stage 0 and the last stage, over the embedding group
TIED_OPS = (Op.SEND_TIED_GRAD, Op.RECV_TIED_GRAD, Op.SEND_TIED_WEIGHT, Op.RECV_TIED_WEIGHT)
SEND_OPS = P2P_SENDS + (Op.SEND_TIED_GRAD, Op.SEND_TIED_WEIGHT)
RECV_OPS = P2P_RECVS + (Op.RECV_TIED_GRAD, Op.RECV_TIED_WEIGHT)
# what follows the backward that closes a group (after its gradient went back): the tied
# messages of that group, and the group's gradients finished and stepped
STEP_BLOCK = (Op.SEND_TIED_GRAD, Op.RECV_TIED_WEIGHT, Op.RECV_TIED_GRAD, Op.REDUCE, Op.STEP,
              Op.SEND_TIED_WEIGHT)
_ACTION_RE = re.compile(r"^(SF|RF|SB|RB|SG|RG|SW|RW|F|B|R|T)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    op: Op
    # micro-batch index; for R, T and the tied actions the micro-batch whose backward closes
    # the group (for SW and RW: the group of stage 0's step whose weight travels)
    mb: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.mb}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. F3, B3, SF3, RB3, R7, T7)")
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
    tied: bool = False  # stage 0 and the last stage exchange a tied weight (SG/RG, SW/RW)

    def __str__(self) -> str:
        head = (
            f"{self.name}: P={self.num_stages} a={self.accumulation} "
            f"M={self.num_microbatches}{' tied' if self.tied else ''}"
        )
        rows = [f"  stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(self.stages)]
        return "\n".join([head] + rows)

    @staticmethod
    def parse(name: str, accumulation: int, text_rows: Sequence[str]) -> "Schedule":
        stages = tuple(tuple(Action.parse(t) for t in row.split()) for row in text_rows)
        num_mb = 1 + max((a.mb for row in stages for a in row if a.op in COMPUTE_OPS), default=-1)
        tied = any(a.op in TIED_OPS for row in stages for a in row)
        return Schedule(name, len(stages), accumulation, num_mb, stages, tied)


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


def _backward_actions(stage: int, num_stages: int, mb: int, accumulation: int,
                      tied: bool) -> List[Action]:
    """RB, B, SB, and after the backward that closes a group: R, T. Tied, the group's two
    messages in the same order at both ends: the last stage sends its output-layer gradient
    as its data-parallel reduction left it (SG, right after its R) and posts the receive of
    stage 0's weight of that group (RW); stage 0 receives that gradient before its R (RG),
    which adds it to its own reduced one, and sends the weight it stepped to after its T
    (SW)."""
    first, last = stage == 0, stage == num_stages - 1
    acts = [] if last else [Action(Op.RECV_B, mb)]
    acts.append(Action(Op.BACKWARD, mb))
    closes = closes_group(mb, accumulation)
    if not first:
        acts.append(Action(Op.SEND_B, mb))
    if not closes:
        return acts
    if tied and first:
        acts.append(Action(Op.RECV_TIED_GRAD, mb))
    acts.append(Action(Op.REDUCE, mb))
    if tied and last:
        acts += [Action(Op.SEND_TIED_GRAD, mb), Action(Op.RECV_TIED_WEIGHT, mb)]
    acts.append(Action(Op.STEP, mb))
    if tied and first:
        acts.append(Action(Op.SEND_TIED_WEIGHT, mb))
    return acts


def install_step(mb: int, num_stages: int, accumulation: int) -> int:
    """The last stage's step (the micro-batch closing it) after which it installs stage 0's
    weight of the step closing ``mb``: ``tied_lag`` steps later. RW only posts the receive;
    the install waits for it there."""
    return mb + tied_lag(num_stages, accumulation) * accumulation


def _one_f_one_b(stage: int, num_stages: int, mbs: Sequence[int], accumulation: int,
                 tied: bool = False) -> List[Action]:
    """1F1B over ``mbs``: P-1-s warm-up forwards, then alternate, then drain the rest."""
    warmup = min(num_stages - 1 - stage, len(mbs))
    acts: List[Action] = []
    for mb in mbs[:warmup]:
        acts += _forward_actions(stage, num_stages, mb)
    for i, mb in enumerate(mbs):
        if i + warmup < len(mbs):
            acts += _forward_actions(stage, num_stages, mbs[i + warmup])
        acts += _backward_actions(stage, num_stages, mb, accumulation, tied)
    return acts


def receive_before_step(actions: Sequence[Action]) -> List[Action]:
    """Move the receive of the next forward input from just after a local step to just before
    the group's gradients are finished: ``B j SB j R j T j RF k`` becomes
    ``B j SB j RF k R j T j`` (the last stage's tied messages, ``SG j RW j``, stay between
    ``R j`` and ``T j``).

    ``SB j`` and ``RF k`` then form one exchange (Megatron's send_backward_recv_forward), the
    partner of the previous stage's ``SF k``+``RB j``. With NCCL that partner exchange completes
    only once this stage posts ``RF k``; behind the step it would wait for the step (batched
    p2p) or deadlock (unbatched, P >= 3, or with the variable-length shape exchange). Only the
    time the receive buffer is posted changes; F k still runs after the step.
    """
    out = list(actions)
    for i, act in enumerate(out):
        if act.op is Op.RECV_F:
            j = i
            while j > 0 and out[j - 1].op in STEP_BLOCK:
                j -= 1
            out.insert(j, out.pop(i))
    return out


def build_paci(num_stages: int, accumulation: int, num_microbatches: int,
               tied: bool = False) -> Schedule:
    """PACI: one 1F1B stream that never flushes; each stage steps after every a-th backward.

    Stage s keeps P-1-s forwards ahead of its backwards, so it holds at most P-s micro-batches
    in flight, and a micro-batch sees at most ceil((P-1-s)/a) local steps between its forward
    and its backward there. No exchange a neighbour waits on sits behind a step
    (``receive_before_step``), so the lists are safe under NCCL's pairing rules
    (``simulate.run_nccl``). ``tied`` (P > 1): the tied-weight exchange of ``mcore/tied.py``.
    """
    check_params(num_stages, accumulation, num_microbatches)
    tied = tied and num_stages > 1
    mbs = list(range(num_microbatches))
    stages = [receive_before_step(_one_f_one_b(s, num_stages, mbs, accumulation, tied))
              for s in range(num_stages)]
    return Schedule("paci", num_stages, accumulation, num_microbatches,
                    tuple(map(tuple, stages)), tied)


def build_flush(num_stages: int, accumulation: int, num_microbatches: int,
                tied: bool = False) -> Schedule:
    """The synchronous baseline: stock 1F1B over each group of a micro-batches, drained
    before every step (what Megatron-Core does with num_microbatches = a per iteration).
    Tied weights stay equal through stock's all-reduce inside R: no tied messages."""
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


def build(kind: str, num_stages: int, accumulation: int, num_microbatches: int,
          tied: bool = False) -> Schedule:
    try:
        builder = SCHEDULE_BUILDERS[kind]
    except KeyError:
        raise ValueError(f"unknown schedule kind {kind!r}; known: {sorted(SCHEDULE_BUILDERS)}")
    return builder(num_stages, accumulation, num_microbatches, tied)


# --- who talks to whom ----------------------------------------------------------------------

def peer(stage: int, op: Op, num_stages: Optional[int] = None) -> int:
    """The stage on the other end of a communication action (``num_stages`` for tied ones)."""
    if op in TIED_OPS:
        if num_stages is None:
            raise ValueError(f"the peer of {op.value} needs the number of stages")
        return num_stages - 1 if stage == 0 else 0
    return stage + 1 if op in (Op.SEND_F, Op.RECV_B) else stage - 1


_DIRECTION = {Op.SEND_F: "F", Op.RECV_F: "F", Op.SEND_B: "B", Op.RECV_B: "B",
              Op.SEND_TIED_GRAD: "G", Op.RECV_TIED_GRAD: "G",
              Op.SEND_TIED_WEIGHT: "W", Op.RECV_TIED_WEIGHT: "W"}


def channel(stage: int, action: Action, num_stages: Optional[int] = None) -> Tuple[int, int, str]:
    """(sender, receiver, direction) of a communication action; messages on one channel
    arrive in the order they were sent."""
    other = peer(stage, action.op, num_stages)
    direction = _DIRECTION[action.op]
    return (stage, other, direction) if action.op in SEND_OPS else (other, stage, direction)


# --- what the executor dispatches -----------------------------------------------------------

WorkItem = Union[Action, Tuple[Action, ...]]


def work_items(actions: Sequence[Action]) -> List[WorkItem]:
    """A stage's list as the executor runs it: one item per action, except that consecutive
    point-to-point actions form one item (handed together to the runtime, which posts them as
    Megatron's fused exchanges: NCCL needs the pairs posted together to avoid deadlock)."""
    items: List[WorkItem] = []
    for act in actions:
        if act.op not in P2P_OPS:
            items.append(act)
        elif items and isinstance(items[-1], tuple):
            items[-1] += (act,)
        else:
            items.append((act,))
    return items


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


# --- cutting the stream into calls ----------------------------------------------------------

_CLOSING = (Op.SEND_B,) + STEP_BLOCK


def _index_after_backward(actions: Sequence[Action], count: int) -> int:
    """Index just past the ``count``-th backward and what closes it: its gradient's send and,
    if it closes a group, the step block (with the receive that ``receive_before_step`` put
    before that block)."""
    if count == 0:
        return 0
    seen = 0
    for i, act in enumerate(actions):
        if act.op is Op.BACKWARD:
            seen += 1
            if seen == count:
                j = i + 1
                while j < len(actions) and actions[j].op in _CLOSING:
                    j += 1
                if j + 1 < len(actions) and actions[j].op is Op.RECV_F \
                        and actions[j + 1].op in STEP_BLOCK and actions[j + 1].mb == act.mb:
                    j += 1
                    while j < len(actions) and actions[j].op in STEP_BLOCK:
                        j += 1
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
            if i < len(acts) and acts[i].op in P2P_RECVS:
                src = peer(s, acts[i].op)
                sent = [a for a in schedule.stages[src][: cuts[src]] if a.op in P2P_SENDS
                        and channel(src, a) == channel(s, acts[i])]
                got = [a for a in acts[:i] if a.op in P2P_RECVS and channel(s, a) == channel(s, acts[i])]
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
    """No message may cross a call boundary: what a call sends, it also receives (the tied
    weight too; the last stage installs it L steps later from where it was received)."""
    P = len(segment)

    def messages(ops):
        return sorted((channel(s, a, P), a.mb) for s, acts in enumerate(segment) for a in acts
                      if a.op in ops)

    sent = messages(SEND_OPS)
    got = messages(RECV_OPS)
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


Segment = Tuple[Tuple[Action, ...], ...]


@dataclass(frozen=True)
class StreamPlan:
    """What each stage runs in the k-th call of an endless stream of N micro-batches a call.

    The first calls start from an empty pipeline (warm-up); every later call is the same list
    shifted by N micro-batches (with tied embeddings too: the lists do not show which of the
    last stage's steps install a weight, ``install_step`` does). After a call, stage s of
    PACI holds P-1-s forwards in flight (and, for s > 0, the received input of its next
    forward); a flush plan holds none.
    """

    kind: str
    num_stages: int
    accumulation: int
    per_call: int
    first: Tuple[Segment, ...]  # calls 0 .. len(first)-1
    steady: Segment  # call len(first); call k is it shifted by (k - len(first)) x N
    tied: bool = False

    def call(self, k: int) -> Segment:
        if k < len(self.first):
            return self.first[k]
        return shift_segment(self.steady, (k - len(self.first)) * self.per_call)

    def lists(self, calls: int) -> Tuple[Tuple[Action, ...], ...]:
        """Each stage's actions over calls 0..calls-1 (each call cut once, not once a stage)."""
        cut = [self.call(k) for k in range(calls)]
        return tuple(tuple(act for seg in cut for act in seg[s]) for s in range(self.num_stages))

    def steps_before_backward(self, call: int, stage: int, mb: int) -> int:
        """What the lists say of micro-batch ``mb``, forwarded in call ``call``: the local
        steps (T) ``stage`` takes before its backward (in this call or a later one)."""
        steps, seen = 0, False
        for k in range(call, call + self.num_stages + 2):
            for act in self.call(k)[stage]:
                if not seen:
                    seen = act.op is Op.FORWARD and act.mb == mb
                elif act.op is Op.BACKWARD and act.mb == mb:
                    return steps
                else:
                    steps += act.op is Op.STEP
            if not seen:
                raise ValueError(f"call {call} of stage {stage} has no F{mb}")
        raise ValueError(f"no B{mb} follows F{mb} on stage {stage}")

    def __str__(self) -> str:
        rows = [f"{self.kind} stream: P={self.num_stages} a={self.accumulation} "
                f"N={self.per_call} per call{' tied' if self.tied else ''}"]
        k0 = len(self.first)
        titled = [(f"call {k}", seg) for k, seg in enumerate(self.first)]
        titled.append((f"call k>={k0} (k-{k0})*N later", self.steady))
        for title, seg in titled:
            rows.append(f" {title}:")
            rows += [f"  stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(seg)]
        return "\n".join(rows)


def plan_stream(kind: str, num_stages: int, accumulation: int, per_call: int,
                tied: bool = False) -> StreamPlan:
    """Cut a long schedule into calls and find where it becomes periodic. The calls at the
    end of the finite schedule (its cool-down) are not part of the endless stream."""
    check_per_call(per_call, accumulation)
    tied = tied and kind == "paci" and num_stages > 1
    warm = math.ceil(num_stages / per_call)
    calls = warm + 3 + math.ceil(num_stages / per_call)
    segs = segments(build(kind, num_stages, accumulation, per_call * calls, tied), per_call)
    usable = calls - math.ceil(num_stages / per_call)  # the tail drains the finite schedule
    for k0 in range(1, usable - 1):
        if all(shift_segment(segs[k0], (k - k0) * per_call) == segs[k] for k in range(k0, usable)):
            return StreamPlan(kind, num_stages, accumulation, per_call, tuple(segs[:k0]),
                              segs[k0], tied)
    raise ValueError(f"{kind} schedule is not periodic by call {usable - 2}")
