"""Run an unchanged Megatron-LM training script with a selectable pipeline schedule.

    torchrun --nproc-per-node 8 -m paci_megatron.run path/to/Megatron-LM/pretrain_gpt.py \\
        <the script's usual flags> --pipeline-schedule paci --paci-accumulation-factor 8

The script runs as ``__main__`` (see ``run_as_main``) with its folder on ``sys.path``, after
this module installed version-guarded hooks from ``paci_megatron.patches.megatron_lm``:

* always: PACI's flags (``config.paci_flags``, the table ``pretrain_gpt_paci.py`` uses too;
  ``--pipeline-schedule`` defaults to ``1f1b`` here) in Megatron-LM's argument parser (so
  ``--help`` lists them), checked by the same validator before any process group starts;
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

Supported: megatron-core 0.16.1 to 0.19.x with a Megatron-LM checkout of the same minor release
(``patches/versions.py``); any other version stops with an error that says so. From 0.17 on the
megatron-core wheel ships a ``megatron.training`` of its own: the checkout's is used.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import os
import sys
import types
from typing import List, Optional, Sequence

from .autograd_versions import ZERO_CENTERED_GAMMA
from .config import (Layout, PaciConfig, add_paci_arguments, first_stage_shares_weight,
                     rampup_micro_batches, refuse_paci_flags, refuse_tied_mtp_checkpoints,
                     resolve)
from .features import method_cost_lines
from .flag import ConfigError
from .layer_split import expand_layout
from .quiet import exit_after_local_rank0, fallback_notice
from .restart import restart_count

NADAM = "nadam"
NADAM_HELP = ("nadam (paci_megatron.run): torch's NAdam inside Megatron-Core's Adam wrappers, "
              "the same betas, decoupled weight decay.")
USAGE = ("usage: python -m paci_megatron.run path/to/Megatron-LM/pretrain_gpt.py "
         "[Megatron-LM flags] [--pipeline-schedule {1f1b,interleaved,paci}] [--paci-... flags]")


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """PACI's flags in Megatron-LM's parser: the same table as pretrain_gpt_paci.py's, with
    Megatron-LM's own schedule (1f1b) as the default, so that nothing changes unasked; and
    ``nadam`` among Megatron-LM's ``--optimizer`` choices."""
    from .patches import megatron_lm

    megatron_lm.add_optimizer_choice(parser, NADAM, NADAM_HELP)
    return add_paci_arguments(parser, schedule_default="1f1b",
                              title="PACI pipeline schedule (paci_megatron.run)")


def requested_optimizer(argv: Sequence[str]) -> Optional[str]:
    """The command line's --optimizer, as Megatron-LM's parser will read it (None if absent)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--optimizer")
    return parser.parse_known_args(list(argv))[0].optimizer


def use_nadam(optimizer, config) -> None:
    """``--optimizer nadam``: torch's NAdam in the place of the Adam Megatron just built (its
    wrappers, main copies, shards and clipping stay Megatron's, as in pretrain_gpt_paci.py)."""
    from .job_log import optimizer_line
    from .mcore import nadam

    nadam.use_nadam(optimizer, decoupled_weight_decay=getattr(config, "decoupled_weight_decay",
                                                              True))
    if _rank0():
        line = optimizer_line(NADAM, (config.adam_beta1, config.adam_beta2),
                              config.weight_decay, config.clip_grad)
        print(f"> paci_megatron.run: {line[2:]}", flush=True)


def parse_paci_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """PACI's flags from a full command line (the rest is left to Megatron-LM's parser)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    known, _rest = parser.parse_known_args(list(argv))
    return known


def megatron_lm_layout(args, num_microbatches: Optional[int] = None) -> Layout:
    """What PACI's checks need, from Megatron-LM's parsed flags (before its validate_args:
    the data-parallel size as it will derive it, world / (TP x PP x CP))."""
    pp = args.pipeline_model_parallel_size or 1
    model_parallel = (args.tensor_model_parallel_size * pp
                      * (getattr(args, "context_parallel_size", 1) or 1))
    dp = max(1, getattr(args, "world_size", 1) // model_parallel)
    per_step = args.micro_batch_size * dp
    final = args.global_batch_size or per_step
    ramp = rampup_micro_batches(getattr(args, "rampup_batch_size", None), final, per_step,
                                round_down=getattr(args, "decrease_batch_size_if_needed", False))
    virtual = (getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
               or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None)
    microbatches = num_microbatches or (ramp[0] if ramp else max(1, final // per_step))
    return Layout(pipeline_size=pp, microbatches=microbatches,
                  micro_batch_size=args.micro_batch_size, data_parallel_size=dp,
                  virtual=virtual, ramp=tuple(ramp),
                  tied=first_stage_shares_weight(pp, args.untie_embeddings_and_output_weights,
                                                 getattr(args, "mtp_num_layers", None)),
                  mtp=pp > 1 and bool(getattr(args, "mtp_num_layers", None)),
                  fp16=bool(getattr(args, "fp16", False)))


def validate_flags(args: argparse.Namespace) -> Optional[PaciConfig]:
    """PACI's flags against Megatron-LM's parsed ones (before any process group exists), by
    the same validator as pretrain_gpt_paci.py's, plus Megatron-LM's own stage-crossing
    flags. Raises ValueError with the flag and the fix. ``1f1b`` is stock Megatron-LM, which
    picks its schedule itself: nothing but stray PACI flags is checked."""
    if args.pipeline_schedule == "1f1b":
        refuse_paci_flags(args, "1f1b")
        return None
    cfg = resolve(args, megatron_lm_layout(args))
    if args.pipeline_schedule != "paci":
        return cfg
    rerun_mode = getattr(args, "rerun_mode", "disabled")
    if rerun_mode not in ("disabled", "validate_results"):
        raise ConfigError(f"--pipeline-schedule paci cannot re-run iterations (micro-batches "
                          f"stay in flight across them); drop --rerun-mode {rerun_mode}")
    if getattr(args, "apply_layernorm_1p", False):
        raise ConfigError(ZERO_CENTERED_GAMMA)
    if getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise ConfigError(REUSE_GRAD_BUF)
    refuse_stage_crossing_collectives(args)
    return cfg


# Under PACI a stage's gradient buffer holds a group's partial sum between its backwards, and
# weights are gathered in between; with this flag the gather's buffer is that gradient buffer.
REUSE_GRAD_BUF = (
    "--pipeline-schedule paci does not support --reuse-grad-buf-for-mxfp8-param-ag: it makes "
    "the MXFP8 weights' all-gather buffer the gradient buffer, and under PACI weights are "
    "gathered while that buffer holds the partial gradient of a local step's group (a local "
    "step inside an iteration with --overlap-param-gather, whose copy of the weights into the "
    "buffer Megatron-LM makes once an iteration; a move of the weights), so a gather would "
    "wipe the accumulated gradient or gather it into the weights; drop "
    "--reuse-grad-buf-for-mxfp8-param-ag (MXFP8 weights then keep a buffer of their own: more "
    "memory) or use --pipeline-schedule 1f1b")


def check_and_adapt(args: argparse.Namespace) -> Optional[PaciConfig]:
    """``validate_flags``, then Megatron-LM's args as it can run them: ``--optimizer nadam``
    reaches it as ``adam`` (the choice stays in ``args.paci_optimizer``)."""
    from .patches import megatron_lm

    cfg = validate_flags(args)
    megatron_lm.take_optimizer_choice(args, NADAM)
    return cfg


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
        refuse_mtp_off_the_last_stage(getattr(args, "pipeline_model_parallel_layout", None))
        refuse_tied_mtp_checkpoints(pp, getattr(args, "untie_embeddings_and_output_weights",
                                                False), args.mtp_num_layers,
                                    getattr(args, "save", None))
    if getattr(args, "step_batch_size_schedule", None):  # Megatron-LM 0.19
        raise ValueError("--pipeline-schedule paci does not support --step-batch-size-schedule "
                         "yet: the accumulation factor is checked against every number of "
                         "micro-batches before training; drop it")
    refuse_moe_options(args)


def refuse_mtp_off_the_last_stage(layout) -> None:
    """MTP at P > 1 rides on the tied exchange between stage 0 and the last stage (its copy of
    the embedding), so every MTP layer ('m' of a layout) must sit on the last stage, where
    Megatron puts them without a layout."""
    if not isinstance(layout, str):  # None, or a layout Megatron-LM already parsed
        return
    stages = expand_layout(layout).split("|")
    if "m" in "".join(stages[:-1]):
        raise ConfigError(f"--pipeline-schedule paci: --pipeline-model-parallel-layout "
                          f"{layout!r} puts MTP layers ('m') before the last stage; PACI "
                          "carries their copy of the embedding only between stage 0 and the "
                          "last stage (--mtp-num-layers): move every 'm' into the last stage")


def refuse_moe_options(args: argparse.Namespace) -> None:
    """MoE options that cannot stay within a stage under PACI (Megatron-LM 0.19's names;
    earlier releases lack them and pass)."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if getattr(args, "num_experts", None) is None or pp == 1:
        return
    if getattr(args, "flextron", False):
        raise ConfigError("--pipeline-schedule paci does not support --flextron: its router's "
                          "gradients are all-reduced over the pipeline group at every optimizer "
                          "step (finalize_model_grads), which would hold every stage to the "
                          "slowest; drop --flextron or use --pipeline-schedule 1f1b")
    if getattr(args, "moe_expert_rank_capacity_factor", None) is not None:
        raise ConfigError("--pipeline-schedule paci does not support "
                          "--moe-expert-rank-capacity-factor: Megatron-LM then wraps the "
                          "forward-backward function in PagedStashRunner, which all-reduces an "
                          "overflow flag over all ranks (every stage) at every iteration and "
                          "re-runs the iteration on overflow; drop the flag or use "
                          "--pipeline-schedule 1f1b")
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        raise ConfigError("--pipeline-schedule paci does not support "
                          "--overlap-moe-expert-parallel-comm: it overlaps one micro-batch's "
                          "expert-parallel all-to-all with another's compute inside Megatron's "
                          "combined 1F1B schedule for virtual pipeline stages, which PACI "
                          "replaces; drop the flag (or use --pipeline-schedule interleaved)")
    # Megatron-LM sets the expert tensor-parallel size to --tensor-model-parallel-size unless given
    expert_tp = (getattr(args, "expert_tensor_parallel_size", None)
                 or getattr(args, "tensor_model_parallel_size", 1) or 1)
    if expert_tp > 1 and getattr(args, "distributed_backend", "nccl") == "gloo":
        raise ConfigError("--expert-tensor-parallel-size > 1 does not run on gloo: the token "
                          "dispatcher all-gathers tensors of uneven sizes over the expert "
                          "tensor-parallel group, which gloo does not support; use "
                          "--expert-tensor-parallel-size 1 or --distributed-backend nccl")


def make_runtime(margs, num_microbatches: int, optimizer, scheduler):
    """The PACI runtime for Megatron-LM's parsed args (process groups exist by now), bound to
    the stage's optimizer and LR scheduler, resumed at the iteration Megatron-LM loaded."""
    from .mcore.checkpoint import writer_queue_dies_with_this_process
    from .registry import make_paci_runtime

    # a worker killed under torchrun --max-restarts must not leave Megatron's checkpoint
    # writer Manager behind (it holds the job's output pipes open)
    writer_queue_dies_with_this_process()
    try:
        cfg = resolve(margs, megatron_lm_layout(margs, num_microbatches))
    except ValueError as exc:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: error: {exc}") from None
    runtime = make_paci_runtime(cfg)
    runtime.bind(optimizer, scheduler, lr_increment=cfg.shape.lr_increment)
    iteration = getattr(margs, "iteration", 0) or 0
    runtime.resume_at(iteration, local_steps_before(margs, cfg, iteration))
    if margs.rank == 0:
        shape = cfg.shape
        print(f"> PACI: accumulation factor {'auto from ' if cfg.auto else ''}"
              f"{shape.accumulation} of {shape.per_call} micro-batches per iteration "
              f"({shape.steps_per_call} local steps per stage and iteration), "
              f"{shape.num_stages} stages"
              + (f", {runtime.describe()}" if runtime.describe() else ", plain PACI"),
              flush=True)
        for note in cfg.notes:
            print(note, flush=True)
    return runtime


def local_steps_before(margs, cfg: PaciConfig, iteration: int) -> int:
    """Local steps every stage took in Megatron-LM's first ``iteration`` iterations (a
    --load resumes there)."""
    if not margs.rampup_batch_size:
        return cfg.local_steps_before(iteration)
    from .mcore.build import BatchRamp

    ramp = BatchRamp([int(x) for x in margs.rampup_batch_size], margs.global_batch_size,
                     margs.micro_batch_size, margs.data_parallel_size)
    return cfg.local_steps_before(iteration, ramp.per_iteration(iteration))


def make_moe_metrics(model, runtime):
    """The stage's MoE metrics, reported within the stage (``mcore.moe_metrics``)."""
    from .mcore.moe_metrics import StageMoeMetrics

    return StageMoeMetrics(model, lambda: runtime.forwards_in_call)


def mtp_report(original, *args, **kwargs):
    """Megatron-LM's MTP loss report, within the stage (``mcore.mtp_metrics``)."""
    from .mcore.mtp_metrics import report as stage_local

    return stage_local(original, *args, **kwargs)


def report(runtime, moe=None) -> None:
    """Every rank: gather the drift statistics (and MoE metrics) over the pipeline; the last
    stage prints them."""
    from .mcore.build import stage_info
    from .mcore.moe_metrics import summary_line
    from .mcore.runtime import gather_across_pipeline

    rows = gather_across_pipeline(runtime.drift_summary())
    moe_rows = gather_across_pipeline(moe.summary()) if moe is not None else []
    tied = gather_across_pipeline(runtime.tied_digest())
    info = stage_info()
    if info["is_last"] and info["tp_rank"] == 0 and info["dp_rank"] == 0:
        for row in rows:
            skipped = f", skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
            warmed = f", start-up exchange {'+'.join(row['startup_exchange'])}" \
                if row.get("startup_exchange") else ""
            pace = f", forward {row['stage_forward_ms']:.2f} ms" \
                if row.get("stage_forward_ms") else ""
            print(f"> PACI stage {row['stage']}: max drift {row['max']} (bound {row['bound']}), "
                  f"histogram {row['histogram']}, local steps {row['steps']}{skipped}{warmed}"
                  f"{pace}", flush=True)
        if rows[-1].get("tied"):
            stale = rows[-1]["tied"]
            same = "identical" if tied[0] == tied[-1] else "DIFFERENT"
            print(f"> PACI tied embedding: staleness max {stale['max']} (bound {stale['bound']}), "
                  f"histogram {stale['histogram']}; stage 0 and last stage copies {same} after "
                  f"the drain (sha256 {tied[0][:12]}, {tied[-1][:12]})", flush=True)
        for line in method_cost_lines(rows, prefix="> PACI stage"):
            print(line, flush=True)
        for stage, row in enumerate(moe_rows):
            line = summary_line(stage, row)
            if line:
                print(line, flush=True)


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

    ours = parse_paci_arguments(argv)
    megatron_lm.prepare_import_path(os.path.dirname(script))
    versions = megatron_lm.check_megatron_lm()
    cpu = megatron_lm.apply_megatron_lm_cpu_patches()
    megatron_lm.install_arguments(add_arguments, exit_after_local_rank0, validate=check_and_adapt)
    installed = {"schedule": ours.pipeline_schedule, "cpu_patches": cpu, "hooks": [], **versions}
    if requested_optimizer(argv) == NADAM:
        installed["hooks"] += megatron_lm.install_inner_optimizer(use_nadam)
    if ours.pipeline_schedule == "paci":
        hooks = megatron_lm.PaciTrainingHooks(make_runtime, report=report,
                                              drain_before_eval=ours.paci_drain_before_eval,
                                              make_moe_metrics=make_moe_metrics,
                                              mtp_report=mtp_report)
        hooks.log = _log_last_stage(hooks)
        installed["hooks"] += hooks.install()
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
