"""Which plan each forward-backward call runs, decided between calls.

``PlanPolicy``: a fixed accumulation factor. ``AdaptivePlan`` (--paci-accumulation-factor
auto): the factor is chosen between calls by ``adapt.Adaptive`` from a signal every rank
measures at its steps (``WeightChange``) and reduces without blocking. Torch (for that
reduction), no Megatron.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

from .adapt import Adaptive, bound_in_call, staleness
from .features.base import StageContext, StageFeature
from .schedule import StreamPlan, plan_stream


class PlanPolicy:
    """A fixed accumulation factor: every call runs the same plan."""

    def __init__(self, kind: str, num_stages: int, accumulation: int):
        self.kind = kind
        self.num_stages = num_stages
        self.factor = accumulation  # the a of the plans this policy hands out
        self.features: tuple = ()  # stage features the policy needs (a meter)

    def plan(self, calls_done: int, per_call: int, tied: bool) -> StreamPlan:
        return plan_stream(self.kind, self.num_stages, self.factor, per_call, tied)

    def before_call(self, rt, plan: StreamPlan) -> StreamPlan:
        return plan

    def after_call(self, rt) -> None:
        pass

    def finish(self) -> None:
        """Wait for anything this policy still has in flight (a drain)."""

    def summary(self, calls_done: int) -> dict:
        return {}


class WeightChange(StageFeature):
    """The relative weight change of a local step, ||w_new - w_old|| / ||w_old||, estimated on
    a fixed strided sample of about 256 entries per parameter (no copy of the weights), and
    averaged over the steps since the last ``take``."""

    name = "weight_change"
    SAMPLE = 256

    def __init__(self):
        self._sum = 0.0
        self._count = 0

    def _sample(self, params) -> list:
        return [p.detach().reshape(-1)[::max(1, p.numel() // self.SAMPLE)].float().clone()
                for p in params]

    @contextlib.contextmanager
    def measured(self, params):
        old = self._sample(params)
        yield
        new = self._sample(params)
        moved = sum(float((n - o).square().sum()) for n, o in zip(new, old))
        size = sum(float(o.square().sum()) for o in old)
        self._sum += (moved / size) ** 0.5 if size > 0 else 0.0
        self._count += 1

    def around_optimizer(self, ctx: StageContext):
        return self.measured(ctx.params)

    def take(self) -> float:
        mean = self._sum / self._count if self._count else 0.0
        self._sum, self._count = 0.0, 0
        return mean


class AdaptivePlan(PlanPolicy):
    """--paci-accumulation-factor auto (see adapt.py): every ``interval`` calls each rank sends
    its stage's staleness into a non-blocking MAX all-reduce over all ranks, applied two calls
    later by every rank at the same call; the plan of the new a exchanges the same messages.
    While micro-batches forwarded under a larger a are in flight, the drift guard allows the
    bound of the smaller a (``adapt.bound_in_call``)."""

    def __init__(self, num_stages: int, adaptive: Adaptive, max_drift: Optional[int] = None):
        super().__init__("paci", num_stages, adaptive.current)
        self.adaptive = adaptive
        self.max_drift = max_drift
        self.meter = WeightChange()
        self.features = (self.meter,)
        self._pending = None  # (all-reduce work, its tensor, the call it applies from)
        self._before: Dict[int, int] = {}
        self.call_drift: Dict[int, int] = {}  # call -> largest drift of its backwards

    def before_call(self, rt, plan: StreamPlan) -> StreamPlan:
        """Apply a decision that is due, swap in the plan of the new a (same messages, steps
        elsewhere) and set the drift guard to the bound of this call."""
        ad = self.adaptive
        if self._pending is not None and self._pending[2] <= rt.calls_done:
            work, signal, _ = self._pending
            work.wait()
            self._pending = None
            ad.current = ad.decide(float(signal.item()))
        if plan.kind == "paci" and ad.current != plan.accumulation:
            self.factor = ad.current
            plan = plan_stream("paci", self.num_stages, self.factor, plan.per_call)
        ad.record_call(rt.calls_done, plan.accumulation)
        if self.max_drift is None and plan.kind == "paci":
            rt.drift.bound = bound_in_call(self.num_stages, rt.stage, plan.per_call,
                                           ad.factors, rt.calls_done)
        self._before = dict(rt.drift.histogram)
        return plan

    def after_call(self, rt) -> None:
        """Record this call's largest drift; every ``interval`` calls send this stage's
        staleness into the reduction."""
        import torch

        ad = self.adaptive
        grown = [d for d, n in rt.drift.histogram.items() if n > self._before.get(d, 0)]
        self.call_drift[rt.calls_done - 1] = max(grown, default=0)
        if self._pending is not None or not ad.request_due(rt.calls_done):
            return
        value = staleness(self.meter.take(), self.num_stages, rt.stage)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        signal = torch.tensor([value], dtype=torch.float64, device=device)
        work = torch.distributed.all_reduce(signal, op=torch.distributed.ReduceOp.MAX,
                                            async_op=True)
        self._pending = (work, signal, rt.calls_done + 1)

    def finish(self) -> None:
        if self._pending is not None:  # every rank sent its part: finishing it waits on none
            self._pending[0].wait()

    def summary(self, calls_done: int) -> dict:
        """a per call, as (first call, a) runs; max drift per call."""
        return {"factor_changes": list(self.adaptive.changes),
                "call_drift": [self.call_drift.get(k) for k in range(calls_done)]}
