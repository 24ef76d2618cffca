"""The places in ``megatron/training`` that assume a GPU, made to run on CPU (only when CUDA is
absent; for any schedule). megatron-core's own CPU patches are ``cpu_gloo.py``."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from typing import Callable, Dict, List

import torch

from ..cpu_gloo import apply_cpu_patches
from ..cpu_stand_ins import CpuCuda, CpuStream, CpuTorch, redirect_torch, run_as_cpu
from .version import _replace, _resolve


class _OneCpuDevice(CpuCuda):
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


class _InitializeTorch(CpuTorch):
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
    return redirect_torch("megatron.training.initialize", _InitializeTorch)


class _NoStreams(CpuCuda):
    """``torch.cuda`` inside ``megatron/training/training.py`` on CPU: ``get_model`` builds DDP
    on a side stream (``Stream()``, ``stream(s)``, ``current_stream().wait_stream``)."""

    Stream = CpuStream

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _TrainingTorch(CpuTorch):
    def __init__(self):
        super().__init__()
        self.cuda = _NoStreams()


def cpu_training_tensors() -> bool:
    """training.py: start-time/exit-duration/eval-iteration flags and loss accumulators are
    created with ``device='cuda'`` or on ``torch.cuda.current_device()``; ``synchronize``;
    ``get_model``'s DDP side stream (see :class:`_NoStreams`)."""
    return redirect_torch("megatron.training.training", _TrainingTorch)


def cpu_training_utils() -> bool:
    """utils.py: the model-parallel reductions (grad norm, update flag, LR for logging) and the
    TP broadcasts of a batch allocate on ``torch.cuda.current_device()``. The module is the
    one that defines them: ``megatron.training.utils`` until 0.17, its ``common_utils`` from
    0.18 on (``utils`` became a package)."""
    from megatron.training import utils as mlm_utils

    return redirect_torch(mlm_utils.reduce_max_stat_across_model_parallel_group.__module__)


def cpu_timers() -> bool:
    """megatron-core timers.py (used by Megatron-LM's loop, not by megatron-core's own code
    paths that paci_megatron's CPU patches cover): ``torch.cuda.synchronize()`` around each
    timer and the all-rank gather buffer on ``torch.cuda.current_device()``."""
    return redirect_torch("megatron.core.timers")


class _NoCudaGenerator(CpuCuda):
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


class _NoCudaRngTorch(CpuTorch):
    def __init__(self):
        super().__init__()
        self.cuda = _NoCudaGenerator()


def cpu_rerun_state_machine() -> bool:
    """megatron-core rerun_state_machine.py (driven by Megatron-LM's ``train_step``, default
    ``--rerun-mode validate_results``): saves ``torch.cuda.get_rng_state()`` before each
    iteration; flags and result tensors on ``device='cuda'`` / the current CUDA device."""
    return redirect_torch("megatron.core.rerun_state_machine", _NoCudaRngTorch)


def cpu_checkpointing() -> bool:
    """checkpointing.py: the checkpoint's RNG states include ``torch.cuda.get_rng_state()``
    (saved as None on CPU, and None is restored as nothing); the latest-iteration all-reduce
    uses ``device='cuda'``; ``empty_cache``."""
    return redirect_torch("megatron.training.checkpointing", _NoCudaRngTorch)


def cpu_get_model() -> bool:
    """training.py ``get_model``: ``model_module.cuda(...)`` (runs once)."""
    from megatron.training import training as mlm_training

    original = _resolve("megatron.training.training.get_model")[2]
    return _replace(mlm_training, "get_model", run_as_cpu(original))


def cpu_distributed_models() -> bool:
    """megatron/training/models/dist_utils.py (Megatron-LM 0.19, where ``get_model``'s
    wrapping moved): ``model_module.cuda(...)`` and the DDP side stream, as in ``get_model``
    above (runs once). Absent before 0.19 (0.18 has the module without that function)."""
    if importlib.util.find_spec("megatron.training.models") is None or \
            importlib.util.find_spec("megatron.training.models.dist_utils") is None:
        return False
    from megatron.training.models import dist_utils

    name = "prepare_existing_model_chunks_for_distributed_training"
    original = _resolve(f"{dist_utils.__name__}.{name}")[2]
    if original is None:  # 0.18 has the module, but get_model still wraps the model itself
        return False
    changed = redirect_torch(dist_utils.__name__, _TrainingTorch)
    return _replace(dist_utils, name, run_as_cpu(original)) or changed


def cpu_evaluate() -> bool:
    """training.py ``evaluate``: the validation-loss accumulator is
    ``torch.tensor([0.0, 0.0]).cuda()``. Evaluation runs under the CUDA-as-CPU mode (every
    torch call passes through unchanged except ``.cuda()`` and ``device='cuda'``)."""
    from megatron.training import training as mlm_training

    original = _resolve("megatron.training.training.evaluate")[2]
    return _replace(mlm_training, "evaluate", run_as_cpu(original))


