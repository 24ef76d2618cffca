"""Version-guarded patches that run Megatron-LM's own training loop (``pretrain_gpt.py``) with PACI.

Used by ``python -m paci_megatron.run path/to/Megatron-LM/pretrain_gpt.py ...``. In order:

* :func:`prepare_import_path` (always): the checkout's folder on ``sys.path`` behind the
  installed megatron-core, which therefore provides ``megatron.core``; its prebuilt dataset
  helpers are not recompiled; without Triton, a stand-in for the one megatron-core module
  Megatron-LM imports Triton through.
* :func:`install_arguments` (always): ``--pipeline-schedule``, ``--paci-accumulation-factor``,
  ``--paci-max-drift`` and ``--paci-on-nonfinite`` join Megatron-LM's argument parser, next to
  whatever ``extra_args_provider`` the script passes. Nothing else changes, so
  ``--pipeline-schedule 1f1b`` is stock Megatron-LM.
* :func:`apply_megatron_lm_cpu_patches` (only when CUDA is absent, for any schedule): the few
  places in ``megatron/training`` that assume a GPU. With CUDA it does nothing.
* :class:`PaciTrainingHooks` (``--pipeline-schedule paci``): after Megatron-LM built model,
  optimizer and LR scheduler, a PACI runtime is bound to them and handed out as the
  forward-backward function; ``train_step`` sees the per-stage local steps instead of a global
  optimizer step; the pipeline is drained before every checkpoint and at the end of training.

Everything patched is looked up where Megatron-LM looks it up (module globals of
``megatron.training.training`` etc.), and checked first: the Megatron-LM checkout must say
:data:`SUPPORTED_MEGATRON_LM_VERSIONS` in its ``megatron/core/package_info.py``, megatron-core
must be :data:`SUPPORTED_MCORE_VERSIONS`, and every patched function must still have the
signature these patches were written against. Anything else stops with
:class:`UnsupportedMegatronLM` naming the versions that work.

Only relative imports: the PACI runtime itself is passed in by the caller
(``paci_megatron/run.py``), so this file depends on nothing outside ``patches/``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .cpu_gloo import (
    SUPPORTED_MCORE_VERSIONS,
    UnsupportedMegatronVersion,
    _CpuCuda,
    _CpuTorch,
    _redirect_torch,
    _run_as_cpu,
    apply_cpu_patches,
    check_megatron_core_version,
)
from .schedule_hook import install_forward_backward_func

SUPPORTED_MEGATRON_LM_VERSIONS = ("0.16.1",)
VERIFIED_MEGATRON_LM_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"  # tag core_v0.16.1

SCHEDULE_CHOICES = ("1f1b", "interleaved", "paci")

__all__ = [
    "SUPPORTED_MEGATRON_LM_VERSIONS",
    "UnsupportedMegatronLM",
    "add_paci_arguments",
    "parse_paci_arguments",
    "prepare_import_path",
    "megatron_lm_checkout_version",
    "check_megatron_lm",
    "install_arguments",
    "apply_megatron_lm_cpu_patches",
    "PaciTrainingHooks",
]


class UnsupportedMegatronLM(UnsupportedMegatronVersion):
    """The Megatron-LM checkout (or megatron-core) is not one these patches support."""


def _supported() -> str:
    return (f"Megatron-LM {', '.join(SUPPORTED_MEGATRON_LM_VERSIONS)} (e.g. git tag core_v0.16.1, "
            f"commit {VERIFIED_MEGATRON_LM_COMMIT[:12]}) with megatron-core "
            f"{', '.join(SUPPORTED_MCORE_VERSIONS)}")


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------


def _at_least(name: str, low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} expects an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {value}")
        return value

    return parse


def add_paci_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """PACI's flags, as a Megatron-LM ``extra_args_provider`` (returns the parser)."""
    group = parser.add_argument_group(title="PACI pipeline schedule (paci_megatron.run)")
    group.add_argument("--pipeline-schedule", choices=SCHEDULE_CHOICES, default="1f1b",
                       help="1f1b: stock Megatron (default, nothing is patched); interleaved: "
                            "stock Megatron with --num-layers-per-virtual-pipeline-stage; paci: "
                            "never-flushing 1F1B with per-stage optimizer steps")
    group.add_argument("--paci-accumulation-factor", default=None,
                       type=_at_least("--paci-accumulation-factor", 1),
                       help="backward passes per local optimizer step of a stage; must divide "
                            "the micro-batches per global batch (default: all of them)")
    group.add_argument("--paci-max-drift", type=_at_least("--paci-max-drift", 0), default=None,
                       help="largest tolerated weight-version drift (default: the bound "
                            "ceil((P-1-s)/a))")
    group.add_argument("--paci-stale-grad-weight", type=float, default=None, metavar="W",
                       help="weigh each micro-batch's gradient at a stage by W ** its drift "
                            "there, renormalised (0 < W <= 1; default: paci-megatron's, 0.2; "
                            "1: the paper's plain PACI)")
    group.add_argument("--paci-stale-grad-correction", type=float, default=None, metavar="K",
                       help="correct each stage's gradient for its stale micro-batches: "
                            "g -= K x lr x mean drift x the optimizer's first moment, before "
                            "each local step (K >= 0, in 1/LR; default: paci-megatron's, off)")
    group.add_argument("--paci-on-nonfinite", choices=("skip", "abort"), default="skip",
                       help="a NaN/Inf gradient at a stage's local step: skip that update or stop")
    return parser


