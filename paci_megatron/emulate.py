"""All pipeline stages in one process: one valid global order of every stage's action list.

Pure Python, no torch. ``mcore/reference.py`` uses it to run the same per-stage lists the
multi-process runtime runs, with activations and gradients handed over in memory. Any order
that respects the messages gives the same numbers (a stage's work depends only on its own
state and on what it received, in order), so the first valid one is taken.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .schedule import RECV_OPS, SEND_OPS, Action, channel

Channel = Tuple[int, int, str]


class EmulationDeadlock(RuntimeError):
    """No stage can make progress: the lists cannot run together."""


def global_order(stage_lists: Sequence[Sequence[Action]],
                 sent: Optional[Dict[Channel, Deque[int]]] = None) -> List[Tuple[int, Action]]:
    """Every stage's actions interleaved into one sequence in which each receive comes after
    its matching send (same channel, same micro-batch, in order). Runs each stage as far as
    it can, round robin; raises EmulationDeadlock when none can move. ``sent`` holds the
    messages in transit and carries over between calls (the tied weight crosses them)."""
    P = len(stage_lists)
    position = [0] * P
    sent = {} if sent is None else sent
    order: List[Tuple[int, Action]] = []
    while any(p < len(acts) for p, acts in zip(position, stage_lists)):
        moved = False
        for stage, acts in enumerate(stage_lists):
            while position[stage] < len(acts):
                act = acts[position[stage]]
                if act.op in RECV_OPS:
                    queue = sent.get(channel(stage, act, P))
                    if not queue:
                        break
                    mb = queue.popleft()
                    if mb != act.mb:
                        raise EmulationDeadlock(
                            f"stage {stage} expects {act} but the next message on its channel "
                            f"{channel(stage, act, P)} carries micro-batch {mb}")
                elif act.op in SEND_OPS:
                    sent.setdefault(channel(stage, act, P), deque()).append(act.mb)
                order.append((stage, act))
                position[stage] += 1
                moved = True
        if not moved:
            waiting = ", ".join(f"stage {s} at {acts[p]}" for s, (p, acts)
                                in enumerate(zip(position, stage_lists)) if p < len(acts))
            raise EmulationDeadlock(f"no stage can proceed: {waiting}")
    return order


def run_global(stage_lists: Sequence[Sequence[Action]],
               run_action: Callable[[int, Action], None],
               sent: Optional[Dict[Channel, Deque[int]]] = None) -> None:
    """Call ``run_action(stage, action)`` for every action, in one valid global order."""
    for stage, act in global_order(stage_lists, sent):
        run_action(stage, act)
