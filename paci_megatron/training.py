"""The training loop behind ``pretrain_gpt_paci.py``: Megatron-style, schedule chosen by name.

With a stock schedule (``1f1b``, ``interleaved``) an iteration is what Megatron-LM does:
zero grads, ``get_forward_backward_func()(...)``, ``optimizer.step()``, LR step. With ``paci``
the optimizer and LR steps happen inside the schedule, per stage, after every a-th backward,
so the loop only calls the forward-backward function.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .mcore import build, checkpoint, moe_metrics, mtp_metrics
from .mcore import runtime as mcore_runtime
from .mcore.tied import tied_sha256
from .job_log import (final_record, log, log_final_drift, log_iteration, log_start, mean_loss,
                      memory_record, optimizer_line, pipeline_table, tensorboard_writer,
                      trim_metrics_file, write_metrics)
from .memory import LiveTensorMeter, SavedTensorMeter
from .quiet import exit_after_local_rank0, is_local_rank0, is_rank0
from .arguments import layer_split
from .config import PaciConfig, first_stage_shares_weight
from .registry import SCHEDULES_BY_NAME
from .restart import (SaveClock, describe_mismatch, describe_reshard, describe_switch,
                      restart_count, run_fingerprint)


@dataclass
class Job:
    """Everything one rank needs to train, built once from the flags."""

    args: Any
    opts: PaciConfig
    info: Dict
    spec: Any
    model: List
    optimizer: Any
    lr_scheduler: Any
    runtime: Optional[Any]
    forward_backward: Any
    datasets: Any
    reporter: bool
    consumed: int = 0
    iteration: int = 0
    history: List[Optional[float]] = field(default_factory=list)
    train_data: Any = None
    metrics: Any = None
    tensorboard: Any = None
    uninstall: Any = None  # restores Megatron's own get_forward_backward_func
    last_eval: Optional[tuple] = None  # (iteration, validation loss)
    forward_step: Any = None  # build.gpt_forward_step, metered with --measure-activation-memory
    meter: Any = None
    live_meter: Any = None  # --measure-memory on CPU: every live tensor of this stage
    started: float = field(default_factory=time.perf_counter)
    save_clock: Optional[SaveClock] = None  # --save-interval-minutes
    ramp: Any = None  # --rampup-batch-size: build.BatchRamp
    train_iters: int = 0  # what the log below this layer reads, taken from the flags here
    optimizer_line: str = ""
    moe: Any = None  # --num-experts: moe_metrics.StageMoeMetrics, this stage's MoE metrics


def _gpt_spec(args):
    return build.GPTSpec(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        vocab_size=args.vocab_size, ffn_hidden_size=args.ffn_hidden_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        max_position_embeddings=args.max_position_embeddings,
        untie_embeddings=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        bf16=args.bf16, fp16=args.fp16, calculate_per_token_loss=args.calculate_per_token_loss,
        normalization=args.normalization,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        transformer_impl=args.transformer_impl, moe=_moe_spec(args),
        position_embedding_type=args.position_embedding_type,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        layer_split=layer_split(args))


def _moe_spec(args):
    if args.num_experts is None:
        return None
    return build.MoESpec(
        num_experts=args.num_experts, router_topk=args.moe_router_topk,
        ffn_hidden_size=args.moe_ffn_hidden_size, layer_freq=args.moe_layer_freq,
        aux_loss_coeff=args.moe_aux_loss_coeff, z_loss_coeff=args.moe_z_loss_coeff,
        router_load_balancing_type=args.moe_router_load_balancing_type,
        router_score_function=args.moe_router_score_function,
        router_enable_expert_bias=args.moe_router_enable_expert_bias,
        router_bias_update_rate=args.moe_router_bias_update_rate,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        token_dispatcher_type=args.moe_token_dispatcher_type)


def preflight(args, opts: PaciConfig):
    """Checks that need files but no process group: tokenizer, dataset, checkpoint. Raises
    ConfigError (the flag and the fix) so that a bad input fails before training starts."""
    from .arguments import ConfigError
    from .mcore import data

    kind = args.tokenizer_type or "NullTokenizer"
    vocab = args.vocab_size if kind != "NullTokenizer" else (args.vocab_size or 256)
    try:
        tokenizer = data.build_tokenizer(kind, args.tokenizer_model, vocab_size=vocab)
        if args.data_path is not None:
            data.check_indexed_dataset(args.data_path)
        args.vocab_size = tokenizer.vocab_size  # NullTokenizer adds its end-of-document id
        if args.load:
            _check_checkpoint_matches(args, opts)
    except ValueError as exc:  # CheckpointError is one too
        raise ConfigError(str(exc)) from None
    _check_lr_schedule_on_load(args)
    return tokenizer


def _check_checkpoint_matches(args, opts: PaciConfig) -> None:
    """The newest complete checkpoint under --load must come from a run like this one (same
    parallel layout and model shape; the schedule may switch between 1f1b and paci, and a may
    change, with one line saying so): raises naming each flag that differs. A missing or
    empty --load directory passes (the run starts from scratch)."""
    from .arguments import ConfigError

    path = checkpoint.find_checkpoint(args.load)
    if path is None:
        return
    saved, current = checkpoint.read_extra(path).get("run"), run_fingerprint(vars(args), opts)
    problems = describe_mismatch(saved, current)
    for change in (describe_switch(saved, current), describe_reshard(saved, current)):
        if change and not problems and is_rank0():
            log(f"> --load {args.load}: {change}")
    if problems:
        raise ConfigError(
            f"--load {args.load}: checkpoint {path} was written by a different run: "
            f"{'; '.join(problems)}. Resume with the checkpoint's settings, or --save to a new "
            "directory (a checkpoint reshards to another P, TP or DP, and switches between "
            "1f1b and paci, but the model itself must stay the same)")


def _check_lr_schedule_on_load(args) -> None:
    from .arguments import ConfigError
    from .mcore import lr_resume

    try:
        lr_resume.check_lr_schedule_on_load(lr_resume.LrFlags(
            lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
            train_iters=args.train_iters, decay_style=args.lr_decay_style,
            weight_decay=args.weight_decay, global_batch_size=args.global_batch_size,
            load=args.load, override=args.override_opt_param_scheduler,
            use_checkpoint=args.use_checkpoint_opt_param_scheduler), log=log)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _datasets(args, tokenizer):
    from .mcore import data

    gbs = args.global_batch_size
    evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    return data.build_gpt_datasets(
        args.data_path, args.split, args.seq_length, args.seed, tokenizer,
        train_samples=args.train_iters * gbs,
        valid_samples=max(1, args.eval_iters * gbs * evals), test_samples=gbs,
        mock=args.data_path is None)


def _batches(job: Job, dataset, start: int):
    from .mcore import data

    if not (job.info["is_first"] or job.info["is_last"]):
        # Megatron-Core's interleaved schedule wants one entry per model chunk on every rank
        return [None] * len(job.model) if len(job.model) > 1 else None

    def batches():
        return data.gpt_batches(dataset, job.args.micro_batch_size, start_sample=start,
                                dp_rank=job.info["dp_rank"], dp_size=job.info["dp_size"])

    # like Megatron-LM: one iterator per model chunk, each reading the same stream
    return [batches() for _ in job.model] if len(job.model) > 1 else batches()


def setup(args, opts: PaciConfig) -> Job:
    tokenizer = preflight(args, opts)
    info = build.init_distributed(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size, backend=args.distributed_backend,
        timeout_s=args.distributed_timeout_minutes * 60, seed=args.seed,
        ep=args.expert_model_parallel_size)
    datasets = _datasets(args, tokenizer)
    spec = _gpt_spec(args)
    model = build.build_gpt_model(
        spec, seed=args.seed, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather)
    info["layers"] = build.stage_layer_numbers(model)  # as built: the start-up line, the summary
    optimizer = build.build_optimizer(
        model, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
        bf16=args.bf16, use_distributed_optimizer=args.use_distributed_optimizer,
        fp16=args.fp16, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        optimizer=args.optimizer)
    gbs = args.global_batch_size
    lr_scheduler = build.build_lr_scheduler(
        optimizer, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters * gbs,
        decay_steps=args.train_iters * gbs, decay_style=args.lr_decay_style,
        override=args.override_opt_param_scheduler,
        use_checkpoint=args.use_checkpoint_opt_param_scheduler)
    runtime = SCHEDULES_BY_NAME.get(args.pipeline_schedule).make(opts)
    uninstall = None
    if runtime is not None:
        runtime.bind(optimizer, lr_scheduler, lr_increment=opts.shape.lr_increment)
        uninstall = mcore_runtime.install_schedule(runtime.forward_backward)
    reporter = info["is_last"] and info["tp_rank"] == 0 and info["dp_rank"] == 0
    job = Job(args, opts, info, spec, model, optimizer, lr_scheduler, runtime,
              mcore_runtime.get_forward_backward_func(), datasets, reporter, uninstall=uninstall,
              train_iters=args.train_iters, optimizer_line=optimizer_line(
                  args.optimizer, (args.adam_beta1, args.adam_beta2), args.weight_decay,
                  args.clip_grad))
    if args.rampup_batch_size:
        job.ramp = build.BatchRamp(args.rampup_batch_size, args.global_batch_size,
                                   args.micro_batch_size, info["dp_size"], rank=info["rank"])
    if args.load:
        _load(job)
    restart = restart_count(os.environ)
    if reporter and restart:
        log(f"> restart {restart} of this job (torchrun TORCHELASTIC_RESTART_COUNT={restart}, "
            f"--max-restarts {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}): resumed from "
            f"iteration {job.iteration}")
    job.train_data = _batches(job, datasets[0], job.consumed)
    if spec.moe is not None:
        job.moe = moe_metrics.StageMoeMetrics(
            model, None if runtime is None else lambda: runtime.forwards_in_call)
    job.forward_step = build.gpt_forward_step
    if args.measure_activation_memory:
        job.meter = SavedTensorMeter(p for chunk in model for p in chunk.parameters())
        job.forward_step = job.meter.wrap(build.gpt_forward_step)
    resumed = job.iteration > 0 or restart > 0  # records after job.iteration are replayed
    if args.measure_memory and not torch.cuda.is_available():
        job.live_meter = LiveTensorMeter().start()
        if job.runtime is not None:
            job.runtime.ctx.memory_window = job.live_meter
    if reporter and args.metrics_file:
        if resumed:
            trim_metrics_file(args.metrics_file, job.iteration)
        job.metrics = open(args.metrics_file, "a")
    if reporter and args.tensorboard_dir:
        job.tensorboard = tensorboard_writer(args.tensorboard_dir,
                                       purge_step=job.iteration + 1 if resumed else None)
    if args.save_interval_minutes:
        job.save_clock = SaveClock(args.save_interval_minutes * 60.0, job.iteration,
                                   time.perf_counter())
    return job


def _load(job: Job) -> None:
    """Resume from the newest complete checkpoint under --load, or start from scratch (one line
    says so) while there is none: Megatron-LM's ``--save DIR --load DIR`` from the first
    launch, and what a restart by ``torchrun --max-restarts`` needs."""
    args = job.args
    if checkpoint.find_checkpoint(args.load) is None:
        if job.reporter:
            log(f"> --load {args.load}: no checkpoint there yet; starting from scratch")
        return
    state = checkpoint.load_checkpoint(args.load, job.model, job.optimizer, job.lr_scheduler)
    job.iteration = state["iteration"]
    job.consumed = int(state["extra"].get("consumed_samples")
                       or job.iteration * args.global_batch_size)
    if job.reporter and state["not_mapped"]:
        log(f"> --load {args.load}: not taken from the checkpoint: "
            + "; ".join(state["not_mapped"]))
    if job.runtime is not None:  # weight versions count local steps since the start
        job.runtime.resume_at(job.iteration, _local_steps_before(job))
    if job.reporter:
        log(f"> loaded checkpoint from {args.load} at iteration {job.iteration} "
            f"({job.consumed} samples consumed; {state['path']})")


def _micro_batches_now(job: Job) -> int:
    """M for this iteration: fixed, or from --rampup-batch-size. Where M changes, PACI drains
    (every stage computes the same M from the same consumed samples: no communication) and a
    default accumulation factor becomes the new M."""
    args = job.args
    if job.ramp is None:
        return args.num_microbatches
    num_mb = job.ramp.micro_batches(job.consumed)
    dropped = job.runtime.use_microbatches(num_mb) if job.runtime is not None else None
    if dropped is not None and job.reporter:
        log(f"> PACI: {num_mb} micro-batches per iteration from iteration {job.iteration + 1} "
            f"(--rampup-batch-size), accumulation factor {job.runtime.accumulation}; drained "
            f"the pipeline (this stage dropped {dropped} in-flight forwards; their data is "
            "replayed)")
    return num_mb


def _local_steps_before(job: Job) -> int:
    """Local steps a stage took in the first ``job.iteration`` iterations."""
    ramp = job.ramp.per_iteration(job.iteration) if job.ramp is not None else None
    return job.opts.local_steps_before(job.iteration, ramp)


def train_step(job: Job) -> Dict:
    args = job.args
    num_mb = _micro_batches_now(job)
    samples = num_mb * args.micro_batch_size * job.info["dp_size"]
    if job.runtime is None:
        for chunk in job.model:
            chunk.zero_grad_buffer()
        job.optimizer.zero_grad()
    losses = job.forward_backward(
        forward_step_func=job.forward_step, data_iterator=job.train_data, model=job.model,
        num_microbatches=num_mb, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    if job.runtime is None:
        ok, grad_norm, _ = job.optimizer.step()
        if ok:
            job.lr_scheduler.step(increment=samples)
    else:
        grad_norm = job.runtime.steps[-1].grad_norm if job.runtime.steps else None
    job.iteration += 1
    job.consumed += samples
    aux = {**_moe_metrics(job, num_mb), **_mtp_losses(job, num_mb)}
    return {"loss": mean_loss(losses), "grad_norm": grad_norm, "samples": samples, "aux": aux}


def _mtp_losses(job: Job, num_mb: int) -> Dict:
    """This iteration's MTP losses on the stage that holds the MTP layers (the last), as
    Megatron-LM logs them ("mtp_1 loss", ...), reported within the stage (``mtp_metrics``)."""
    if job.spec.mtp_num_layers is None:
        return {}
    return mtp_metrics.take(1.0 / num_mb, job.iteration)


def _moe_metrics(job: Job, num_mb: int) -> Dict:
    """This stage's MoE metrics of the iteration (Megatron's tracker, reduced within the stage
    and divided by the stage's own MoE layers; ``moe_metrics``)."""
    if job.moe is None:
        return {}
    moe = job.spec.moe
    return job.moe.take(1.0 / num_mb, job.iteration,
                        moe_metrics.track_names(moe.router_load_balancing_type,
                                                moe.z_loss_coeff),
                        job.spec.num_layers)