def parse_paci_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """PACI's flags from a full command line (the rest is left to Megatron-LM's parser)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_paci_arguments(parser)
    known, _rest = parser.parse_known_args(list(argv))
    return known


# --------------------------------------------------------------------------------------------
# Import path and version guard
# --------------------------------------------------------------------------------------------

_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _batch_invariant_stub() -> types.ModuleType:
    """Stands in for megatron-core's batch-invariant kernels when Triton is not installed.

    ``megatron/training/initialize.py`` imports ``enable_batch_invariant_mode`` from that module
    unconditionally, and the module imports ``triton`` at the top; the CPU torch wheel has no
    Triton. The stub says the mode is off and refuses to turn it on (``--batch-invariant-mode``
    needs Triton and a GPU)."""
    stub = types.ModuleType(_BATCH_INVARIANT)
    stub.__doc__ = "paci_megatron stand-in: Triton is not installed, batch-invariant mode is off"
    stub._paci_stub = True

    def is_batch_invariant_mode_enabled() -> bool:
        return False

    def refuse(*_args, **_kwargs):
        raise RuntimeError("--batch-invariant-mode needs Triton (and a GPU); Triton is not "
                           "installed here")

    def set_batch_invariant_mode(enabled: bool = True):
        if enabled:
            refuse()

    stub.is_batch_invariant_mode_enabled = is_batch_invariant_mode_enabled
    stub.enable_batch_invariant_mode = refuse
    stub.disable_batch_invariant_mode = lambda: None
    stub.set_batch_invariant_mode = set_batch_invariant_mode
    stub.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                    "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    return stub


def _is_dir(entry: str, folder: str) -> bool:
    return os.path.abspath(entry or os.curdir) == folder  # "" on sys.path is the cwd


def prepare_import_path(script_dir: str) -> str:
    """Put Megatron-LM's root (the script's folder) on ``sys.path`` without letting its
    ``megatron/core`` shadow the installed megatron-core.

    ``megatron`` is a namespace package in both places, and the first ``megatron/core`` on
    ``sys.path`` wins. The checkout's root therefore goes right *after* the installed
    megatron-core's folder (``python script.py`` would put it first; so would ``python -m``
    run from inside the checkout, whose cwd entry is taken out here): ``megatron.core`` is
    the installed wheel (with the prebuilt ``helpers_cpp`` dataset extension that a source
    checkout lacks), also in processes that multiprocessing spawns with this ``sys.path``,
    and the checkout contributes only what megatron-core does not ship:
    ``megatron.training``, ``megatron.legacy``, ``megatron.post_training``, ``megatron.rl``
    and the script's own modules (``gpt_builders``, ``model_provider``).
    Returns the installed megatron-core version.
    """
    script_dir = os.path.abspath(script_dir)
    sys.path[:] = [entry for entry in sys.path if not _is_dir(entry, script_dir)]
    version = check_megatron_core_version()
    if importlib.util.find_spec("triton") is None and _BATCH_INVARIANT not in sys.modules:
        sys.modules[_BATCH_INVARIANT] = _batch_invariant_stub()
    import megatron.core

    core_dir = os.path.dirname(os.path.abspath(megatron.core.__file__))
    if core_dir.startswith(script_dir + os.sep):
        raise UnsupportedMegatronLM(
            f"megatron.core was already imported from the Megatron-LM checkout ({core_dir}); "
            f"paci_megatron.run needs the installed megatron-core {version}")
    if getattr(sys.modules["megatron"], "__file__", None):
        raise UnsupportedMegatronLM(
            f"'megatron' is a regular package here ({sys.modules['megatron'].__file__}); "
            f"megatron-core {version} installs it as a namespace package. Reinstall it.")
    site = os.path.dirname(os.path.dirname(core_dir))
    index = next((i for i, entry in enumerate(sys.path) if _is_dir(entry, site)), None)
    sys.path.insert(len(sys.path) if index is None else index + 1, script_dir)
    _use_prebuilt_dataset_helpers()
    return version


def _use_prebuilt_dataset_helpers() -> bool:
    """``initialize_megatron`` runs ``megatron.core.datasets.utils.compile_helpers()`` (``make``
    in the folder of ``megatron.core.datasets``) on rank 0. The megatron-core wheel ships that
    extension prebuilt (``helpers_cpp``) and has no makefile, so ``make`` fails and Megatron-LM
    exits. The replacement builds only when the prebuilt extension cannot be imported."""
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers
    if getattr(original, "_paci_original", None) is not None:
        return False

    @functools.wraps(original)
    def compile_helpers():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None
        return original()

    compile_helpers._paci_original = original
    dataset_utils.compile_helpers = compile_helpers
    return True


_VERSION_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(.+?)\s*(#.*)?$", re.M)


def megatron_lm_checkout_version(root: str) -> Optional[str]:
    """``MAJOR.MINOR.PATCH[PRE_RELEASE]`` from a checkout's ``megatron/core/package_info.py``,
    read as text (newer checkouts run git in that file). None if the file is absent."""
    path = os.path.join(root, "megatron", "core", "package_info.py")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    fields = {m.group(1): m.group(2).strip("'\"") for m in _VERSION_FIELD.finditer(text)}
    if not {"MAJOR", "MINOR", "PATCH"} <= set(fields):
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"


def _params(fn) -> List[str]:
    return list(inspect.signature(fn).parameters)


# function -> the parameters it had when these patches were written (Megatron-LM 0.16.1)
_EXPECTED_SIGNATURES: Dict[str, List[str]] = {
    "megatron.training.arguments.parse_args": ["extra_args_provider", "ignore_unknown_args"],
    "megatron.training.initialize.initialize_megatron": [
        "extra_args_provider", "args_defaults", "ignore_unknown_args", "allow_no_cuda",
        "skip_mpu_initialization", "get_embedding_ranks", "get_position_embedding_ranks",
        "parsed_args", "store"],
    "megatron.training.training.setup_model_and_optimizer": [
        "model_provider_func", "model_type", "checkpointing_context"],
    "megatron.training.training.train_step": [
        "forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler",
        "config", "forward_backward_func", "iteration"],
    "megatron.training.training.train": [
        "forward_step_func", "model", "optimizer", "opt_param_scheduler", "train_data_iterator",
        "valid_data_iterator", "process_non_loss_data_func", "config", "checkpointing_context",
        "non_loss_data_func", "inference_model"],
    "megatron.training.training.save_checkpoint": [
        "iteration", "model", "optimizer", "opt_param_scheduler",
        "num_floating_point_operations_so_far", "checkpointing_context", "pipeline_rank",
        "expert_rank", "tensor_rank", "pipeline_parallel", "expert_parallel",
        "non_persistent_ckpt", "train_data_iterator", "preprocess_common_state_dict_fn",
        "release", "tp_group", "pp_group", "dp_cp_group"],
    "megatron.training.training.get_model": [
        "model_provider_func", "model_type", "wrap_with_ddp", "config", "pg_collection"],
    "megatron.training.training.logical_and_across_model_parallel_group": ["input"],
    "megatron.training.training.reduce_max_stat_across_model_parallel_group": ["stat"],
    "megatron.training.training.get_forward_backward_func": ["pp_size", "vp_size"],
    "megatron.training.training.evaluate": [
        "forward_step_func", "data_iterator", "model", "process_non_loss_data_func", "config",
        "verbose", "non_loss_data_func", "eval_iters"],
    "megatron.training.initialize._warmup_jit_function": [],
    "megatron.legacy.fused_kernels.load": ["args"],
    "megatron.training.utils.get_batch_on_this_tp_rank": ["data_iterator", "mtp_on_this_rank"],
}


def _resolve(dotted: str):
    module_name, attr = dotted.rsplit(".", 1)
    module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    return module, attr, getattr(fn, "_paci_original", fn)


def check_megatron_lm() -> Dict[str, str]:
    """Check megatron-core, the Megatron-LM checkout and every function patched here.

    Returns ``{"megatron_core": version, "megatron_lm": version or "unknown",
    "megatron_lm_root": path}``; raises :class:`UnsupportedMegatronLM` on any mismatch."""
    try:
        mcore = check_megatron_core_version()
    except UnsupportedMegatronVersion as exc:
        raise UnsupportedMegatronLM(f"{exc} paci_megatron.run supports {_supported()}.") from None
    spec = importlib.util.find_spec("megatron.training")
    if spec is None or not spec.origin:
        raise UnsupportedMegatronLM(
            "megatron.training (Megatron-LM) is not importable: pass the path of "
            "pretrain_gpt.py inside a Megatron-LM checkout. paci_megatron.run supports "
            f"{_supported()}.")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))))
    checkout = megatron_lm_checkout_version(root)
    if checkout is not None and checkout not in SUPPORTED_MEGATRON_LM_VERSIONS:
        raise UnsupportedMegatronLM(
            f"the Megatron-LM checkout at {root} is version {checkout}; paci_megatron.run "
            f"supports {_supported()}. Check out that version (git checkout core_v0.16.1).")
    changed = []
    for dotted, expected in _EXPECTED_SIGNATURES.items():
        try:
            _module, _attr, fn = _resolve(dotted)
        except ModuleNotFoundError as exc:
            _refuse_missing_package(exc)
            changed.append(f"{dotted}: cannot import ({exc})")
            continue
        except ImportError as exc:
            changed.append(f"{dotted}: cannot import ({exc})")
            continue
        if fn is None:
            changed.append(f"{dotted}: missing")
        elif _params(fn) != expected:
            changed.append(f"{dotted}{inspect.signature(fn)}: expected parameters {expected}")
    if changed:
        raise UnsupportedMegatronLM(
            f"the Megatron-LM at {root} (version {checkout or 'unknown'}) differs from the one "
            f"these patches were written for ({_supported()}):\n  " + "\n  ".join(changed))
    return {"megatron_core": mcore, "megatron_lm": checkout or "unknown", "megatron_lm_root": root}


def _refuse_missing_package(exc: ModuleNotFoundError) -> None:
    """A third-party package Megatron-LM's training code imports is absent: say so (and how to
    install it), rather than report a version mismatch."""
    top = (exc.name or "").split(".")[0]
    if top and top != "megatron":
        raise UnsupportedMegatronLM(
            f"Megatron-LM's training code imports {top!r}, which is not installed: "
            f"pip install -e \".[megatron-lm]\" (in paci-megatron's folder) installs what "
            f"Megatron-LM's pretrain_gpt.py needs, or install the package providing {top!r} "
            f"({exc})") from exc


# --------------------------------------------------------------------------------------------
# Patch bookkeeping
# --------------------------------------------------------------------------------------------


def _replace(module, attr: str, new) -> bool:
    """Set ``module.attr = new`` (keeping the original on ``new._paci_original``); False if a
    paci_megatron replacement is already there."""
    old = getattr(module, attr)
    if getattr(old, "_paci_original", None) is not None:
        return False
    new._paci_original = old
    setattr(module, attr, new)
    return True


# --------------------------------------------------------------------------------------------
# Layer 1: the parser
# --------------------------------------------------------------------------------------------


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Every rank parses the same flags: a usage error is printed once per node (local rank
    0) as one line, not Megatron-LM's whole usage text once per rank."""
    def error(message: str):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            parser.exit(2, f"{parser.prog}: error: {message}\n")
        parser.exit(2)

    parser.error = error


