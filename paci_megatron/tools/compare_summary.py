"""What ``compare`` makes of its runs' metrics: one seed of one run summarized with its
validation curve on every x axis (``summarize``), the targets, the time to each with each
method's own cost (``time_to_accuracy``), and the budget comparison. ``compare_report``
prints them."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..throughput import mean_ratio
from ..simulate import Costs
from . import tta
from .compare_report import X_GPU, X_PROJECTED, X_SAMPLES, X_UNCOSTED, X_UPDATES


class CompareError(ValueError):
    """Bad compare flags; the message names the flag and the fix."""


def _stage_forwards(final: Dict) -> List[Optional[float]]:
    """Per stage, the forward the run's final record timed beside its method's cost."""
    return final.get("method_forward_ms") or final.get("predicted_forward_ms") or []


def stage_ratios(final: Dict, key: str) -> List[Optional[float]]:
    """Per stage, the cost the run's final record times under ``key`` over the same stage's
    forward (None or 0 where the stage timed neither)."""
    return [c and f and c / f for c, f in zip(final.get(key) or [], _stage_forwards(final))]


def _mean_ratio(final: Dict, key: str) -> Optional[float]:
    return mean_ratio(final.get(key) or [], _stage_forwards(final))


def measured_method_cost(shape: tta.RunShape, final: Dict, costs: Costs) -> tta.MethodCost:
    """The run's method's cost in forwards as the run timed it (per stage, over the same
    stage's forward, the mean over stages); where it did not time it, the projection's own
    --project-predict-ms (a look-ahead always times its pass where it moves anything)."""
    per = {"stale forward": 0.0, "step": 0.0}
    source = "its run's timing"
    for cost in shape.passes:
        ratio = _mean_ratio(final, cost.key)
        if ratio is None and cost.per == "stale forward" and costs.predict:
            ratio, source = costs.predict / costs.forward, "--project-predict-ms"
        if ratio is None:
            raise CompareError(f"a run's method did not time its pass ({cost.key}: a run older "
                               "than its timing): its cost is unknown; give it with "
                               "--project-predict-ms MS (a pass per stale forward) or "
                               "--project-costs measured, so that no speed-up leaves it out")
        per[cost.per] += ratio
    return tta.MethodCost(per["stale forward"], per["step"], source=source)


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
        "predict_in_forwards": stage_ratios(final, "predict_ms"),
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
    if costs is None or shape.schedule != "1f1b" or shape.stage_scale:
        return None  # uneven stages take no virtual stages
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
