"""--paci-weight-prediction: run a stale micro-batch's forward on the weights its backward
will meet.

Under PACI a micro-batch whose backward comes after d local steps of its stage runs its
forward on weights d steps older than the ones its backward uses. Before such a forward (the
action lists say which: ``StreamPlan.steps_before_backward``) the stage writes into its model
weights what its optimizer's next d steps would make of them, runs the forward, and writes
the weights back from the fp32 main copies, as Megatron's own step does: bit for bit.

The prediction is the optimizer's own step (``prediction_pass.py``): the group's gradient so
far, made the mean of its backwards and unscaled (fp16), clipped by the clip coefficient of
that estimate (its norm reduced over the stage's grad-stats group, stage-local, as Megatron's
clipping norm is), folded into Adam's moments or SGD's momentum as the step folds it (L2
decay included), and d times the step, at the LRs of the next d steps. A gradient that holds
Inf or NaN will make the next step skip: the prediction then aims d - 1 steps ahead and folds
nothing, decided on the device. Weights whose gradient is complete only later (stage 0's tied
embedding, weights reduced over tensor parallel at R, every weight with context parallelism)
fold nothing: their moments alone. Before a group's first backward there is no gradient:
the moments alone (SGD without momentum then has nothing to go on and moves nothing).

No copy of the weights and no temporaries: the main copies and optimizer state are laid out
flat (``mcore/main_params.py``) and one fused kernel per piece moves the weights
(``torch.compile``; a plain chunked pass where it cannot run). That needs the fp32 main copy,
which exists under --bf16 and --fp16 only: in fp32 the default leaves the prediction off
(the start-up line says why) and the flag is refused. So it is, when the flags are read,
where Megatron-LM keeps the weights or the state outside that layout: FP8 and FP4 weights
(uint8 buffers) and the precision-aware optimizer (its state inside Transformer Engine's
FusedAdam).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..flag import ConfigError, Flag
from ..shape import steps_in_flight
from .base import Method, PassCost, StageContext, optimizer_of
from .moves import (UNTIMED_COMPILE, flat_state_unsupported, grad_factor, predict_ahead,
                    versions_kept)
from ..throughput import mean_forwards, projected_throughput
from .timer import SpanTimer

# On by default under --pipeline-schedule paci wherever the run's flags allow it (the paper-
# regime study's decision: docs/convergence.md, "Which PACI runs by default");
# --no-paci-weight-prediction is the paper's plain PACI.
DEFAULT_PREDICTION = True

PREDICTION_FLAG = Flag(
    "--paci-weight-prediction", negatable=True, neutral=False,
    help="before a forward whose backward comes after d local steps of its stage, move the "
         "stage's weights in place to the optimizer's prediction d steps ahead, and back after "
         "it (exact, from the fp32 main params: needs --bf16 or --fp16). On by default where "
         "the run allows it; --no-paci-weight-prediction runs the paper's plain PACI, every "
         "forward on the current weights")

OVERLAP_FLAG = Flag(
    "--paci-weight-prediction-overlap", switch=True, neutral=False,
    help="move the weights layer by layer as the predicted forward goes, each layer's move "
         "on a side stream while the previous layer computes, and put each back after it: "
         "only the first move and the last restore stay exposed (a GPU gains; a CPU runs the "
         "same moves one after another). Not with "
         "--use-distributed-optimizer (whole-stage moves there, and the start-up line says so)")


def unsupported(args) -> str:
    """Why this run's flags rule the prediction out, with the fix ("" when they do not)."""
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return ("needs --bf16 or --fp16: the weights are put back after a predicted forward "
                "from the optimizer's fp32 main copy, which fp32 training does not keep "
                "(undoing an in-place move in fp32 is not exact)")
    state = flat_state_unsupported(args)
    if state:
        return state
    if (getattr(args, "expert_model_parallel_size", None) or 1) > 1 \
            and not getattr(args, "use_distributed_optimizer", False):
        return ("does not support --expert-model-parallel-size > 1 without "
                "--use-distributed-optimizer yet: its clipping norm reduces the stage's dense and "
                "expert gradients over one group, and without the distributed optimizer the "
                "dense ones repeat on every expert-parallel rank; add --use-distributed-optimizer")
    if getattr(args, "overlap_param_gather", False):
        return ("does not support --overlap-param-gather: the predicted weights must be "
                "gathered before the forward that uses them, and put back right after it; "
                "drop --overlap-param-gather")
    if getattr(args, "paci_accumulation_factor", None) == "auto":
        return ("does not support --paci-accumulation-factor auto: a stale forward's "
                "backward falls into the next call, whose factor auto decides only when that "
                "call starts (so that deciding never stalls a stage), so the forward's steps "
                "ahead are not known when it runs; give a fixed factor")
    if optimizer_of(args) not in ("adam", "sgd"):
        return f"predicts Adam's and SGD's steps only, not --optimizer {optimizer_of(args)}"
    if getattr(args, "paci_lookahead", None):
        return ("does not combine with --paci-lookahead: both move the weights ahead; "
                "choose one")
    return ""


