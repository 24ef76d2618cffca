"""pretrain_gpt_paci.py with every host sync of the steady state counted.

    torchrun --standalone --nproc-per-node P tests/workers/count_host_syncs.py <training flags>

A sync is what makes a GPU run's host wait for the device: an operator that reads a scalar
back (``aten._local_scalar_dense``, ``aten.item``, ``aten.is_nonzero``: ``.item()``,
``float(t)``, ``bool(t)``), counted by a dispatch mode, and a copy of device memory to the
host (``Tensor.cpu``, ``Tensor.tolist``, ``Tensor.numpy``), counted where it is called, as on
CPU those copy nothing. Counting runs over the training steps of iterations 2 to the
second-to-last (the steady state: past the pipeline's warm-up, before the final drain).
Every rank prints ``RESULT {json}`` with its count per iteration and the first callers.
"""

import json
import os
import sys
import traceback

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SCALAR_READS = {"aten._local_scalar_dense.default", "aten.item.default",
                "aten.is_nonzero.default"}
COPIES = ("cpu", "tolist", "numpy")


class Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def note(self, what: str) -> None:
        stack = [f for f in traceback.extract_stack()[:-2] if "count_host_syncs" not in f.filename
                 and "/torch/" not in f.filename and "contextlib" not in f.filename]
        self.calls.append({"what": what, "caller": f"{stack[-1].filename}:{stack[-1].lineno}"
                           if stack else "?"})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SCALAR_READS:
            self.note(str(func))
        return func(*args, **(kwargs or {}))


def count_copies(syncs: Syncs, active):
    for name in COPIES:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if active[0]:
                syncs.note(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


def main(argv):
    from paci_megatron import training

    syncs, active, iterations = Syncs(), [False], [0]
    count_copies(syncs, active)
    original = training.train_step

    def train_step(job):
        counting = 2 <= job.iteration < job.args.train_iters - 1
        if not counting:
            return original(job)
        active[0] = True
        iterations[0] += 1
        with syncs:
            result = original(job)
        active[0] = False
        return result

    training.train_step = train_step
    original_finish = training.finish

    def finish(job):
        rank = int(os.environ.get("RANK", "0"))
        print("RESULT " + json.dumps({"rank": rank, "iterations": iterations[0],
                                      "per_iteration": len(syncs.calls) / max(1, iterations[0]),
                                      "calls": syncs.calls[:8]}), flush=True)
        return original_finish(job)

    training.finish = finish
    return training.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
