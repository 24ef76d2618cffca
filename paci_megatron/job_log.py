"""What a training run reports: its log lines (Megatron-LM's format, with PACI's drift per
stage), the ``--metrics-file`` records and TensorBoard scalars, and the per-stage tables that
are gathered only where the stages meet anyway (checkpoints, the end)."""

from __future__ import annotations

import json
import time
from typing import Dict, List, Optional

from .features import METHODS, method_cost_lines
from .mcore import build, nadam
from .mcore import runtime as mcore_runtime
from .restart import trim_metrics


def log(msg: str) -> None:
    print(msg, flush=True)


def mean_loss(losses: List[dict]) -> Optional[float]:
    """Mean over micro-batches; with --calculate-per-token-loss each value is [loss sum,
    tokens] and the mean is over tokens (as Megatron-LM's train_step)."""
    values = [d["lm loss"] for d in losses if "lm loss" in d]
    if not values:
        return None
    if getattr(values[0], "numel", lambda: 1)() == 2:
        total = sum(v.double() for v in values)
        return float(total[0] / total[1].clamp(min=1))
    return sum(float(v) for v in values) / len(values)


def trim_metrics_file(path: str, iteration: int) -> None:
    kept, dropped = trim_metrics(path, iteration)
    if dropped:
        log(f"> --metrics-file {path}: dropped {dropped} records after iteration {iteration} "
            f"(kept {kept}); the resumed run writes those iterations again, once")


def tensorboard_writer(path: str, purge_step: Optional[int] = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log("> --tensorboard-dir: tensorboard is not installed (pip install tensorboard); "
            "scalars are not written")
        return None
    # purge_step: events of replayed steps (from before a restart) are discarded
    return SummaryWriter(log_dir=path, purge_step=purge_step)


def stage_stats(job) -> Optional[List[Optional[Dict]]]:
    """Per stage, the drift summary this rank knows without communicating: its own stage's.
    A gather over the pipeline group would make every stage wait for the slowest at each log
    line (about P-1 backwards under PACI); the full table is gathered only where the stages
    meet anyway: at checkpoints and at the end (``_pipeline_table``)."""
    if job.runtime is None:
        return None
    row = job.runtime.drift_summary()
    return [row if s == row["stage"] else None for s in range(job.info["pp_size"])]


def pipeline_table(job) -> List[Dict]:
    """Every stage's drift summary: a gather over the pipeline group, so call it only after a
    drain (checkpoints, end of training), where no stage is waiting on another's messages."""
    return mcore_runtime.gather_across_pipeline(job.runtime.drift_summary())


def write_metrics(job, record: Dict) -> None:
    if job.metrics is not None:
        job.metrics.write(json.dumps(record) + "\n")
        job.metrics.flush()
    if job.tensorboard is not None:
        step = record.get("iteration", job.iteration)
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            for s, v in enumerate(values):
                if key == "iteration" or isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue  # not a scalar (None: not measured)
                job.tensorboard.add_scalar(f"{key}/stage{s}" if isinstance(value, list) else key,
                                           v, step)


def log_iteration(job, step: Dict, elapsed_ms: float) -> None:
    if not job.reporter:
        return
    stats = stage_stats(job)  # None for the stages this rank cannot see without a collective
    drift = [row and row["max"] for row in stats] if stats else None
    skipped = ([row and row["skipped_steps"] for row in stats] if stats
               else [0] * job.info["pp_size"])
    tokens_per_s = step["samples"] * job.spec.seq_length / (elapsed_ms / 1000.0)
    lr = job.optimizer.param_groups[0]["lr"]
    gn = "n/a" if step["grad_norm"] is None else f"{step['grad_norm']:.3f}"
    drift_text = f" | PACI drift max (this stage) {drift[-1]}" if drift is not None else ""
    if skipped[-1]:
        drift_text += f" | skipped (non-finite) steps (this stage) {skipped[-1]}"
    factor = factor_in_force(job)
    adaptive = job.runtime.policy.adaptive if job.opts.auto else None
    if adaptive is not None:
        drift_text += f" | PACI a {factor}"
    eta_s = int(elapsed_ms / 1000.0 * (job.train_iters - job.iteration))
    drift_text += f" | ETA {eta_s // 3600:d}:{eta_s // 60 % 60:02d}:{eta_s % 60:02d}"
    # the last stage's MoE metrics and MTP losses
    aux = {name: float(value) for name, value in step.get("aux", {}).items()}
    aux_text = "".join(f" | {name}: {value:.6e}" for name, value in aux.items())
    log(f" iteration {job.iteration:8d}/{job.train_iters:8d} | consumed samples "
        f"{job.consumed:10d} | elapsed time per iteration (ms): {elapsed_ms:.1f} | "
        f"tokens/s: {tokens_per_s:.0f} | learning rate: {lr:.4e} | lm loss: "
        f"{step['loss']:.6e}{aux_text} | grad norm: {gn}{drift_text}")
    write_metrics(job, {"iteration": job.iteration, "consumed_samples": job.consumed,
                         "wall_s": time.perf_counter() - job.started,
                         "lm_loss": step["loss"], "lr": lr, "elapsed_ms": elapsed_ms,
                         "tokens_per_sec": tokens_per_s, "grad_norm": step["grad_norm"], **aux,
                         "max_drift": drift if drift is not None else [0] * job.info["pp_size"],
                         "skipped_steps": skipped, **({} if factor is None else
                                                      {"accumulation_factor": factor}),
                         **({} if adaptive is None else
                            {"paci_staleness": adaptive.last_signal})})


def factor_in_force(job) -> Optional[int]:
    """The accumulation factor of the iteration just run (PACI; all stages use the same)."""
    plan = job.runtime.plan if job.runtime is not None else None
    return plan.accumulation if plan is not None else None


def memory_record(job) -> Dict:
    """This stage's peaks: every tensor (the CUDA allocator's peak, or on CPU the live-tensor
    meter of --measure-memory), the bytes saved for backward (--measure-activation-memory), and
    the process's resident memory."""
    activation = job.meter.peak / 2**20 if job.meter is not None else None
    whole = build.peak_device_memory_mb()
    record = {}
    if job.live_meter is not None:
        job.live_meter.stop()
        whole = job.live_meter.peak / 2**20
        if job.live_meter.window_peak:  # inside the predicted forwards
            record["peak_predicted_forward_mb"] = job.live_meter.window_peak / 2**20
    return {"stage": job.info["pp_rank"], "peak_memory_mb": whole,
            "peak_activation_mb": activation, "peak_rss_mb": build.peak_rss_mb(), **record}


def log_start(job) -> None:
    """The start-up lines: which rank is which stage; on the reporting rank, the schedule."""
    opts, info = job.opts, job.info
    log(f"[paci] rank {info['rank']} = pipeline stage {info['pp_rank']} "
        f"({layer_ranges(info.get('layers', []))}), tensor rank {info['tp_rank']}, "
        f"data rank {info['dp_rank']}")
    if not job.reporter:
        return
    fb = job.forward_backward
    log(f"> forward-backward function: {getattr(fb, '__module__', '')}."
        f"{getattr(fb, '__qualname__', repr(fb))}")
    features = job.runtime.describe() if job.runtime is not None else ""
    log(f"> schedule {opts.schedule}: P={info['pp_size']} TP={info['tp_size']} "
        f"DP={info['dp_size']} micro-batches/iteration={opts.shape.per_call} a="
        + (f"auto (from {opts.accumulation}, every {opts.adapt_interval} iterations, "
           f"policy {opts.adapt_policy})" if opts.auto else f"{opts.accumulation}")
        + (f", {features}" if features else ""))
    log(job.optimizer_line)
    for note in opts.notes:
        log(note)


def layer_ranges(numbers: List[int]) -> str:
    """A stage's transformer layers for a log line: ``[2, 3, 4, 5]`` reads "transformer
    layers 2-5"; interleaving's chunks give several runs ("1-2, 5-6")."""
    if not numbers:
        return "no transformer layer"
    runs, start = [], numbers[0]
    for prev, now in zip(numbers, numbers[1:] + [None]):
        if now != prev + 1:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = now
    return f"transformer layer{'s' if len(numbers) > 1 else ''} {', '.join(runs)}"


def optimizer_line(optimizer: str, betas: tuple, weight_decay: float, clip_grad: float) -> str:
    """Which optimizer steps, as the flags chose it (NAdam is not Megatron's own)."""
    name = {"adam": "Megatron-Core's Adam", "nadam": "torch's NAdam in Megatron-Core's Adam "
            f"wrappers, momentum decay {nadam.MOMENTUM_DECAY:g}"}[optimizer]
    return (f"> optimizer {optimizer} ({name}): betas ({betas[0]:g}, {betas[1]:g}), "
            f"decoupled weight decay {weight_decay:g}, clip-grad {clip_grad:g}")


def log_final_drift(dropped: int, drift: List[Dict]) -> None:
    """The end of training, on the reporting rank: every stage's drift (and tied staleness)."""
    log(f"> PACI: drained the pipeline at the end (this stage dropped {dropped} in-flight "
        "forwards)")
    for row in drift:
        log(f"> stage {row['stage']}: max drift {row['max']} (bound {row['bound']}), "
            f"histogram {row['histogram']}, local steps {row['steps']}"
            + (f", forward {row['stage_forward_ms']:.2f} ms" if row.get("stage_forward_ms")
               else ""))
        if row.get("tied"):
            tied = row["tied"]
            log(f"> stage {row['stage']}: tied embedding staleness max {tied['max']} "
                f"(bound {tied['bound']}), histogram {tied['histogram']}")
    for line in method_cost_lines(drift):
        log(line)


def final_record(job, summary: Dict, validation: Optional[float]) -> Dict:
    """The last metrics record: per stage, drift, skipped steps and peak memory."""
    memory, drift = summary["memory"], summary.get("drift", [])
    tied = [r.get("tied") for r in drift]
    # each method's own cost, per stage, beside the forward it is stated in (PassCost.key)
    keys = [m.COST.key for m in METHODS if m.COST is not None]
    costs = {key: [r.get(key) for r in drift] for key in keys if any(key in r for r in drift)}
    if costs:
        costs["method_forward_ms"] = [r.get("forward_ms") for r in drift]
    paces = [r.get("stage_forward_ms") for r in drift]
    return {**({"tied_max_staleness": [t and t["max"] for t in tied]} if any(tied) else {}),
            **costs, **({"stage_forward_ms": paces} if any(paces) else {}),
            "final": True, "iteration": job.iteration, "consumed_samples": job.consumed,
            "validation_loss": validation, "wall_s": time.perf_counter() - job.started,
            "max_drift": [r["max"] for r in drift],
            "peak_memory_mb": [m["peak_memory_mb"] for m in memory],
            **({"peak_predicted_forward_mb": [m.get("peak_predicted_forward_mb") for m in memory]}
               if any("peak_predicted_forward_mb" in m for m in memory) else {}),
            "skipped_steps": [r["skipped_steps"] for r in drift],
            "peak_rss_mb": [m["peak_rss_mb"] for m in memory],
            "peak_activation_mb": [m["peak_activation_mb"] for m in memory]}