def cuda_graph_flag(args) -> str:
    """The Megatron-LM flag (and value) that replays layers as CUDA graphs, "" if none:
    --enable-cuda-graph and --external-cuda-graph before its validate_args, which turns them
    into --cuda-graph-impl local / transformer_engine (0.16 on; full_iteration from 0.18)."""
    for name, dest in (("--enable-cuda-graph", "enable_cuda_graph"),
                       ("--external-cuda-graph", "external_cuda_graph")):
        if getattr(args, dest, False):
            return name
    impl = getattr(args, "cuda_graph_impl", None)
    return f"--cuda-graph-impl {impl}" if impl not in (None, "none") else ""


def prediction_setting(args) -> Tuple[bool, str]:
    """(on, why the default is off for this run): the flag where it is given, else the
    default where the run's flags allow it."""
    asked = getattr(args, PREDICTION_FLAG.dest, None)
    if asked is not None:
        return bool(asked), ""
    if not DEFAULT_PREDICTION:
        return False, ""
    why = unsupported(args)
    return not why, why


def default_off_line(why: str) -> str:
    """The start-up line of a run whose flags turn the default prediction off."""
    return (f"> PACI: weight prediction (on by default) is off for this run: it {why}; "
            "this is the paper's plain PACI")


@dataclass(frozen=True)
class Prediction:
    """The prediction's resolved settings: on, moved whole or layer by layer."""

    overlap: bool = False  # --paci-weight-prediction-overlap


