"""Runtime patches that let stock Megatron-Core (the releases of ``versions.py``) run on CPU
with the gloo backend.

Megatron-Core assumes CUDA in a few dozen places (``torch.cuda.current_device()``, literal
``device="cuda"``, the CUDA RNG, ``Tensor.cuda()``, ``param.type() == 'torch.cuda.FloatTensor'``).
Each patch below fixes one of them, as narrowly as possible:

* module-level references are redirected (a module's global ``torch`` is replaced by a
  :class:`CpuTorch` stand-in that maps ``"cuda"`` devices to the CPU and makes
  ``torch.cuda.current_device``/``synchronize`` CPU-safe) so the hot paths pay nothing;
* a ``TorchFunctionMode`` (:class:`CudaAsCpuMode`) is used only around calls that run once
  (model/optimizer construction) or that check tensor types (gradient clipping).

``apply_cpu_patches()`` is idempotent and does nothing when CUDA is available. Nothing here
copies Megatron code: patches wrap or re-point Megatron's own functions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from typing import Callable, Dict, Iterable, List

import torch

from .cpu_stand_ins import CpuTorch, redirect_torch, run_as_cpu
from .release_check import check_megatron_core_version

__all__ = [
    "apply_cpu_patches",
    "applied_cpu_patches",
    "CPU_PATCHES",
]


# --------------------------------------------------------------------------------------------
# The patches
# --------------------------------------------------------------------------------------------


def patch_p2p_communication():
    """p2p_communication.py: buffers on torch.cuda.current_device(); torch.cuda.synchronize()."""
    return redirect_torch("megatron.core.pipeline_parallel.p2p_communication")


def patch_schedules_token_count():
    """schedules.py: all three schedules allocate total_num_tokens with device="cuda"."""
    return redirect_torch("megatron.core.pipeline_parallel.schedules")


def patch_ddp_buffers():
    """param_and_grad_buffer.py: DDP grad/param buffers on torch.cuda.current_device()."""
    return redirect_torch("megatron.core.distributed.param_and_grad_buffer")


def patch_causal_mask():
    """transformer/utils.py: get_default_causal_mask (attention_mask=None) uses device="cuda"."""
    return redirect_torch("megatron.core.transformer.utils")


def patch_global_memory_buffer():
    """core/utils.py: GlobalMemoryBuffer (attention scores) on torch.cuda.current_device()."""
    return redirect_torch("megatron.core.utils")


def patch_rotary_embedding():
    """rotary_pos_embedding.py: RoPE moves inv_freq to torch.cuda.current_device() on first use."""
    return redirect_torch("megatron.core.models.common.embeddings.rotary_pos_embedding")


def patch_rng_tracker():
    """tensor_parallel/random.py: RNG tracker add/fork and recompute's RNG replay use CUDA RNG."""
    from megatron.core.tensor_parallel import random as mp_random

    if getattr(mp_random, "_paci_cpu_rng", False):
        return False
    base = mp_random.CudaRNGStatesTracker
    mp_random.CudaRNGStatesTracker = _make_cpu_rng_tracker(base)
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    # a tracker created before the patch holds (or would add) CUDA states: recreate it lazily
    if mp_random._CUDA_RNG_STATE_TRACKER is not None:
        mp_random._CUDA_RNG_STATE_TRACKER = None
        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mp_random._paci_cpu_rng = True
    return True


