"""The norm PACI's local step clips by, with --num-distributed-optimizer-instances N (run under
torchrun on gloo, 4 ranks, tensor parallel 1).

    torchrun --standalone --nproc-per-node 4 tests/workers/grad_stats_cases.py --out DIR CASE...

Each case builds Megatron's parallel state with P stages and N distributed-optimizer
instances, binds a PACI runtime to a stand-in distributed optimizer (what ``bind`` reads of
it: its config) and takes the group ``bind`` handed it for its grad norm. Every rank then
holds its shard of its stage's gradient as the distributed optimizer lays it out: the stage's
gradient cut into as many shards as an instance has data-parallel ranks, the same shard on
the same position of every instance (Megatron all-reduces the gradient across instances).
Megatron's own ``get_grad_norm_fp32`` over that group must give the stage's gradient norm.
Writes DIR/CASE.rank<R>.json for tests/test_precision_options.py.
"""

import json
import os
import sys
import types

import torch
from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

from paci_megatron.mcore.distributed import init_distributed
from paci_megatron.mcore.runtime import PaciRuntime

from case_args import parse_case_args  # same folder: the script's own

CASES = {  # name: (pipeline stages, distributed-optimizer instances)
    "p1_n2": (1, 2),  # 4 data-parallel ranks, 2 an instance
    "p2_n2": (2, 2),  # 2 stages of 2 data-parallel ranks, 1 an instance
    "p2_n1": (2, 1),  # one instance: the stage's whole group, as before
}


def einops_if_missing() -> None:
    """Megatron makes the instances' expert groups with ``einops.rearrange`` (one pattern,
    ``create_hierarchical_groups``); without einops installed it refuses N > 1. The pattern,
    in numpy, so that Megatron's own ``initialize_model_parallel`` builds every group."""
    if parallel_state.HAVE_EINOPS:
        return
    import numpy as np

    def rearrange(ranks, pattern, l, s, u):
        assert pattern == "(l s u) -> (l u) s", pattern
        return np.asarray(ranks).reshape(l, s, u).transpose(0, 2, 1).reshape(l * u, s)

    parallel_state.einops = types.SimpleNamespace(rearrange=rearrange)
    parallel_state.HAVE_EINOPS = True


def stage_gradient(stage: int) -> torch.Tensor:
    """The stage's whole gradient, the same on every rank of the stage."""
    gen = torch.Generator().manual_seed(100 + stage)
    return torch.randn(24, generator=gen)


def run_case(name: str) -> dict:
    pp, instances = CASES[name]
    init_distributed(pp=pp, timeout_s=90)  # the process group; then the state asked for
    parallel_state.destroy_model_parallel()
    einops_if_missing()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, num_distributed_optimizer_instances=instances,
        distributed_timeout_minutes=1.5)
    optimizer = types.SimpleNamespace(config=types.SimpleNamespace(use_distributed_optimizer=True))
    runtime = PaciRuntime(accumulation=2)
    runtime.bind(optimizer)
    group = optimizer.grad_stats_parallel_group
    stage = parallel_state.get_pipeline_model_parallel_rank()
    shards = parallel_state.get_data_parallel_world_size(with_context_parallel=True,
                                                         partial_data_parallel=True)
    position = parallel_state.get_data_parallel_rank(with_context_parallel=True,
                                                      partial_data_parallel=True)
    whole = stage_gradient(stage)
    shard = whole.chunk(shards)[position].clone()
    norm = get_grad_norm_fp32([shard], grad_stats_parallel_group=group)
    stage_ranks = torch.distributed.get_process_group_ranks(
        parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    return dict(case=name, rank=torch.distributed.get_rank(), stage=stage, instances=instances,
                norm=float(norm), expected=float(whole.norm()),
                group=sorted(torch.distributed.get_process_group_ranks(group)),
                stage_ranks=sorted(stage_ranks))


def main() -> int:
    args = parse_case_args(CASES)
    for name in args.cases:
        row = run_case(name)
        with open(os.path.join(args.out, f"{name}.rank{row['rank']}.json"), "w") as f:
            json.dump(row, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