class WeightPrediction(Method):
    """Moves the stage's weights to their predicted values around each stale forward."""

    name = "weight_prediction"
    FLAGS = (PREDICTION_FLAG, OVERLAP_FLAG)
    # move: reads main, m, v, grad (16 B), writes the weight (2); restore: reads main (4), writes 2
    COST = PassCost("predict_ms", "stale forward", gpu_bytes=24)

    def __init__(self, overlap: bool = False):
        self.overlap = overlap  # --paci-weight-prediction-overlap
        self.mover = None  # the layer-by-layer move, where the stage allows it
        self.moved = False  # the weights are predicted now
        self.timing = False  # the forward after a move is being timed
        self.layout = None  # the stage's flat prediction state (mcore/main_params.py)
        self.predicted = Counter()  # steps ahead -> forwards run on predicted weights
        # what it costs, beside a forward: the end-of-run report (``cost_lines``); every
        # span counts: the pass's kernels are compiled at start-up (``on_start``), untimed
        self.move_time, self.restore_time, self.forward_time = (SpanTimer() for _ in range(3))

    @staticmethod
    def check(args, layout) -> None:
        if getattr(args, PREDICTION_FLAG.dest, None):
            why = unsupported(args)
            if why:
                plain = " (or drop --paci-weight-prediction: the paper's plain PACI)" \
                    if why == flat_state_unsupported(args) else ""
                raise ConfigError(f"--paci-weight-prediction {why}{plain}")
        graphs = cuda_graph_flag(args)
        if getattr(args, OVERLAP_FLAG.dest, False) and graphs:
            raise ConfigError(
                f"--paci-weight-prediction-overlap moves each layer's weights in that layer's "
                f"forward hooks, and a CUDA graph replay ({graphs}) runs the layer without "
                "its hooks, so the layer would run on unmoved weights: drop "
                f"--paci-weight-prediction-overlap (the whole stage then moves before each "
                f"predicted forward) or drop {graphs.split()[0]}")
        on, why = prediction_setting(args)
        if OVERLAP_FLAG.is_set(args) and not on:
            raise ConfigError(f"{OVERLAP_FLAG.name} needs the weight prediction, which is off "
                              f"for this run{': it ' + why if why else ''}; drop "
                              f"{OVERLAP_FLAG.name}")

    @classmethod
    def settings(cls, args) -> Optional[Prediction]:
        on, _why = prediction_setting(args)
        return Prediction(OVERLAP_FLAG.is_set(args)) if on else None

    @classmethod
    def off_note(cls, args) -> str:
        _on, why = prediction_setting(args)
        return default_off_line(why) if why else ""

    @classmethod
    def build(cls, settings: Prediction) -> "WeightPrediction":
        return cls(settings.overlap)

    @classmethod
    def label(cls, settings: Prediction) -> str:
        return "prediction per-forward"  # the name 0.1's runs were kept under

    @classmethod
    def cost_lines(cls, rows: List[dict], prefix: str = "> stage") -> List[str]:
        return cost_lines(rows, prefix)

    @classmethod
    def emulated(cls, settings: Prediction) -> "EmulatedPrediction":
        return EmulatedPrediction()

    def describe(self) -> str:
        if self.overlap:
            return "stale forwards on predicted weights, moved layer by layer"
        return "stale forwards on predicted weights"

    def summary(self) -> dict:
        row = {"predicted_forwards": dict(sorted(self.predicted.items()))}
        move, restore = self.move_time.mean_ms(), self.restore_time.mean_ms()
        forward = self.forward_time.mean_ms()
        if move is not None and restore is not None and forward is not None:
            row.update(predict_ms=round(move + restore, 3), forward_ms=round(forward, 3))
        if self.layout is not None:
            row["prediction_kernel"] = self.layout.stage_pass.kernel
            if getattr(self.layout.stage_pass, "fallbacks", 0):  # fused calls run plain
                row["prediction_plain_calls"] = self.layout.stage_pass.fallbacks
        return row

    def on_bind(self, ctx: StageContext) -> None:
        ctx.check_flat_state()

    def on_start(self, ctx: StageContext) -> None:
        self.layout = ctx.flat_state()
        if self.overlap and self.mover is None:
            self.mover = ctx.layer_mover()
        # the kernel for the run, every variant compiled now (the first stream only): the
        # layer-by-layer move's slices too, with and without a gradient (per-token loss
        # folds none), at the loss scale the moves will read
        scale = ctx.loss_scale_tensor()
        ctx.settle_pass(self.mover.piece_sets() if self.mover is not None else (),
                              (False,) if ctx.per_token else (True, False),
                              None if scale is None else scale.reciprocal())
        cuda = self.layout.stage_pass.device.type == "cuda"
        for timer in (self.move_time, self.restore_time, self.forward_time):
            timer.cuda = cuda

    def before_forward(self, ctx: StageContext, mb: int) -> None:
        steps = ctx.planned_drift(mb)
        if not steps:
            return
        backwards = ctx.drift.group_backwards  # since the last step: the partial gradient's
        factor = None if ctx.per_token or not backwards \
            else grad_factor(ctx.accumulation, backwards)
        if ctx.memory_window is not None:
            ctx.memory_window.window_start()
        self.move_time.start()
        with versions_kept(ctx.params):
            moved = predict_ahead(self.layout, steps, factor, ctx.lr_sum,
                                  ctx.loss_scale_tensor(), ctx.reduce_stage_sumsq, self.mover)
            if moved:
                ctx.gather_weights()
        self.move_time.stop()
        if ctx.memory_window is not None and not moved:
            ctx.memory_window.window_stop()
        if not moved:
            return
        self.moved = self.timing = ctx.weights_moved = True
        self.predicted[steps] += 1
        self.forward_time.start()

    def after_forward(self, ctx: StageContext, mb: int) -> None:
        if self.timing:
            self.forward_time.stop()
            self.timing = False
        if self.moved:
            self._restore(ctx, timed=True)
            if ctx.memory_window is not None:
                ctx.memory_window.window_stop()
            ctx.weights_moved = True  # the next forward's weights differ from this one's

    def after_step(self, ctx: StageContext, record) -> None:
        self.layout.on_step(record.update_successful)

    def on_drain(self, ctx: StageContext) -> None:
        if self.moved:  # a drain comes after a step: never, but the weights must be true
            self._restore(ctx, timed=False)

    def _restore(self, ctx: StageContext, timed: bool) -> None:
        if timed:
            self.restore_time.start()
        with versions_kept(ctx.params):
            if self.mover is not None:
                self.mover.finish()  # the layers are back already; the rest now
            else:
                self.layout.stage_pass.restore()
            ctx.gather_weights()
        if timed:
            self.restore_time.stop()
        self.moved = False


