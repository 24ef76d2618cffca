"""Time one pipeline stage's actions on the real model (``mcore/costs.py``), for the compare
tool's projection.

    torchrun --nproc-per-node 1 -m paci_megatron.tools.costs <pretrain_gpt_paci.py flags>

Prints ``PACI_COSTS {"forward_ms": ..., "backward_ms": ..., "step_ms": ..., "predict_ms": ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch


def main(argv: Optional[Sequence[str]] = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--cost-repeats", type=int, default=8)
    own.add_argument("--cost-warmup", type=int, default=2)
    mine, rest = own.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if mine.cost_repeats < 1 or mine.cost_warmup < 0:
        own.error("--cost-repeats must be >= 1 and --cost-warmup >= 0")
    from .. import training
    from ..arguments import parse_and_validate
    from ..mcore import build
    from ..mcore.costs import time_stage_actions

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
