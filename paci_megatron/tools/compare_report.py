"""The compare tool's report: tables of the runs side by side, the time-to-accuracy and
loss-gap tables, the plots, and the speed-up lines."""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence

from . import tta

# x values of a curve point (compare.summarize): projected seconds with the run's method's own
# cost on this machine's costs (the headline), with a GPU's costs, and with the cost left out
X_SAMPLES, X_UPDATES, X_WALL, X_PROJECTED, X_GPU, X_UNCOSTED = range(6)


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(_fmt(v, 1) for v in value)
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def _stat(values: Sequence[Optional[float]], digits: int = 3, total: Optional[int] = None) -> str:
    """'mean ± sd' over the seeds that have a value; says how many when some have none."""
    have = [v for v in values if v is not None]
    total = len(values) if total is None else total
    if not have:
        return "not reached" if total else "-"
    mean, sd = tta.mean_and_spread(have)
    text = f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if len(have) > 1 else "")
    if len(have) < total:
        text += f" ({len(have)}/{total} seeds)"
    return text


def _per_stage_mean(seeds: List[Dict], key: str) -> Optional[List[Optional[float]]]:
    lists = [r[key] for r in seeds if r[key] is not None]
    if not lists:
        return None
    return [None if None in col else sum(col) / len(col) for col in zip(*lists)]


def _per_stage_max(seeds: List[Dict], key: str):
    lists = [r[key] for r in seeds if r[key] is not None]
    return [max(col) for col in zip(*lists)] if lists else None


def report_table(runs: Dict[str, List[Dict]], base_name: str) -> str:
    base = runs[base_name]
    head = ("| run | seeds | final val loss | best val loss | tokens/s | tokens/s vs "
            f"{base_name} | projected s/iteration | projected throughput vs {base_name} | "
            "peak RSS MB per stage | peak activation MB per stage | max drift per stage |")
    rows = [head, "|" + "---|" * 11]
    base_proj = base[0]["projected_s_per_iteration"]
    for name, seeds in runs.items():
        ratios = [r["tokens_per_sec"] / b["tokens_per_sec"] for r, b in zip(seeds, base)]
        proj = seeds[0]["projected_s_per_iteration"]
        rows.append(
            f"| {name} | {len(seeds)} | {_stat([r['final_val'] for r in seeds], 4)} | "
            f"{_stat([r['best_val'] for r in seeds], 4)} | "
            f"{_stat([r['tokens_per_sec'] for r in seeds], 0)} | {_stat(ratios)} | "
            f"{proj:.4g} | {base_proj / proj:.3f} | "
            f"{_fmt(_per_stage_mean(seeds, 'peak_rss_mb'))} | "
            f"{_fmt(_per_stage_mean(seeds, 'peak_activation_mb'))} | "
            f"{_fmt(_per_stage_max(seeds, 'max_drift'))} |")
    return "\n".join(rows)


def speedup_cells(row: Dict, key: str) -> List[Optional[Sequence[float]]]:
    """The speed-ups ``key`` (speedup, vs_interleaved) of a row as the report prints them:
    with the method's own cost on this machine, on the GPU, and, beside them, with the cost
    left out. A speed-up with the cost left out never goes out alone: a row that has it but
    not the ones with the cost is refused."""
    costed, gpu = row.get(key), row.get(f"{key}_gpu")
    left_out = row.get(f"{key}_cost_left_out")
    if left_out is not None and (costed is None or gpu is None):
        raise ValueError(f"run {row['run']}: a speed-up with the method's cost left out is "
                         "printed only beside the ones with it; compute those first")
    return [costed, gpu, left_out]


def tta_table(rows: List[Dict], base_name: str, gpu_name: str = "GPU") -> str:
    """One row per run and target; each speed-up with the run's method's own cost (this
    machine's costs, then the GPU's), and with the cost left out beside them for runs whose
    method has one. The speed-up over interleaved 1F1B is its own run's where there is one,
    else projected from the baseline's curve (see compare.interleaved_hits)."""
    inter = any(row.get("vs_interleaved") is not None for row in rows)
    head = (f"| run | target | target loss | samples | updates | wall s | projected s | "
            f"speed-up vs {base_name}, with its cost | the same, {gpu_name} costs | "
            f"the same, its cost left out |"
            + (" vs interleaved, with its cost | the same, GPU costs |" if inter else ""))
    out = [head, "|" + "---|" * (12 if inter else 10)]
    for row in rows:
        n = len(row["hits"])
        col = [[h and h[i] for h in row["hits"]] for i in range(4)]
        reached = any(row["hits"])

        def cell(values, digits=3):
            return _stat(values, digits, total=n) if reached and values is not None else (
                "not reached" if not reached else "-")

        costed, gpu, left_out = speedup_cells(row, "speedup")
        same = left_out is not None and costed is not None and list(left_out) == list(costed)
        line = (f"| {row['run']} | {row['target']} | {_stat(row['target_values'], 4)} | "
                f"{_stat(col[X_SAMPLES], 0)} | {_stat(col[X_UPDATES], 1)} | "
                f"{_stat(col[X_WALL], 1)} | {_stat(col[X_PROJECTED], 4)} | "
                f"{cell(costed)} | {cell(gpu)} | "
                f"{'(no cost)' if same else cell(left_out)} |")
        if inter:
            vs, vs_gpu, _ = speedup_cells(row, "vs_interleaved")
            line += f" {cell(vs)} | {cell(vs_gpu)} |"
        out.append(line)
    return "\n".join(out)