def install_arguments(validate: Optional[Callable[[argparse.Namespace], None]] = None) -> None:
    """Add PACI's flags to Megatron-LM's ``parse_args`` wherever it is called from.

    ``parse_args(extra_args_provider, ignore_unknown_args)`` builds its parser, then calls the
    script's ``extra_args_provider(parser)``: the replacement passes a provider that runs the
    script's one (if any) and then :func:`add_paci_arguments`. ``validate(args)`` (optional)
    checks the parsed PACI flags and raises ``ValueError``, reported as a usage error.
    """
    from megatron.training import arguments as mlm_arguments
    from megatron.training import initialize as mlm_initialize

    original = _resolve("megatron.training.arguments.parse_args")[2]

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            _one_line_errors(parser)
            return add_paci_arguments(parser)

        args = original(provider, ignore_unknown_args)
        if validate is not None and not ignore_unknown_args:
            try:
                validate(args)
            except ValueError as exc:
                if args.rank == 0:
                    print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr,
                          flush=True)
                sys.exit(2)
        return args

    parse_args.__doc__ = original.__doc__
    # initialize.py holds its own reference (from ... import parse_args); others call
    # arguments.parse_args (ft_integration, inprocess_restart)
    _replace(mlm_arguments, "parse_args", parse_args)
    _replace(mlm_initialize, "parse_args", parse_args)