def evaluate(job: Job) -> Optional[float]:
    """Validation loss over --eval-iters batches from the start of the validation split.

    PACI needs no drain: between two calls every stage has taken the same number of local
    steps, so the stages hold one consistent model; the forwards in flight stay untouched and
    training continues exactly as without evaluation."""
    args = job.args
    if job.runtime is not None and job.runtime.primed and job.opts.drain_before_eval:
        dropped = job.runtime.drain()
        if job.reporter:
            log(f"> PACI: drained the pipeline before evaluation at iteration {job.iteration} "
                f"(this stage dropped {dropped} in-flight forwards; their data is replayed)")
    if job.reporter and job.runtime is not None and job.runtime.primed:
        log(f"> evaluating at iteration {job.iteration}: PACI pipeline not drained (every stage "
            f"at local step {job.runtime.drift.version}; its in-flight micro-batches are kept)")
    data = _batches(job, job.datasets[1], 0)
    for chunk in job.model:
        chunk.eval()
    total = []
    for _ in range(args.eval_iters):
        with torch.no_grad():  # as Megatron-LM: no graph, so no activations kept
            losses = job.forward_backward(
                forward_step_func=build.gpt_forward_step, data_iterator=data, model=job.model,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True)
        loss = mean_loss(losses)
        if loss is not None:
            total.append(loss)
    for chunk in job.model:
        chunk.train()
    value = sum(total) / len(total) if total else None
    job.last_eval = (job.iteration, value)
    if job.reporter:
        log(f" validation loss at iteration {job.iteration} | lm loss value: {value:.6e} | "
            f"lm loss PPL: {math.exp(min(value, 50)):.3f}")
    return value


