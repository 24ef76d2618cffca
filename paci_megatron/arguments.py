"""Command-line flags with Megatron-LM's names, plus PACI's, and checks that run before any
process group starts (so bad input fails fast with the flag and the fix in the message)."""

from __future__ import annotations

import argparse
import math
import os
from typing import List, Optional, Sequence

from .quiet import is_local_rank0
from .registry import SCHEDULES, ScheduleOptions
from .stale_correction import DEFAULT_STRENGTH, resolve_strength
from .stale_weights import DEFAULT_WEIGHT, resolve_weight


class ConfigError(ValueError):
    """A bad flag or combination of flags; the message names the flag and the fix."""


def _bounded_int(name: str, low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a whole number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {value}")
        return value

    return parse


def _positive(name: str):
    return _bounded_int(name, 1)


def _bounded_float(name: str, low: float = 0.0, high: float = float("inf"),
                   low_open: bool = False, high_open: bool = False):
    """A finite number in [low, high] (or open ends)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a number, got {text!r}")
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if not math.isfinite(value) or too_low or too_high:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"{name} must be a finite number in {span}, "
                                             f"got {text}")
        return value

    return parse


def _non_negative_float(name: str):
    return _bounded_float(name)


def _probability(name: str):
    return _bounded_float(name, 0.0, 1.0, high_open=True)


def _factor_or_auto(text: str):
    """--paci-accumulation-factor: a whole number, or auto."""
    if text.strip() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--paci-accumulation-factor takes a whole number or auto, got {text!r}")
    return value  # its range is checked with the schedule (registry._check_paci)


def _path(name: str):
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} needs a path, got an empty string")
        return text

    return parse


class _Parser(argparse.ArgumentParser):
    """A usage error is printed once per node (local rank 0; every rank parses the same flags
    under torchrun), as one line: the usage text would list every flag."""

    def error(self, message: str):
        if is_local_rank0():
            self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        description="GPT pretraining on Megatron-Core with a selectable pipeline schedule "
                    "(PACI: asynchronous, bubble-free, bounded weight drift).")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=_positive("--num-layers"), default=4)
    g.add_argument("--hidden-size", type=_positive("--hidden-size"), default=64)
    g.add_argument("--num-attention-heads", type=_positive("--num-attention-heads"), default=4)
    g.add_argument("--ffn-hidden-size", type=_positive("--ffn-hidden-size"), default=None)
    g.add_argument("--seq-length", type=_positive("--seq-length"), default=32)
    g.add_argument("--max-position-embeddings", type=_positive("--max-position-embeddings"),
                   default=None)
    g.add_argument("--vocab-size", type=_positive("--vocab-size"), default=None,
                   help="mock data: token ids 0..N-1 (default 256); with --tokenizer-model: "
                        "taken from the model")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--hidden-dropout", type=_probability("--hidden-dropout"), default=0.0)
    g.add_argument("--attention-dropout", type=_probability("--attention-dropout"), default=0.0)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive("--tensor-model-parallel-size"),
                   default=1)
    g.add_argument("--pipeline-model-parallel-size",
                   type=_positive("--pipeline-model-parallel-size"), default=None,
                   help="default: every rank not used by tensor parallelism (data parallel 1)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage",
                   type=_positive("--num-layers-per-virtual-pipeline-stage"), default=None)
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=_bounded_float(
        "--distributed-timeout-minutes", low_open=True), default=5.0,
        help="a stage that stalls this long makes its neighbours (and the job) stop")
    g = p.add_argument_group("batch and optimizer")
    g.add_argument("--micro-batch-size", type=_positive("--micro-batch-size"), default=2)
    g.add_argument("--global-batch-size", type=_positive("--global-batch-size"), default=None,
                   help="default: 8 micro-batches per data-parallel rank")
    g.add_argument("--train-iters", type=_positive("--train-iters"), default=20)
    g.add_argument("--lr", type=_non_negative_float("--lr"), default=1e-3)
    g.add_argument("--min-lr", type=_non_negative_float("--min-lr"), default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=_bounded_int("--lr-warmup-iters", 0), default=0)
    g.add_argument("--weight-decay", type=_non_negative_float("--weight-decay"), default=0.01)
    g.add_argument("--adam-beta1", type=_probability("--adam-beta1"), default=0.9)
    g.add_argument("--adam-beta2", type=_probability("--adam-beta2"), default=0.999)
    g.add_argument("--clip-grad", type=_non_negative_float("--clip-grad"), default=1.0)
    g.add_argument("--rampup-batch-size", nargs=3, type=_positive("--rampup-batch-size"),
                   default=None, metavar=("START", "INCR", "SAMPLES"),
                   help="as in Megatron-LM: the global batch size starts at START and grows by "
                        "INCR, evenly over the first SAMPLES samples, up to --global-batch-size "
                        "(PACI drains where the number of micro-batches changes)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over the data-parallel ranks of a stage")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start the data-parallel gradient reduction during the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer and --overlap-grad-reduce: gather the "
                        "updated parameters during the next forward pass")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 weights with dynamic loss scaling; under PACI every stage has its "
                        "own scaler and skips its own overflowing steps")
    g.add_argument("--loss-scale", type=_bounded_float("--loss-scale", low_open=True),
                   default=None, help="--fp16: a static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=_bounded_float("--initial-loss-scale",
                   low_open=True), default=2.0 ** 32, help="--fp16: the dynamic scale's start")
    g.add_argument("--min-loss-scale", type=_bounded_float("--min-loss-scale", low_open=True),
                   default=1.0, help="--fp16: the dynamic scale's floor")
    g.add_argument("--loss-scale-window", type=_positive("--loss-scale-window"), default=1000,
                   help="--fp16: steps without overflow before the scale doubles")
    g.add_argument("--hysteresis", type=_positive("--hysteresis"), default=2,
                   help="--fp16: overflowing steps in a row before the scale halves")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over the tokens of a batch (a local step's group "
                        "under PACI), not over micro-batches")
    g.add_argument("--seed", type=_bounded_int("--seed", 0), default=1234)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="transformer_engine only where Transformer Engine is importable")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=_positive("--recompute-num-layers"),
                   default=None)
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic tokens (the default when no --data-path is given)")
    g.add_argument("--data-path", type=_path("--data-path"), default=None,
                   help="prefix of a Megatron indexed dataset (PREFIX.bin / PREFIX.idx)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", type=_path("--tokenizer-model"), default=None)
    g = p.add_argument_group("evaluation, checkpoints and logging")
    g.add_argument("--eval-interval", type=_positive("--eval-interval"), default=None)
    g.add_argument("--eval-iters", type=_positive("--eval-iters"), default=2)
    g.add_argument("--save", type=_path("--save"), default=None,
                   help="checkpoint directory to write")
    g.add_argument("--load", type=_path("--load"), default=None,
                   help="checkpoint directory to resume from (its newest complete checkpoint); "
                        "a missing or empty one starts from scratch, as in Megatron-LM, so "
                        "--save DIR --load DIR works from the first launch and after restarts")
    g.add_argument("--save-interval", type=_positive("--save-interval"), default=None)
    g.add_argument("--save-interval-minutes", type=_bounded_float(
        "--save-interval-minutes", low_open=True), default=None,
        help="also save when this much wall-clock time has passed since the last save (bounds "
             "the work a crash loses, whatever the iteration time; stages agree on the "
             "iteration at about 10 check points per interval)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="with --load: train with the flags' LR schedule (--lr, --min-lr, "
                        "--lr-warmup-iters, --train-iters, --lr-decay-style, --weight-decay) "
                        "from the checkpoint's position in it, where they differ from the "
                        "checkpoint's (default: such a difference is an error)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="with --load: keep the checkpoint's LR schedule where the flags differ")
    g.add_argument("--exit-interval", type=_positive("--exit-interval"), default=None,
                   help="stop (evaluate, save with --save) when the iteration is a multiple "
                        "of this; resume with --load and the same --train-iters")
    g.add_argument("--log-interval", type=_positive("--log-interval"), default=1)
    g.add_argument("--tensorboard-dir", type=_path("--tensorboard-dir"), default=None)
    g.add_argument("--measure-activation-memory", action="store_true",
                   help="count the bytes autograd keeps for backward (per stage peak in the "
                        "final metrics record)")
    g.add_argument("--measure-memory", action="store_true",
                   help="on CPU, count every live tensor of each stage (weights, gradients, "
                        "optimizer state and temporaries, activations, buffers; slows training) "
                        "for the per-stage peak_memory_mb; on CUDA the allocator's peak is "
                        "always reported")
    g.add_argument("--metrics-file", type=_path("--metrics-file"), default=None,
                   help="append one JSON object per logged iteration (and a final one)")
    g = p.add_argument_group("pipeline schedule")
    g.add_argument("--pipeline-schedule", default="paci",
                   help=f"one of {SCHEDULES.names()} (default: paci)")
    g.add_argument("--paci-accumulation-factor", type=_factor_or_auto, default=None,
                   help="backward passes per local optimizer step (default: micro-batches per "
                        "global batch); auto: chosen at iteration boundaries among the "
                        "divisors of the micro-batches per batch within --paci-max-drift "
                        "(see README, 'Adaptive accumulation factor')")
    g.add_argument("--paci-adapt-interval", type=_positive("--paci-adapt-interval"),
                   default=None, help="with --paci-accumulation-factor auto: iterations "
                   "between two decisions (default 10)")
    g.add_argument("--paci-adapt-tolerance", type=_bounded_float(
        "--paci-adapt-tolerance", low_open=True), default=None,
        help="with --paci-accumulation-factor auto: largest predicted staleness (relative "
             "weight change per step x steps in flight) of the smallest a taken (default: "
             "the largest a = N staleness measured so far, i.e. never above plain PACI's)")
    g.add_argument("--paci-adapt-policy", choices=["staleness", "cycle"], default=None,
                   help="with --paci-accumulation-factor auto: staleness (default) or cycle "
                        "(each decision takes the next candidate, largest first: a test "
                        "policy that changes a regardless of the signal)")
    g.add_argument("--paci-max-drift", type=int, default=None,
                   help="largest tolerated drift; default: the bound ceil((P-1-s)/a)")
    g.add_argument("--paci-drain-before-eval", action="store_true",
                   help="drain the pipeline before each evaluation (frees the in-flight "
                        "activations; training then continues as if it had flushed there). "
                        "Default: evaluate between iterations without draining, which leaves "
                        "training unchanged")
    g.add_argument("--paci-sync-iters", type=_bounded_int("--paci-sync-iters", 0), default=0,
                   help="synchronous warm start: run the first K iterations as stock 1F1B "
                        "(flush, one step per iteration), then PACI with no drain at the "
                        "switch (default 0)")
    g.add_argument("--paci-stale-grad-weight", type=float, default=None, metavar="W",
                   help="weigh each micro-batch's gradient at a stage by W ** drift (its "
                        "drift there), renormalised so each step still applies a mean over a "
                        f"micro-batches; 0 < W <= 1 (default {DEFAULT_WEIGHT:g}; 1: the "
                        "paper's plain PACI)")
    g.add_argument("--paci-stale-grad-correction", type=_non_negative_float(
        "--paci-stale-grad-correction"), default=None, metavar="K",
                   help="correct each stage's gradient for its stale micro-batches to first "
                        "order: g -= K x lr x mean drift x the optimizer's first moment, "
                        "before each local step; K estimates Adam's preconditioned curvature, "
                        "in 1/LR (4000 was best at LR 2e-3; default "
                        f"{DEFAULT_STRENGTH:g}: off, as in the paper)")
    g.add_argument("--paci-on-nonfinite", choices=["skip", "abort"], default="skip",
                   help="a NaN/Inf gradient at a stage's step: skip that update (and count it) "
                        "or stop the job")
    return p


def validate(args: argparse.Namespace, world_size: int) -> ScheduleOptions:
    """Fill derived values into ``args`` and check them; raises ConfigError."""
    tp = args.tensor_model_parallel_size
    if world_size % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} must divide the world size "
                          f"{world_size} (torchrun --nproc-per-node x --nnodes)")
    pp = args.pipeline_model_parallel_size or world_size // tp
    args.pipeline_model_parallel_size = pp
    if world_size % (tp * pp):
        raise ConfigError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size "
                          f"{pp} must divide the world size {world_size}")
    dp = world_size // (tp * pp)
    args.data_parallel_size = dp
    if args.num_layers % pp:
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by "
                          f"--pipeline-model-parallel-size {pp}; pick a multiple of {pp}")
    vpp = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage "
                f"{args.num_layers_per_virtual_pipeline_stage} must divide the "
                f"{per_stage} layers of each pipeline stage")
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
        if vpp == 1:
            vpp = None
    args.virtual_pipeline_model_parallel_size = vpp
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} must be divisible by "
                          f"--num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} must be divisible "
                          f"by --tensor-model-parallel-size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    if args.global_batch_size is None:
        args.global_batch_size = 8 * args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                          f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}"
                          f" = {per_step}")
    num_mb = args.global_batch_size // per_step
    args.num_microbatches = num_mb
    ramp = rampup_micro_batches(args.rampup_batch_size, args.global_batch_size, per_step)
    _validate_data_parallel_flags(args)
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive; pick one")
    check_loss_scales(args)
    _validate_data_and_outputs(args)
    if args.lr_warmup_iters < 0:
        raise ConfigError(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    adapt_interval = _adaptive_flags(args)
    if adapt_interval and pp > 1 and not args.untie_embeddings_and_output_weights:
        # the tied copy's lag ceil(P/a) is fixed at the start; a smaller a would need more
        raise ConfigError("--paci-accumulation-factor auto does not support tied embeddings "
                          "yet (the tied weight's lag is set for a fixed a); add "
                          "--untie-embeddings-and-output-weights or give a number")
    if adapt_interval and ramp:
        raise ConfigError("--paci-accumulation-factor auto does not support --rampup-batch-size "
                          "yet (its candidates are the divisors of one M); give a number or "
                          "drop --rampup-batch-size")
    # with --rampup-batch-size the default a follows M (a = M at every batch size)
    args.paci_accumulation_follows = args.paci_accumulation_factor is None
    if args.paci_accumulation_factor is None or adapt_interval:
        args.paci_accumulation_factor = ramp[0] if ramp else num_mb  # auto starts at a = N
    if ramp and args.pipeline_schedule == "paci":
        check_accumulation_divides(args.paci_accumulation_factor, ramp,
                                    args.paci_accumulation_follows)
    try:
        entry = SCHEDULES.get(args.pipeline_schedule)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    opts = ScheduleOptions(
        pipeline_size=pp, virtual_size=vpp, num_microbatches=ramp[0] if ramp else num_mb,
        accumulation=args.paci_accumulation_factor, max_drift=args.paci_max_drift,
        micro_batch_size=args.micro_batch_size, data_parallel_size=dp,
        on_nonfinite=args.paci_on_nonfinite, sync_iters=args.paci_sync_iters,
        stale_grad_weight=resolve_weight(args.paci_stale_grad_weight, args.pipeline_schedule),
        stale_grad_correction=resolve_strength(args.paci_stale_grad_correction,
                                               args.pipeline_schedule),
        adapt_interval=adapt_interval, adapt_tolerance=args.paci_adapt_tolerance,
        adapt_policy=args.paci_adapt_policy or "staleness",
    )
    _check_stale_grad_weight(args)
    _check_stale_grad_correction(args)
    if args.paci_sync_iters and args.pipeline_schedule != "paci":
        raise ConfigError(f"--paci-sync-iters {args.paci_sync_iters} only applies to "
                          "--pipeline-schedule paci; drop it")
    try:
        entry.check(opts)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return opts


def _check_stale_grad_weight(args) -> None:
    weight = args.paci_stale_grad_weight
    if weight is None:
        return
    if not 0.0 < weight <= 1.0:
        raise ConfigError(f"--paci-stale-grad-weight {weight:g} must be in (0, 1] (1: plain PACI)")
    if weight != 1.0 and args.pipeline_schedule != "paci":
        raise ConfigError(f"--paci-stale-grad-weight {weight:g} only applies to "
                          "--pipeline-schedule paci; drop it")


def _check_stale_grad_correction(args) -> None:
    strength = args.paci_stale_grad_correction
    if strength and args.pipeline_schedule != "paci":
        raise ConfigError(f"--paci-stale-grad-correction {strength:g} only applies to "
                          "--pipeline-schedule paci; drop it")


# tolerance 0: plain PACI's peak staleness so far (see adapt.py)
ADAPT_DEFAULTS = {"paci_adapt_interval": 10, "paci_adapt_tolerance": 0.0,
                  "paci_adapt_policy": "staleness"}


def _adaptive_flags(args) -> int:
    """--paci-accumulation-factor auto: fill its flags' defaults, note it in
    ``args.paci_adaptive`` and return the decision interval (0 without auto)."""
    auto = args.paci_accumulation_factor == "auto"
    args.paci_adaptive = auto
    if auto and args.pipeline_schedule != "paci":
        raise ConfigError(f"--paci-accumulation-factor auto only applies to --pipeline-schedule "
                          f"paci, not {args.pipeline_schedule}; drop it")
    for attr, default in ADAPT_DEFAULTS.items():
        flag = "--" + attr.replace("_", "-")
        if getattr(args, attr) is not None and not auto:
            raise ConfigError(f"{flag} only applies with --paci-accumulation-factor auto; "
                              "drop it or add --paci-accumulation-factor auto")
        if auto and getattr(args, attr) is None:
            setattr(args, attr, default)
    return args.paci_adapt_interval if auto else 0


def rampup_micro_batches(rampup: Optional[Sequence[int]], global_batch_size: int,
                         per_step: int) -> List[int]:
    """Every number of micro-batches per iteration that ``--rampup-batch-size START INCR
    SAMPLES`` goes through (START, START+INCR, ..., --global-batch-size, each divided by
    micro-batch x data-parallel size); [] without a ramp. Raises ConfigError naming the flag."""
    if rampup is None:
        return []
    start, incr, _samples = rampup
    flag = f"--rampup-batch-size {start} {incr} {_samples}"
    if start == global_batch_size:
        raise ConfigError(f"{flag}: START equals --global-batch-size, so there is nothing to "
                          "ramp up; drop --rampup-batch-size or lower START")
    if start > global_batch_size or (global_batch_size - start) % incr:
        raise ConfigError(f"{flag}: START must be at most --global-batch-size "
                          f"{global_batch_size} and reach it in steps of INCR")
    sizes = list(range(start, global_batch_size + 1, incr))
    bad = [size for size in sizes if size % per_step]
    if bad:
        raise ConfigError(f"{flag}: the batch sizes {bad} are not divisible by --micro-batch-size"
                          f" x data-parallel size = {per_step}; pick START and INCR multiples "
                          f"of {per_step}")
    return [size // per_step for size in sizes]


def check_accumulation_divides(accumulation: int, ramp: List[int], follows: bool) -> None:
    """An explicit accumulation factor stays fixed while M ramps up: it must divide every M."""
    if follows:
        return
    bad = [m for m in ramp if m % accumulation]
    if bad:
        raise ConfigError(
            f"--paci-accumulation-factor {accumulation} must divide every number of "
            f"micro-batches per iteration that --rampup-batch-size goes through {ramp} (not "
            f"{bad}); pick a common divisor, or drop --paci-accumulation-factor (a then equals "
            "the number of micro-batches at every batch size)")


def _validate_data_parallel_flags(args) -> None:
    """Megatron-LM's own rules for the overlap flags."""
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                          "--overlap-grad-reduce (as in Megatron-LM); add them or drop it")
    tied = (args.pipeline_schedule == "paci" and not args.untie_embeddings_and_output_weights
            and (args.pipeline_model_parallel_size or 1) > 1)
    for flag, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                     ("--overlap-grad-reduce", args.overlap_grad_reduce),
                     ("--fp16", args.fp16)):
        if tied and on:
            # the output layer's gradient is sent to stage 0 before any data-parallel reduction
            raise ConfigError(f"--pipeline-schedule paci with tied embeddings does not support "
                              f"{flag} yet; drop it or add --untie-embeddings-and-output-weights")


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def check_loss_scales(args) -> None:
    """fp16 under PACI: each stage rescales a received gradient by (own scale / sender's
    scale), exact only for powers of two (the dynamic scaler doubles and halves them)."""
    flags = (("--initial-loss-scale", getattr(args, "initial_loss_scale", None)),
             ("--min-loss-scale", getattr(args, "min_loss_scale", None)),
             ("--loss-scale", getattr(args, "loss_scale", None)))
    if not getattr(args, "fp16", False):
        return
    if (args.min_loss_scale or 0) > (args.initial_loss_scale or 0) and args.loss_scale is None:
        raise ConfigError(f"--min-loss-scale {args.min_loss_scale:g} is above "
                          f"--initial-loss-scale {args.initial_loss_scale:g}")
    if getattr(args, "pipeline_schedule", None) != "paci":
        return
    for flag, value in flags:
        if value is not None and not _is_power_of_two(value):
            nearest = 2.0 ** round(math.log2(value))
            raise ConfigError(f"{flag} {value:g}: --pipeline-schedule paci with --fp16 needs a "
                              f"power of two (each stage rescales received gradients by the "
                              f"ratio of two scales, exact only then); use {nearest:g}")


