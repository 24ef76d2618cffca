"""--paci-lookahead C: the stage's model weights run C x d_s steps ahead of its true weights.

A stale micro-batch at stage s ran its forward on weights about d_s local steps older than
the ones its backward meets (d_s = (P-1-s)/a, the stage's planned mean drift). Forward weight
prediction moves the weights before each stale forward and back after it: a pass a stale
forward. The look-ahead moves them once a step instead: right after each local step (which
Megatron ends by writing the bf16/fp16 model weights from the fp32 main copies), the model
weights become

    main x (1 - c lr wd) - c lr m / (sqrt(v) + eps)     (Adam, bias-corrected; c = C x d_s)

the moments' update direction c steps on (SGD: its momentum buffer), the same pass as the
prediction's without a gradient (``prediction_pass.py``). Every forward and backward of the
stage, fresh or stale, runs on them until the next step; the main copies, the optimizer's
state, the distributed optimizer's shards and the checkpoints keep the true weights (a drain
and an evaluation put them back, and the look-ahead returns after). Nothing per forward;
one pass per step (and, with the distributed optimizer, one all-gather). fp32 is refused: the
model weights are the optimizer's own there.

Related: Nesterov's look-ahead; Kosson et al. 2021 (arXiv 2003.11666), "spike compensation"
and linear weight prediction for asynchronous pipelines. What it gains: the study in
benchmarks (issue 31).
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional

from ..flag import ConfigError, Flag
from .base import Method, PassCost, StageContext, optimizer_of
from .moves import UNTIMED_COMPILE, flat_state_unsupported, predict_ahead, versions_kept
from ..throughput import mean_forwards, projected_throughput
from .timer import SpanTimer

LOOKAHEAD_FLAG = Flag(
    "--paci-lookahead", type=float, metavar="C", neutral=0.0,
    help="after each local step, run the stage's model weights C x d_s steps ahead of the "
         "optimizer's true weights along its moments' update (d_s = (P-1-s)/a, the stage's "
         "planned mean drift; the main copies and checkpoints stay true): one pass a step, "
         "nothing per forward. Needs --bf16 or --fp16; not with --paci-weight-prediction "
         "(default 0: off)")


def check_strength(strength: float) -> None:
    if not 0.0 <= strength < float("inf") or math.isnan(strength):
        raise ConfigError(f"--paci-lookahead {strength:g} must be a finite number >= 0 "
                          "(0: off)")


def mean_drift(num_stages: int, stage: int, accumulation: int) -> float:
    """The stage's planned mean drift: (P-1-s)/a (never above the bound ceil of it)."""
    return (num_stages - 1 - stage) / accumulation


def cost_lines(rows: List[dict], prefix: str = "> stage") -> List[str]:
    """The end of a run, from every stage's summary: what the look-ahead's pass cost each
    stage that looked ahead, a step, in forwards of that stage, and the throughput that leaves
    PACI against 1F1B's (M = a; a backward costs 2 forwards). No lines when nothing was timed."""
    timed = [r for r in rows if r.get("lookahead_ms") is not None and r.get("forward_ms")]
    if not timed:
        return []
    lines = [f"{prefix} {r['stage']}: look-ahead pass {r['lookahead_ms']:.2f} ms a step against "
             f"{r['forward_ms']:.2f} ms a forward ({r['lookahead_ms'] / r['forward_ms']:.2f} "
             "forwards a step)" for r in timed]
    with_it, plain = projected_throughput(rows, per_step=mean_forwards(timed, "lookahead_ms"))
    lines.append(f"> PACI: the look-ahead's cost leaves a projected throughput of {with_it:.2f}x "
                 f"1F1B's (plain PACI {plain:.2f}x; backward = 2 forwards); `python -m "
                 "paci_megatron.tools.compare --project-costs measured` projects whether its "
                 f"lower loss pays for that; {UNTIMED_COMPILE.replace('move', 'pass')}")
    return lines


