"""Run one training config under several schedules and write a side-by-side report.

    python -m paci_megatron.compare --schedules 1f1b,paci --out DIR [--nproc-per-node 2] \\
        -- <pretrain_gpt_paci.py flags>

Default schedules: 1f1b, interleaved (when each stage has at least two layers), paci, and
paci-a1 (paci with --paci-accumulation-factor 1: a step after every backward, the unbounded
"PipeDream without stash" reference). Runs one after another, then writes DIR/report.md (final
and best validation loss, iterations and wall time to reach 1F1B's final validation loss,
tokens/s, peak memory per stage, max drift) and two plots: loss against consumed samples and
against wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "pretrain_gpt_paci.py")


def schedule_flags(name: str, layers_per_stage: int) -> Optional[List[str]]:
    """Extra flags for a named run; None when it does not apply to this config."""
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
    raise ValueError(f"--schedules: unknown run {name!r}; known: 1f1b, interleaved, paci, paci-a1")


def _flag(flags: Sequence[str], name: str, default: Optional[str] = None) -> Optional[str]:
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return flags[i + 1]
    return default


def run_one(name: str, extra: List[str], train_flags: List[str], out: str, nproc: int,
            timeout: float) -> Dict:
    metrics = os.path.join(out, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", ENTRY, *train_flags, *extra, "--metrics-file", metrics]
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {log.name}")
    with open(metrics) as f:
        return summarize(name, [json.loads(line) for line in f if line.strip()])


def summarize(name: str, records: List[Dict]) -> Dict:
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "validation_loss" in r and not r.get("final")]
    final = next(r for r in records if r.get("final"))
    by_iter = {r["iteration"]: r for r in train}
    curve = [(by_iter[r["iteration"]]["consumed_samples"], by_iter[r["iteration"]]["wall_s"],
              r["iteration"], r["validation_loss"]) for r in evals if r["iteration"] in by_iter]
    curve.append((final["consumed_samples"], final["wall_s"], final["iteration"],
                  final["validation_loss"]))
    steady = train[len(train) // 4:] or train
    return {
        "name": name, "train": train, "curve": curve,
        "final_val": final["validation_loss"],
        "best_val": min(v for *_, v in curve),
        "tokens_per_sec": sum(r["tokens_per_sec"] for r in steady) / len(steady),
        "peak_rss_mb": final.get("peak_rss_mb"),
        "peak_activation_mb": final.get("peak_activation_mb"),
        # per-iteration records know only the logging stage's drift; the final one has all
        "max_drift": final.get("max_drift") or (train[-1]["max_drift"] if train else None),
        "wall_s": final["wall_s"],
    }


def time_to_reach(run: Dict, target: float):
    """(iteration, wall seconds) of the first evaluation at or below ``target``."""
    for _samples, wall, iteration, value in run["curve"]:
        if value <= target:
            return iteration, wall
    return None, None


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(_fmt(v, 1) for v in value)
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def report_table(runs: List[Dict]) -> str:
    base = next((r for r in runs if r["name"] == "1f1b"), runs[0])
    target = base["final_val"]
    head = ("| run | final val loss | best val loss | iters to 1F1B final | wall s to 1F1B final "
            "| tokens/s | tokens/s vs 1F1B | peak RSS MB per stage | peak activation MB per "
            "stage | max drift per stage |")
    rows = [head, "|" + "---|" * 10]
    for r in runs:
        iters, wall = time_to_reach(r, target)
        rows.append(
            f"| {r['name']} | {_fmt(r['final_val'], 4)} | {_fmt(r['best_val'], 4)} | "
            f"{_fmt(iters)} | {_fmt(wall, 1)} | {r['tokens_per_sec']:.0f} | "
            f"{r['tokens_per_sec'] / base['tokens_per_sec']:.3f} | {_fmt(r['peak_rss_mb'])} | "
            f"{_fmt(r['peak_activation_mb'])} | {_fmt(r['max_drift'])} |")
    return "\n".join(rows)


def plot(runs: List[Dict], out: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, index, label in (("samples", 0, "consumed samples"), ("wall", 1, "wall time (s)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs:
            train_x = [t["consumed_samples"] if index == 0 else t["wall_s"] for t in r["train"]]
            ax.plot(train_x, [t["lm_loss"] for t in r["train"]], alpha=0.35, lw=1)
            ax.plot([c[index] for c in r["curve"]], [c[3] for c in r["curve"]], marker="o",
                    label=f"{r['name']} (validation)", color=ax.lines[-1].get_color())
        ax.set_xlabel(label)
        ax.set_ylabel("lm loss (thin: training, dots: validation)")
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(out, f"loss_vs_{key}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default="1f1b,interleaved,paci,paci-a1")
    parser.add_argument("--out", required=True)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    args = parser.parse_args(own)
    os.makedirs(args.out, exist_ok=True)
    pp = int(_flag(train_flags, "--pipeline-model-parallel-size", str(args.nproc_per_node)))
    layers = int(_flag(train_flags, "--num-layers", "4"))
    if "--eval-interval" not in train_flags:
        iters = int(_flag(train_flags, "--train-iters", "20"))
        train_flags += ["--eval-interval", str(max(1, iters // 10))]
    runs = []
    for name in args.schedules.split(","):
        extra = schedule_flags(name.strip(), layers // pp)
        if extra is None:
            print(f"skipping {name}: needs at least 2 layers per stage", flush=True)
            continue
        print(f"running {name} ...", flush=True)
        runs.append(run_one(name.strip(), extra, train_flags, args.out, args.nproc_per_node,
                            args.timeout))
    table = report_table(runs)
    plots = plot(runs, args.out)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("# Schedule comparison\n\nTraining flags: `" + " ".join(train_flags) + "`\n\n")
        f.write(table + "\n\n")
        f.write("Time to 1F1B's final validation loss is measured at evaluation points.\n\n")
        for p in plots:
            f.write(f"![{os.path.basename(p)}]({os.path.basename(p)})\n")
    print(table)
    base = next((r for r in runs if r["name"] == "1f1b"), None)
    for r in runs:
        if base and r is not base and None not in (r["peak_activation_mb"] or [None]) \
                and None not in (base["peak_activation_mb"] or [None]):
            ratio = [a / b for a, b in zip(r["peak_activation_mb"], base["peak_activation_mb"])]
            print(f"peak activation memory {r['name']}/1f1b per stage: "
                  + " ".join(f"{x:.3f}" for x in ratio))
    print(f"report: {os.path.join(args.out, 'report.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
