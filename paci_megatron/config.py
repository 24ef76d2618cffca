"""PACI's one configuration: the flag table both command lines are generated from, and the
one validator both entry points call.

``paci_flags()`` lists every PACI flag (the core ones here, each stage feature's own in its
module); ``add_paci_arguments`` adds them to ``pretrain_gpt_paci.py``'s parser and, through
``patches/megatron_lm``, to Megatron-LM's. ``resolve(args, layout)`` checks them against the
rest of the run (``Layout``: what either entry point knows of P, N, data parallelism, tied
embeddings, precision) before any process group starts, runs the plan(s) the run will use
through the simulator's checks, and returns the ``PaciConfig`` every later layer reads.
Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .adapt import candidates
from .features import METHODS, method_named
from .flag import ConfigError, Flag, RemovedFlag, bounded_float, bounded_int, positive
from .schedule import check_max_drift, check_per_call, plan_stream
from .shape import StreamShape, local_steps_ramped
from .simulate import ScheduleError, check_plan

SCHEDULES = ("1f1b", "interleaved", "paci")
ADAPT_DEFAULTS = {"paci_adapt_interval": 10, "paci_adapt_tolerance": 0.0,
                  "paci_adapt_policy": "staleness"}


def _factor_or_auto(text: str):
    """--paci-accumulation-factor: a whole number >= 1, or auto."""
    if text.strip() == "auto":
        return "auto"
    return positive("--paci-accumulation-factor")(text)


SCHEDULE_FLAG = Flag(
    "--pipeline-schedule", choices=SCHEDULES,
    help="paci: never-flushing 1F1B with per-stage optimizer steps every a backwards, drift "
         "<= ceil((P-1-s)/a); 1f1b: stock Megatron-Core (the regression baseline); "
         "interleaved: stock Megatron-Core with --num-layers-per-virtual-pipeline-stage")
CORE_FLAGS = (
    Flag("--paci-accumulation-factor", type=_factor_or_auto, metavar="A",
         help="backward passes per local optimizer step of a stage; must divide the "
              "micro-batches per global batch (default: all of them). auto: chosen between "
              "iterations among those divisors within --paci-max-drift (docs/convergence.md)"),
    Flag("--paci-max-drift", type=bounded_int("--paci-max-drift", 0), metavar="D",
         help="largest tolerated weight-version drift (default: the bound ceil((P-1-s)/a))"),
    Flag("--paci-on-nonfinite", choices=("skip", "abort"), default="skip", neutral="skip",
         help="a NaN/Inf gradient at a stage's local step: skip that update (and count it) "
              "or stop the job"),
    Flag("--paci-drain-before-eval", switch=True,
         help="drain the pipeline before each evaluation (frees the in-flight activations; "
              "training then continues as if it had flushed there). Default: evaluate between "
              "iterations without draining, which leaves training unchanged"),
    Flag("--paci-adapt-interval", type=positive("--paci-adapt-interval"), metavar="N",
         help="with --paci-accumulation-factor auto: iterations between two decisions "
              "(default 10)"),
    Flag("--paci-adapt-tolerance", type=bounded_float("--paci-adapt-tolerance", low_open=True),
         metavar="X", help="with --paci-accumulation-factor auto: largest predicted staleness "
                           "(relative weight change per step x steps in flight) of the smallest "
                           "a taken (default: the largest a = N staleness measured so far)"),
    # a test hook: every decision takes the next candidate, whatever the signal
    Flag("--paci-adapt-policy", choices=("staleness", "cycle"), hidden=True,
         help="with --paci-accumulation-factor auto: staleness or cycle"),
)


# methods that lost their studies (benchmarks/studies/ keeps their numbers)
_PREDICTION_INSTEAD = ("the default weight prediction replaced it (--no-paci-weight-prediction "
                       "runs the paper's plain PACI); drop the flag")
REMOVED_FLAGS = (
    RemovedFlag("--paci-stale-grad-weight", "0.2.0",
                "it doubled plain PACI's gap (studies 09, 10, 12); " + _PREDICTION_INSTEAD),
    RemovedFlag("--paci-stale-grad-correction", "0.2.0",
                "it trailed plain PACI (studies 11, 12); " + _PREDICTION_INSTEAD),
    RemovedFlag("--paci-weight-prediction-schedule", "0.2.0",
                "moving once a group lost to moving before every stale forward (study 14), "
                "which the default weight prediction always does (--no-paci-weight-prediction "
                "runs the paper's plain PACI); drop the flag"),
    RemovedFlag("--paci-sync-iters", "0.2.0",
                "the warm start took nothing off (study 08); to start on stock 1F1B, run K "
                "iterations with --pipeline-schedule 1f1b --save DIR, then --load DIR "
                "--pipeline-schedule paci (docs/operations.md, switching schedules)"),
    RemovedFlag("--paci-cooldown-iters", "0.2.0",
                "the cool-down did not recover the gap (study 12); to end on stock 1F1B, "
                "--save DIR, then --load DIR --pipeline-schedule 1f1b (docs/operations.md, "
                "switching schedules)"),
)


def paci_flags() -> Tuple[Flag, ...]:
    """Every PACI flag: the schedule, the core ones, each method's."""
    return (SCHEDULE_FLAG,) + CORE_FLAGS + tuple(f for method in METHODS for f in method.FLAGS)


