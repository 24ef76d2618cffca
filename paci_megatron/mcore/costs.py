"""Time one pipeline stage's actions on the real model, for the compare tool's projection
(its command line is ``tools/costs.py``).

Run with the flags of a one-stage model holding one stage's layers (``compare`` passes
``--num-layers L/P --pipeline-model-parallel-size 1``): it builds the model, optimizer and
data exactly as training does, then times ``--cost-repeats`` forwards and backwards of one
micro-batch (Megatron's ``forward_step`` / ``backward_step``), as many local steps (gradient
finalisation, ``optimizer.step()``, zeroing) and, where the weights have fp32 main copies, as
many moves to the predicted weights and back (``--paci-weight-prediction``'s extra work on a
stale forward), after ``--cost-warmup`` untimed rounds (reading a batch is not timed), and
prints ``PACI_COSTS {"forward_ms": ..., "backward_ms": ..., "step_ms": ..., "predict_ms":
...}`` with the medians (wall time on an accelerator; on CPU the process's CPU time with one
thread; ``predict_ms`` 0 without main copies: such a run cannot predict).
The stage holds the embedding and the output layer too, so it is the slowest stage's cost
(or above it), which sets a pipeline's pace.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config, get_model_type

from ..features.moves import predict_ahead
from ..flag import ConfigError
from . import compat, main_params


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
    times: Dict[str, List[float]] = {"forward_ms": [], "backward_ms": [], "step_ms": [],
                                     "predict_ms": []}
    try:
        layout = main_params.StageLayout(model, job.optimizer)
    except ConfigError:  # no fp32 main copies: such a run cannot predict
        layout = None

    def predict():  # one step ahead with the gradient folded in, as on a stale forward
        predict_ahead(layout, 1, 1.0, lambda group, n: n * group["lr"],
                      main_params.loss_scale_tensor(job.optimizer))
        layout.stage_pass.restore()

    for i in range(warmup + repeats):
        model.zero_grad_buffer()
        job.optimizer.zero_grad()
        batch = iter([next(job.train_data)])  # read outside the clock: time the model only
        fwd, (output, _) = _timed(lambda: mcore_schedules.forward_step(
            job.forward_step, batch, model, 1, None, [], config,
            cp_group_size=parallel_state.get_context_parallel_world_size(),
            is_first_microbatch=True, current_microbatch=0, is_last_stage=True))
        bwd, _ = _timed(lambda: compat.backward_step(None, output, None, model_type, config))

        def step():
            finalize_model_grads([model], None)
            job.optimizer.step()
            model.zero_grad_buffer()
            job.optimizer.zero_grad()

        prd, _ = _timed(predict) if layout else (0.0, None)  # exact restore: the step is as before
        stp, _ = _timed(step)
        if i >= warmup:
            for key, seconds in zip(times, (fwd, bwd, stp, prd)):
                times[key].append(seconds * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}
