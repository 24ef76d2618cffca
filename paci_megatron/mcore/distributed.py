"""Process groups for a run on Megatron-Core: torch.distributed and Megatron's parallel state,
Megatron-LM's seeding per pipeline rank, this rank's place in the grid, and peak memory."""

from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Dict, Optional

import torch

try:  # installed layout: the repo-root folder patches/ is the package paci_megatron.patches
    from paci_megatron.patches import apply_cpu_patches
except ImportError:  # source checkout with PYTHONPATH=<repo root>
    from patches import apply_cpu_patches

from megatron.core import parallel_state, tensor_parallel

from .admission import forget_instance_groups


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    backend: Optional[str] = None,
    timeout_s: float = 120,
    seed: int = 1234,
    ep: int = 1,
) -> Dict[str, int]:
    """Initialise torch.distributed from the torchrun environment and Megatron's parallel state.

    Without CUDA, ``apply_cpu_patches()`` runs before the parallel state is built. Seeds follow
    Megatron-LM (``seed + 100 * pp_rank`` for python/torch and the model-parallel RNG tracker).
    ``ep``: --expert-model-parallel-size, the experts of an MoE layer split over that many
    data-parallel ranks of one stage. Returns :func:`stage_info`.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if vpp is not None and vpp <= 1:
        vpp = None
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise ValueError(
            f"WORLD_SIZE={world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp})"
        )
    if vpp is not None and pp < 2:
        raise ValueError("--virtual-pipeline-model-parallel-size needs "
                         "--pipeline-model-parallel-size >= 2")

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        backend = backend or ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            store=_restart_safe_store(world_size, timedelta(seconds=timeout_s)),
            device_id=bound_device(backend, cuda, local_rank),
        )
    if not cuda:
        apply_cpu_patches()

    if parallel_state.model_parallel_is_initialized():
        release_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=timeout_s / 60.0,  # timedelta(minutes=...) takes floats
    )
    set_random_seed(seed)
    return stage_info()


def bound_device(backend: str, cuda: bool, local_rank: int) -> Optional[torch.device]:
    """The device NCCL's communicators are bound to at ``init_process_group``: each is then
    made when its group is (Megatron's set-up, in one order on every rank), never by a first
    use in the middle of PACI's stream. None on gloo (the CPU). Megatron-LM's own
    ``_initialize_distributed`` binds none, so the drop-in entry point runs lazily made
    communicators; the start-up exchange makes and connects them there."""
    return torch.device("cuda", local_rank) if cuda and backend == "nccl" else None


def _restart_safe_store(world_size: int, timeout: timedelta):
    """The store for ``init_process_group`` under torchrun: None (torch's own) unless the
    workers share the agent's store, as torchrun's c10d rendezvous makes them do by default.

    That store outlives the workers, so after a restart (``--max-restarts``) the new workers
    would read the keys the dead ones wrote (gloo's peer addresses, NCCL's unique id) and fail
    to connect ("Gloo connectFullMesh failed ... Connection refused"; pytorch issue 135712).
    Every restart gets keys of its own here, under TORCHELASTIC_RESTART_COUNT, which all
    workers share when one agent runs them (one node). Across nodes the agents count restarts
    apart, so a multi-node job that restarts should set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    for torchrun (each restart then gets a fresh store, and this returns None)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
        world_size=world_size, is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch.distributed.PrefixStore(f"paci_restart_{attempt}/", store)


def set_random_seed(seed: int) -> None:
    """Seed python/torch like Megatron-LM: different per pipeline stage, same across DP."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def release_model_parallel() -> None:
    """Megatron's parallel state dropped and every group made since the default one shut down
    (a process that sets up one config after another: the tests' case workers). Megatron's
    ``destroy_model_parallel`` only drops its references, and a gloo group keeps its threads
    until it is shut down: forty set-ups in one process held some 1,600 threads a rank."""
    parallel_state.destroy_model_parallel()
    forget_instance_groups()
    world = torch.distributed.GroupMember.WORLD
    for group in list(torch.distributed.distributed_c10d._world.pg_map):
        if group is not world:
            torch.distributed.destroy_process_group(group)


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def stage_info() -> Dict[str, int]:
    """This rank's place in the (TP, PP, DP) grid."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    return dict(
        rank=torch.distributed.get_rank(),
        pp_rank=pp_rank,
        pp_size=pp_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        is_first=pp_rank == 0,
        is_last=pp_rank == pp_size - 1,
    )


def peak_rss_mb() -> float:
    """Peak resident memory of this process (host memory, on any machine)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def peak_device_memory_mb() -> Optional[float]:
    """The CUDA allocator's peak of allocated memory (every tensor of the stage); None without
    CUDA (there ``memory.LiveTensorMeter`` counts the same, with --measure-memory)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return None


def _is_gloo() -> bool:
    return (
        torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    )