def _get_cpu_rng_state(device=None, clone=False, graph_safe=False):
    """CPU replacement for random._get_cuda_rng_state (already a copy)."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=None, graph_safe=False):
    """CPU replacement for random._set_cuda_rng_state."""
    torch.set_rng_state(new_state)


def _make_cpu_rng_tracker(base):
    """A subclass of Megatron's tracker whose named states are CPU generator states."""

    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker on the CPU default generator (the 'default-rng' state)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_name = self._current_state_name
            outer_state = torch.get_rng_state()
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def patch_tied_embeddings():
    """language_module.py: setup_embeddings_and_output_layer: weight.data.cuda() (tied, PP>1)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    fn = LanguageModule.setup_embeddings_and_output_layer
    if getattr(fn, "_paci_cpu_wrapped", False):
        return False
    LanguageModule.setup_embeddings_and_output_layer = run_as_cpu(fn)
    return True


def patch_optimizer_construction():
    """optimizer/*.py: optimizer __init__s use device="cuda", assert type() 'torch.cuda.*'."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    changed = False
    for cls in (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer):
        init = cls.__dict__["__init__"]
        if not getattr(init, "_paci_cpu_wrapped", False):
            cls.__init__ = run_as_cpu(init)  # runs once per optimizer: the mode costs nothing
            changed = True
    return changed


def patch_grad_norm_groups():
    """optimizer.py (megatron-core 0.19): ``has_grad_norm_group`` reduces a flag made with
    device='cuda' at an optimizer's first step (then caches it). Absent before 0.19."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    fn = MegatronOptimizer.__dict__.get("has_grad_norm_group")
    if fn is None or getattr(fn, "_paci_cpu_wrapped", False):
        return False
    MegatronOptimizer.has_grad_norm_group = run_as_cpu(fn)  # runs once per group
    return True


def patch_clip_grads():
    """clip_grads.py: buffers on device='cuda'; clip_grad_by_total_norm_fp32 asserts cuda type."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_opt

    changed = redirect_torch("megatron.core.optimizer.clip_grads")
    fn = clip_grads.clip_grad_by_total_norm_fp32
    if not getattr(fn, "_paci_cpu_wrapped", False):
        wrapped = run_as_cpu(fn)
        clip_grads.clip_grad_by_total_norm_fp32 = wrapped
        mcore_opt.clip_grad_by_total_norm_fp32 = wrapped
        changed = True
    return changed


def patch_dist_checkpointing():
    """dist_checkpointing torch_dist save: torch.cuda.synchronize() after the D2H copy, CUDA
    flags for the write-result exchange (filesystem_async.py, state_dict_saver.py,
    async_utils.py)."""
    changed = False
    for name in ("filesystem_async", "state_dict_saver", "async_utils"):
        changed |= redirect_torch(f"megatron.core.dist_checkpointing.strategies.{name}")
    return changed


def patch_grad_scaler():
    """optimizer/grad_scaler.py (fp16 loss scaling): the scale, its bounds and factors are
    tensors on device='cuda'; a loaded scale is moved with ``.cuda(current_device())``."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    changed = redirect_torch("megatron.core.optimizer.grad_scaler")
    load = DynamicGradScaler.__dict__["load_state_dict"]
    if not getattr(load, "_paci_cpu_wrapped", False):
        DynamicGradScaler.load_state_dict = run_as_cpu(load)  # once per checkpoint load
        changed = True
    return changed


class _FusedAdamOptim:
    """``torch.optim`` whose Adam and AdamW default to the fused kernel."""

    def __getattr__(self, name):
        return getattr(torch.optim, name)

    Adam = functools.partial(torch.optim.Adam, fused=True)
    AdamW = functools.partial(torch.optim.AdamW, fused=True)


class _FusedAdamTorch(CpuTorch):
    _paci_fused_adam = True

    def __init__(self):
        super().__init__()
        self.optim = _FusedAdamOptim()


def patch_fused_cpu_adam():
    """optimizer/__init__.py: without TE/Apex Megatron builds torch's Adam(W) with torch's
    default, on CPU the per-tensor loop, which allocates temporaries the size of each weight
    (the whole embedding at the first stage) inside every step. PACI steps while micro-batches
    are in flight, so they raised its peak above 1F1B's; the fused CPU kernel updates in place
    (and is several times faster). Not needed to run: a memory and speed fix."""
    module = importlib.import_module("megatron.core.optimizer")
    if getattr(module.torch, "_paci_fused_adam", False):
        return False
    module.torch = _FusedAdamTorch()
    return True


def patch_adam_step_on_load():
    """distrib_optimizer.py: without TE/Apex (always on CPU) torch's Adam keeps 'step' per
    parameter, Megatron-Core's checkpoint per group, and its load restores the group's step
    first. Then the parameter-state load copies every per-parameter key from the checkpoint's
    buckets: the fully reshardable format has no 'step' (KeyError), and the default one
    carries the step of the placeholder state the load template was built from (1), which
    resets Adam's bias correction; and the restored step is one tensor shared by every
    parameter, which fused Adam's in-place increment advances once per parameter. A resume
    differed from the uninterrupted run in the 4th digit. Keep the restored step, one copy
    per parameter."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    fn = DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"]
    if getattr(fn, "_paci_step_kept", False):
        return False

    @functools.wraps(fn)
    def keep_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state.get(self.optimizer.param_groups[group]["params"][order], {})
        if "step" in state:
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        return fn(self, model_param, tensors)

    keep_step._paci_step_kept = True
    DistributedOptimizer._set_main_param_and_optimizer_states = keep_step
    return True


def patch_low_precision_gemm():
    """Its own module, :mod:`patches.low_precision_gemm`; imported here when applied, since
    that module builds on this one's helpers."""
    from .low_precision_gemm import patch_low_precision_gemm as patch

    return patch()


# the MoE modules that ask torch.cuda for a device, a side stream or an event (and the
# tensor-parallel mappings the expert-parallel gathers and all-to-alls go through)
MOE_MODULES = tuple(f"megatron.core.transformer.moe.{name}" for name in (
    "router", "experts", "shared_experts", "token_dispatcher", "moe_utils", "moe_layer")) \
    + ("megatron.core.tensor_parallel.mappings",)


class _HostSplitsDistributed:
    """``torch.distributed`` for the MoE modules: gloo's ``all_to_all_single`` takes its split
    sizes as lists of ints only (the alltoall dispatcher hands it numpy arrays)."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        def as_list(sizes):
            return None if sizes is None else [int(size) for size in sizes]

        return torch.distributed.all_to_all_single(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), group=group,
            async_op=async_op)


class _MappingsTorch(CpuTorch):
    def __init__(self):
        super().__init__()
        self.distributed = _HostSplitsDistributed()


def patch_moe_cuda():
    """transformer/moe/*.py: the router's and experts' buffers on torch.cuda.current_device(),
    the shared experts' and the alltoall dispatcher's side streams and events, the expert-
    parallel gathers' outputs and the all-to-all's split sizes as lists for gloo
    (tensor_parallel/mappings.py); moe_utils names te_general_gemm only where Transformer
    Engine imported (0.16): None here, the torch path."""
    changed = False
    for module_name in MOE_MODULES:
        if importlib.util.find_spec(module_name) is not None:
            changed |= redirect_torch(module_name, _MappingsTorch)
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        changed = True
    return changed


def patch_mtp_cuda():
    """transformer/multi_token_prediction.py: the MTP loss tracker on
    torch.cuda.current_device()."""
    return redirect_torch("megatron.core.transformer.multi_token_prediction")


def _never_an_inference_linear(module) -> bool:
    return False


def patch_mtp_inference_linear():
    """Megatron-LM main (0.20): every MTP layer asks ``is_inference_column_parallel_linear``,
    an ``isinstance`` against classes built on Transformer Engine's. Without Transformer Engine
    those are MagicMock stand-ins, not types, so the check raises and no MTP model builds,
    stock 1F1B included. No module can be one of them then: the answer is False."""
    if importlib.util.find_spec("megatron.core.tensor_parallel.inference_layers") is None:
        return False
    layers = importlib.import_module("megatron.core.tensor_parallel.inference_layers")
    mtp = importlib.import_module("megatron.core.transformer.multi_token_prediction")
    if getattr(mtp, "is_inference_column_parallel_linear", None) is None \
            or isinstance(layers.InferenceColumnParallelLinear, type):
        return False
    mtp.is_inference_column_parallel_linear = _never_an_inference_linear
    return True


# Registry, in application order: name -> function. Each returns True if it changed something.
CPU_PATCHES: Dict[str, Callable[[], bool]] = {
    "p2p_communication": patch_p2p_communication,
    "schedules_token_count": patch_schedules_token_count,
    "ddp_buffers": patch_ddp_buffers,
    "causal_mask": patch_causal_mask,
    "global_memory_buffer": patch_global_memory_buffer,
    "rotary_embedding": patch_rotary_embedding,
    "rng_tracker": patch_rng_tracker,
    "tied_embeddings": patch_tied_embeddings,
    "optimizer_construction": patch_optimizer_construction,
    "clip_grads": patch_clip_grads,
    "grad_norm_groups": patch_grad_norm_groups,
    "grad_scaler": patch_grad_scaler,
    "dist_checkpointing": patch_dist_checkpointing,
    "fused_cpu_adam": patch_fused_cpu_adam,
    "adam_step_on_load": patch_adam_step_on_load,
    "low_precision_gemm": patch_low_precision_gemm,
    "moe_cuda": patch_moe_cuda,
    "mtp_cuda": patch_mtp_cuda,
    "mtp_inference_linear": patch_mtp_inference_linear,
}

_APPLIED: List[str] = []


def applied_cpu_patches() -> List[str]:
    """Names of the patches applied so far in this process."""
    return list(_APPLIED)


def apply_cpu_patches(exclude: Iterable[str] = ()) -> List[str]:
    """Patch Megatron-Core for CPU/gloo; idempotent; a no-op when CUDA is available.

    Returns the names of all CPU patches in effect (empty with CUDA). ``exclude`` leaves named
    patches out (for checking that each one is needed).
    """
    if torch.cuda.is_available():
        return []
    check_megatron_core_version()
    excluded = set(exclude)
    # debugging aid: PACI_SKIP_CPU_PATCHES=a,b leaves patches out (to show that each is needed)
    excluded |= {n for n in os.environ.get("PACI_SKIP_CPU_PATCHES", "").split(",") if n}
    unknown = excluded - set(CPU_PATCHES)
    if unknown:
        raise ValueError(f"unknown CPU patches {sorted(unknown)}; known: {list(CPU_PATCHES)}")
    for name, patch in CPU_PATCHES.items():
        if name in excluded or name in _APPLIED:
            continue
        patch()
        _APPLIED.append(name)
    return applied_cpu_patches()