def add_paci_arguments(parser: argparse.ArgumentParser, schedule_default: str,
                       title: str = "pipeline schedule"):
    """PACI's flags as one argument group (returns the parser, as Megatron-LM's
    ``extra_args_provider`` must)."""
    group = parser.add_argument_group(title=title)
    for flag in paci_flags():
        flag.add_to(group, default=schedule_default if flag is SCHEDULE_FLAG else None)
    for removed in REMOVED_FLAGS:
        removed.add_to(group)
    return parser


@dataclass(frozen=True)
class Layout:
    """What PACI's checks need of the rest of a run, as either entry point knows it."""

    pipeline_size: int
    microbatches: int  # per iteration (the first of a ramp)
    micro_batch_size: int = 1
    data_parallel_size: int = 1
    virtual: bool = False
    ramp: Tuple[int, ...] = ()  # every M --rampup-batch-size goes through
    # stage 0 shares a weight with the last stage (first_stage_shares_weight): the tied actions
    tied: bool = False
    mtp: bool = False  # ... because of --mtp-num-layers (P > 1)
    fp16: bool = False


def first_stage_shares_weight(pipeline_size: int, untied: bool, mtp_num_layers) -> bool:
    """At P > 1, does stage 0's word embedding have a copy on the last stage, kept equal by
    the tied actions (SG/RG, SW/RW)? With tied embeddings (the output layer), and with
    multi-token prediction (its layers on the last stage read their own copy). The flags'
    side of ``mcore.tied.shares_first_and_last``."""
    return pipeline_size > 1 and (not untied or bool(mtp_num_layers))


def refuse_tied_mtp_checkpoints(pipeline_size: int, untied: bool, mtp_num_layers,
                                save) -> None:
    """Megatron-Core (0.16.1 to main) cannot save tied embeddings beside MTP at P > 1: its MTP
    stage allocates an output-layer weight that nothing reads, and its sharded_state_dict
    asserts that weight absent, at the first save, under stock 1F1B too. Say so before the
    run rather than at its first checkpoint."""
    if pipeline_size > 1 and mtp_num_layers and not untied and save:
        raise ConfigError("--mtp-num-layers with tied embeddings at P > 1 cannot be saved by "
                          "Megatron-Core (the last stage's output layer keeps a weight nothing "
                          "reads, which its checkpoint asserts absent; stock 1F1B fails at the "
                          "first save too): add --untie-embeddings-and-output-weights (as "
                          "DeepSeek-V3 does), or drop --save")


@dataclass(frozen=True)
class PaciConfig:
    """PACI's settings once resolved: defaults filled in, checked against the layout."""

    schedule: str
    shape: StreamShape  # P, a, N, micro-batch, data-parallel, warm-up
    accumulation_follows: bool = False  # no explicit a: it follows M through a ramp
    max_drift: Optional[int] = None
    on_nonfinite: str = "skip"
    drain_before_eval: bool = False
    adapt_interval: int = 0  # --paci-accumulation-factor auto: decide every N iterations
    adapt_tolerance: float = 0.0
    adapt_policy: str = "staleness"
    # (name, settings) of each convergence method this run runs, in features.METHODS' order
    methods: Tuple[Tuple[str, object], ...] = ()
    notes: Tuple[str, ...] = ()  # start-up lines: why a method's default is off for this run

    def method(self, name: str):
        """That method's resolved settings, None when this run does not run it."""
        method_named(name)  # a misspelt name is an error, not "off"
        return dict(self.methods).get(name)

    @property
    def accumulation(self) -> int:
        return self.shape.accumulation

    @property
    def auto(self) -> bool:
        return bool(self.adapt_interval)

    def local_steps_before(self, iteration: int, ramp: Optional[Sequence[int]] = None) -> int:
        """Local steps every stage has taken after ``iteration`` iterations (a --load resumes
        there); ``ramp``: each iteration's micro-batches under --rampup-batch-size."""
        if ramp is None:
            return self.shape.local_steps_before(iteration)
        return local_steps_ramped(ramp, None if self.accumulation_follows else self.accumulation)


def resolve(args, layout: Layout) -> PaciConfig:
    """Check PACI's flags in ``args`` against ``layout`` and fill in their defaults; raises
    ConfigError naming the flag and the fix."""
    schedule = args.pipeline_schedule
    _check_schedule(schedule, layout)
    if schedule != "paci":
        refuse_paci_flags(args, schedule)
        return PaciConfig(schedule, StreamShape(layout.pipeline_size, layout.microbatches,
                                                layout.microbatches, layout.micro_batch_size,
                                                layout.data_parallel_size))
    _check_fp16_scales(args, layout)
    for method in METHODS:
        method.check(args, layout)
    auto = args.paci_accumulation_factor == "auto"
    adapt = _adapt_settings(args, auto, layout)
    follows = args.paci_accumulation_factor is None
    accumulation = layout.microbatches if follows or auto else args.paci_accumulation_factor
    check_accumulation_divides(accumulation, layout.ramp, follows)
    try:
        check_per_call(layout.microbatches, accumulation)
        check_max_drift(layout.pipeline_size, accumulation, args.paci_max_drift)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    shape = StreamShape(layout.pipeline_size, accumulation, layout.microbatches,
                        layout.micro_batch_size, layout.data_parallel_size)
    cfg = PaciConfig(
        "paci", shape, accumulation_follows=follows, max_drift=args.paci_max_drift,
        on_nonfinite=args.paci_on_nonfinite or "skip",
        drain_before_eval=bool(args.paci_drain_before_eval), **adapt,
        methods=tuple((m.name, settings) for m in METHODS
                      if (settings := m.settings(args)) is not None),
        notes=tuple(note for m in METHODS if (note := m.off_note(args))))
    check_plans(cfg, layout)
    return cfg


def _resolved(value, default):
    return default if value is None else value


def _check_schedule(schedule: str, layout: Layout) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {schedule!r} is unknown; choose one of "
                          f"{list(SCHEDULES)}")
    if schedule == "1f1b" and layout.virtual:
        raise ConfigError("--pipeline-schedule 1f1b runs without virtual stages; drop "
                          "--num-layers-per-virtual-pipeline-stage or use --pipeline-schedule "
                          "interleaved")
    if schedule == "interleaved":
        if not layout.virtual or layout.pipeline_size < 2:
            raise ConfigError("--pipeline-schedule interleaved needs "
                              "--pipeline-model-parallel-size >= 2 and "
                              "--num-layers-per-virtual-pipeline-stage")
        if layout.microbatches % layout.pipeline_size:
            raise ConfigError(f"--pipeline-schedule interleaved needs the number of "
                              f"micro-batches ({layout.microbatches}) to be a multiple of "
                              f"--pipeline-model-parallel-size ({layout.pipeline_size})")
    if schedule == "paci" and layout.virtual:
        raise ConfigError("--pipeline-schedule paci does not support virtual pipeline stages; "
                          "drop --num-layers-per-virtual-pipeline-stage")


def refuse_paci_flags(args, schedule: str) -> None:
    """A PACI flag set under another schedule would silently do nothing."""
    given = [f.name for f in paci_flags() if f is not SCHEDULE_FLAG and f.is_set(args)]
    if given:
        verb = "apply" if len(given) > 1 else "applies"
        raise ConfigError(f"{', '.join(given)} only {verb} to --pipeline-schedule paci, not "
                          f"{schedule}; drop {'them' if len(given) > 1 else 'it'}")


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _check_fp16_scales(args, layout: Layout) -> None:
    """fp16 under PACI: each stage rescales a received gradient by (own scale / sender's
    scale), exact only for powers of two (the dynamic scaler doubles and halves them)."""
    if not layout.fp16:
        return
    for flag in ("--initial-loss-scale", "--min-loss-scale", "--loss-scale"):
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None and not _is_power_of_two(value):
            nearest = 2.0 ** round(math.log2(value))
            raise ConfigError(f"{flag} {value:g}: --pipeline-schedule paci with --fp16 needs a "
                              f"power of two (each stage rescales received gradients by the "
                              f"ratio of two scales, exact only then); use {nearest:g}")


