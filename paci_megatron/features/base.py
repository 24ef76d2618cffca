"""What a stage feature is: one convergence method or option, with the hooks it needs.

Pure Python at import. The runtime calls every feature's hooks at fixed points of its
sequence (``mcore/local_step.py``, ``mcore/handlers.py``); it never asks which features are
on. A feature owns its state, its flags (``FLAGS``, in ``config.paci_flags``) and their
checks (``check``), and builds itself from the resolved configuration (``from_config``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

from ..executor import DriftStats


def optimizer_of(args) -> str:
    """--optimizer as the user chose it. The Megatron-LM drop-in hands Megatron-LM ``adam`` for
    ``nadam`` (Megatron builds Adam's wrappers, NAdam then takes the inner Adam's place) and
    keeps the choice in ``paci_optimizer``."""
    return getattr(args, "paci_optimizer", None) or getattr(args, "optimizer", "adam")


def sub_optimizers(optimizer) -> list:
    """Megatron's chained optimizer's parts, or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


@dataclass
class StageContext:
    """What features may read of their stage."""

    stage: int
    num_stages: int
    drift: DriftStats
    optimizer: Any = None
    params: Tuple = ()
    features: List["StageFeature"] = field(default_factory=list)
    accumulation: int = 1  # the plan's a
    stale: bool = True  # the plan is PACI's (not a stock warm-up or cool-down): drift exists
    per_token: bool = False  # --calculate-per-token-loss: gradients are token sums until R
    # what the action lists say: the stage's local steps between F mb and B mb
    planned_drift: Callable[[int], int] = lambda mb: 0
    loss_scale_tensor: Callable[[], Any] = lambda: None  # the buffers' loss scale (None: 1)
    weights_moved: bool = False  # a hook moved the weights: the next forward refreshes caches
    # the weight prediction's services (mcore/): the optimizer's check, the stage's flat state
    # (main_params.StageLayout, made or re-homed at each stream start), the LRs of the next
    # steps, the stage-local reduction of its clipping norm, and the distributed optimizer's
    # all-gather that completes the weights after a move
    check_prediction: Callable[[], None] = lambda: None
    prediction_layout: Callable[[], Any] = lambda: None
    prediction_mover: Callable[[], Any] = lambda: None  # layer by layer (or None: whole)
    # the pass's kernel, decided once a run and alike on the stage's ranks (Pass.settle):
    # (the piece sets moved besides the whole stage, the folds, the loss scale's inverse)
    settle_prediction: Callable[..., None] = lambda piece_sets=(), folds=(), inv_scale=None: None
    lr_sum: Callable[[dict, int], float] = lambda group, steps: steps * group["lr"]
    reduce_stage_sumsq: Optional[Callable[[Any], None]] = None
    gather_weights: Callable[[], None] = lambda: None
    # --measure-memory: a meter with window_start()/window_stop() (memory.LiveTensorMeter)
    memory_window: Any = None

    def group_mean_drift(self) -> float:
        """The mean drift of the group the next step applies, weighted as its gradients are."""
        for feature in self.features:
            mean = feature.weighted_mean_drift()
            if mean is not None:
                return mean
        return self.drift.group_mean_drift


class StageFeature:
    """Base: every hook does nothing. Hooks, in the order a stage meets them:

    - ``on_bind``: the stage's optimizer is known (refuse one the feature cannot use);
    - ``on_start``: a stream starts (the model is known; after a --load too);
    - ``before_forward`` / ``after_forward``: around a micro-batch's forward;
    - ``backward_factor``: on a backward, the factor the group's gradient buffer is scaled by
      before that micro-batch's gradient joins it, and ``token_weight``, its token count's;
    - in R, once per group: ``after_reduction`` (the data-parallel reduction is done: where
      stock's tied all-reduce reads the gradients), ``finish_factor`` (the group's gradients
      are weighed by it), ``after_weighing`` (before the per-token division);
    - ``before_step``, ``around_optimizer`` (entered only when the optimizer is called),
      ``after_step``: around the local step;
    - ``on_drain``: the stream stops at a group boundary; ``evaluating``: around an
      evaluation between two training calls;
    - ``describe`` (the start-up line) and ``summary`` (the stage's report).
    """

    name = "feature"
    FLAGS: Sequence = ()

    @staticmethod
    def check(args, layout) -> None:
        """Refuse bad values and combinations of this feature's flags (raise ConfigError)."""

    def describe(self) -> str:
        return ""

    def summary(self) -> dict:
        return {}

    def on_bind(self, ctx: StageContext) -> None:
        pass

    def on_start(self, ctx: StageContext) -> None:
        pass

    def before_forward(self, ctx: StageContext, mb: int) -> None:
        pass

    def after_forward(self, ctx: StageContext, mb: int) -> None:
        pass

    def backward_factor(self, ctx: StageContext, drift: int) -> float:
        return 1.0

    def token_weight(self, drift: int) -> float:
        return 1.0

    def after_reduction(self, ctx: StageContext) -> None:
        pass

    def finish_factor(self, ctx: StageContext, per_token: bool) -> float:
        return 1.0

    def after_weighing(self, ctx: StageContext) -> None:
        pass

    def weighted_mean_drift(self) -> Optional[float]:
        """A feature that weighs gradients says how it weighs the group's drift."""
        return None

    def before_step(self, ctx: StageContext) -> None:
        pass

    def around_optimizer(self, ctx: StageContext) -> ContextManager:
        return contextlib.nullcontext()

    def after_step(self, ctx: StageContext, record) -> None:
        pass

    def on_drain(self, ctx: StageContext) -> None:
        pass

    def evaluating(self, ctx: StageContext) -> ContextManager:
        """Entered around an evaluation (a forward-only call between two training calls)."""
        return contextlib.nullcontext()