def method_cost_line(runs: Dict[str, List[Dict]], gpu_text: str) -> str:
    """What each method's cost is in the projection, in forwards of a stage (with the
    prediction's per stage, where the runs timed it)."""
    parts = []
    for name, seeds in runs.items():
        cpu, gpu = seeds[0]["method_cost"], seeds[0]["gpu_method_cost"]
        if cpu.free and gpu.free:
            continue
        mean = [sum(getattr(r["method_cost"], k) for r in seeds) / len(seeds)
                for k in ("per_predicted_forward", "per_step")]
        stages = ""
        if all(r.get("predict_in_forwards") for r in seeds):
            stages = f" (by stage {_fmt(_per_stage_mean(seeds, 'predict_in_forwards'))})"
        parts.append(f"{name}: {mean[0]:.3g} forwards a predicted forward{stages}, "
                     f"{mean[1]:.3g} a step on this machine ({cpu.source}); "
                     f"{gpu.per_predicted_forward:.3g} and {gpu.per_step:.3g} on the GPU")
    return ("Each method's own cost in the projections with it, in forwards of the same "
            "stage (a predicted forward's move + restore; the look-ahead's pass a step; the "
            "mean over stages and seeds, timed by runs whose processes share this machine's "
            "cores): " + "; ".join(parts) + f". GPU costs by arithmetic: {gpu_text}.") \
        if parts else f"No run's method has a cost of its own. GPU costs by arithmetic: {gpu_text}."


def budget_table(rows: List[Dict], base_name: str, control_name: str) -> str:
    head = (f"| run | val loss at {base_name}'s projected time | {base_name} final | final | "
            f"gap to {control_name} at its end (equal samples) | projected speed-up vs "
            f"{control_name} to its final loss |")
    out = [head, "|" + "---|" * 6]
    for row in rows:
        n = len(row["final"])
        out.append(f"| {row['run']} | {_stat(row['budget_loss'], 4)} | "
                   f"{_stat(row['base_final'], 4)} | {_stat(row['final'], 4)} | "
                   f"{_stat(row['gap_to_control'], 2)} % | "
                   f"{_stat(row['speedup_to_control_final'], 3, total=n)} |")
    return "\n".join(out)


GAP_FRACTIONS = (0.25, 0.5, 1.0)


def gap_table(runs: Dict[str, List[Dict]], base_name: str) -> str:
    """Validation-loss gap to the baseline of the same seed at equal samples, at 25%, 50% and
    100% of the baseline's training (interpolated between evaluations)."""
    head = ("| run | " + " | ".join(f"gap at {f:.0%} of training" for f in GAP_FRACTIONS)
            + " |")
    out = [head, "|" + "---|" * (1 + len(GAP_FRACTIONS))]
    for name, seeds in runs.items():
        per_seed = [tta.gaps_at(b["curve"], r["curve"], X_SAMPLES, GAP_FRACTIONS)
                    for r, b in zip(seeds, runs[base_name])]
        cols = [[g[i] for g in per_seed] for i in range(len(GAP_FRACTIONS))]
        out.append(f"| {name} | " + " | ".join(f"{_stat(c, 2)} %" for c in cols) + " |")
    return "\n".join(out)


def plot(runs: Dict[str, List[Dict]], out: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    axes = (("samples", X_SAMPLES, "consumed samples", "consumed_samples"),
            ("wall", X_WALL, "wall time (s)", "wall_s"),
            ("projected", X_PROJECTED, "projected accelerator time (s)", None))
    for key, index, label, train_key in axes:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n, (name, seeds) in enumerate(runs.items()):
            color = f"C{n % 10}"
            for i, r in enumerate(seeds):
                if train_key is not None:
                    ax.plot([t[train_key] for t in r["train"]], [t["lm_loss"] for t in r["train"]],
                            alpha=0.3, lw=1, color=color)
                ax.plot([xs[index] for xs, _ in r["curve"]], [v for _, v in r["curve"]],
                        marker="o", color=color, label=None if i else f"{name} (validation)")
        ax.set_xlabel(label)
        ax.set_ylabel("lm loss (thin: training, dots: validation)" if train_key
                      else "validation lm loss")
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(out, f"loss_vs_{key}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def print_speedups(runs: Dict[str, List[Dict]], rows: List[Dict], base_name: str) -> None:
    base = runs[base_name]
    for name, seeds in runs.items():
        if name == base_name:
            continue
        throughput = base[0]["projected_s_per_iteration"] / seeds[0]["projected_s_per_iteration"]
        for row in (r for r in rows if r["run"] == name):
            costed, gpu, left_out = speedup_cells(row, "speedup")
            n = len(row["hits"])
            free = seeds[0]["method_cost"].free
            print(f"{name}: projected time-to-accuracy speed-up vs {base_name} to "
                  f"{row['target']} ({_stat(row['target_values'], 4)}), with its cost: "
                  f"{_stat(costed, 3, total=n)} on this machine's costs, "
                  f"{_stat(gpu, 3, total=n)} on the GPU's"
                  + ("" if free else f"; its cost left out: {_stat(left_out, 3, total=n)}")
                  + f" (projected throughput ratio with its cost {throughput:.3f})")
        if None not in (_per_stage_mean(seeds, "peak_activation_mb") or [None]) \
                and None not in (_per_stage_mean(base, "peak_activation_mb") or [None]):
            ratio = [a / b for a, b in zip(_per_stage_mean(seeds, "peak_activation_mb"),
                                           _per_stage_mean(base, "peak_activation_mb"))]
            print(f"peak activation memory {name}/{base_name} per stage: "
                  + " ".join(f"{x:.3f}" for x in ratio))
