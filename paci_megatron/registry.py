"""Pipeline schedules selectable by name (``--pipeline-schedule``).

Pure: an entry says what it needs and how to build its forward-backward function once
Megatron's process groups exist. ``None`` from ``make`` means "leave Megatron-Core's own
choice untouched", which is what ``1f1b`` and ``interleaved`` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional


@dataclass(frozen=True)
class ScheduleOptions:
    pipeline_size: int
    virtual_size: Optional[int]
    num_microbatches: int
    accumulation: int
    max_drift: Optional[int] = None
    micro_batch_size: int = 1
    data_parallel_size: int = 1
    on_nonfinite: str = "skip"
    sync_iters: int = 0  # --paci-sync-iters: stock 1F1B for the first K iterations
    stale_grad_weight: float = 1.0  # --paci-stale-grad-weight W
    stale_grad_correction: float = 0.0  # --paci-stale-grad-correction K
    # --paci-accumulation-factor auto: decide every adapt_interval iterations (0: fixed a)
    adapt_interval: int = 0
    adapt_tolerance: float = 0.0
    adapt_policy: str = "staleness"


@dataclass(frozen=True)
class ScheduleEntry:
    name: str
    description: str
    check: Callable[[ScheduleOptions], None]
    make: Callable[[ScheduleOptions], Optional[object]]


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


def _check_1f1b(opts: ScheduleOptions) -> None:
    if opts.virtual_size is not None:
        raise ValueError("--pipeline-schedule 1f1b runs without virtual stages; drop "
                         "--num-layers-per-virtual-pipeline-stage or use "
                         "--pipeline-schedule interleaved")


def _check_interleaved(opts: ScheduleOptions) -> None:
    if opts.virtual_size is None or opts.pipeline_size < 2:
        raise ValueError("--pipeline-schedule interleaved needs --pipeline-model-parallel-size "
                         ">= 2 and --num-layers-per-virtual-pipeline-stage")
    if opts.num_microbatches % opts.pipeline_size:
        raise ValueError(f"--pipeline-schedule interleaved needs the number of micro-batches "
                         f"({opts.num_microbatches}) to be a multiple of "
                         f"--pipeline-model-parallel-size ({opts.pipeline_size})")


def _check_paci(opts: ScheduleOptions) -> None:
    from .schedule import check_max_drift, check_per_call

    if opts.virtual_size is not None:
        raise ValueError("--pipeline-schedule paci does not support virtual pipeline stages; "
                         "drop --num-layers-per-virtual-pipeline-stage")
    if opts.accumulation < 1:
        raise ValueError(f"--paci-accumulation-factor must be >= 1, got {opts.accumulation}")
    check_per_call(opts.num_microbatches, opts.accumulation)
    check_max_drift(opts.pipeline_size, opts.accumulation, opts.max_drift)


def _make_paci(opts: ScheduleOptions):
    from .adapt import Adaptive, candidates
    from .mcore.runtime import PaciRuntime

    adaptive = None
    if opts.adapt_interval:
        adaptive = Adaptive(
            opts.pipeline_size, opts.num_microbatches,
            candidates(opts.pipeline_size, opts.num_microbatches, opts.max_drift),
            opts.adapt_interval, opts.adapt_tolerance, opts.adapt_policy)
    return PaciRuntime(accumulation=opts.accumulation, max_drift=opts.max_drift,
                       on_nonfinite=opts.on_nonfinite, sync_calls=opts.sync_iters,
                       adaptive=adaptive, stale_grad_weight=opts.stale_grad_weight,
                       stale_grad_correction=opts.stale_grad_correction)


def default_registry() -> ScheduleRegistry:
    reg = ScheduleRegistry()
    reg.register(ScheduleEntry("1f1b", "stock Megatron-Core 1F1B (flush at every step)",
                               _check_1f1b, lambda opts: None))
    reg.register(ScheduleEntry("interleaved", "stock Megatron-Core interleaved 1F1B",
                               _check_interleaved, lambda opts: None))
    reg.register(ScheduleEntry("paci", "PACI: never-flushing 1F1B, per-stage steps every a "
                               "backwards, drift <= ceil((P-1-s)/a)", _check_paci, _make_paci))
    return reg


SCHEDULES = default_registry()
