"""Test harness: several pipeline stages in several processes on one GPU.

    torchrun --nproc-per-node P tests/one_gpu.py pretrain_gpt_paci.py --distributed-backend gloo ...

NCCL refuses two ranks on one device, and gloo cannot read or write CUDA memory. So every rank
runs on cuda:0 (LOCAL_RANK is forced to 0), the backend is gloo, and each point-to-point
message or collective on a CUDA tensor goes through a host copy: ``isend`` sends a CPU copy,
``irecv`` receives into a CPU buffer and copies it into the CUDA tensor when waited for, and a
collective runs on CPU copies that are then copied back. DDP's coalescing manager (gloo has no
coalesced CUDA all-reduce) becomes a plain context whose reductions have already run.

The product never imports this: it is how the CUDA tests (``tests/test_cuda.py``) put P=2 and
P=4 on the one GPU a test machine may have. It patches ``torch.distributed`` before the script
imports Megatron (Megatron binds some of these functions at import time).

Environment:
  ONE_GPU_STAGE_CPU=1   stage CPU tensors too, so the plumbing runs (and is tested) without a GPU
  ONE_GPU_STATS=DIR     at exit, write this rank's counts of staged operations to DIR/rank<R>.json
"""

import atexit
import contextlib
import json
import os
import runpy
import sys
from collections import Counter
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base")


class _SendViaHost:
    """The send of a host copy; the copy lives as long as the work (gloo reads it late)."""

    def __init__(self, work, host: torch.Tensor):
        self.work, self.host = work, host

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _RecvViaHost:
    """A receive into a host buffer, copied into the real tensor on the first wait()."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target = work, host, target

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        if self.target is not None:
            with torch.no_grad():
                self.target.copy_(self.host)
            self.target = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _Finished:
    """What an async collective returns here: it already ran synchronously."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self) -> bool:
        return True


def _tensor_slot(args: tuple, kwargs: dict) -> Tuple[Any, Callable]:
    """The p2p call's tensor (positional or ``tensor=``) and a function that swaps it."""
    if "tensor" in kwargs:
        return kwargs["tensor"], lambda t: (args, {**kwargs, "tensor": t})
    return args[0], lambda t: ((t,) + tuple(args[1:]), kwargs)


class HostStaging:
    """Replacements for torch.distributed's p2p and collectives that stage through host
    memory every tensor ``wanted`` says (CUDA ones; CPU ones too with ``stage_cpu``)."""

    def __init__(self, stage_cpu: bool = False):
        self.stage_cpu = stage_cpu
        self.counts: Counter = Counter()
        self.original: Dict[str, Callable] = {}

    def wanted(self, value: Any) -> bool:
        return torch.is_tensor(value) and (value.is_cuda or self.stage_cpu)

    def isend(self, *args, **kwargs):
        tensor, swap = _tensor_slot(args, kwargs)
        if not self.wanted(tensor):
            return self.original["isend"](*args, **kwargs)
        host = tensor.detach().to("cpu", copy=True)  # the sender may free its tensor early
        self.counts["isend"] += 1
        call_args, call_kwargs = swap(host)
        return _SendViaHost(self.original["isend"](*call_args, **call_kwargs), host)

    def irecv(self, *args, **kwargs):
        tensor, swap = _tensor_slot(args, kwargs)
        if not self.wanted(tensor):
            return self.original["irecv"](*args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        self.counts["irecv"] += 1
        call_args, call_kwargs = swap(host)
        return _RecvViaHost(self.original["irecv"](*call_args, **call_kwargs), host, tensor)

    def collective(self, name: str) -> Callable:
        original = self.original[name]

        def staged(*args, **kwargs):
            pairs = []  # (real tensor, host copy), copied back after the collective

            def to_host(value):
                if self.wanted(value):
                    host = value.detach().to("cpu", copy=True)
                    pairs.append((value, host))
                    return host
                if isinstance(value, list) and value and all(map(self.wanted, value)):
                    return [to_host(v) for v in value]
                return value

            call_args = tuple(to_host(a) for a in args)
            call_kwargs = {k: to_host(v) for k, v in kwargs.items()}
            if not pairs:
                return original(*args, **kwargs)
            asynchronous = call_kwargs.pop("async_op", False)
            work = original(*call_args, **call_kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()  # async_op passed positionally
            with torch.no_grad():
                # outputs come before inputs in these signatures, and Megatron's input may be
                # a view of its output (a shard of the bucket): copying back in reverse order
                # lets the output's values land last
                for real, host in reversed(pairs):
                    real.copy_(host)
            self.counts[name] += 1
            return _Finished() if asynchronous else None

        return staged

    @staticmethod
    @contextlib.contextmanager
    def uncoalesced(*args, **kwargs):
        """DDP's grad-bucket reductions run one by one (each already staged and finished)."""
        manager = _Finished()
        manager.works = []
        yield manager

    def install(self) -> None:
        for name in ("isend", "irecv") + COLLECTIVES:
            if hasattr(c10d, name):
                self.original[name] = getattr(c10d, name)
        replacements = {"isend": self.isend, "irecv": self.irecv,
                        "_coalescing_manager": self.uncoalesced}
        replacements.update({name: self.collective(name) for name in COLLECTIVES
                             if name in self.original})
        for module in (dist, c10d):
            for name, func in replacements.items():
                setattr(module, name, func)


def write_stats(staging: HostStaging, folder: str) -> None:
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(dict(staging.counts), f)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: torchrun --nproc-per-node P tests/one_gpu.py SCRIPT [ARGS...]")
    os.environ["LOCAL_RANK"] = "0"  # every rank on cuda:0
    staging = HostStaging(stage_cpu=os.environ.get("ONE_GPU_STAGE_CPU") == "1")
    staging.install()
    if os.environ.get("ONE_GPU_STATS"):
        atexit.register(write_stats, staging, os.environ["ONE_GPU_STATS"])
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
