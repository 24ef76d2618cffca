"""Activation memory, counted where autograd keeps it: the tensors saved for backward.

A saved-tensor hook adds each saved tensor's storage (once, however many views of it are
saved) and subtracts it when the last graph holding it is freed, so the peak is the
activation memory a schedule keeps alive, independent of allocator caching and of the host.
Weights are not counted: they are saved by reference to the parameters.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable

import torch


class _Held:
    """What the pack hook hands autograd instead of the tensor; freed with the graph."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.refs: Dict[int, int] = {}  # storage pointer -> saved tensors holding it
        self.live = 0
        self.peak = 0

    def _release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.live -= nbytes

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.param_storages or storage.nbytes() == 0:
            return tensor
        if ptr not in self.refs:
            self.refs[ptr] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, ptr, storage.nbytes())
        return held

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def wrap(self, forward_step_func: Callable) -> Callable:
        """A Megatron forward_step_func whose model forward is metered."""

        def forward_step(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return forward_step_func(*args, **kwargs)

        return forward_step
