"""PACI inside Megatron-LM's training loop: after Megatron-LM built model, optimizer and LR
scheduler, a PACI runtime (made by the caller) is bound to them and handed out as the
forward-backward function; ``train_step`` sees the per-stage local steps instead of a global
optimizer step; the pipeline is drained before every checkpoint and at the end of training;
the stage-crossing reductions of ``train_step`` stay within the stage."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, List, Optional

import torch

from ..schedule_hook import install_forward_backward_func
from .version import _replace, _resolve


class LocalStepOptimizer:
    """What ``train_step`` gets as its optimizer under PACI.

    ``train_step`` calls ``optimizer.step()`` once per iteration after the forward-backward
    function; under PACI every stage already stepped its own optimizer after every ``a``
    backward passes inside that function. ``step()`` therefore does not step: it reports this
    iteration's local steps of this stage: ``update_successful`` is True when all of them
    updated (so a skipped local step counts as a skipped iteration), ``grad_norm`` is the last
    one's, ``num_zeros_in_grad`` is None (not measured per local step). Everything else
    (``zero_grad``, ``param_groups``, ``get_loss_scale``, ...) is the real optimizer's.
    """

    def __init__(self, optimizer, runtime, steps_before: int):
        self._paci_optimizer = optimizer
        self._paci_runtime = runtime
        self._paci_steps_before = steps_before

    def step(self):
        records = self._paci_runtime.steps[self._paci_steps_before:]
        if not records:
            raise RuntimeError("PACI: train_step asked for the optimizer step, but this stage "
                               "took no local step during the iteration")
        return all(r.update_successful for r in records), records[-1].grad_norm, None

    def __getattr__(self, name):
        return getattr(self._paci_optimizer, name)


class LocalStepScheduler:
    """What ``train_step`` gets as its LR scheduler under PACI: ``step()`` does nothing,
    because each local step already advanced this stage's scheduler by
    ``a * micro_batch_size * data_parallel_size`` samples (the same total per iteration as
    Megatron-LM's one step of ``num_microbatches * micro_batch_size * data_parallel_size``).
    Everything else is the real scheduler's."""

    def __init__(self, scheduler):
        self._paci_scheduler = scheduler

    def step(self, increment=None):
        return None

    def __getattr__(self, name):
        return getattr(self._paci_scheduler, name)


def _stage_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _stat_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def stage_local_logical_and(input: bool, group=None) -> bool:
    """Replaces ``logical_and_across_model_parallel_group`` in training.py under PACI.

    Stock Megatron-LM ANDs the update flag over the model-parallel group (tensor x pipeline)
    after each global step, i.e. across all stages. Under PACI each stage steps on its own:
    the flag comes from this stage's local steps, whose found-inf check already ran over the
    stage's own grad-stats group; it is ANDed over the stage's tensor-parallel group only (no
    communication with TP=1). Other stages are never waited for. ``group`` (Megatron-LM 0.19
    passes the model-parallel group) is not used, for the same reason."""
    group = _stage_group()
    if torch.distributed.get_world_size(group) == 1:
        return bool(input)
    flag = torch.tensor([1 if input else 0], dtype=torch.int, device=_stat_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def stage_local_max_stat(stat, group=None):
    """Replaces ``reduce_max_stat_across_model_parallel_group`` in training.py under PACI.

    Stock Megatron-LM takes the max of a statistic over the model-parallel group (all stages)
    in ``train_step`` (grad norm, zeros in grad) and in ``training_log`` (learning rate), so
    that the logging rank has a value even where a rank has no parameters. Under PACI every
    stage has parameters and its own values: the max is taken over the stage's tensor-parallel
    group only. The log (printed by the last stage) therefore shows the last stage's grad norm
    and learning rate; every stage's learning rate is the same, because every stage takes the
    same number of local steps per iteration. ``group`` (0.19) is not used, as above."""
    group = _stage_group()
    if torch.distributed.get_world_size(group) == 1:
        return None if stat is None else float(stat)
    value = torch.tensor([-1.0 if stat is None else float(stat)], dtype=torch.float32,
                         device=_stat_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
    result = value.item()
    return None if result == -1.0 else result


class PaciTrainingHooks:
    """PACI inside Megatron-LM's ``pretrain()``.

    ``make_runtime(args, num_microbatches, optimizer, scheduler)`` builds the runtime, bound to
    the stage's optimizer and LR scheduler and resumed at ``args.iteration`` (after Megatron-LM
    initialised its process groups and maybe loaded a checkpoint); ``report(runtime, moe)``
    runs on every rank at the end of training (it may gather across the pipeline);
    ``make_moe_metrics(model, runtime)``, for MoE models, the stage-local stand-in for
    Megatron's MoE metric report (its ``report(original, *args, **kwargs)``);
    ``mtp_report(original, *args, **kwargs)``, the stage-local run of Megatron's MTP loss
    report (``MTPLossLoggingHelper.track_mtp_metrics``);
    ``drain_before_eval``: --paci-drain-before-eval. Installed by :meth:`install`; see the
    docstring of each hook.
    """

    def __init__(self, make_runtime: Callable[[Any, int, Any, Any], Any],
                 report: Optional[Callable[[Any, Any], None]] = None, log: Callable[[str], None] = None,
                 drain_before_eval: bool = False,
                 make_moe_metrics: Optional[Callable[[Any, Any], Any]] = None,
                 mtp_report: Optional[Callable[..., Any]] = None):
        self.make_runtime = make_runtime
        self.make_moe_metrics = make_moe_metrics
        self.mtp_report = mtp_report
        self.moe = None
        self.report = report
        self.drain_before_eval = drain_before_eval
        self.log = log or (lambda text: print(text, flush=True))
        self.runtime = None
        self.uninstall_schedule: Optional[Callable[[], None]] = None

    # the hooks -----------------------------------------------------------------------------
    def setup_model_and_optimizer(self, original):
        """After Megatron-LM built (and maybe loaded) model, optimizer and LR scheduler: build
        the runtime for them and make ``get_forward_backward_func()`` return
        ``runtime.forward_backward`` (``train()`` and ``evaluate()`` look it up afterwards)."""

        @functools.wraps(original)
        def setup_model_and_optimizer(*args, **kwargs):
            model, optimizer, scheduler = original(*args, **kwargs)
            if optimizer is None:  # --skip-train: nothing to schedule
                return model, optimizer, scheduler
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            from megatron.training.global_vars import get_args

            margs = get_args()
            self.disable_reruns()
            runtime = self.make_runtime(margs, get_num_microbatches(), optimizer, scheduler)
            self.runtime = runtime
            if self.make_moe_metrics is not None and getattr(margs, "num_experts", None):
                self.moe = self.make_moe_metrics(model, runtime)
            self.uninstall_schedule = install_forward_backward_func(runtime.forward_backward)
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def disable_reruns(self) -> None:
        """Megatron-LM's default ``--rerun-mode validate_results`` re-runs an iteration on the
        same rank when a checked result (the loss) is NaN/Inf, to tell a transient fault from a
        persistent one. PACI's iterations overlap (micro-batches stay in flight across
        them), so an iteration cannot be repeated on its own: the mode is set to ``disabled``
        (a NaN/Inf loss then stops the job, as ``--rerun-mode disabled`` does; a non-finite
        gradient at a local step follows ``--paci-on-nonfinite``). ``report_determinism_stats``
        re-runs every iteration and is refused at start-up."""
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

        machine = get_rerun_state_machine()
        if machine.get_mode() != RerunMode.DISABLED:
            machine.set_mode(RerunMode.DISABLED)
            self.log("> PACI: --rerun-mode set to disabled (an iteration cannot be re-run while "
                     "micro-batches of the next one are in flight)")

    def train_step(self, original):
        """Runs Megatron-LM's ``train_step`` with :class:`LocalStepOptimizer` and
        :class:`LocalStepScheduler` in place of the optimizer and LR scheduler: the
        forward-backward call takes the stage's local steps; ``train_step``'s own
        ``optimizer.step()`` and ``opt_param_scheduler.step()`` then only report / do nothing.
        Its zeroing of gradients before the call is kept: every call ends with a local step
        (``a`` divides the micro-batches), so the gradients are already zero then. Where
        ``--rampup-batch-size`` changes the number of micro-batches (Megatron-LM updates it
        before calling ``train_step``), the runtime drains first (``use_microbatches``)."""

        signature = inspect.signature(original)

        @functools.wraps(original)
        def train_step(*args, **kwargs):
            runtime = self.runtime
            if runtime is None:
                return original(*args, **kwargs)
            self.follow_batch_size()
            call = signature.bind(*args, **kwargs)  # the parameters by name, on every release
            call.arguments["optimizer"] = LocalStepOptimizer(
                call.arguments["optimizer"], runtime, len(runtime.steps))
            call.arguments["opt_param_scheduler"] = LocalStepScheduler(
                call.arguments["opt_param_scheduler"])
            return original(*call.args, **call.kwargs)

        return train_step

    def follow_batch_size(self) -> None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        num_microbatches = get_num_microbatches()
        dropped = self.runtime.use_microbatches(num_microbatches)
        if dropped is not None:
            self.log(f"> PACI: {num_microbatches} micro-batches per iteration from here on "
                     f"(--rampup-batch-size), accumulation factor {self.runtime.accumulation}; "
                     f"drained the pipeline (stage {self.runtime.stage} dropped {dropped} "
                     "in-flight forwards; their data is replayed)")

    def save_checkpoint(self, original):
        """Drain before any checkpoint Megatron-LM writes (interval, exit, signal, end of
        training, batch-size change): in-flight forwards are dropped and read again after the
        save, so the checkpoint holds the state of a pipeline that flushed at this iteration
        and a resumed run continues from ``consumed_train_samples`` exactly. No communication:
        every stage stops at the same iteration boundary."""

        @functools.wraps(original)
        def save_checkpoint(*args, **kwargs):
            if self.runtime is not None and self.runtime.primed:
                dropped = self.runtime.drain()
                self.log(f"> PACI: drained the pipeline before saving a checkpoint (stage "
                         f"{self.runtime.stage} dropped {dropped} in-flight forwards)")
            return original(*args, **kwargs)

        return save_checkpoint

    def train(self, original):
        """Drain at the end of training (also when ``train()`` exits the process for
        ``--exit-interval`` / ``--exit-duration-in-mins`` / a signal, which it does with
        ``sys.exit``), then ``report(runtime)`` (drift per stage)."""

        @functools.wraps(original)
        def train(*args, **kwargs):
            try:
                result = original(*args, **kwargs)
            except SystemExit:
                self.finish()
                raise
            self.finish()
            return result

        return train

    def finish(self) -> None:
        runtime = self.runtime
        if runtime is None:
            return
        dropped = runtime.drain()
        self.log(f"> PACI: drained the pipeline at the end of training (stage {runtime.stage} "
                 f"dropped {dropped} in-flight forwards)")
        if self.report is not None:
            self.report(runtime, self.moe)

    def evaluate_and_print_results(self, original):
        """--paci-drain-before-eval: drain before Megatron-LM evaluates (frees the in-flight
        activations; training then continues as if the schedule had flushed there). Without
        it the evaluation runs between two iterations and leaves training unchanged."""

        @functools.wraps(original)
        def evaluate_and_print_results(*args, **kwargs):
            runtime = self.runtime
            if self.drain_before_eval and runtime is not None and runtime.primed:
                dropped = runtime.drain()
                self.log(f"> PACI: drained the pipeline before evaluation (stage "
                         f"{runtime.stage} dropped {dropped} in-flight forwards)")
            return original(*args, **kwargs)

        return evaluate_and_print_results

    # installation --------------------------------------------------------------------------
    def install(self) -> List[str]:
        """Patch ``megatron.training.training`` (where ``pretrain``/``train`` look these names
        up). Returns the names patched."""
        from megatron.training import training as mlm_training

        patched = []
        for name in ("setup_model_and_optimizer", "train_step", "save_checkpoint", "train",
                     "evaluate_and_print_results"):
            original = _resolve(f"megatron.training.training.{name}")[2]
            if _replace(mlm_training, name, getattr(self, name)(original)):
                patched.append(name)
        for name, local in (("logical_and_across_model_parallel_group", stage_local_logical_and),
                            ("reduce_max_stat_across_model_parallel_group", stage_local_max_stat)):
            if _replace(mlm_training, name, _plain(local)):
                patched.append(name)
        patched += self.install_moe_report(mlm_training)
        patched += self.install_mtp_report(mlm_training)
        return patched

    def install_mtp_report(self, mlm_training) -> List[str]:
        """Megatron-LM's training log reports the MTP losses once an iteration through
        ``MTPLossLoggingHelper.track_mtp_metrics``: under PACI through ``mtp_report``, within
        the stage. The training module's name is pointed at a subclass (the model's own
        calls, which fill the tracker, keep the class)."""
        helper = getattr(mlm_training, "MTPLossLoggingHelper", None)
        if helper is None or self.mtp_report is None:
            return []
        report = self.mtp_report

        class StageLocalMTPLossLoggingHelper(helper):
            @staticmethod
            def track_mtp_metrics(*args, **kwargs):
                return report(helper.track_mtp_metrics, *args, **kwargs)

        return ["MTPLossLoggingHelper"] if _replace(
            mlm_training, "MTPLossLoggingHelper", StageLocalMTPLossLoggingHelper) else []

    def install_moe_report(self, mlm_training) -> List[str]:
        """Megatron-LM's training log reports the MoE metrics once an iteration with an
        all-reduce over the pipeline group (``track_moe_metrics`` through 0.17, the tracker's
        ``report`` from 0.18): under PACI it runs stage-locally (``make_moe_metrics``)."""
        hooks = self
        if hasattr(mlm_training, "track_moe_metrics"):
            original = mlm_training.track_moe_metrics

            @functools.wraps(original)
            def track_moe_metrics(*args, **kwargs):
                if hooks.moe is None:
                    return original(*args, **kwargs)
                return hooks.moe.report(original, *args, **kwargs)

            return ["track_moe_metrics"] if _replace(mlm_training, "track_moe_metrics",
                                                     track_moe_metrics) else []
        if hasattr(mlm_training, "get_moe_metrics_tracker"):
            get_tracker = mlm_training.get_moe_metrics_tracker

            @functools.wraps(get_tracker)
            def get_moe_metrics_tracker():
                tracker = get_tracker()
                return tracker if hooks.moe is None else _StageLocalTracker(tracker, hooks.moe)

            return ["get_moe_metrics_tracker"] if _replace(
                mlm_training, "get_moe_metrics_tracker", get_moe_metrics_tracker) else []
        return []


class _StageLocalTracker:
    """Megatron's MoE metrics tracker (0.18+) whose ``report`` runs stage-locally."""

    def __init__(self, tracker, moe):
        self._paci_tracker = tracker
        self._paci_moe = moe

    def report(self, *args, **kwargs):
        return self._paci_moe.report(self._paci_tracker.report, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._paci_tracker, name)


def _plain(fn):
    """A fresh function object per install (``_replace`` marks it)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper
