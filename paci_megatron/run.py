"""Run an unchanged Megatron-LM training script with a selectable pipeline schedule.

    torchrun --nproc-per-node 8 -m paci_megatron.run path/to/Megatron-LM/pretrain_gpt.py \\
        <the script's usual flags> --pipeline-schedule paci --paci-accumulation-factor 8

The script runs as ``__main__`` (see ``run_as_main``) with its folder on ``sys.path``, after
this module installed version-guarded hooks from ``paci_megatron.patches.megatron_lm``:

* always: the flags ``--pipeline-schedule {1f1b,interleaved,paci}`` (default ``1f1b``),
  ``--paci-accumulation-factor``, ``--paci-max-drift``, ``--paci-on-nonfinite`` in Megatron-LM's
  argument parser (so ``--help`` lists them);
* ``1f1b`` / ``interleaved``: nothing else; Megatron-LM's training runs as without this module;
* ``paci``: the PACI runtime in Megatron-LM's training loop (see ``PaciTrainingHooks``);
* without CUDA (any schedule): megatron-core's and Megatron-LM's CPU/gloo patches
  (add ``--distributed-backend gloo`` and the CPU flags, see tests/test_megatron_lm.py).

``megatron.core`` is always the installed megatron-core package, never the checkout's copy
(``prepare_import_path``): the checkout's folder goes on ``sys.path`` after it. Because the
wheel ships the dataset helpers prebuilt and without a makefile, Megatron-LM's start-up
compilation of them is skipped when they import (any schedule). Without Triton (the CPU torch
wheel), the module Megatron-LM imports Triton through is replaced by a stand-in that keeps
``--batch-invariant-mode`` off.

Supported: Megatron-LM 0.16.1 (tag core_v0.16.1) with megatron-core 0.16.1; any other version
stops with an error that says so.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import os
import sys
import types
from typing import List, Optional, Sequence

from .arguments import check_loss_scales
from .autograd_versions import ZERO_CENTERED_GAMMA
from .quiet import fallback_notice
from .restart import restart_count

USAGE = ("usage: python -m paci_megatron.run path/to/Megatron-LM/pretrain_gpt.py "
         "[Megatron-LM flags] [--pipeline-schedule {1f1b,interleaved,paci}] "
         "[--paci-accumulation-factor A] [--paci-max-drift D] [--paci-on-nonfinite {skip,abort}]")


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def validate_flags(args: argparse.Namespace) -> None:
    """PACI's flags against Megatron-LM's parsed ones (before any process group exists).
    Raises ValueError with the flag and the fix; ``1f1b`` is never checked (stock)."""
    schedule = args.pipeline_schedule
    paci_flags = [flag for flag, value in (
        ("--paci-accumulation-factor", args.paci_accumulation_factor),
        ("--paci-max-drift", args.paci_max_drift),
        ("--paci-stale-grad-weight", args.paci_stale_grad_weight),
        ("--paci-stale-grad-correction", args.paci_stale_grad_correction)) if value is not None]
    if schedule != "paci" and paci_flags:
        verb = "apply" if len(paci_flags) > 1 else "applies"
        raise ValueError(f"{', '.join(paci_flags)} only {verb} to --pipeline-schedule paci "
                         f"(got --pipeline-schedule {schedule})")
    if schedule == "1f1b":
        return
    virtual = (args.num_layers_per_virtual_pipeline_stage is not None
               or args.num_virtual_stages_per_pipeline_rank is not None)
    pp = args.pipeline_model_parallel_size
    if schedule == "interleaved":
        if not virtual or pp < 2:
            raise ValueError("--pipeline-schedule interleaved needs --pipeline-model-parallel-size"
                             " >= 2 and --num-layers-per-virtual-pipeline-stage (Megatron-LM "
                             "picks the interleaved schedule from those)")
        return
    # paci
    if virtual:
        raise ValueError("--pipeline-schedule paci does not support virtual pipeline stages; "
                         "drop --num-layers-per-virtual-pipeline-stage / "
                         "--num-virtual-stages-per-pipeline-rank")
    if getattr(args, "fp16", False):  # each stage's own scaler; gradients carry the scale
        check_loss_scales(args)
    tied = pp > 1 and not args.untie_embeddings_and_output_weights
    if tied and getattr(args, "use_distributed_optimizer", False):
        raise ValueError("--pipeline-schedule paci with tied embeddings does not support "
                         "--use-distributed-optimizer yet; drop it or add "
                         "--untie-embeddings-and-output-weights")
    if tied and getattr(args, "overlap_grad_reduce", False):
        raise ValueError("--pipeline-schedule paci with tied embeddings does not support "
                         "--overlap-grad-reduce yet (the output-layer gradient is sent before "
                         "the data-parallel reduction); drop it or add "
                         "--untie-embeddings-and-output-weights")
    if tied and getattr(args, "fp16", False):
        raise ValueError("--pipeline-schedule paci with tied embeddings does not support --fp16 "
                         "yet (the output layer's gradient reaches stage 0 at the last stage's "
                         "loss scale); use --bf16, or add --untie-embeddings-and-output-weights")
    check_rampup(args)
    check_stale_grad_weight(args)
    check_stale_grad_correction(args)
    rerun_mode = getattr(args, "rerun_mode", "disabled")
    if rerun_mode not in ("disabled", "validate_results"):
        raise ValueError(f"--pipeline-schedule paci cannot re-run iterations (micro-batches stay "
                         f"in flight across them); drop --rerun-mode {rerun_mode}")
    if getattr(args, "apply_layernorm_1p", False):
        raise ValueError(ZERO_CENTERED_GAMMA)
    refuse_stage_crossing_collectives(args)


def check_stale_grad_weight(args: argparse.Namespace) -> None:
    weight = args.paci_stale_grad_weight
    if weight is None or weight == 1.0:
        return
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"--paci-stale-grad-weight {weight:g} must be in (0, 1] (1: plain PACI)")


def check_stale_grad_correction(args: argparse.Namespace) -> None:
    strength = args.paci_stale_grad_correction
    if strength is not None and not 0.0 <= strength < float("inf"):
        raise ValueError(f"--paci-stale-grad-correction {strength:g} must be a finite number "
                         ">= 0 (0: off, plain PACI)")


def check_rampup(args: argparse.Namespace) -> None:
    """--rampup-batch-size: PACI drains where the number of micro-batches M changes; an
    explicit --paci-accumulation-factor must divide every M of the ramp (the default follows
    M). Data-parallel size as Megatron-LM will derive it (world / (TP x PP x CP))."""
    from .arguments import check_accumulation_divides, rampup_micro_batches

    rampup = getattr(args, "rampup_batch_size", None)
    accumulation = args.paci_accumulation_factor
    if rampup is None or accumulation is None:
        return
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * (getattr(args, "context_parallel_size", 1) or 1))
    per_step = args.micro_batch_size * max(1, getattr(args, "world_size", 1) // model_parallel)
    start, incr, samples = (int(x) for x in rampup)
    final = args.global_batch_size or per_step
    if getattr(args, "decrease_batch_size_if_needed", False):  # Megatron rounds each size down
        counts = [size // per_step for size in range(start, final + 1, incr)]
    else:
        counts = rampup_micro_batches([start, incr, samples], final, per_step)
    check_accumulation_divides(accumulation, counts, follows=False)


def refuse_stage_crossing_collectives(args: argparse.Namespace) -> None:
    """Megatron-LM flags that add a collective over all stages to every iteration or to the
    local step. Under PACI the stages run out of step, so each would stall every stage to the
    slowest one (or hang, inside a local step)."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if (getattr(args, "timing_log_level", 0) or 0) >= 1:
        raise ValueError("--pipeline-schedule paci cannot run --timing-log-level "
                         f"{args.timing_log_level}: its timers barrier all ranks inside each "
                         "stage's local step (finalize_model_grads, optimizer); use "
                         "--timing-log-level 0")
    if getattr(args, "exit_duration_in_mins", None):
        raise ValueError("--pipeline-schedule paci: --exit-duration-in-mins all-reduces over "
                         "all ranks at every iteration, stalling every stage to the slowest; "
                         "use --exit-interval (iterations) instead")
    if getattr(args, "exit_signal_handler", False):
        raise ValueError("--pipeline-schedule paci: --exit-signal-handler gathers over all ranks "
                         "at every iteration, stalling every stage to the slowest; drop it "
                         "(checkpoint with --save-interval)")
    if pp > 1 and getattr(args, "log_params_norm", False):
        raise ValueError("--pipeline-schedule paci: --log-params-norm all-reduces the parameter "
                         "norm over the model-parallel group (all stages) at every iteration; "
                         "drop it")
    if pp > 1 and getattr(args, "mtp_num_layers", None):
        raise ValueError("--pipeline-schedule paci does not support --mtp-num-layers with "
                         "pipeline parallelism: the embedding gradient is all-reduced between "
                         "the first and last stage at every local step")
    if pp > 1 and getattr(args, "num_experts", None) is not None:
        raise ValueError("--pipeline-schedule paci does not support MoE (--num-experts) with "
                         "pipeline parallelism yet: Megatron-LM's training_log all-reduces "
                         "the MoE auxiliary losses over the pipeline group at every iteration")


def make_runtime(margs, num_microbatches: int):
    """The PACI runtime for Megatron-LM's parsed args (process groups exist by now)."""
    from .mcore.checkpoint import writer_queue_dies_with_this_process
    from .registry import SCHEDULES, ScheduleOptions
    from .stale_correction import resolve_strength
    from .stale_weights import resolve_weight

    # a worker killed under torchrun --max-restarts must not leave Megatron's checkpoint
    # writer Manager behind (it holds the job's output pipes open)
    writer_queue_dies_with_this_process()

    accumulation = margs.paci_accumulation_factor or num_microbatches
    opts = ScheduleOptions(
        pipeline_size=margs.pipeline_model_parallel_size,
        virtual_size=margs.virtual_pipeline_model_parallel_size,
        num_microbatches=num_microbatches, accumulation=accumulation,
        max_drift=margs.paci_max_drift, micro_batch_size=margs.micro_batch_size,
        data_parallel_size=margs.data_parallel_size, on_nonfinite=margs.paci_on_nonfinite,
        stale_grad_weight=resolve_weight(margs.paci_stale_grad_weight, "paci"),
        stale_grad_correction=resolve_strength(margs.paci_stale_grad_correction, "paci"))
    entry = SCHEDULES.get("paci")
    try:
        entry.check(opts)
    except ValueError as exc:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: error: {exc}") from None
    runtime = entry.make(opts)
    # --rampup-batch-size: without --paci-accumulation-factor, a follows M
    runtime.accumulation_follows = margs.paci_accumulation_factor is None
    if margs.rank == 0:
        print(f"> PACI: accumulation factor {accumulation} of {num_microbatches} micro-batches "
              f"per iteration ({num_microbatches // accumulation} local steps per stage and "
              f"iteration), {margs.pipeline_model_parallel_size} stages, stale gradients "
              f"weighted {opts.stale_grad_weight:g} ** drift"
              + (f", corrected with the momentum (K={opts.stale_grad_correction:g})"
                 if opts.stale_grad_correction else ""), flush=True)
    return runtime


