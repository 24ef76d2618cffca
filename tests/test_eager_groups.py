"""Communicators made at set-up on NCCL: ``pretrain_gpt_paci.py`` binds the device at
``init_process_group`` (``device_id``), and PACI makes no process group of its own, since with
the device bound every ``new_group`` is a split all ranks must join (issue 30). CPU only:
the CUDA side is seen through what is passed to torch."""

import importlib
import os
import socket

import pytest
import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from paci_megatron.mcore import admission, distributed


@pytest.mark.parametrize("backend,cuda,expected", [
    ("nccl", True, torch.device("cuda", 3)), ("gloo", True, None), ("gloo", False, None)])
def test_the_device_is_bound_on_nccl_only(backend, cuda, expected):
    assert distributed.bound_device(backend, cuda, local_rank=3) == expected


class _Stop(Exception):
    pass


def test_init_distributed_binds_the_local_rank_device_on_nccl(monkeypatch):
    seen = {}

    def init_process_group(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("set", device))
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(_Stop):
        distributed.init_distributed(pp=2)
    assert seen["backend"] == "nccl" and seen["set"] == 1
    assert seen["device_id"] == torch.device("cuda", 1)


def test_the_tied_stages_embedding_group_makes_no_communicator(monkeypatch):
    """stage_local_groups runs on stage 0 and the last stage only: a new_group there would
    hang the other ranks' split. Megatron's finalize_model_grads takes its stand-in and skips
    the tied all-reduce without asking for its ranks (which a two-rank group would)."""
    def no_group(*args, **kwargs):
        raise AssertionError("PACI made a process group of its own")

    monkeypatch.setattr(torch.distributed, "new_group", no_group)
    pg = ProcessGroupCollection()
    for name in ("tp", "pp", "cp", "pos_embd", "dp_cp", "tp_dp_cp", "embd"):
        setattr(pg, name, object())
    out = admission.stage_local_groups(pg)
    assert out.embd.size() == 1 and out.tp is pg.tp and out.dp_cp is pg.dp_cp

    def ranks(group):
        raise AssertionError("the all-reduce was not skipped")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", ranks)
    # the module, not the function megatron.core.distributed exports under its name
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    finalize._allreduce_embedding_grad([], out.embd, None, weight_getter=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_second_set_up_shuts_the_first_ones_groups_down(monkeypatch):
    """The tests' case workers set up one config after another in one process. Each set-up
    shuts the last one's groups down: Megatron's destroy_model_parallel only drops them, and
    gloo keeps a group's threads until it is shut down (forty set-ups held some 1,600 threads
    a rank, and a 4-rank launch ran out of time)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)
    live = torch.distributed.distributed_c10d._world.pg_map
    try:
        distributed.init_distributed(seed=1, timeout_s=60)
        groups, threads = len(live), _threads()
        assert groups > 1  # Megatron's own groups beside the default one
        for _ in range(3):
            distributed.init_distributed(seed=1, timeout_s=60)
        assert len(live) == groups
        assert _threads() <= threads
    finally:
        distributed.destroy_distributed()