# --------------------------------------------------------------------------------------------
# Layer 2: CPU
# --------------------------------------------------------------------------------------------


class _OneCpuDevice(_CpuCuda):
    """``torch.cuda`` inside ``megatron/training/initialize.py`` on a CPU-only machine: it
    reports one device so that Megatron-LM takes its normal path (model-parallel groups, the
    model-parallel RNG tracker, which megatron-core's CPU patches back with CPU generators);
    ``set_device`` has nothing to select."""

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(device):
        return None


class _InitializeTorch(_CpuTorch):
    def __init__(self):
        super().__init__()
        self.cuda = _OneCpuDevice()


def cpu_allow_no_cuda() -> bool:
    """initialize.py: ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless
    ``allow_no_cuda=True``; pretrain() does not pass it. On CPU we pass it."""
    from megatron.training import training as mlm_training

    original = _resolve("megatron.training.initialize.initialize_megatron")[2]

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return _replace(mlm_training, "initialize_megatron", initialize_megatron)


def cpu_initialize_device() -> bool:
    """initialize.py: model parallelism and the model-parallel seed are set up only when
    ``torch.cuda.device_count() > 0``; ``torch.cuda.set_device``. See :class:`_OneCpuDevice`."""
    return _redirect_torch("megatron.training.initialize", _InitializeTorch)