def save(job: Job) -> None:
    if job.runtime is not None and job.runtime.primed:
        dropped = job.runtime.drain()
        if job.reporter:
            log(f"> PACI: drained the pipeline before saving (this stage dropped {dropped} "
                "in-flight forwards; their data is replayed)")
    if job.runtime is not None:  # the stages meet here anyway: the per-stage table is free
        table = pipeline_table(job)
        if job.reporter:
            log(f"> PACI drift at iteration {job.iteration}: max per stage "
                f"{[row['max'] for row in table]}, skipped steps per stage "
                f"{[row['skipped_steps'] for row in table]}")
    path = checkpoint.save_checkpoint(
        job.args.save, job.iteration, job.model, job.optimizer, job.lr_scheduler,
        extra={"consumed_samples": job.consumed, "schedule": job.args.pipeline_schedule,
               "run": run_fingerprint(vars(job.args), job.opts)},
        fully_reshardable=job.args.dist_ckpt_optim_fully_reshardable)
    if job.save_clock is not None:
        job.save_clock.saved(time.perf_counter())
    if job.reporter:
        log(f"> saved checkpoint at iteration {job.iteration} to {path}")


def _save_is_due(job: Job) -> bool:
    """--save-interval (iterations) or --save-interval-minutes (wall-clock time). The time
    decision is global rank 0's, taken at check points every rank knows in advance (see
    SaveClock), so the stages agree on the iteration with no collective in between."""
    args = job.args
    if not args.save or job.iteration >= args.train_iters:
        return False
    due = bool(args.save_interval and job.iteration % args.save_interval == 0)
    clock = job.save_clock
    if clock is not None and clock.is_check_point(job.iteration):
        now = time.perf_counter()
        by_time, next_check = mcore_runtime.take_rank0s(clock.propose(job.iteration, now))
        clock.agree(job.iteration, next_check, now)
        if by_time and not due and job.reporter:
            log(f"> saving at iteration {job.iteration}: --save-interval-minutes "
                f"{args.save_interval_minutes:g} passed since the last save")
        due = due or by_time
    return due


def train(args, opts: PaciConfig) -> Dict:
    job = setup(args, opts)
    log_start(job)
    t_last = time.perf_counter()
    since_log = 0
    while job.iteration < args.train_iters:
        if args.exit_interval and job.iteration % args.exit_interval == 0 and job.history:
            if job.reporter:
                log(f"> exiting at iteration {job.iteration} (--exit-interval)")
            break
        step = train_step(job)
        job.history.append(step["loss"])
        since_log += 1
        if job.iteration % args.log_interval == 0:
            now = time.perf_counter()
            log_iteration(job, step, (now - t_last) * 1000.0 / since_log)
            t_last, since_log = now, 0
        if args.eval_interval and job.iteration % args.eval_interval == 0:
            write_metrics(job, {"iteration": job.iteration, "validation_loss": evaluate(job)})
            t_last = time.perf_counter()
        if _save_is_due(job):
            save(job)
            t_last = time.perf_counter()
    summary = finish(job)
    return summary


def finish(job: Job) -> Dict:
    args = job.args
    summary: Dict[str, Any] = {"schedule": args.pipeline_schedule, "losses": job.history,
                               "iteration": job.iteration}
    if job.runtime is not None:
        dropped = job.runtime.drain()
        drift = pipeline_table(job)
        summary["drift"] = drift
        if job.reporter:
            log_final_drift(dropped, drift)
    if job.moe is not None:  # after the drain: a gather over the pipeline waits for no forward
        summary["moe"] = mcore_runtime.gather_across_pipeline(job.moe.summary())
        for stage, row in enumerate(summary["moe"]):
            line = moe_metrics.summary_line(stage, row)
            if job.reporter and line:
                log(line)
    if job.last_eval is None or job.last_eval[0] != job.iteration:
        evaluate(job)
    validation = job.last_eval[1]
    summary["validation_loss"] = validation
    # one digest per pipeline stage (this rank's pipeline group: tensor and data rank fixed)
    summary["weights_sha256"] = mcore_runtime.gather_across_pipeline(
        checkpoint.weights_sha256(job.model))
    if job.model[0] is not None and first_stage_shares_weight(
            job.info["pp_size"], args.untie_embeddings_and_output_weights, args.mtp_num_layers):
        # tied or MTP: stage 0's and the last stage's copies (and master copies), after the drain
        summary["tied_sha256"] = mcore_runtime.gather_across_pipeline(
            tied_sha256(job.model[0], job.optimizer))
    if args.save:
        save(job)
    memory = mcore_runtime.gather_across_pipeline(memory_record(job))
    summary["memory"] = memory
    # each stage's transformer layers (global numbers, 1-based), as its model built them
    summary["layers"] = mcore_runtime.gather_across_pipeline(job.info["layers"])
    write_metrics(job, final_record(job, summary, validation))
    if job.uninstall is not None:
        job.uninstall()
    if job.reporter:
        log("PACI_SUMMARY " + json.dumps(summary))
    if job.metrics is not None:
        job.metrics.close()
    if job.tensorboard is not None:
        job.tensorboard.close()
    build.destroy_distributed()
    return summary


def main(argv=None) -> int:
    from .arguments import parse_and_validate

    args, opts = parse_and_validate(argv)
    return run(args, opts)


def run(args, opts: PaciConfig) -> int:
    """Train; a ConfigError found before training (files, checkpoint) exits like a bad flag."""
    from .arguments import ConfigError

    try:
        train(args, opts)
    except ConfigError as exc:
        if not is_local_rank0():  # every rank found it, before any process group
            exit_after_local_rank0(2)
        print(f"pretrain_gpt_paci.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