class Lookahead(Method):
    """Writes the look-ahead weights after each step; puts the true ones back for a drain
    and an evaluation."""

    name = "lookahead"
    FLAGS = (LOOKAHEAD_FLAG,)
    # after the step: reads main, m, v (12 B), writes the weight (2)
    COST = PassCost("lookahead_ms", "step", gpu_bytes=14)

    def __init__(self, strength: float):
        check_strength(strength)
        self.strength = strength
        self.layout = None
        self.ahead = False  # the model weights hold the look-ahead now
        # one pass a step: the step's extra cost (every pass counts: the kernels are
        # compiled at start-up, ``on_start``, untimed)
        self.time = SpanTimer()
        self.forward_time = SpanTimer()  # the stage's forwards, to state that cost in

    @staticmethod
    def check(args, layout) -> None:
        strength = getattr(args, LOOKAHEAD_FLAG.dest, None)
        if not strength:
            return
        check_strength(strength)
        if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
            raise ConfigError(f"--paci-lookahead {strength:g} needs --bf16 or --fp16: the "
                              "true weights live in the optimizer's fp32 main copy, which "
                              "fp32 training does not keep")
        if getattr(args, "paci_weight_prediction", None):
            raise ConfigError(f"--paci-lookahead {strength:g} and --paci-weight-prediction "
                              "both move the weights ahead: choose one")
        why = flat_state_unsupported(args)
        if why:
            raise ConfigError(f"--paci-lookahead {strength:g} {why} (or drop --paci-lookahead)")
        if optimizer_of(args) not in ("adam", "sgd"):
            raise ConfigError(f"--paci-lookahead {strength:g} follows Adam's and SGD's "
                              f"steps, not --optimizer {optimizer_of(args)}: use --optimizer "
                              "adam or drop --paci-lookahead")

    @classmethod
    def settings(cls, args) -> Optional[float]:
        return getattr(args, LOOKAHEAD_FLAG.dest, None) or None  # C; 0 is off

    @classmethod
    def label(cls, settings: float) -> str:
        return f"look-ahead C={settings:g}"

    @classmethod
    def cost_lines(cls, rows: List[dict], prefix: str = "> stage") -> List[str]:
        return cost_lines(rows, prefix)

    @classmethod
    def emulated(cls, settings: float) -> "EmulatedLookahead":
        return EmulatedLookahead(settings)

    def describe(self) -> str:
        return f"look-ahead weights, C={self.strength:g}"

    def summary(self) -> dict:
        ms, forward = self.time.mean_ms(), self.forward_time.mean_ms()
        if ms is None or forward is None:
            return {}
        return {"lookahead_ms": round(ms, 3), "forward_ms": round(forward, 3)}

    def before_forward(self, ctx: StageContext, mb: int) -> None:
        self.forward_time.start()

    def after_forward(self, ctx: StageContext, mb: int) -> None:
        self.forward_time.stop()

    def on_bind(self, ctx: StageContext) -> None:
        ctx.check_flat_state()

    def on_start(self, ctx: StageContext) -> None:
        self.layout = ctx.flat_state()
        ctx.settle_pass((), (False,), None)  # its one variant: no gradient, no scale
        self.time.cuda = self.forward_time.cuda = self.layout.stage_pass.device.type == "cuda"
        self._look_ahead(ctx)

    def after_step(self, ctx: StageContext, record) -> None:
        self.layout.on_step(record.update_successful)
        if record.update_successful:  # the step wrote the true weights: look ahead again
            self.ahead = False
            self._look_ahead(ctx)

    def on_drain(self, ctx: StageContext) -> None:
        self._true_weights(ctx)

    @contextlib.contextmanager
    def evaluating(self, ctx: StageContext):
        was_ahead = self.ahead
        self._true_weights(ctx)
        try:
            yield
        finally:
            if was_ahead:
                self._look_ahead(ctx)

    def steps_ahead(self, ctx: StageContext) -> float:
        return self.strength * mean_drift(ctx.num_stages, ctx.stage, ctx.accumulation)

    def _look_ahead(self, ctx: StageContext) -> None:
        steps = self.steps_ahead(ctx)
        sp = self.layout.stage_pass
        if not steps or not any(self.layout.step_count(k.inner) for k in sp.klasses):
            return  # the last stage, or no moments yet
        self.time.start()
        with versions_kept(ctx.params):
            moved = predict_ahead(self.layout, steps, None, lambda group, n: n * group["lr"])
            if moved:
                ctx.gather_weights()
        self.time.stop()
        if moved:
            self.ahead = ctx.weights_moved = True

    def _true_weights(self, ctx: StageContext) -> None:
        if not self.ahead:
            return
        with versions_kept(ctx.params):
            self.layout.stage_pass.restore()
            ctx.gather_weights()
        self.ahead = False
        ctx.weights_moved = True


class EmulatedLookahead:
    """The emulator's own look-ahead (``mcore/reference.py``): after each step that updated,
    and at a stream's start, stage s's model weights C x (P-1-s)/a steps along its moments'
    update (nothing before its first update, nothing on the last stage); the true weights back
    for a drain."""

    def __init__(self, strength: float):
        self.strength = strength
        self.ahead = set()  # the stages whose model weights are ahead now

    def before_forward(self, stage, mb: int) -> bool:
        return False

    def after_forward(self, stage, moved: bool) -> None:
        pass

    def on_stream_start(self, stage) -> None:
        self._look_ahead(stage)

    def after_step(self, stage, ok: bool) -> None:
        if ok:  # the step wrote the true weights: ahead again, at the next LR
            self.ahead.discard(stage.index)
            self._look_ahead(stage)

    def on_drain(self, stage) -> None:
        if stage.index in self.ahead:
            with stage.keep_versions():
                stage.layout().stage_pass.restore()
                stage.gather()
            self.ahead.discard(stage.index)

    def _look_ahead(self, stage) -> None:
        steps = self.strength * (stage.num_stages - 1 - stage.index) / stage.accumulation
        layout = stage.layout()
        if not steps or not any(layout.step_count(k.inner) for k in layout.stage_pass.klasses):
            return
        with stage.keep_versions():
            if predict_ahead(layout, steps, None, lambda group, n: n * group["lr"]):
                stage.gather()
                self.ahead.add(stage.index)