def report(runtime) -> None:
    """Every rank: gather the drift statistics over the pipeline; the last stage prints them."""
    from megatron.core import parallel_state

    from .mcore.runtime import gather_across_pipeline

    rows = gather_across_pipeline(runtime.drift_summary())
    tied = gather_across_pipeline(runtime.tied_digest())
    if runtime.is_last and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        for row in rows:
            skipped = f", skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
            print(f"> PACI stage {row['stage']}: max drift {row['max']} (bound {row['bound']}), "
                  f"histogram {row['histogram']}, local steps {row['steps']}{skipped}", flush=True)
        if rows[-1].get("tied"):
            stale = rows[-1]["tied"]
            same = "identical" if tied[0] == tied[-1] else "DIFFERENT"
            print(f"> PACI tied embedding: staleness max {stale['max']} (bound {stale['bound']}), "
                  f"histogram {stale['histogram']}; stage 0 and last stage copies {same} after "
                  f"the drain (sha256 {tied[0][:12]}, {tied[-1][:12]})", flush=True)


def _log_last_stage(runtime_holder):
    def log(text: str) -> None:
        runtime = runtime_holder.runtime
        if (runtime.is_last if runtime is not None else _rank0()):
            print(text, flush=True)

    return log


def install(argv: Sequence[str], script: str) -> dict:
    """Set up imports and hooks for ``script`` with command line ``argv`` (the script's flags).
    Returns what was installed (for the start-up line and the tests)."""
    from .patches import megatron_lm

    ours = megatron_lm.parse_paci_arguments(argv)
    megatron_lm.prepare_import_path(os.path.dirname(script))
    versions = megatron_lm.check_megatron_lm()
    cpu = megatron_lm.apply_megatron_lm_cpu_patches()
    megatron_lm.install_arguments(validate=validate_flags)
    installed = {"schedule": ours.pipeline_schedule, "cpu_patches": cpu, "hooks": [], **versions}
    if ours.pipeline_schedule == "paci":
        hooks = megatron_lm.PaciTrainingHooks(make_runtime, report=report)
        hooks.log = _log_last_stage(hooks)
        installed["hooks"] = hooks.install()
    return installed


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        print(__doc__, file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"paci_megatron.run: error: {argv[0]} is not a file\n{USAGE}")
    installed = install(argv[1:], script)
    if _rank0():
        print(f"> paci_megatron.run: {os.path.basename(script)} with --pipeline-schedule "
              f"{installed['schedule']} (Megatron-LM {installed['megatron_lm']} at "
              f"{installed['megatron_lm_root']}, megatron-core {installed['megatron_core']}); "
              f"hooks: {', '.join(installed['hooks']) or 'none'}; CPU patches: "
              f"{', '.join(installed['cpu_patches']) or 'none'}", flush=True)
        notice = fallback_notice()
        if notice:
            print(notice, flush=True)
        restart = restart_count(os.environ)
        if restart:
            print(f"> paci_megatron.run: restart {restart} of this job (torchrun --max-restarts "
                  f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}); Megatron-LM resumes "
                  "from the newest checkpoint under --load", flush=True)
    sys.argv = [script, *argv[1:]]
    run_as_main(script)


def run_as_main(script: str) -> None:
    """Execute ``script`` as the ``__main__`` module, as ``python script.py`` would (its
    ``if __name__ == "__main__":`` block runs, and objects it defines pickle as ``__main__.*``).

    Unlike ``runpy.run_path``, the module gets a spec named ``__main__`` (what ``python -m``
    gives a package's ``__main__``): processes that Megatron starts with multiprocessing's
    *spawn* method (the asynchronous writers of distributed checkpoints) then do not execute
    the script again on start-up. They would do so without the hooks installed here and,
    without Triton, fail on Megatron-LM's unconditional Triton import."""
    with open(script, "rb") as handle:
        code = compile(handle.read(), script, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = script
    module.__spec__ = importlib.machinery.ModuleSpec("__main__", None, origin=script)
    module.__builtins__ = builtins
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


if __name__ == "__main__":
    main()
