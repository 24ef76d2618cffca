"""Memory meters: the activations autograd keeps (``SavedTensorMeter``) and every live tensor
of a stage (``LiveTensorMeter``).

Activation memory, counted where autograd keeps it: the tensors saved for backward.

A saved-tensor hook adds each saved tensor's storage (once, however many views of it are
saved) and subtracts it when the last graph holding it is freed, so the peak is the
activation memory a schedule keeps alive, independent of allocator caching and of the host.
Weights are not counted: they are saved by reference to the parameters.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Callable, Dict, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Held:
    """What the pack hook hands autograd instead of the tensor; freed with the graph."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.params = list(params)
        self.param_storages: set = set()
        self.find_param_storages()
        self.refs: Dict[int, int] = {}  # storage pointer -> saved tensors holding it
        self.live = 0
        self.peak = 0

    def find_param_storages(self) -> None:
        """Where the weights live now: weight prediction moves them into one flat buffer
        after the meter is made, and a stale set would count them as activations."""
        self.param_storages = {p.untyped_storage().data_ptr() for p in self.params}

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
            self.find_param_storages()
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return forward_step_func(*args, **kwargs)

        return forward_step


class LiveTensorMeter:
    """Peak bytes of every live tensor storage of the process: parameters, gradients,
    optimizer state and temporaries, activations, communication buffers.

    A dispatch mode sees every tensor an operator returns (forward, backward, optimizer), and a
    weak reference to its storage says when the storage is freed, so ``live`` is the sum over
    storages that exist now, each counted once however many views share it (a storage freed
    between two operators leaves ``live`` at the next one, before the peak is taken). Tensors that
    existed before ``start()`` are found by a scan of the garbage collector's objects. It
    counts bytes in use, not what an allocator caches; it costs a Python call per operator, so
    it is for measurement runs (``--measure-memory``).
    """

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.window_peak = 0  # the peak inside windows (``window_start`` ... ``window_stop``)
        self._in_window = False
        self._tracked: Dict[int, tuple] = {}
        self._mode = None

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self._tracked.get(key)
        if entry is not None and not entry[0].expired():
            return
        if entry is not None:
            self.live -= entry[1]
        self._tracked[key] = (StorageWeakRef(storage), storage.nbytes())
        self.live += storage.nbytes()

    def sweep(self) -> None:
        """Forget freed storages."""
        dead = [key for key, (ref, _) in self._tracked.items() if ref.expired()]
        for key in dead:
            self.live -= self._tracked.pop(key)[1]

    def note_peak(self) -> None:
        self.peak = max(self.peak, self.live)
        if self._in_window:
            self.window_peak = max(self.window_peak, self.live)

    def window_start(self) -> None:
        """From here to ``window_stop`` the peak is also counted in ``window_peak`` (the
        weight prediction marks its predicted forwards, move and restore included)."""
        self._in_window = True
        self.note_peak()

    def window_stop(self) -> None:
        self.sweep()
        self.note_peak()
        self._in_window = False

    def start(self) -> "LiveTensorMeter":
        with warnings.catch_warnings():  # isinstance() wakes deprecated module attributes
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for tensor in tensors:
            if tensor.device.type != "meta" and tensor.layout == torch.strided:
                self.track(tensor)
        self.note_peak()
        self._mode = _MeterMode(self)
        self._mode.__enter__()
        return self

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


class _MeterMode(TorchDispatchMode):
    def __init__(self, meter: LiveTensorMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        meter = self.meter
        meter.sweep()
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                meter.track(leaf)
        meter.note_peak()
        return out
