"""Pipeline schedules selectable by name (``--pipeline-schedule``).

An entry says how to build its forward-backward function once Megatron's process groups
exist. ``None`` from ``make`` means "leave Megatron-Core's own choice untouched", which is what
``1f1b`` and ``interleaved`` do. What each schedule accepts is checked by ``config.resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .config import SCHEDULES, PaciConfig


@dataclass(frozen=True)
class ScheduleEntry:
    name: str
    description: str
    make: Callable[[PaciConfig], Optional[object]]


def make_paci_runtime(cfg: PaciConfig):
    """The PACI runtime a resolved configuration asks for: its plan policy (a fixed or an
    automatic a) and its stage features."""
    from .adapt import Adaptive, candidates
    from .features import build_features
    from .mcore.runtime import PaciRuntime
    from .plan_policy import AdaptivePlan, PlanPolicy

    shape = cfg.shape
    if cfg.auto:
        adaptive = Adaptive(shape.num_stages, shape.per_call,
                            candidates(shape.num_stages, shape.per_call, cfg.max_drift),
                            cfg.adapt_interval, cfg.adapt_tolerance, cfg.adapt_policy)
        policy = AdaptivePlan(shape.num_stages, adaptive, cfg.max_drift)
    else:
        policy = PlanPolicy("paci", shape.num_stages, shape.accumulation)
    runtime = PaciRuntime(accumulation=shape.accumulation, max_drift=cfg.max_drift,
                          on_nonfinite=cfg.on_nonfinite, policy=policy,
                          features=build_features(cfg))
    runtime.accumulation_follows = cfg.accumulation_follows
    return runtime


class ScheduleRegistry:
    def __init__(self):
        self._entries: Dict[str, ScheduleEntry] = {}

    def register(self, entry: ScheduleEntry) -> None:
        if entry.name in self._entries:
            raise ValueError(f"schedule {entry.name!r} is already registered")
        self._entries[entry.name] = entry

    def names(self) -> List[str]:
        return list(self._entries)

    def get(self, name: str) -> ScheduleEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"--pipeline-schedule {name!r} is unknown; choose one of {self.names()}"
            ) from None


def default_registry() -> ScheduleRegistry:
    reg = ScheduleRegistry()
    descriptions = {"1f1b": "stock Megatron-Core 1F1B (flush at every step)",
                    "interleaved": "stock Megatron-Core interleaved 1F1B",
                    "paci": "PACI: never-flushing 1F1B, per-stage steps every a backwards, "
                            "drift <= ceil((P-1-s)/a)"}
    for name in SCHEDULES:
        make = make_paci_runtime if name == "paci" else (lambda cfg: None)
        reg.register(ScheduleEntry(name, descriptions[name], make))
    return reg


SCHEDULES_BY_NAME = default_registry()
