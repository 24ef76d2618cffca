"""Time one pipeline stage's actions on the real model, for the compare tool's projection.

    torchrun --nproc-per-node 1 -m paci_megatron.mcore.costs <pretrain_gpt_paci.py flags>

Run with the flags of a one-stage model holding one stage's layers (``compare`` passes
``--num-layers L/P --pipeline-model-parallel-size 1``): it builds the model, optimizer and
data exactly as training does, then times ``--cost-repeats`` forwards and backwards of one
micro-batch (Megatron's ``forward_step`` / ``backward_step``) and as many local steps (gradient
finalisation, ``optimizer.step()``, zeroing), after ``--cost-warmup`` untimed rounds (reading a batch is not timed), and prints
``PACI_COSTS {"forward_ms": ..., "backward_ms": ..., "step_ms": ...}`` with the medians
(wall time on an accelerator; on CPU the process's CPU time with one thread).
The stage holds the embedding and the output layer too, so it is the slowest stage's cost
(or above it), which sets a pipeline's pace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config, get_model_type


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # time the kernels, not their launch


def _clock() -> float:
    """Wall time on an accelerator; on CPU this process's CPU time, which other jobs sharing
    the cores do not inflate (with one thread, the time on a core of its own)."""
    return time.perf_counter() if torch.cuda.is_available() else time.process_time()


def _timed(fn):
    _sync()
    start = _clock()
    out = fn()
    _sync()
    return _clock() - start, out


def time_stage_actions(job, repeats: int, warmup: int) -> Dict[str, float]:
    """Median milliseconds of one forward, one backward (one micro-batch each) and one local
    step of ``job``'s single-stage model."""
    model = job.model[0]
    config = get_model_config(model)
    model_type = get_model_type(model)
    times: Dict[str, List[float]] = {"forward_ms": [], "backward_ms": [], "step_ms": []}
    for i in range(warmup + repeats):
        model.zero_grad_buffer()
        job.optimizer.zero_grad()
        batch = iter([next(job.train_data)])  # read outside the clock: time the model only
        fwd, (output, _) = _timed(lambda: mcore_schedules.forward_step(
            job.forward_step, batch, model, 1, None, [], config,
            cp_group_size=parallel_state.get_context_parallel_world_size(),
            is_first_microbatch=True, current_microbatch=0, is_last_stage=True))
        bwd, _ = _timed(lambda: mcore_schedules.backward_step(None, output, None, model_type,
                                                              config))

        def step():
            finalize_model_grads([model], None)
            job.optimizer.step()
            model.zero_grad_buffer()
            job.optimizer.zero_grad()

        stp, _ = _timed(step)
        if i >= warmup:
            for key, seconds in zip(times, (fwd, bwd, stp)):
                times[key].append(seconds * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--cost-repeats", type=int, default=8)
    own.add_argument("--cost-warmup", type=int, default=2)
    mine, rest = own.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if mine.cost_repeats < 1 or mine.cost_warmup < 0:
        own.error("--cost-repeats must be >= 1 and --cost-warmup >= 0")
    from ..arguments import parse_and_validate
    from .. import training
    from . import build

    args, opts = parse_and_validate(rest)
    if args.pipeline_model_parallel_size != 1 or args.pipeline_schedule != "1f1b":
        own.error("time one stage as a one-stage model: --pipeline-model-parallel-size 1 "
                  "--pipeline-schedule 1f1b")
    if not torch.cuda.is_available():
        # one thread: its CPU time is one core's work (idle OpenMP threads spinning on a busy
        # machine would be counted as work)
        torch.set_num_threads(1)
    job = training.setup(args, opts)
    costs = time_stage_actions(job, mine.cost_repeats, mine.cost_warmup)
    costs.update(repeats=mine.cost_repeats, layers=args.num_layers)
    if torch.distributed.get_rank() == 0:
        print("PACI_COSTS " + json.dumps(costs), flush=True)
    build.destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
