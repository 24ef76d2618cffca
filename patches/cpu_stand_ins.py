"""CPU stand-ins for CUDA, the tools every CPU patch is made of: a per-module ``torch``
stand-in (:class:`CpuTorch`, put in place by :func:`redirect_torch`) for the hot paths, and a
scoped ``TorchFunctionMode`` (:class:`CudaAsCpuMode`, through :func:`run_as_cpu`) for calls
that run once. Nothing here patches Megatron by itself."""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode



def is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return factory


class CpuStream:
    """A CUDA stream on CPU: work is already ordered, there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else CpuEvent()

    def synchronize(self):
        return None

    def query(self):
        return True


class CpuEvent:
    """A CUDA event on CPU: recorded work is already done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


class CpuCuda:
    """Stands in for ``torch.cuda`` inside one module: CPU-safe current_device/synchronize,
    and a no-op current stream (megatron-core 0.19's grad buffers wait on it for CUDA-graph
    events before each reduction)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def current_stream(device=None):
        return CpuStream()

    Stream = CpuStream  # the MoE modules' side streams (shared experts, the D2H copies)
    Event = CpuEvent

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()


class CpuTorch(types.ModuleType):
    """Stands in for the ``torch`` module inside one Megatron module (see ``redirect_torch``).

    A module object (not a plain instance) so that torch.compile'd functions of that module
    still trace it like ``torch`` itself."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor")

    _paci_cpu_torch = True  # marker (checked by name: this file may be loaded twice)

    def __init__(self):
        super().__init__("torch")
        self.cuda = CpuCuda()
        for name in self._FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups are plain attribute hits
        return value


def redirect_torch(module_name: str, factory: Callable[[], "CpuTorch"] = None) -> bool:
    """Point ``module_name``'s global ``torch`` at a :class:`CpuTorch` (or what ``factory``
    makes, a subclass); False if already done."""
    module = importlib.import_module(module_name)
    if getattr(module.torch, "_paci_cpu_torch", False):
        return False
    module.torch = (factory or CpuTorch)()
    return True


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class CudaAsCpuMode(TorchFunctionMode):
    """While active: ``device='cuda'`` means CPU, ``Tensor.cuda()`` is a no-op and
    ``Tensor.type()`` reports the CUDA type name. Only used around rarely-called functions."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None and args[0].device.type == "cpu":
                return name
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def run_under(mode: type, marker: str, fn: Callable) -> Callable:
    """Wrap ``fn`` so that it runs under the TorchFunctionMode ``mode``; ``marker``, set on the
    wrapper, keeps a second patch from wrapping it twice."""
    if getattr(fn, marker, False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with mode():
            return fn(*args, **kwargs)

    setattr(wrapper, marker, True)
    return wrapper


def run_as_cpu(fn: Callable) -> Callable:
    """Wrap ``fn`` so that it runs under :class:`CudaAsCpuMode`."""
    return run_under(CudaAsCpuMode, "_paci_cpu_wrapped", fn)
