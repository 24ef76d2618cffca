"""Run one stage's action list by dispatching each action to a handler.

Torch-free: the handlers (``mcore/runtime.py`` for Megatron-Core, fakes in the tests) do the
work; this module owns the order, the weight-version bookkeeping and the drift guard.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Protocol, Sequence

from .schedule import Action, Op, work_items


class Handlers(Protocol):
    """One method per kind of action (the tied ones only where the lists have them)."""

    def forward(self, mb: int) -> None: ...

    def backward(self, mb: int) -> None: ...

    def communicate(self, actions: Sequence[Action]) -> None:
        """Post the sends and complete the receives of consecutive point-to-point actions."""

    def reduce(self, mb: int) -> None:
        """Finish the group's gradients: the data-parallel sync (stage-local)."""

    def step(self, mb: int) -> None: ...

    def send_tied_grad(self, mb: int) -> None: ...

    def recv_tied_grad(self, mb: int) -> None: ...

    def send_tied_weight(self, mb: int) -> None: ...

    def recv_tied_weight(self, mb: int) -> None: ...


HANDLER_OF = {Op.REDUCE: "reduce", Op.SEND_TIED_GRAD: "send_tied_grad",
              Op.RECV_TIED_GRAD: "recv_tied_grad", Op.SEND_TIED_WEIGHT: "send_tied_weight",
              Op.RECV_TIED_WEIGHT: "recv_tied_weight"}


class DriftBoundExceeded(RuntimeError):
    def __init__(self, stage: int, mb: int, fwd_version: int, bwd_version: int, bound: int):
        self.stage, self.mb, self.bound = stage, mb, bound
        self.fwd_version, self.bwd_version = fwd_version, bwd_version
        super().__init__(
            f"PACI drift bound violated at stage {stage}: micro-batch {mb} ran forward on weight "
            f"version {fwd_version} and backward on version {bwd_version} (drift "
            f"{bwd_version - fwd_version} > --paci-max-drift {bound})"
        )


class ExecutionError(RuntimeError):
    """An action failed; says which stage and action, and shows the list around it."""


@dataclass
class DriftStats:
    """Per-stage record of weight versions: version = local optimizer steps taken so far."""

    stage: int
    bound: Optional[int]
    version: int = 0
    fwd_version: Dict[int, int] = field(default_factory=dict)
    histogram: Counter = field(default_factory=Counter)
    # (mb, fwd_version, bwd_version) of the most recent backwards
    log: Deque[tuple] = field(default_factory=lambda: deque(maxlen=4096))
    group_backwards: int = 0  # since the last step (the group the next step applies)

    def on_forward(self, mb: int) -> None:
        self.fwd_version[mb] = self.version

    def on_backward(self, mb: int) -> None:
        fwd = self.fwd_version.pop(mb)
        drift = self.version - fwd
        if self.bound is not None and drift > self.bound:
            raise DriftBoundExceeded(self.stage, mb, fwd, self.version, self.bound)
        self.histogram[drift] += 1
        self.log.append((mb, fwd, self.version))
        self.group_backwards += 1

    def on_step(self) -> None:
        self.version += 1
        self.group_backwards = 0

    def forget_in_flight(self) -> List[int]:
        """Drop micro-batches whose forward ran but whose backward never will (a drain)."""
        dropped = sorted(self.fwd_version)
        self.fwd_version.clear()
        return dropped

    @property
    def max(self) -> int:
        return max(self.histogram, default=0)


def _context(actions: Sequence[Action], index: int, radius: int = 4) -> str:
    lo, hi = max(0, index - radius), min(len(actions), index + radius + 1)
    parts = [f"[{a}]" if i == index else str(a) for i, a in enumerate(actions[lo:hi], lo)]
    return ("... " if lo else "") + " ".join(parts) + (" ..." if hi < len(actions) else "")


class StageExecutor:
    """Executes a stage's actions in order, one work item at a time (``schedule.work_items``:
    consecutive point-to-point actions go together to ``Handlers.communicate``, Megatron's
    fused send/recv, which NCCL needs to avoid deadlock)."""

    def __init__(self, stage: int, handlers: Handlers, drift: DriftStats):
        self.stage = stage
        self.handlers = handlers
        self.drift = drift

    def run(self, actions: Sequence[Action]) -> None:
        index = 0
        for item in work_items(actions):
            try:
                self._dispatch(item)
            except (DriftBoundExceeded, ExecutionError):
                raise
            except Exception as exc:
                raise ExecutionError(
                    f"stage {self.stage} failed at {actions[index]}: {type(exc).__name__}: {exc}"
                    f"\n  stage {self.stage} actions: {_context(actions, index)}"
                ) from exc
            index += len(item) if isinstance(item, tuple) else 1

    def _dispatch(self, item) -> None:
        if isinstance(item, tuple):
            self.handlers.communicate(item)
        elif item.op is Op.FORWARD:
            self.drift.on_forward(item.mb)
            self.handlers.forward(item.mb)
        elif item.op is Op.BACKWARD:
            self.drift.on_backward(item.mb)
            self.handlers.backward(item.mb)
        elif item.op is Op.STEP:
            self.handlers.step(item.mb)
            self.drift.on_step()
        else:
            getattr(self.handlers, HANDLER_OF[item.op])(item.mb)


class ReplayIterator:
    """Wraps a stage's data iterator so that the items consumed by forwards that a drain
    throws away are served again, in order, by the next forwards."""

    def __init__(self, base: Optional[Iterator]):
        self.base = base
        self.current: Optional[int] = None
        self.taken: Dict[int, List[Any]] = {}
        self.replay: Deque[Any] = deque()

    def __iter__(self):
        return self

    def __next__(self):
        item = self.replay.popleft() if self.replay else next(self.base)
        self.taken.setdefault(self.current, []).append(item)
        return item

    def release(self, mb: int) -> None:
        self.taken.pop(mb, None)

    def rewind(self, mbs: Sequence[int]) -> int:
        items = [item for mb in sorted(mbs) for item in self.taken.pop(mb, [])]
        self.replay.extendleft(reversed(items))
        return len(items)
