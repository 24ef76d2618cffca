"""What a stage feature is (hooks at fixed points of a stage's sequence), and what a
convergence method is: a feature that also owns its flags, their checks, its resolved
settings, its start-up and end-of-run lines, its compare label, its cost in the projections
and its step in the one-process emulator.

Pure Python at import (torch only inside the hooks). The runtime calls every feature's hooks
at fixed points of its sequence (``mcore/local_step.py``, ``mcore/handlers.py``); it never
asks which features are on. A method is one file under ``features/`` and one line of
``features.METHODS``: ``config`` reads its flags and settings, ``tools/compare`` its label and
cost, ``mcore/reference.py`` its emulated step, all through ``Method``'s interface.
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
    per_token: bool = False  # --calculate-per-token-loss: gradients are token sums until R
    # what the action lists say: the stage's local steps between F mb and B mb
    planned_drift: Callable[[int], int] = lambda mb: 0
    loss_scale_tensor: Callable[[], Any] = lambda: None  # the buffers' loss scale (None: 1)
    weights_moved: bool = False  # a hook moved the weights: the next forward refreshes caches
    # services for methods that move the weights (mcore/): the optimizer's check, the stage's
    # flat state (main_params.StageLayout, made or re-homed at each stream start), the LRs of
    # the next steps, the stage-local reduction of a clipping norm, and the distributed
    # optimizer's all-gather that completes the weights after a move
    check_flat_state: Callable[[], None] = lambda: None
    flat_state: Callable[[], Any] = lambda: None
    layer_mover: Callable[[], Any] = lambda: None  # layer by layer (or None: whole)
    # the pass's kernel, decided once a run and alike on the stage's ranks (Pass.settle):
    # (the piece sets moved besides the whole stage, the folds, the loss scale's inverse)
    settle_pass: Callable[..., None] = lambda piece_sets=(), folds=(), inv_scale=None: None
    lr_sum: Callable[[dict, int], float] = lambda group, steps: steps * group["lr"]
    reduce_stage_sumsq: Optional[Callable[[Any], None]] = None
    gather_weights: Callable[[], None] = lambda: None
    # --measure-memory: a meter with window_start()/window_stop() (memory.LiveTensorMeter)
    memory_window: Any = None


class StageFeature:
    """Base: every hook does nothing. Hooks, in the order a stage meets them:

    - ``on_bind``: the stage's optimizer is known (refuse one the feature cannot use);
    - ``on_start``: a stream starts (the model is known; after a --load too);
    - ``before_forward`` / ``after_forward``: around a micro-batch's forward;
    - ``after_reduction``: in R, once per group, the data-parallel reduction done (where
      stock's tied all-reduce reads the gradients; before the per-token division);
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

    def after_reduction(self, ctx: StageContext) -> None:
        pass

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


@dataclass(frozen=True)
class PassCost:
    """How a method's own cost enters the throughput projections: timed per ``per`` ("stale
    forward" or "step") and reported under ``key`` in a stage's summary (ms, beside its
    ``forward_ms``); ``gpu_bytes`` a parameter of the stage per pass for the GPU arithmetic
    (bf16 weights, fp32 main copies and moments)."""

    key: str
    per: str
    gpu_bytes: int


class Method(StageFeature):
    """A convergence method: a stage feature plus its configuration-time side (class methods:
    nothing here needs torch or a process group).

    ``settings(args)`` is the method's resolved settings for a run (None: off), kept in
    ``PaciConfig.methods`` under ``name``; ``build(settings)`` makes the stage's feature,
    ``emulated(settings)`` the emulator's own implementation of it (``mcore/reference.py``
    calls ``before_forward``, ``after_forward``, ``on_stream_start``, ``after_step`` and
    ``on_drain`` on it with a view of one emulated stage)."""

    COST: Optional[PassCost] = None

    @classmethod
    def settings(cls, args) -> Any:
        return None

    @classmethod
    def off_note(cls, args) -> str:
        """The start-up line of a run whose flags turn this method's default off ("": none)."""
        return ""

    @classmethod
    def build(cls, settings) -> "Method":
        return cls(settings)

    @classmethod
    def label(cls, settings) -> str:
        """The method as compare names a run of it."""
        return cls.name

    @classmethod
    def given(cls, args) -> bool:
        """The user named one of this method's flags (on or off)."""
        return any(getattr(args, flag.dest, None) is not None for flag in cls.FLAGS)

    @classmethod
    def cost_lines(cls, rows: List[dict], prefix: str = "> stage") -> List[str]:
        """The end-of-run lines of this method's cost, from every stage's summary."""
        return []

    @classmethod
    def emulated(cls, settings) -> Any:
        raise NotImplementedError(f"{cls.name} has no emulated step")
