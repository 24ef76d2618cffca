"""Run one training config under several schedules and write a side-by-side report.

    python -m paci_megatron.tools.compare --schedules 1f1b,paci --out DIR [--nproc-per-node 2] \\
        [--run NAME="FLAGS"]... [--seeds 1234,1235] -- <pretrain_gpt_paci.py flags>

Built-in runs (``--schedules``; default, without ``--run``: all of them): 1f1b, interleaved
(when each stage has at least two layers), paci, and paci-a1 (paci with
--paci-accumulation-factor 1: a step after every backward, the unbounded "PipeDream without
stash" reference). ``--run NAME="FLAGS"`` adds a named run with its own extra flags, e.g.
``--run paci-a4="--pipeline-schedule paci --paci-accumulation-factor 4"``. ``--seeds`` repeats
every run with each ``--seed``; the report gives the mean and the sample standard deviation
over seeds of every figure.

Runs one after another, then writes DIR/report.md and plots (loss against consumed samples,
wall time and projected accelerator time):
- per run: final and best validation loss, tokens/s, the simulator's projected time per
  iteration, peak memory and drift per stage;
- time to accuracy: for each target loss (the baseline's validation loss at 50, 75, 90 and
  100% of its run, per seed, plus ``--targets``), the samples, optimizer updates, wall time
  and projected accelerator time at which each run's validation curve first reaches it
  (interpolated between evaluations), and the projected time-to-accuracy speed-up over the
  baseline and over interleaved 1F1B;
- with runs named ``*-long`` and a ``1f1b-long`` control: the budget comparison.

The projection (``tta.py``) runs each schedule's action lists for this P and M through the
lockstep simulator with per-action costs from ``--project-forward-ms`` /
``--project-backward-ms`` / ``--project-step-ms`` (default 1 : 2 : 0), or, with
``--project-costs measured``, timed before the runs on the real model: one stage's layers as a
one-stage model with the run's flags (``mcore/costs.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..simulate import Costs
from . import tta
from .compare_report import (X_GPU, X_PROJECTED, X_SAMPLES, X_UNCOSTED, X_UPDATES, budget_table,
                             gap_table, method_cost_line, plot, prediction_cost_line,
                             print_speedups, report_table, tta_table)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(REPO, "pretrain_gpt_paci.py")
BUILT_IN = ("1f1b", "interleaved", "paci", "paci-a1")


class CompareError(ValueError):
    """Bad compare flags; the message names the flag and the fix."""


@dataclass(frozen=True)
class RunSpec:
    name: str
    flags: Tuple[str, ...]


def schedule_flags(name: str, layers_per_stage: int) -> Optional[List[str]]:
    """Extra flags for a built-in run; None when it does not apply to this config."""
    if name == "1f1b":
        return ["--pipeline-schedule", "1f1b"]
    if name == "interleaved":
        if layers_per_stage < 2:
            return None
        return ["--pipeline-schedule", "interleaved",
                "--num-layers-per-virtual-pipeline-stage", str(layers_per_stage // 2)]
    if name == "paci":
        return ["--pipeline-schedule", "paci"]
    if name == "paci-a1":
        return ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "1"]
    raise CompareError(f"--schedules: unknown run {name!r}; known: {', '.join(BUILT_IN)} "
                       "(define others with --run NAME=\"FLAGS\")")


def parse_run(text: str) -> RunSpec:
    """``NAME=FLAGS`` (FLAGS split like a shell would) into a named run."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", name):
        raise CompareError(f"--run {text!r}: expected NAME=\"FLAGS\" with a name of letters, "
                           "digits and _.+- (e.g. --run paci-a4=\"--pipeline-schedule paci "
                           "--paci-accumulation-factor 4\")")
    try:
        return RunSpec(name, tuple(shlex.split(flags)))
    except ValueError as exc:
        raise CompareError(f"--run {name}: cannot split its flags ({exc})") from None


def parse_seeds(text: Optional[str]) -> List[Optional[int]]:
    if text is None:
        return [None]
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise CompareError(f"--seeds {text!r}: expected comma-separated whole numbers, "
                           "e.g. --seeds 1234,1235") from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise CompareError(f"--seeds {text!r}: seeds must be distinct and >= 0")
    return seeds