def _validate_data_and_outputs(args) -> None:
    if args.tokenizer_model is not None and not os.path.isfile(args.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: no such file; run "
                          "python -m paci_megatron.preprocess_data first")
    if args.data_path is not None and args.mock_data:
        raise ConfigError("--mock-data and --data-path are exclusive; drop one")
    if args.data_path is not None:
        if args.tokenizer_type is None:
            args.tokenizer_type = "SentencePieceTokenizer"
        if args.tokenizer_type == "SentencePieceTokenizer":
            if not args.tokenizer_model:
                raise ConfigError("--data-path with SentencePieceTokenizer needs "
                                  "--tokenizer-model (the .model file preprocess_data wrote)")
            if not os.path.isfile(args.tokenizer_model):
                raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: no such file; "
                                  "run python -m paci_megatron.preprocess_data first")
        for ext in (".bin", ".idx"):
            if not os.path.isfile(args.data_path + ext):
                raise ConfigError(f"--data-path {args.data_path}: {args.data_path + ext} does "
                                  "not exist (give the prefix without .bin/.idx)")
    try:
        weights = [float(x) for x in args.split.split(",")]
    except ValueError:
        raise ConfigError(f"--split {args.split!r} must be comma-separated numbers, e.g. 969,30,1")
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {args.split!r} needs three non-negative weights, e.g. 969,30,1")
    if args.eval_interval is not None and weights[1] == 0 and args.data_path is not None:
        raise ConfigError("--eval-interval needs a validation share in --split (the 2nd weight)")
    for flag, value in (("--save-interval", args.save_interval),
                        ("--save-interval-minutes", args.save_interval_minutes)):
        if value is not None and not args.save:
            raise ConfigError(f"{flag} needs --save DIR")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and "
                          "--use-checkpoint-opt_param-scheduler are exclusive; pick one")
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ConfigError("--transformer-impl transformer_engine: Transformer Engine is not "
                              "importable here; use --transformer-impl local") from None
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method "
                          "{uniform,block} (and --recompute-num-layers)")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ConfigError("--recompute-method needs --recompute-granularity full")
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1


def parse_and_validate(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        opts = validate(args, world)
    except ConfigError as exc:
        parser.error(str(exc))
    return args, opts