def cost_lines(rows: List[dict], prefix: str = "> stage") -> List[str]:
    """The end of a run, from every stage's summary: what a predicted forward cost each stage
    that predicted, and the throughput that leaves PACI against 1F1B's (M = a; a backward
    costs 2 forwards), as compare projects it. No lines when nothing was predicted or timed."""
    timed = [r for r in rows if r.get("predict_ms") is not None and r.get("forward_ms")]
    if not timed:
        return []
    lines = []
    for row in timed:
        moved = sum(row["predicted_forwards"].values())
        lines.append(f"{prefix} {row['stage']}: weight prediction on {moved} forwards, move + "
                     f"restore {row['predict_ms']:.2f} ms against "
                     f"{row['forward_ms']:.2f} ms a forward "
                     f"({row['predict_ms'] / row['forward_ms']:.1f} forwards)")
    with_it, plain = projected_throughput(rows, mean_forwards(timed, "predict_ms"))
    verdict = ("slower than 1F1B on this machine; --no-paci-weight-prediction runs plain PACI"
               if with_it < 1.0 else "`python -m paci_megatron.tools.compare --project-costs "
               "measured` projects whether its lower loss pays for that")
    lines.append(f"> PACI: weight prediction's cost leaves a projected throughput of "
                 f"{with_it:.2f}x 1F1B's (plain PACI {plain:.2f}x; backward = 2 forwards); "
                 f"{verdict}; {UNTIMED_COMPILE}")
    return lines


class EmulatedPrediction:
    """The emulator's own prediction (``mcore/reference.py``): before stage s's forward of
    micro-batch mb, the steps s takes before its backward, counted from the shape (not read
    from the action lists); the weights moved there with the mean gradient of the group's
    backwards so far (none for per-token loss: token sums), and put back from the main
    copies after the forward."""

    def __init__(self):
        self.predicted = defaultdict(Counter)  # stage -> steps ahead -> forwards

    def before_forward(self, stage, mb: int) -> bool:
        steps = steps_in_flight(stage.num_stages, stage.index, stage.accumulation, mb)
        if not steps:
            return False
        layout = stage.layout()
        done = stage.group_backwards
        factor = None if stage.per_token or not done else grad_factor(stage.accumulation, done)
        with stage.keep_versions():
            moved = predict_ahead(layout, steps, factor, stage.lr_sum, stage.loss_scale(),
                                  stage.reduce_sumsq)
            if moved:
                stage.gather()
        if moved:
            self.predicted[stage.index][steps] += 1
        return moved

    def after_forward(self, stage, moved: bool) -> None:
        if moved:
            with stage.keep_versions():
                stage.layout().stage_pass.restore()
                stage.gather()

    def on_stream_start(self, stage) -> None:
        pass

    def after_step(self, stage, ok: bool) -> None:
        pass

    def on_drain(self, stage) -> None:
        pass