def cpu_batch_to_device() -> bool:
    """Each batch's ``tensor.cuda(non_blocking=True)``: on CPU the tensors stay where they are.

    Through Megatron-LM 0.17 the move is in ``megatron.training.utils.get_batch_on_this_tp_rank``,
    which runs under the CUDA-as-CPU mode. From 0.18 on that function is megatron-core's (it
    only broadcasts) and ``pretrain_gpt.py`` itself moves the batch, where no module patch
    reaches: there, ``Tensor.cuda`` becomes the identity in this process, which on a machine
    without CUDA changes only calls that would raise."""
    from megatron.training import utils as mlm_utils

    original = _resolve("megatron.training.utils.get_batch_on_this_tp_rank")[2]
    if original is None or "data_iterator" not in inspect.signature(original).parameters:
        return _tensor_cuda_is_identity()

    as_cpu = run_as_cpu(original)

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False):
        return as_cpu(data_iterator, mtp_on_this_rank=mtp_on_this_rank)

    changed = _replace(mlm_utils, "get_batch_on_this_tp_rank", get_batch_on_this_tp_rank)
    from megatron.training import training as mlm_training  # imports it too (dummy_train_step)

    if getattr(mlm_training, "get_batch_on_this_tp_rank", None) is original:
        mlm_training.get_batch_on_this_tp_rank = get_batch_on_this_tp_rank
    return changed


def _tensor_cuda_is_identity() -> bool:
    """``torch.Tensor.cuda`` returns the tensor itself (only ever applied without CUDA)."""
    original = torch.Tensor.cuda
    if getattr(original, "_paci_original", None) is not None:
        return False

    @functools.wraps(original)
    def cuda(self, *args, **kwargs):
        return self

    cuda._paci_original = original
    torch.Tensor.cuda = cuda
    return True


def cpu_fused_kernels() -> bool:
    """initialize.py ``_compile_dependencies`` (Megatron-LM 0.16):
    ``megatron.legacy.fused_kernels.load(args)`` runs ``$CUDA_HOME/bin/nvcc -V`` (and builds
    nothing else); without CUDA there is no nvcc. The local transformer implementation uses no
    fused kernel on CPU. 0.17 removed the module, and the call with it."""
    if importlib.util.find_spec("megatron.legacy") is None or \
            importlib.util.find_spec("megatron.legacy.fused_kernels") is None:
        return False
    from megatron.legacy import fused_kernels

    def load(args):
        return None

    return _replace(fused_kernels, "load", load)


def cpu_jit_warmup() -> bool:
    """initialize.py ``set_jit_fusion_options`` -> ``_warmup_jit_function`` (0.19 passes
    ``tp_size``): runs the fused bias-GeLU / bias-dropout-add functions a few times on
    ``device="cuda"`` tensors to compile their GPU kernels before training. On CPU there is
    nothing to warm up (the CPU flags turn those fusions off), and running them would only
    draw from the CPU random generator."""
    from megatron.training import initialize as mlm_initialize

    def _warmup_jit_function(*args, **kwargs):
        return None

    return _replace(mlm_initialize, "_warmup_jit_function", _warmup_jit_function)


def cpu_data_loader_seed() -> bool:
    """training.py ``build_pretraining_data_loader``: each ``iter(DataLoader)`` draws its worker
    base seed from ``loader.generator``, by default torch's global generator. On a GPU the
    model's dropout draws from the CUDA generator; on CPU from that same global generator,
    which a ``--load`` restores before the iterators are made: a resumed run would then drop
    out differently from the uninterrupted one. On CPU each loader gets a generator of its
    own, seeded with the global generator's initial seed (the one Megatron-LM gave the rank,
    from ``--seed``)."""
    from megatron.training import training as mlm_training

    original = _resolve("megatron.training.training.build_pretraining_data_loader")[2]

    @functools.wraps(original)
    def build_pretraining_data_loader(*args, **kwargs):
        loader = original(*args, **kwargs)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(torch.initial_seed())
        return loader

    return _replace(mlm_training, "build_pretraining_data_loader", build_pretraining_data_loader)


MEGATRON_LM_CPU_PATCHES: Dict[str, Callable[[], bool]] = {
    "allow_no_cuda": cpu_allow_no_cuda,
    "initialize_device": cpu_initialize_device,
    "fused_kernels": cpu_fused_kernels,
    "jit_warmup": cpu_jit_warmup,
    "training_tensors": cpu_training_tensors,
    "get_model": cpu_get_model,
    "distributed_models": cpu_distributed_models,
    "training_utils": cpu_training_utils,
    "batch_to_device": cpu_batch_to_device,
    "timers": cpu_timers,
    "rerun_state_machine": cpu_rerun_state_machine,
    "evaluate": cpu_evaluate,
    "checkpointing": cpu_checkpointing,
    "data_loader_seed": cpu_data_loader_seed,
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
