"""The training loop behind ``pretrain_gpt_paci.py``: Megatron-style, schedule chosen by name.

With a stock schedule (``1f1b``, ``interleaved``) an iteration is what Megatron-LM does:
zero grads, ``get_forward_backward_func()(...)``, ``optimizer.step()``, LR step. With ``paci``
the optimizer and LR steps happen inside the schedule, per stage, after every a-th backward,
so the loop only calls the forward-backward function.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Dict, List, Optional

from .mcore import build
from .mcore import runtime as mcore_runtime
from .registry import SCHEDULES, ScheduleOptions


def _log(msg: str) -> None:
    print(msg, flush=True)


def _mean_loss(losses: List[dict]) -> Optional[float]:
    values = [float(d["lm loss"]) for d in losses if "lm loss" in d]
    return sum(values) / len(values) if values else None


def train(args, opts: ScheduleOptions) -> Dict:
    info = build.init_distributed(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size, backend=args.distributed_backend,
        timeout_s=args.distributed_timeout_minutes * 60, seed=args.seed)
    spec = build.GPTSpec(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        vocab_size=args.vocab_size, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings,
        untie_embeddings=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        bf16=args.bf16, normalization=args.normalization)
    model = build.build_gpt_model(spec, seed=args.seed)
    optimizer = build.build_optimizer(
        model, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
        bf16=args.bf16)
    gbs = args.global_batch_size
    lr_scheduler = build.build_lr_scheduler(
        optimizer, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters * gbs,
        decay_steps=args.train_iters * gbs, decay_style=args.lr_decay_style)

    runtime = SCHEDULES.get(args.pipeline_schedule).make(opts)
    uninstall = None
    if runtime is not None:
        runtime.bind(optimizer, lr_scheduler,
                     lr_increment=opts.accumulation * opts.micro_batch_size * opts.data_parallel_size)
        uninstall = mcore_runtime.install_schedule(runtime.forward_backward)
    forward_backward = mcore_runtime.get_forward_backward_func()

    reads_data = info["is_first"] or info["is_last"]
    data = build.mock_data_iterator(spec, args.micro_batch_size, args.seed) if reads_data else None
    if isinstance(model, list) and len(model) > 1:
        data = [data] * len(model)
    reporter = info["is_last"] and info["tp_rank"] == 0 and info["dp_rank"] == 0
    if reporter:
        fb_name = getattr(forward_backward, "__qualname__", repr(forward_backward))
        _log(f"> forward-backward function: {getattr(forward_backward, '__module__', '')}.{fb_name}")
        _log(f"> schedule {args.pipeline_schedule}: P={info['pp_size']} TP={info['tp_size']} "
             f"DP={info['dp_size']} micro-batches/iteration={args.num_microbatches} "
             f"a={opts.accumulation}")
    history = []
    consumed = 0
    t_last = time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        if runtime is None:
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=build.gpt_forward_step, data_iterator=data, model=model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        if runtime is None:
            ok, grad_norm, _ = optimizer.step()
            if ok:
                lr_scheduler.step(increment=gbs)
        else:
            grad_norm = runtime.steps[-1].grad_norm if runtime.steps else None
        consumed += gbs
        loss = _mean_loss(losses)
        history.append(loss)
        if reporter and iteration % args.log_interval == 0:
            now = time.perf_counter()
            elapsed_ms = (now - t_last) * 1000.0 / args.log_interval
            t_last = now
            tokens_per_s = gbs * args.seq_length / (elapsed_ms / 1000.0)
            drift = f" | drift max (this stage) {runtime.drift.max}" if runtime else ""
            gn = "n/a" if grad_norm is None else f"{grad_norm:.3f}"
            _log(f" iteration {iteration:6d}/{args.train_iters} | consumed samples {consumed:8d} "
                 f"| elapsed time per iteration (ms): {elapsed_ms:.1f} | tokens/s {tokens_per_s:.0f}"
                 f" | learning rate {optimizer.param_groups[0]['lr']:.3e} | lm loss {loss:.6e} "
                 f"| grad norm {gn}{drift}")
    summary = {"schedule": args.pipeline_schedule, "losses": history}
    if runtime is not None:
        dropped = runtime.drain()
        drift = mcore_runtime.gather_across_pipeline(runtime.drift_summary())
        summary["drift"] = drift
        if reporter:
            _log(f"> drained the pipeline (this stage dropped {dropped} in-flight forwards)")
            for row in drift:
                _log(f"> stage {row['stage']}: max drift {row['max']} (bound {row['bound']}), "
                     f"histogram {row['histogram']}, local steps {row['steps']}")
        uninstall()
    if reporter:
        _log("PACI_SUMMARY " + json.dumps(summary))
    build.destroy_distributed()
    return summary


def main(argv=None) -> int:
    from .arguments import parse_and_validate

    args, opts = parse_and_validate(argv)
    train(args, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