def _adapt_settings(args, auto: bool, layout: Layout) -> dict:
    """--paci-accumulation-factor auto: its flags' defaults; they need auto, and auto needs
    no weight shared by the first and last stage (untied embeddings, no MTP) and a fixed
    number of micro-batches."""
    for dest in ADAPT_DEFAULTS:
        if getattr(args, dest, None) is not None and not auto:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} only applies with --paci-accumulation-factor auto; "
                              "drop it or add --paci-accumulation-factor auto")
    if not auto:
        return {}
    if layout.mtp:  # the embedding copy's lag ceil(P/a) is set for a fixed a
        raise ConfigError("--paci-accumulation-factor auto does not support --mtp-num-layers at "
                          "P > 1 yet (the last stage's copy of the embedding trails stage 0's "
                          "by a lag set for a fixed a); give a number or drop --mtp-num-layers")
    if layout.tied:  # the tied copy's lag ceil(P/a) is set for a fixed a
        raise ConfigError("--paci-accumulation-factor auto does not support tied embeddings "
                          "yet (the tied weight's lag is set for a fixed a); add "
                          "--untie-embeddings-and-output-weights or give a number")
    if layout.ramp:
        raise ConfigError("--paci-accumulation-factor auto does not support --rampup-batch-size "
                          "yet (its candidates are the divisors of one M); give a number or "
                          "drop --rampup-batch-size")
    value = {d: _resolved(getattr(args, d, None), default) for d, default in ADAPT_DEFAULTS.items()}
    return {"adapt_interval": value["paci_adapt_interval"],
            "adapt_tolerance": value["paci_adapt_tolerance"],
            "adapt_policy": value["paci_adapt_policy"]}


def rampup_micro_batches(rampup: Optional[Sequence[int]], global_batch_size: int,
                         per_step: int, round_down: bool = False) -> List[int]:
    """Every number of micro-batches per iteration that ``--rampup-batch-size START INCR
    SAMPLES`` goes through (START, START+INCR, ..., --global-batch-size, each divided by
    micro-batch x data-parallel size); [] without a ramp. ``round_down``: Megatron-LM's
    --decrease-batch-size-if-needed. Raises ConfigError naming the flag."""
    if rampup is None:
        return []
    start, incr, samples = (int(x) for x in rampup)
    flag = f"--rampup-batch-size {start} {incr} {samples}"
    from .mcore.compat import has_batch_size_rampup

    if not has_batch_size_rampup():
        raise ConfigError(f"{flag}: the installed megatron-core no longer ramps the batch size "
                          "(0.18 deprecated the flag and ignores it); drop it, or use "
                          "megatron-core 0.17 or earlier")
    if start == global_batch_size:
        raise ConfigError(f"{flag}: START equals --global-batch-size, so there is nothing to "
                          "ramp up; drop --rampup-batch-size or lower START")
    if start > global_batch_size or (global_batch_size - start) % incr:
        raise ConfigError(f"{flag}: START must be at most --global-batch-size "
                          f"{global_batch_size} and reach it in steps of INCR")
    sizes = list(range(start, global_batch_size + 1, incr))
    if round_down:
        return [size // per_step for size in sizes]
    bad = [size for size in sizes if size % per_step]
    if bad:
        raise ConfigError(f"{flag}: the batch sizes {bad} are not divisible by --micro-batch-size"
                          f" x data-parallel size = {per_step}; pick START and INCR multiples "
                          f"of {per_step}")
    return [size // per_step for size in sizes]


def check_accumulation_divides(accumulation: int, ramp: Sequence[int], follows: bool) -> None:
    """An explicit accumulation factor stays fixed while M ramps up: it must divide every M."""
    if follows:
        return
    bad = [m for m in ramp if m % accumulation]
    if bad:
        raise ConfigError(
            f"--paci-accumulation-factor {accumulation} must divide every number of "
            f"micro-batches per iteration that --rampup-batch-size goes through {list(ramp)} "
            f"(not {bad}); pick a common divisor, or drop --paci-accumulation-factor (a then "
            "equals the number of micro-batches at every batch size)")


def check_plans(cfg: PaciConfig, layout: Layout) -> None:
    """Every plan the run can use (each a that auto may pick, each M of a ramp) passes the
    simulator's checks; the runtime checks its own again at start-up, with NCCL's rules where
    it runs on NCCL."""
    shape = cfg.shape
    per_calls = layout.ramp or (shape.per_call,)
    for per_call in per_calls:
        factors = candidates(shape.num_stages, per_call, cfg.max_drift) if cfg.auto else \
            (per_call if cfg.accumulation_follows else shape.accumulation,)
        for a in factors:
            try:
                check_plan(plan_stream("paci", shape.num_stages, a, per_call, layout.tied))
            except (ScheduleError, ValueError) as exc:
                raise ConfigError(f"the PACI plan for P={shape.num_stages}, a={a}, "
                                  f"N={per_call} fails its checks: {exc}") from None
