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

from ..features import METHODS, method_named
from ..layer_split import EMBEDDING, FIRST, LAST, LAYOUT, LOSS, UNEVEN_FLAGS
from ..simulate import Costs
from . import tta
from .compare_report import (budget_table, gap_table, method_cost_line, plot, print_speedups,
                             report_table, tta_table)
from .compare_summary import (CompareError, budget_rows, summarize, targets_per_seed,
                              time_to_accuracy)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(REPO, "pretrain_gpt_paci.py")
BUILT_IN = ("1f1b", "interleaved", "paci", "paci-a1")


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
    return _shape(*_validated(name, flags, nproc))


def run_method(name: str, flags: Sequence[str], nproc: int) -> Dict[str, object]:
    """Which PACI method the flags run, as resolved today, and whether they left it to the
    default: a finished run whose method was the default of another version is not reused."""
    return _method(*_validated(name, flags, nproc))


NO_METHOD: Dict[str, object] = {"method": "", "by_default": False}  # a stock schedule's


def _shape(args, cfg) -> tta.RunShape:
    methods = [method_named(name) for name, _ in cfg.methods] \
        if args.pipeline_schedule == "paci" else []
    return tta.RunShape(
        schedule=args.pipeline_schedule, num_stages=args.pipeline_model_parallel_size,
        microbatches=args.num_microbatches, accumulation=cfg.accumulation,
        virtual_chunks=args.virtual_pipeline_model_parallel_size or 1,
        passes=tuple(m.COST for m in methods if m.COST is not None),
        stage_scale=stage_scale(args.layers_per_stage))


def uneven_note(shape: tta.RunShape) -> str:
    if not shape.stage_scale:
        return ""
    shares = ", ".join(f"{x:.2f}" for x in shape.stage_scale)
    return (f" Uneven stages: the costs are a stage of the largest stage's layers, and each "
            f"stage runs at its layers' share of them ({shares}; the ends' embedding and loss "
            "left out, which errs against PACI).")


def stage_scale(layers: Sequence[int]) -> Tuple[float, ...]:
    """Each stage's layers over the largest stage's; () for even stages."""
    if len(set(layers)) <= 1:
        return ()
    return tuple(n / max(layers) for n in layers)


def _method(args, cfg) -> Dict[str, object]:
    if args.pipeline_schedule != "paci":
        return dict(NO_METHOD)
    labels = [method_named(name).label(settings) for name, settings in cfg.methods]
    return {"method": " + ".join(labels) or "plain",
            "by_default": not any(m.given(args) for m in METHODS)}


def _validated(name: str, flags: Sequence[str], nproc: int):
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
    return args, cfg


# flags a one-stage timing launch must not inherit (value-taking, then switches)
NOT_FOR_TIMING = ("--num-layers", "--pipeline-model-parallel-size", "--pipeline-schedule",
                  "--num-layers-per-virtual-pipeline-stage", "--save", "--load",
                  "--metrics-file", "--tensorboard-dir", "--exit-interval", "--save-interval",
                  "--save-interval-minutes", "--paci-accumulation-factor", "--paci-max-drift",
                  "--paci-on-nonfinite", "--eval-interval", FIRST, LAST, LAYOUT)
SWITCHES_NOT_FOR_TIMING = ("--paci-drain-before-eval", "--measure-memory",
                           "--measure-activation-memory", "--override-opt_param-scheduler",
                           "--use-checkpoint-opt_param-scheduler", EMBEDDING, LOSS)


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


def paced_by(run_args) -> int:
    """The layers of the stage that holds the most (a run's validated flags): with uneven
    stages that stage sets the pace, so the projection times a stage of its size."""
    return max(run_args.layers_per_stage)