class _CpuStream:
    """A CUDA stream on CPU: work is already ordered, there is nothing to wait for."""

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def synchronize(self):
        return None


class _NoStreams(_CpuCuda):
    """``torch.cuda`` inside ``megatron/training/training.py`` on CPU: ``get_model`` builds DDP
    on a side stream (``Stream()``, ``stream(s)``, ``current_stream().wait_stream``)."""

    Stream = _CpuStream

    @staticmethod
    def current_stream(device=None):
        return _CpuStream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _TrainingTorch(_CpuTorch):
    def __init__(self):
        super().__init__()
        self.cuda = _NoStreams()


def cpu_training_tensors() -> bool:
    """training.py: start-time/exit-duration/eval-iteration flags and loss accumulators are
    created with ``device='cuda'`` or on ``torch.cuda.current_device()``; ``synchronize``;
    ``get_model``'s DDP side stream (see :class:`_NoStreams`)."""
    return _redirect_torch("megatron.training.training", _TrainingTorch)


def cpu_training_utils() -> bool:
    """utils.py: the model-parallel reductions (grad norm, update flag, LR for logging) and the
    TP broadcasts of a batch allocate on ``torch.cuda.current_device()``."""
    return _redirect_torch("megatron.training.utils")


def cpu_timers() -> bool:
    """megatron-core timers.py (used by Megatron-LM's loop, not by megatron-core's own code
    paths that paci_megatron's CPU patches cover): ``torch.cuda.synchronize()`` around each
    timer and the all-rank gather buffer on ``torch.cuda.current_device()``."""
    return _redirect_torch("megatron.core.timers")


class _NoCudaGenerator(_CpuCuda):
    """``torch.cuda`` inside megatron-core's rerun_state_machine.py and Megatron-LM's
    checkpointing.py on CPU: there is no CUDA generator to save or restore (the CPU generator
    is saved next to it, as ``torch_rng_state``; the model-parallel tracker's states too)."""

    @staticmethod
    def get_rng_state(device="cuda"):
        return None

    @staticmethod
    def set_rng_state(new_state, device="cuda"):
        if new_state is not None:
            raise RuntimeError("a CUDA RNG state cannot be restored on a CPU-only machine")


class _NoCudaRngTorch(_CpuTorch):
    def __init__(self):
        super().__init__()
        self.cuda = _NoCudaGenerator()


def cpu_rerun_state_machine() -> bool:
    """megatron-core rerun_state_machine.py (driven by Megatron-LM's ``train_step``, default
    ``--rerun-mode validate_results``): saves ``torch.cuda.get_rng_state()`` before each
    iteration; flags and result tensors on ``device='cuda'`` / the current CUDA device."""
    return _redirect_torch("megatron.core.rerun_state_machine", _NoCudaRngTorch)


def cpu_checkpointing() -> bool:
    """checkpointing.py: the checkpoint's RNG states include ``torch.cuda.get_rng_state()``
    (saved as None on CPU, and None is restored as nothing); the latest-iteration all-reduce
    uses ``device='cuda'``; ``empty_cache``."""
    return _redirect_torch("megatron.training.checkpointing", _NoCudaRngTorch)


def cpu_get_model() -> bool:
    """training.py ``get_model``: ``model_module.cuda(...)`` (runs once)."""
    from megatron.training import training as mlm_training

    original = _resolve("megatron.training.training.get_model")[2]
    return _replace(mlm_training, "get_model", _run_as_cpu(original))


def cpu_evaluate() -> bool:
    """training.py ``evaluate``: the validation-loss accumulator is
    ``torch.tensor([0.0, 0.0]).cuda()``. Evaluation runs under the CUDA-as-CPU mode (every
    torch call passes through unchanged except ``.cuda()`` and ``device='cuda'``)."""
    from megatron.training import training as mlm_training

    original = _resolve("megatron.training.training.evaluate")[2]
    return _replace(mlm_training, "evaluate", _run_as_cpu(original))


def cpu_batch_to_device() -> bool:
    """utils.py ``get_batch_on_this_tp_rank``: ``tensor.cuda(non_blocking=True)`` for each
    field of a batch; on CPU the tensors stay where they are."""
    from megatron.training import utils as mlm_utils

    original = _resolve("megatron.training.utils.get_batch_on_this_tp_rank")[2]

    as_cpu = _run_as_cpu(original)

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False):
        return as_cpu(data_iterator, mtp_on_this_rank=mtp_on_this_rank)

    changed = _replace(mlm_utils, "get_batch_on_this_tp_rank", get_batch_on_this_tp_rank)
    from megatron.training import training as mlm_training  # imports it too (dummy_train_step)

    if getattr(mlm_training, "get_batch_on_this_tp_rank", None) is original:
        mlm_training.get_batch_on_this_tp_rank = get_batch_on_this_tp_rank
    return changed


def cpu_fused_kernels() -> bool:
    """initialize.py ``_compile_dependencies``: ``megatron.legacy.fused_kernels.load(args)``
    runs ``$CUDA_HOME/bin/nvcc -V`` (and builds nothing else); without CUDA there is no nvcc.
    The local transformer implementation uses no fused kernel on CPU."""
    from megatron.legacy import fused_kernels

    def load(args):
        return None

    return _replace(fused_kernels, "load", load)


def cpu_jit_warmup() -> bool:
    """initialize.py ``set_jit_fusion_options`` -> ``_warmup_jit_function``: runs the fused
    bias-GeLU / bias-dropout-add functions a few times on ``device="cuda"`` tensors to compile
    their GPU kernels before training. On CPU there is nothing to warm up (the CPU flags turn
    those fusions off), and running them would only draw from the CPU random generator."""
    from megatron.training import initialize as mlm_initialize

    def _warmup_jit_function():
        return None

    return _replace(mlm_initialize, "_warmup_jit_function", _warmup_jit_function)


MEGATRON_LM_CPU_PATCHES: Dict[str, Callable[[], bool]] = {
    "allow_no_cuda": cpu_allow_no_cuda,
    "initialize_device": cpu_initialize_device,
    "fused_kernels": cpu_fused_kernels,
    "jit_warmup": cpu_jit_warmup,
    "training_tensors": cpu_training_tensors,
    "get_model": cpu_get_model,
    "training_utils": cpu_training_utils,
    "batch_to_device": cpu_batch_to_device,
    "timers": cpu_timers,
    "rerun_state_machine": cpu_rerun_state_machine,
    "evaluate": cpu_evaluate,
    "checkpointing": cpu_checkpointing,
}

_CPU_APPLIED: List[str] = []


def apply_megatron_lm_cpu_patches() -> List[str]:
    """megatron-core's CPU/gloo patches plus :data:`MEGATRON_LM_CPU_PATCHES`; a no-op with
    CUDA. Returns the Megatron-LM patch names in effect."""
    if torch.cuda.is_available():
        return []
    apply_cpu_patches()
    for name, patch in MEGATRON_LM_CPU_PATCHES.items():
        if name not in _CPU_APPLIED:
            patch()
            _CPU_APPLIED.append(name)
    return list(_CPU_APPLIED)


# --------------------------------------------------------------------------------------------
# Layer 3: PACI in Megatron-LM's training loop
# --------------------------------------------------------------------------------------------


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


def stage_local_logical_and(input: bool) -> bool:
    """Replaces ``logical_and_across_model_parallel_group`` in training.py under PACI.

    Stock Megatron-LM ANDs the update flag over the model-parallel group (tensor x pipeline)
    after each global step, i.e. across all stages. Under PACI each stage steps on its own:
    the flag comes from this stage's local steps, whose found-inf check already ran over the
    stage's own grad-stats group; it is ANDed over the stage's tensor-parallel group only (no
    communication with TP=1). Other stages are never waited for."""
    group = _stage_group()
    if torch.distributed.get_world_size(group) == 1:
        return bool(input)
    flag = torch.tensor([1 if input else 0], dtype=torch.int, device=_stat_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def stage_local_max_stat(stat):
    """Replaces ``reduce_max_stat_across_model_parallel_group`` in training.py under PACI.

    Stock Megatron-LM takes the max of a statistic over the model-parallel group (all stages)
    in ``train_step`` (grad norm, zeros in grad) and in ``training_log`` (learning rate), so
    that the logging rank has a value even where a rank has no parameters. Under PACI every
    stage has parameters and its own values: the max is taken over the stage's tensor-parallel
    group only. The log (printed by the last stage) therefore shows the last stage's grad norm
    and learning rate; every stage's learning rate is the same, because every stage takes the
    same number of local steps per iteration."""
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

    ``make_runtime(args, num_microbatches)`` builds the runtime (after Megatron-LM initialised
    its process groups); ``report(runtime)`` runs on every rank at the end of training (it may
    gather across the pipeline). Installed by :meth:`install`; see the docstring of each hook.
    """

    def __init__(self, make_runtime: Callable[[Any, int], Any],
                 report: Optional[Callable[[Any], None]] = None, log: Callable[[str], None] = None):
        self.make_runtime = make_runtime
        self.report = report
        self.log = log or (lambda text: print(text, flush=True))
        self.runtime = None
        self.uninstall_schedule: Optional[Callable[[], None]] = None

    # the hooks -----------------------------------------------------------------------------
    def setup_model_and_optimizer(self, original):
        """After Megatron-LM built (and maybe loaded) model, optimizer and LR scheduler: build
        the runtime, bind it to the optimizer and scheduler (LR increment ``a x micro-batch x
        data-parallel`` per local step), and make ``get_forward_backward_func()`` return
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
            runtime = self.make_runtime(margs, get_num_microbatches())
            runtime.bind(optimizer, scheduler, lr_increment=(
                runtime.accumulation * margs.micro_batch_size * margs.data_parallel_size))
            self.runtime = runtime
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

        @functools.wraps(original)
        def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                       config, forward_backward_func, iteration=None):
            runtime = self.runtime
            if runtime is None:
                return original(forward_step_func, data_iterator, model, optimizer,
                                opt_param_scheduler, config, forward_backward_func,
                                iteration=iteration)
            self.follow_batch_size()
            return original(forward_step_func, data_iterator, model,
                            LocalStepOptimizer(optimizer, runtime, len(runtime.steps)),
                            LocalStepScheduler(opt_param_scheduler), config,
                            forward_backward_func, iteration=iteration)

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
            self.report(runtime)

    # installation --------------------------------------------------------------------------
    def install(self) -> List[str]:
        """Patch ``megatron.training.training`` (where ``pretrain``/``train`` look these names
        up). Returns the names patched."""
        from megatron.training import training as mlm_training

        patched = []
        for name in ("setup_model_and_optimizer", "train_step", "save_checkpoint", "train"):
            original = _resolve(f"megatron.training.training.{name}")[2]
            if _replace(mlm_training, name, getattr(self, name)(original)):
                patched.append(name)
        for name, local in (("logical_and_across_model_parallel_group", stage_local_logical_and),
                            ("reduce_max_stat_across_model_parallel_group", stage_local_max_stat)):
            if _replace(mlm_training, name, _plain(local)):
                patched.append(name)
        return patched


def _plain(fn):
    """A fresh function object per install (``_replace`` marks it)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper
