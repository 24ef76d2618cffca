"""--paci-weight-prediction: run a stale micro-batch's forward on the weights its backward
will meet.

Under PACI a micro-batch whose backward comes after d local steps of its stage runs its
forward on weights d steps older than the ones its backward uses. Before such a forward (the
action lists say which: ``StreamPlan.steps_before_backward``) the stage moves its weights in
place to what its optimizer would make of them in d steps, runs the forward, and puts them
back. The prediction is linear (d times one step, as SpecTrain and FTPipe's "linear" mode) and
uses the next step's LR and weight decay from the param groups (the LR scheduler has set them
already), and for Adam the moments with the gradient the group has gathered so far folded in
as the step would fold the whole group's (``grad_factor`` turns the DDP buffer into that mean;
without it the moments alone). With the distributed optimizer each data-parallel rank moves
its own shard and an all-gather over the stage's data-parallel group (stage-local) completes
the weights, once for the move and once for the restore.

No copy of the weights: one piece of one parameter at a time (two fp32 temporaries), and the
restore is exact because it is Megatron's own: the model weight cast from the optimizer's fp32
main copy, which the prediction never touches. That copy exists under --bf16 and --fp16 only;
in fp32 the weight is the optimizer's tensor and no in-place move can be undone bit for bit
without a copy, so there the default leaves the prediction off (the start-up line says why)
and the flag is refused. Parameters a mixed-precision optimizer keeps in fp32 without a main
copy are left where they are.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..flag import ConfigError, Flag
from .base import StageContext, StageFeature, sub_optimizers
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


def unsupported(args) -> str:
    """Why this run's flags rule the prediction out, with the fix ("" when they do not)."""
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return ("needs --bf16 or --fp16: the weights are put back after a predicted forward "
                "from the optimizer's fp32 main copy, which fp32 training does not keep "
                "(undoing an in-place move in fp32 is not exact)")
    if getattr(args, "overlap_param_gather", False):
        return ("does not support --overlap-param-gather: the predicted weights must be "
                "gathered before the forward that uses them, and put back right after it; "
                "drop --overlap-param-gather")
    if getattr(args, "paci_accumulation_factor", None) == "auto":
        return "does not support --paci-accumulation-factor auto yet; give a fixed factor"
    if getattr(args, "optimizer", "adam") not in ("adam", "sgd"):
        return f"predicts Adam's and SGD's steps only, not --optimizer {args.optimizer}"
    return ""


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


class WeightPrediction(StageFeature):
    """Moves the stage's weights to their predicted values around each stale forward."""

    name = "weight_prediction"
    FLAGS = (PREDICTION_FLAG,)

    def __init__(self):
        self.moved = False
        self.predicted = Counter()  # steps ahead -> forwards run on predicted weights
        # what it costs, beside a forward: the end-of-run report (``cost_lines``)
        self.move_time, self.restore_time, self.forward_time = SpanTimer(), SpanTimer(), SpanTimer()

    @staticmethod
    def check(args, layout) -> None:
        if getattr(args, PREDICTION_FLAG.dest, None):
            why = unsupported(args)
            if why:
                raise ConfigError(f"--paci-weight-prediction {why}")

    @classmethod
    def from_config(cls, cfg) -> Optional["WeightPrediction"]:
        return cls() if cfg.weight_prediction else None

    def describe(self) -> str:
        return "stale forwards on predicted weights"

    def summary(self) -> dict:
        row = {"predicted_forwards": dict(sorted(self.predicted.items()))}
        move, restore = self.move_time.mean_ms(), self.restore_time.mean_ms()
        forward = self.forward_time.mean_ms()
        if move is not None and restore is not None and forward is not None:
            row.update(predict_ms=round(move + restore, 3), forward_ms=round(forward, 3))
        return row

    def on_bind(self, ctx: StageContext) -> None:
        check_optimizer(ctx.optimizer, ctx.main_pairs())
        cuda = any(p.is_cuda for p in ctx.params)
        for timer in (self.move_time, self.restore_time, self.forward_time):
            timer.cuda = cuda

    def before_forward(self, ctx: StageContext, mb: int) -> None:
        steps = ctx.planned_drift(mb)
        if not steps:
            return
        # the buffer as the group's mean gradient so far (weighted as the step will weigh it)
        backwards = ctx.drift.group_backwards  # since the last step: the partial gradient's
        factor = None if ctx.per_token or not backwards \
            else ctx.accumulation / backwards / ctx.loss_scale() * ctx.buffer_sum_scale()
        self.move_time.start()
        with _versions_kept(ctx.params):
            move_to_prediction(ctx.main_pairs(), steps, factor)
            ctx.gather_weights()
        self.move_time.stop()
        self.moved = ctx.weights_moved = True
        self.predicted[steps] += 1
        self.forward_time.start()

    def after_forward(self, ctx: StageContext, mb: int) -> None:
        self.forward_time.stop()
        if self.moved:
            self.restore_time.start()
            with _versions_kept(ctx.params):
                restore_weights(ctx.main_pairs())
                ctx.gather_weights()
            self.restore_time.stop()
            self.moved = False
            ctx.weights_moved = True  # the next forward's weights differ from this one's


def cost_lines(rows: List[dict], prefix: str = "> stage") -> List[str]:
    """The end of a run, from every stage's summary: what a predicted forward cost each stage
    that predicted, and the throughput that leaves PACI against 1F1B's (M = a; a backward
    costs 2 forwards, the simulator's default; ``compare --project-costs measured`` projects
    it properly). No lines when nothing was predicted or timed."""
    timed = [r for r in rows if r.get("predict_ms") is not None and r.get("forward_ms")]
    if not timed:
        return []
    lines = []
    for row in timed:
        moved = sum(row["predicted_forwards"].values())
        lines.append(f"{prefix} {row['stage']}: weight prediction on {moved} forwards, "
                     f"move + restore {row['predict_ms']:.2f} ms against {row['forward_ms']:.2f} "
                     f"ms a forward ({row['predict_ms'] / row['forward_ms']:.1f} forwards)")
    with_it, plain = projected_throughput(rows)
    verdict = ("slower than 1F1B on this machine; --no-paci-weight-prediction runs plain PACI"
               if with_it < 1.0 else "`python -m paci_megatron.tools.compare --project-costs "
               "measured` projects whether its lower loss pays for that")
    lines.append(f"> PACI: weight prediction's cost leaves a projected throughput of "
                 f"{with_it:.2f}x 1F1B's (plain PACI {plain:.2f}x; backward = 2 forwards); "
                 f"{verdict}")
    return lines


def projected_throughput(rows: List[dict]) -> Tuple[float, float]:
    """(with prediction, plain PACI) throughput over 1F1B's, M = a: per micro-batch a stage
    spends 3 forwards (f + b, b = 2f) plus its share of predicted forwards times their cost;
    the slowest stage sets PACI's pace, 1F1B's is (a + P - 1) / a of the slowest compute."""
    steps = max(r["steps"] for r in rows)
    backwards = max(sum(r["histogram"].values()) for r in rows)
    a = backwards / steps if steps else 1.0
    plain = (a + len(rows) - 1) / a
    work = [3.0 * r["forward_ms"] for r in rows if r.get("forward_ms")]
    paced = [3.0 * r["forward_ms"] + r["predict_ms"] * sum(r["predicted_forwards"].values())
             / max(1, sum(r["histogram"].values())) for r in rows if r.get("forward_ms")]
    return plain * max(work) / max(paced), plain


def _versions_kept(params):
    """The in-flight graphs saved these weights; their backwards read them as they stand."""
    from ..autograd_versions import keep_version_counters

    return keep_version_counters(params)


@dataclass
class MainPair:
    """One weight the prediction can move: where its model values live (``target``, written
    in place), its fp32 main copy (or this rank's shard of it), the matching gradient buffer
    slice, and the optimizer and param group that step it (``mcore/main_params.py``)."""

    inner: object
    group: dict
    target: object
    main: object
    grad: object = None
    sequence_parallel: bool = False


def check_optimizer(optimizer, pairs: List[MainPair]) -> None:
    """Adam's family or SGD, with an fp32 main copy to restore from."""
    if not pairs:
        raise ConfigError("--paci-weight-prediction found no parameter with an fp32 main copy "
                          "in the stage's optimizer: train with --bf16 or --fp16")
    for opt in sub_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            if "betas" not in group and "momentum" not in group:
                raise ConfigError(f"--paci-weight-prediction predicts Adam's and SGD's steps; "
                                  f"{type(opt.optimizer).__name__} is neither")
            if group.get("amsgrad"):
                raise ConfigError("--paci-weight-prediction does not predict AMSGrad steps")


def move_to_prediction(pairs: List[MainPair], steps: int, grad_factor: Optional[float]) -> None:
    """Write into each weight its main copy ``steps`` optimizer steps ahead. A weight without
    optimizer state yet (before its first step) stays. ``grad_factor`` times the gradient
    buffer is the group's mean gradient so far (None: use the moments alone). The distributed
    optimizer's shards then need ``gather_weights``."""
    for pair in pairs:
        state = pair.inner.state.get(pair.main)
        if not state:
            continue
        grad = pair.grad if grad_factor else None
        if pair.sequence_parallel:
            grad = None  # partial on each tensor-parallel rank until finalize: would differ
        predict = _adam_prediction if "exp_avg" in state else _sgd_prediction
        tensors = _state_tensors(pair.inner, state, pair.main)
        for part in _chunks(pair.target, pair.main, grad, *tensors.values()):
            target, main_part, grad_part, *state_parts = part
            predicted = predict(pair.inner, pair.group, state,
                                dict(zip(tensors, state_parts)), main_part, grad_part,
                                grad_factor or 0.0, steps)
            if predicted is not None:
                target.copy_(predicted)


def restore_weights(pairs: List[MainPair]) -> None:
    """The weights as Megatron derives them from the main copies (bit for bit)."""
    for pair in pairs:
        pair.target.copy_(pair.main)


# The temporaries (two fp32 pieces) are per chunk: a weight is cut into PIECES chunks of at
# least MIN_CHUNK elements, so they stay a few percent of the largest weight's own state and
# below one micro-batch's activations, at a few dozen kernels per large weight.
PIECES = 32
MIN_CHUNK = 1 << 14


def _chunks(*tensors):
    """Matching flat pieces of same-shaped tensors (None stays None)."""
    present = [t for t in tensors if t is not None]
    if not all(t.is_contiguous() for t in present):
        yield tensors
        return
    numel = present[0].numel()
    size = max(MIN_CHUNK, -(-numel // PIECES))
    flat = [None if t is None else t.view(-1) for t in tensors]
    for start in range(0, numel, size):
        yield [None if t is None else t[start:start + size] for t in flat]


def _state_tensors(inner, state, main) -> dict:
    """The optimizer's per-element state of ``main`` in fp32 units (TE may keep it scaled)."""
    names = [n for n in ("exp_avg", "exp_avg_sq", "momentum_buffer")
             if state.get(n) is not None]
    tensors = {n: state[n] for n in names}
    if hasattr(inner, "get_unscaled_state"):
        tensors = {n: (inner.get_unscaled_state(main, n) if t.dtype != main.dtype else t)
                   for n, t in tensors.items()}
    return tensors


def _adam_prediction(inner, group, state, moments, main, grad, factor: float, steps: int):
    """Adam/AdamW: main - steps x (the next step's update); torch's, to fp32 rounding."""
    beta1, beta2 = group["betas"]
    lr, eps, decay = group["lr"], group["eps"], group.get("weight_decay", 0.0)
    exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
    t = float(state["step"] if "step" in state else group.get("step", 0)) + 1  # Apex/TE: group
    if grad is not None:
        num = exp_avg.mul(beta1).add_(grad, alpha=(1 - beta1) * factor)
        den = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=(1 - beta2) * factor * factor)
        if not bool(den.isfinite().all()):  # an fp16 overflow, which the step will skip
            grad = None
    if grad is None:
        num, den = exp_avg.clone(), exp_avg_sq.clone()
    den.sqrt_().div_(math.sqrt(1 - beta2 ** t)).add_(eps)
    num.div_(den)
    del den
    num.mul_(-steps * lr / (1 - beta1 ** t))
    decoupled = group.get("decoupled_weight_decay",
                          getattr(inner, "adam_w_mode", type(inner).__name__ == "AdamW"))
    keep = 1 - steps * lr * decay if decoupled else 1.0
    return num.add_(main, alpha=keep)


def _sgd_prediction(inner, group, state, moments, main, grad, factor: float, steps: int):
    """SGD: the momentum buffer with the partial gradient folded in as the step folds the
    whole group's; without momentum, the partial gradient alone; None: nothing to go on."""
    lr, momentum = group["lr"], group.get("momentum", 0.0)
    buf = moments.get("momentum_buffer")
    if grad is None and buf is None:
        return None
    if grad is None:
        update = buf.clone()
    else:
        update = grad.mul(factor)
        if not bool(update.isfinite().all()):  # an fp16 overflow, which the step will skip
            return None if buf is None else buf.clone().mul_(-steps * lr).add_(main)
        if group.get("weight_decay"):
            update.add_(main, alpha=group["weight_decay"])
        if buf is not None and momentum:
            step_buf = buf.mul(momentum).add_(update, alpha=1 - group.get("dampening", 0.0))
            update = update.add_(step_buf, alpha=momentum) if group.get("nesterov") else step_buf
    return update.mul_(-steps * lr).add_(main)
