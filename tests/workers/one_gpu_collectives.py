"""Collectives and p2p through tests/one_gpu.py's host staging, on CPU, two ranks (torchrun).

Megatron's bucket reductions pass a shard view of the output as the input (reduce-scatter of
gradients, all-gather of parameters): the staged result must still be the collective's. Prints
one line ``RESULT {json}`` per rank.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import one_gpu  # noqa: E402  (the harness under test, from tests/)

staging = one_gpu.HostStaging(stage_cpu=True)
staging.install()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

grads = torch.arange(8, dtype=torch.float32) + 10 * rank
dist.reduce_scatter_tensor(grads.view(world, -1)[rank], grads)
params = torch.full((8,), -1.0)
params.view(world, -1)[rank] = float(rank + 1)
work = dist.all_gather_into_tensor(params, params.view(world, -1)[rank], async_op=True)
work.wait()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
peer = 1 - rank
sent = torch.tensor([100.0 + rank])
received = torch.zeros(1)
reqs = [dist.isend(tensor=sent, dst=peer), dist.irecv(tensor=received, src=peer)]
for req in reqs:
    req.wait()
# one write per line: the two ranks share the pipe, and print() writes the newline apart
sys.stdout.write("RESULT " + json.dumps(dict(
    rank=rank, grads=grads.tolist(), params=params.tolist(), total=total.item(),
    received=received.item(), counts=dict(staging.counts))) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