def _flag(flags: Sequence[str], name: str, default: Optional[str] = None) -> Optional[str]:
    value = default
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]  # the last one wins, as with argparse
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def run_shape(name: str, flags: Sequence[str], nproc: int) -> tta.RunShape:
    """Validate a run's flags as pretrain_gpt_paci.py would (before anything is launched) and
    return what the simulator needs of it."""
    from ..arguments import ConfigError, build_parser, validate

    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(list(flags))
    except SystemExit:
        raise CompareError(f"run {name}: its training flags do not parse (see above)") from None
    if unknown:
        raise CompareError(f"run {name}: unknown training flags {unknown}")
    try:
        cfg = validate(args, nproc)
    except ConfigError as exc:
        raise CompareError(f"run {name}: {exc}") from None
    return tta.RunShape(
        schedule=args.pipeline_schedule, num_stages=args.pipeline_model_parallel_size,
        microbatches=args.num_microbatches, accumulation=cfg.accumulation,
        sync_iters=cfg.sync_iters, cooldown_start=cfg.shape.cooldown_start,
        virtual_chunks=args.virtual_pipeline_model_parallel_size or 1,
        predicts=args.pipeline_schedule == "paci" and cfg.weight_prediction,
        predicts_per_group=args.pipeline_schedule == "paci" and cfg.weight_prediction
        and cfg.prediction_per_group,
        looks_ahead=args.pipeline_schedule == "paci" and bool(cfg.lookahead))


# flags a one-stage timing launch must not inherit (value-taking, then switches)
NOT_FOR_TIMING = ("--num-layers", "--pipeline-model-parallel-size", "--pipeline-schedule",
                  "--num-layers-per-virtual-pipeline-stage", "--save", "--load",
                  "--metrics-file", "--tensorboard-dir", "--exit-interval", "--save-interval",
                  "--save-interval-minutes", "--paci-accumulation-factor", "--paci-max-drift",
                  "--paci-sync-iters", "--paci-on-nonfinite", "--paci-stale-grad-weight",
                  "--paci-stale-grad-correction", "--eval-interval")
SWITCHES_NOT_FOR_TIMING = ("--paci-drain-before-eval", "--measure-memory",
                           "--measure-activation-memory", "--override-opt_param-scheduler",
                           "--use-checkpoint-opt_param-scheduler")


def timing_flags(train_flags: Sequence[str], layers_per_stage: int) -> List[str]:
    """The training flags for a one-stage model of ``layers_per_stage`` layers."""
    out, skip = [], False
    for f in train_flags:
        if skip:
            skip = False
            continue
        name = f.split("=", 1)[0]
        if name in NOT_FOR_TIMING:
            skip = "=" not in f
            continue
        if f not in SWITCHES_NOT_FOR_TIMING:
            out.append(f)
    return out + ["--num-layers", str(layers_per_stage), "--pipeline-model-parallel-size", "1",
                  "--pipeline-schedule", "1f1b"]


def measure_costs(train_flags: Sequence[str], shape: tta.RunShape, out: str,
                  timeout: float) -> Dict[str, float]:
    """Time one stage's forward, backward and step on the real model (one short launch of
    a one-stage model with one stage's layers, tensor parallel as in the runs)."""
    layers = int(_flag(train_flags, "--num-layers", "4"))
    tp = int(_flag(train_flags, "--tensor-model-parallel-size", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp}", "-m", "paci_megatron.tools.costs",
           *timing_flags(train_flags, layers // shape.num_stages)]
    path = os.path.join(out, "costs.log")
    with open(path, "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                              timeout=timeout)
        log.write(proc.stdout)
    found = [l for l in proc.stdout.splitlines() if l.startswith("PACI_COSTS ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"timing the model failed (exit {proc.returncode}); see {path}")
    costs = json.loads(found[-1][len("PACI_COSTS "):])
    with open(os.path.join(out, "costs.json"), "w") as f:
        json.dump(costs, f)
    return costs


def run_one(spec: RunSpec, seed: Optional[int], train_flags: List[str], out: str, nproc: int,
            timeout: float, reuse: bool = False) -> List[Dict]:
    """Train once; returns the metrics records. With ``reuse``, a finished run of the same
    name, seed and flags in ``out`` is read back instead of run again."""
    stem = spec.name if seed is None else f"{spec.name}.seed{seed}"
    metrics = os.path.join(out, f"{stem}.jsonl")
    seed_flags = [] if seed is None else ["--seed", str(seed)]
    flags = [*train_flags, *spec.flags, *seed_flags]
    record = os.path.join(out, f"{stem}.flags.json")
    if reuse and _finished_with(metrics, record, flags, nproc):
        print(f"  reusing {metrics}", flush=True)
        return _read_records(metrics)
    for stale in (metrics, record):
        if os.path.exists(stale):
            os.remove(stale)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", ENTRY, *flags, "--metrics-file", metrics]
    with open(os.path.join(out, f"{stem}.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{stem} failed (exit {proc.returncode}); see {log.name}")
    with open(record, "w") as f:
        json.dump({"flags": flags, "nproc_per_node": nproc}, f)
    return _read_records(metrics)


def _read_records(metrics: str) -> List[Dict]:
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished_with(metrics: str, record: str, flags: List[str], nproc: int) -> bool:
    """A run in ``out`` that ended (its final record is there) with exactly these flags."""
    if not (os.path.exists(metrics) and os.path.exists(record)):
        return False
    with open(record) as f:
        if json.load(f) != {"flags": flags, "nproc_per_node": nproc}:
            return False
    return any(r.get("final") for r in _read_records(metrics))


def _mean_ratio(costs: Sequence, forwards: Sequence) -> Optional[float]:
    """Mean over the stages that timed both of a cost over the same stage's forward."""
    ratios = [c / f for c, f in zip(costs, forwards) if c and f]
    return sum(ratios) / len(ratios) if ratios else None


def measured_method_cost(shape: tta.RunShape, final: Dict, costs: Costs) -> tta.MethodCost:
    """The run's method's cost in forwards as the run timed it (per stage, over the same
    stage's forward, the mean over stages); where it did not time it, the projection's own
    --project-predict-ms (a look-ahead always times its pass where it moves anything)."""
    forwards = final.get("method_forward_ms") or final.get("predicted_forward_ms") or []
    predict = _mean_ratio(final.get("predict_ms") or [], forwards) if shape.predicts else 0.0
    ahead = _mean_ratio(final.get("lookahead_ms") or [], forwards) if shape.looks_ahead else 0.0
    source = "its run's timing"
    if predict is None:
        if not costs.predict:
            raise CompareError("a run predicts weights but did not time its prediction (a "
                               "run older than its timing): give its cost, --project-predict-ms "
                               "MS or --project-costs measured, so that no speed-up leaves it "
                               "out")
        predict, source = costs.predict / costs.forward, "--project-predict-ms"
    if ahead is None:
        raise CompareError("a run looks ahead (--paci-lookahead) but did not time its pass: "
                           "its cost is unknown, so no speed-up is stated for it")
    return tta.MethodCost(predict, ahead, source=source)


def summarize(name: str, records: List[Dict], shape: tta.RunShape, costs: Costs,
              seed: Optional[int] = None,
              gpu: tta.GpuModel = tta.GPU_MODELS["gpt2-medium"]) -> Dict:
    """One seed of one run: its figures and its validation curve, whose points carry
    (samples, updates, wall s, projected s with the method's cost, the same with a GPU's
    costs, projected s with the method's cost left out) and the loss (X_* in
    compare_report)."""
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "validation_loss" in r and not r.get("final")]
    final = next(r for r in records if r.get("final"))
    by_iter = {r["iteration"]: r for r in train}
    method = measured_method_cost(shape, final, costs)
    gpu_method = tta.gpu_method_cost(shape, gpu)
    paces = [(c, tta.seconds_per_iteration(shape, c)) for c in (
        tta.with_method(costs, method),
        tta.with_method(tta.gpu_costs(gpu, shape.num_stages), gpu_method),
        tta.with_method(costs, None))]
    per_iteration = paces[0][1]

    def point(iteration, samples, wall, value):
        xs = (samples, shape.updates(iteration), wall,
              *(tta.projected_seconds(shape, c, iteration, pace) for c, pace in paces))
        return xs, value

    curve = [point(r["iteration"], by_iter[r["iteration"]]["consumed_samples"],
                   by_iter[r["iteration"]]["wall_s"], r["validation_loss"])
             for r in evals if r["iteration"] in by_iter]
    if not curve or final["iteration"] != evals[-1]["iteration"]:
        curve.append(point(final["iteration"], final["consumed_samples"], final["wall_s"],
                           final["validation_loss"]))
    steady = train[len(train) // 4:] or train
    return {
        "name": name, "seed": seed, "shape": shape, "train": train, "curve": curve,
        "final_val": final["validation_loss"],
        "best_val": min(v for _, v in curve),
        "tokens_per_sec": sum(r["tokens_per_sec"] for r in steady) / len(steady),
        "projected_s_per_iteration": per_iteration[1],
        "method_cost": method, "gpu_method_cost": gpu_method,
        "peak_rss_mb": final.get("peak_rss_mb"),
        "peak_activation_mb": final.get("peak_activation_mb"),
        # per-iteration records know only the logging stage's drift; the final one has all
        "max_drift": final.get("max_drift") or (train[-1]["max_drift"] if train else None),
        # per stage, a predicted forward's move + restore in forwards (None: not predicted)
        "predict_in_forwards": [p and f and p / f for p, f in zip(
            final.get("predict_ms") or [],
            final.get("method_forward_ms") or final.get("predicted_forward_ms") or [])],
        "wall_s": final["wall_s"],
        "train_iters": final["iteration"],
    }


# --- targets and time to accuracy --------------------------------------------------------

# the baseline's validation loss at these fractions of its run are targets (besides its final)
RUN_FRACTIONS = (("mid-run", 0.5), ("at 75%", 0.75), ("at 90%", 0.9))


def targets_per_seed(base: List[Dict], extra: Sequence[float]) -> List[Tuple[str, List[float]]]:
    """(label, one target per seed): the baseline's final validation loss of the same seed
    (runs of one seed share data order and initial weights), its loss at half, 75% and 90%
    of its run (equal samples), then fixed targets."""
    name = base[0]["name"]
    found = [(f"{name} final", [r["final_val"] for r in base])]
    found += [(f"{name} {label}", [tta.run_fraction_target(r["curve"], X_SAMPLES, f)
                                   for r in base]) for label, f in RUN_FRACTIONS]
    found += [(f"{value:g}", [value] * len(base)) for value in extra]
    return found


def interleaved_hits(runs: Dict[str, List[Dict]], base_name: str, per_seed: List[float],
                     costs: Optional[Costs], x: int = X_PROJECTED
                     ) -> Optional[List[Optional[float]]]:
    """Per seed, interleaved 1F1B's projected seconds (``x``: with this machine's or the
    GPU's costs) to the target: from its own run when there is one, else from the baseline's
    curve (a synchronous schedule makes the same updates) at interleaved's projected pace
    (v = 2) under ``costs``; None where it cannot run."""
    if "interleaved" in runs:
        return [h and h[x] for h in
                (tta.reach(r["curve"], t) for r, t in zip(runs["interleaved"], per_seed))]
    base = runs[base_name]
    shape = base[0]["shape"]
    if costs is None or shape.schedule != "1f1b":
        return None
    pace = tta.interleaved_seconds_per_iteration(shape.num_stages, shape.microbatches, costs)
    if pace is None:
        return None
    return [h and h[X_UPDATES] * pace for h in
            (tta.reach(r["curve"], t) for r, t in zip(base, per_seed))]


def time_to_accuracy(runs: Dict[str, List[Dict]], base_name: str,
                     targets: List[Tuple[str, List[float]]],
                     costs: Optional[Costs] = None,
                     gpu: tta.GpuModel = tta.GPU_MODELS["gpt2-medium"]) -> List[Dict]:
    """Per run and target: per seed, the x values where the curve first reaches the target
    (None: not reached), and the projected TTA speed-ups over the baseline and over
    interleaved 1F1B (``interleaved_hits``; None where it has none), each with the run's
    method's own cost, on this machine's costs (``speedup``) and a GPU's (``*_gpu``), and
    on this machine's with the method's cost left out (``speedup_cost_left_out``: printed
    only beside the one with it)."""
    rows = []
    for label, per_seed in targets:
        base_hits = [tta.reach(r["curve"], t) for r, t in zip(runs[base_name], per_seed)]
        inter = interleaved_hits(runs, base_name, per_seed, costs)
        inter_gpu = interleaved_hits(runs, base_name, per_seed, tta.gpu_costs(
            gpu, runs[base_name][0]["shape"].num_stages), X_GPU)
        for name, seeds in runs.items():
            hits = [tta.reach(r["curve"], t) for r, t in zip(seeds, per_seed)]

            def vs(base, x):
                return None if base is None else tta.speedups(base, [h and h[x] for h in hits])

            def at(x):
                return [h and h[x] for h in base_hits]

            rows.append({
                "run": name, "target": label, "target_values": per_seed, "hits": hits,
                "speedup": vs(at(X_PROJECTED), X_PROJECTED),
                "speedup_gpu": vs(at(X_GPU), X_GPU),
                "speedup_cost_left_out": vs(at(X_UNCOSTED), X_UNCOSTED),
                "vs_interleaved": vs(inter, X_PROJECTED),
                "vs_interleaved_gpu": vs(inter_gpu, X_GPU),
            })
    return rows


def budget_rows(runs: Dict[str, List[Dict]], base_name: str, control_name: str) -> List[Dict]:
    """The budget comparison: runs named ``*-long`` train for the updates their throughput
    fits into the baseline's time, their cosine stretched over them; ``control_name`` is the
    baseline on the same stretched schedule. Per run and seed: the validation loss at the
    baseline's projected run time (the budget), the final loss, the gap to the control at
    equal samples at the end, and the projected speed-up over the control to the control's
    final loss (the longer cosine alone, which the control also has, is no speed-up)."""
    base, control = runs[base_name], runs[control_name]
    control_hits = [tta.reach(c["curve"], c["final_val"]) for c in control]
    rows = []
    for name, seeds in runs.items():
        if not name.endswith("-long"):
            continue
        budget = [tta.loss_at(r["curve"], X_PROJECTED, b["curve"][-1][0][X_PROJECTED])
                  for r, b in zip(seeds, base)]
        gaps = [tta.gaps_at(c["curve"], r["curve"], X_SAMPLES, (1.0,))[0]
                for r, c in zip(seeds, control)]
        hits = [tta.reach(r["curve"], c["final_val"]) for r, c in zip(seeds, control)]
        rows.append({"run": name, "budget_loss": budget,
                     "base_final": [b["final_val"] for b in base],
                     "final": [r["final_val"] for r in seeds], "gap_to_control": gaps,
                     "speedup_to_control_final": tta.speedups(
                         [h and h[X_PROJECTED] for h in control_hits],
                         [h and h[X_PROJECTED] for h in hits])})
    return rows


# --- formatting --------------------------------------------------------------------------

# --- command line ------------------------------------------------------------------------

def _non_negative(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number >= 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paci_megatron.tools.compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default=None,
                        help=f"built-in runs, comma-separated, from {', '.join(BUILT_IN)} "
                             "(default: all of them when no --run is given)")
    parser.add_argument("--run", action="append", default=[], metavar='NAME="FLAGS"',
                        help="a named run with its own extra training flags (repeatable)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds; every run is repeated with each --seed")
    parser.add_argument("--baseline", default=None,
                        help="run the others are compared with (default: 1f1b if present, "
                             "else the first run)")
    parser.add_argument("--targets", default="",
                        help="extra target validation losses, comma-separated")
    parser.add_argument("--project-costs", choices=("flags", "measured"), default="flags",
                        help="per-stage costs of the projection: the --project-*-ms flags "
                             "(default), or timed on the real model before the runs (one "
                             "stage's layers as a one-stage model, this machine)")
    parser.add_argument("--project-forward-ms", type=_non_negative("--project-forward-ms"),
                        default=None, help="projected cost of one forward per stage (default 1)")
    parser.add_argument("--project-backward-ms", type=_non_negative("--project-backward-ms"),
                        default=None, help="projected cost of one backward per stage (default 2)")
    parser.add_argument("--project-step-ms", type=_non_negative("--project-step-ms"),
                        default=None, help="projected cost of one optimizer step per stage "
                                           "(default 0)")
    parser.add_argument("--project-predict-ms", type=_non_negative("--project-predict-ms"),
                        default=None,
                        help="projected extra cost of a forward on predicted weights (the "
                             "move and the restore, --paci-weight-prediction) per stage, for "
                             "runs that did not time their own (default 0)")
    parser.add_argument("--gpu-model", choices=sorted(tta.GPU_MODELS), default="gpt2-medium",
                        help="the model whose costs on an H200, by arithmetic, give the "
                             "second projection (default gpt2-medium)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--reuse", action="store_true",
                        help="read back runs already finished in --out with the same name, "
                             "seed and flags instead of running them again (to add runs to a "
                             "study)")
    return parser


def plan_runs(args, train_flags: List[str]) -> List[RunSpec]:
    pp = int(_flag(train_flags, "--pipeline-model-parallel-size", str(args.nproc_per_node)))
    layers = int(_flag(train_flags, "--num-layers", "4"))
    names = args.schedules if args.schedules is not None else \
        ("" if args.run else ",".join(BUILT_IN))
    specs = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        extra = schedule_flags(name, layers // pp)
        if extra is None:
            print(f"skipping {name}: needs at least 2 layers per stage", flush=True)
            continue
        specs.append(RunSpec(name, tuple(extra)))
    specs += [parse_run(text) for text in args.run]
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise CompareError(f"run {spec.name!r} is given twice (--schedules / --run): "
                               "rename one")
        seen.add(spec.name)
    if not specs:
        raise CompareError("nothing to run: give --schedules and/or --run")
    return specs


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        return compare(args, train_flags)
    except CompareError as exc:
        parser.error(str(exc))


def _cost_flags(args) -> None:
    """Fill the --project-*-ms defaults; refuse them beside --project-costs measured."""
    given = [f"--project-{k}-ms" for k in ("forward", "backward", "step", "predict")
             if getattr(args, f"project_{k}_ms") is not None]
    if args.project_costs == "measured" and given:
        raise CompareError(f"{', '.join(given)} and --project-costs measured both set the "
                           "projection's costs; drop one")
    for key, default in (("forward", 1.0), ("backward", 2.0), ("step", 0.0), ("predict", 0.0)):
        if getattr(args, f"project_{key}_ms") is None:
            setattr(args, f"project_{key}_ms", default)
    if args.project_forward_ms + args.project_backward_ms <= 0:
        raise CompareError("--project-forward-ms + --project-backward-ms must be > 0")


def compare(args, train_flags: List[str]) -> int:
    _cost_flags(args)
    try:
        extra_targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        raise CompareError(f"--targets {args.targets!r}: expected comma-separated numbers")
    seeds = parse_seeds(args.seeds)
    specs = plan_runs(args, train_flags)
    if args.seeds is not None and any(_flag(list(train_flags) + list(s.flags), "--seed")
                                      for s in specs):
        raise CompareError("--seeds sets --seed for every run: drop --seed from the flags")
    if "--eval-interval" not in train_flags:
        iters = int(_flag(train_flags, "--train-iters", "20"))
        train_flags = train_flags + ["--eval-interval", str(max(1, iters // 10))]
    shapes = {s.name: run_shape(s.name, train_flags + list(s.flags), args.nproc_per_node)
              for s in specs}
    base_name = args.baseline or ("1f1b" if "1f1b" in shapes else specs[0].name)
    if base_name not in shapes:
        raise CompareError(f"--baseline {base_name}: no such run; runs: {', '.join(shapes)}")
    os.makedirs(args.out, exist_ok=True)
    cost_source = "from the flags"
    if args.project_costs == "measured":
        print("timing one stage of the real model ...", flush=True)
        timed = measure_costs(train_flags, shapes[base_name], args.out, args.timeout)
        args.project_forward_ms, args.project_backward_ms, args.project_step_ms = (
            timed["forward_ms"], timed["backward_ms"], timed["step_ms"])
        args.project_predict_ms = timed["predict_ms"]
        cost_source = (f"measured on the real model (median of {timed['repeats']}; a one-stage "
                       f"model of {timed['layers']} layers with the embedding and output layer)")
        print(f"measured costs per stage: forward {timed['forward_ms']:.3f} ms, backward "
              f"{timed['backward_ms']:.3f} ms, step {timed['step_ms']:.3f} ms, a predicted "
              f"forward {timed['predict_ms']:.3f} ms more", flush=True)
    costs = Costs(args.project_forward_ms / 1e3, args.project_backward_ms / 1e3,
                  args.project_step_ms / 1e3, predict=args.project_predict_ms / 1e3)
    gpu = tta.GPU_MODELS[args.gpu_model]
    runs: Dict[str, List[Dict]] = {}
    for spec in specs:
        for seed in seeds:
            print(f"running {spec.name}" + ("" if seed is None else f" (seed {seed})") + " ...",
                  flush=True)
            records = run_one(spec, seed, train_flags, args.out, args.nproc_per_node,
                              args.timeout, reuse=args.reuse)
            runs.setdefault(spec.name, []).append(
                summarize(spec.name, records, shapes[spec.name], costs, seed, gpu))
    targets = targets_per_seed(runs[base_name], extra_targets)
    rows = time_to_accuracy(runs, base_name, targets, costs, gpu)
    table, ttable = report_table(runs, base_name), tta_table(rows, base_name, gpu.name)
    control = f"{base_name}-long"
    budget = budget_table(budget_rows(runs, base_name, control), base_name, control) \
        if control in runs else ""
    gtable = gap_table(runs, base_name)
    cost_line = prediction_cost_line(runs)
    methods = method_cost_line(runs, gpu.describe())
    plots = plot(runs, args.out)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("# Schedule comparison\n\nTraining flags: `" + " ".join(train_flags) + "`\n\n")
        f.write("Runs: " + "; ".join(f"{s.name} = `{' '.join(s.flags)}`" for s in specs) + "\n\n")
        if args.seeds is not None:
            f.write(f"Seeds {args.seeds}: every figure is the mean ± the sample standard "
                    "deviation over seeds.\n\n")
        f.write(table + "\n\n## Gap to " + base_name + " at equal samples\n\n" + gtable
                + "\n\n## Time to accuracy\n\n" + ttable + "\n\n")
        if budget:
            f.write("## Budget comparison\n\n" + budget + "\n\n")
        f.write(f"Targets are per seed (the {base_name} run of the same seed). A run reaches a "
                "target where its validation curve first gets to it, interpolated linearly "
                "between evaluations. Projected time: each schedule's action lists for this P "
                f"and M in the lockstep simulator, forward {args.project_forward_ms:.4g} ms, "
                f"backward {args.project_backward_ms:.4g} ms, step {args.project_step_ms:.4g} ms "
                f"per stage ({cost_source}), and each run's method's own cost (below), "
                "steady state (--paci-sync-iters iterations at 1F1B's pace; "
                "projected s/iteration is the pace after them); interleaved from Megatron-Core's "
                "order per rank, timed the same way.\n\n")
        f.write(methods + "\n\n")
        if cost_line:
            f.write(cost_line + "\n\n")
        for p in plots:
            f.write(f"![{os.path.basename(p)}]({os.path.basename(p)})\n")
    print(table)
    print(gtable)
    print(ttable)
    if budget:
        print(budget)
    print(methods)
    if cost_line:
        print(cost_line)
    print_speedups(runs, rows, base_name)
    print(f"report: {os.path.join(args.out, 'report.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
