"""The CPU patch ``low_precision_gemm`` (registered in :mod:`patches.cpu_gloo`): on a CPU
without a native bf16/fp16 GEMM, Megatron's linear layers and core attention run their GEMMs
in fp32, rounded once, as a GPU's bf16 GEMM accumulates."""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .cpu_stand_ins import CpuTorch, redirect_torch, run_under

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def native_low_precision_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has oneDNN's native GEMM for ``dtype`` (AVX512-BF16/FP16, AMX)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


_UPCAST: set = set()  # the low-precision dtypes this CPU has no native GEMM for


def _low_precision_cpu(a, b) -> bool:
    return a.dtype == b.dtype and a.dtype in _UPCAST and a.device.type == "cpu"


class _Fp32GemmMode(TorchFunctionMode):
    """While active: a matmul of two bf16/fp16 CPU tensors runs in fp32 and rounds its result
    once to their dtype, as a GPU's bf16 GEMM does (fp32 accumulation). Only used inside
    Megatron's linear autograd function, a few calls each."""

    _MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._MATMULS and len(args) == 2 and not kwargs \
                and _low_precision_cpu(*args):
            return torch.matmul(args[0].float(), args[1].float()).to(args[0].dtype)
        return func(*args, **kwargs)


def _in_fp32_gemm_mode(fn: Callable) -> Callable:
    return run_under(_Fp32GemmMode, "_paci_fp32_gemm", fn)


class _Fp32Bmm(torch.autograd.Function):
    """alpha * (a @ b), batched, and its two gradients, each in fp32 rounded once."""

    @staticmethod
    def forward(ctx, a, b, alpha):
        ctx.save_for_backward(a, b)
        ctx.alpha = alpha
        return torch.bmm(a.float(), b.float()).mul_(alpha).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        g = grad.float().mul_(ctx.alpha)
        da = torch.bmm(g, b.float().transpose(1, 2)).to(a.dtype) \
            if ctx.needs_input_grad[0] else None
        db = torch.bmm(a.float().transpose(1, 2), g).to(b.dtype) \
            if ctx.needs_input_grad[1] else None
        return da, db, None


class _Fp32BmmTorch(CpuTorch):
    """``torch`` for dot_product_attention.py: its two batched GEMMs (scores with beta = 0,
    context) through :class:`_Fp32Bmm`, whose backward native autograd would otherwise run
    on the slow bf16 path."""

    @staticmethod
    def bmm(a, b, **kwargs):
        if kwargs or not _low_precision_cpu(a, b):
            return torch.bmm(a, b, **kwargs)
        return _Fp32Bmm.apply(a, b, 1.0)

    @staticmethod
    def baddbmm(input, a, b, *, beta=1.0, alpha=1.0, **kwargs):
        if kwargs or beta != 0 or not _low_precision_cpu(a, b):
            return torch.baddbmm(input, a, b, beta=beta, alpha=alpha, **kwargs)
        return _Fp32Bmm.apply(a, b, alpha)  # beta = 0: the buffer's contents are not read


def patch_low_precision_gemm():
    """tensor_parallel/layers.py, transformer/dot_product_attention.py: on a CPU without a
    native bf16/fp16 GEMM (AVX2 only) oneDNN falls back to a path 5-40x slower than fp32 (1
    GFLOP/s on this project's AMD machines), which made a bf16 model of 8 x 512 train 20x
    slower than on a CPU with AVX512. Every linear layer's GEMMs, forward and backward, go
    through one autograd function, and core attention's through two calls: there they run in
    fp32, rounded once to bf16/fp16, as a GPU's bf16 GEMM accumulates. A speed fix that
    changes the summation order only; nothing changes on a CPU with the native GEMM."""
    _UPCAST.update(d for d in _LOW_PRECISION if not native_low_precision_gemm(d))
    if not _UPCAST:
        return False
    from megatron.core.tensor_parallel import layers

    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    changed = redirect_torch("megatron.core.transformer.dot_product_attention", _Fp32BmmTorch)
    for name in ("forward", "backward"):
        impl = fn.__dict__[name].__func__  # the marker is on the function, not its staticmethod
        if not getattr(impl, "_paci_fp32_gemm", False):
            setattr(fn, name, staticmethod(_in_fp32_gemm_mode(impl)))
            changed = True
    return changed