def measure_costs(train_flags: Sequence[str], stage_layers: int, out: str,
                  timeout: float) -> Dict[str, float]:
    """Time one stage's forward, backward and step on the real model (one short launch of
    a one-stage model of ``stage_layers`` layers, tensor parallel as in the runs)."""
    tp = int(_flag(train_flags, "--tensor-model-parallel-size", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp}", "-m", "paci_megatron.tools.costs",
           *timing_flags(train_flags, stage_layers)]
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
            timeout: float, reuse: bool = False,
            method: Optional[Dict[str, object]] = None) -> List[Dict]:
    """Train once; returns the metrics records. With ``reuse``, a finished run of the same
    name, seed, flags and PACI method (``run_method``) in ``out`` is read back instead of run
    again."""
    stem = spec.name if seed is None else f"{spec.name}.seed{seed}"
    metrics = os.path.join(out, f"{stem}.jsonl")
    seed_flags = [] if seed is None else ["--seed", str(seed)]
    flags = [*train_flags, *spec.flags, *seed_flags]
    record = os.path.join(out, f"{stem}.flags.json")
    method = method or NO_METHOD
    if reuse and _finished_with(metrics, record, flags, nproc, method):
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
        json.dump({"flags": flags, "nproc_per_node": nproc, "method": method["method"]}, f)
    return _read_records(metrics)


def _read_records(metrics: str) -> List[Dict]:
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished_with(metrics: str, record: str, flags: List[str], nproc: int,
                   method: Dict[str, object]) -> bool:
    """A run in ``out`` that ended (its final record is there) with exactly these flags and
    the same PACI method. A record without its method (written before compare kept it) is
    taken only where the flags name the method, not where they left it to the default."""
    if not (os.path.exists(metrics) and os.path.exists(record)):
        return False
    with open(record) as f:
        kept = json.load(f)
    if (kept.get("flags"), kept.get("nproc_per_node")) != (flags, nproc):
        return False
    if "method" in kept:
        if kept["method"] != method["method"]:
            return False
    elif method["by_default"]:
        return False
    return any(r.get("final") for r in _read_records(metrics))


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
                             "seed, flags and PACI method instead of running them again (to "
                             "add runs to a study)")
    return parser


def plan_runs(args, train_flags: List[str]) -> List[RunSpec]:
    pp = int(_flag(train_flags, "--pipeline-model-parallel-size", str(args.nproc_per_node)))
    layers = int(_flag(train_flags, "--num-layers", "4"))
    names = args.schedules if args.schedules is not None else \
        ("" if args.run else ",".join(BUILT_IN))
    specs = []
    uneven = [f for f in train_flags if f.split("=", 1)[0] in UNEVEN_FLAGS]
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name == "interleaved" and uneven:
            print(f"skipping interleaved: uneven stages ({uneven[0]}) take no virtual stages",
                  flush=True)
            continue
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
    resolved = {s.name: _validated(s.name, train_flags + list(s.flags), args.nproc_per_node)
                for s in specs}  # each run's flags parsed and checked once
    shapes = {name: _shape(*run) for name, run in resolved.items()}
    methods = {name: _method(*run) for name, run in resolved.items()}
    base_name = args.baseline or ("1f1b" if "1f1b" in shapes else specs[0].name)
    if base_name not in shapes:
        raise CompareError(f"--baseline {base_name}: no such run; runs: {', '.join(shapes)}")
    os.makedirs(args.out, exist_ok=True)
    cost_source = "from the flags"
    if args.project_costs == "measured":
        print("timing one stage of the real model ...", flush=True)
        timed = measure_costs(train_flags, paced_by(resolved[base_name][0]), args.out,
                              args.timeout)
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
                              args.timeout, reuse=args.reuse, method=methods[spec.name])
            runs.setdefault(spec.name, []).append(
                summarize(spec.name, records, shapes[spec.name], costs, seed, gpu))
    targets = targets_per_seed(runs[base_name], extra_targets)
    rows = time_to_accuracy(runs, base_name, targets, costs, gpu)
    table, ttable = report_table(runs, base_name), tta_table(rows, base_name, gpu.name)
    control = f"{base_name}-long"
    budget = budget_table(budget_rows(runs, base_name, control), base_name, control) \
        if control in runs else ""
    gtable = gap_table(runs, base_name)
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
                "steady state; interleaved from Megatron-Core's "
                "order per rank, timed the same way." + uneven_note(shapes[base_name])
                + "\n\n")
        f.write(methods + "\n\n")
        for p in plots:
            f.write(f"![{os.path.basename(p)}]({os.path.basename(p)})\n")
    print(table)
    print(gtable)
    print(ttable)
    if budget:
        print(budget)
    print(methods)
    print_speedups(runs, rows, base_name)
    print(f"report: {os.path.join(args.out, 'report.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
