"""Checkpoints with Megatron-Core distributed checkpointing (torch_dist format).

A checkpoint holds the model, the optimizer, the LR scheduler, every rank's RNG states and the
data position. It is written to ``iter_XXXXXXX.tmp`` and renamed when every rank has finished,
then ``latest_checkpointed_iteration.txt`` is replaced atomically, so a job killed while saving
leaves the previous checkpoint loadable. PACI drains before saving (a checkpoint cannot hold
activations), so a resumed run continues exactly as one that drained at that iteration.

Megatron-LM's own checkpoints (``pretrain_gpt.py --save``, the same torch_dist format) load
too: model, optimizer, LR scheduler, iteration and consumed samples map; Megatron-LM's RNG
states and its fp16 loss scaler (kept in its own layout) do not, and the load says so.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from typing import Dict, List, Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from ..restart import exit_with_parent, layout_changed, layout_of

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "paci_complete"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names --load."""


def _rng_state() -> Dict:
    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: Dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(data) -> ShardedObject:
    pp, tp = (parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_tensor_model_parallel_world_size())
    dp = parallel_state.get_data_parallel_world_size()
    return ShardedObject(
        "rng_state", data, (pp, tp, dp),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank(),
         parallel_state.get_data_parallel_rank()), replica_id=0)


def _unwrap_ddp(chunk):
    """DDP's own state dicts carry a "module." prefix; the model's keys are what we store."""
    return getattr(chunk, "module", chunk)


def _model_keys(model: List[torch.nn.Module]) -> List[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _model_sharded(model: List[torch.nn.Module]) -> Dict:
    # the data-parallel group in the metadata, as Megatron-LM's checkpointing passes it: the
    # MTP stage's tie of its embedding copy to stage 0's key reads it (None would fail there)
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    return {key: _unwrap_ddp(chunk).sharded_state_dict(metadata=metadata)
            for key, chunk in zip(_model_keys(model), model)}


def optimizer_format(optimizer, fully_reshardable: bool = False) -> Optional[Dict]:
    """How the distributed optimizer's state is written (Megatron-LM's content metadata): its
    default, per data-parallel group shards, reshards over DP only; the fully reshardable one
    (per parameter, gathered on DP rank 0 over gloo, as Megatron-LM's memory-efficient
    variant) over P and TP too. None for other optimizers."""
    if not getattr(optimizer.config, "use_distributed_optimizer", False):
        return None
    if fully_reshardable:
        return {"distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": True}
    return {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state(model, optimizer, is_loading: bool, metadata: Optional[Dict],
                   lr_scheduler=None) -> Dict:
    state = _model_sharded(model)
    merged = {}
    for part in state.values():
        merged.update(part)
    state["optimizer"] = optimizer.sharded_state_dict(merged, is_loading=is_loading,
                                                      metadata=metadata)
    state["rng_state"] = _rng_sharded(None if is_loading else _rng_state())
    if _grad_scalers(optimizer):
        state["grad_scaler"] = _scaler_sharded(
            None if is_loading else _scaler_states(optimizer, lr_scheduler))
    return state


def _grad_scalers(optimizer) -> list:
    """fp16's loss scalers (one per sub-optimizer), those with a state (dynamic ones)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    scalers = [getattr(opt, "grad_scaler", None) for opt in subs]
    return [sc for sc in scalers if sc is not None and sc.state_dict()]


def _scaler_states(optimizer, lr_scheduler) -> list:
    """Per sub-optimizer: its scaler, its Adam step count and the stage's LR scheduler (all in
    Megatron's common state; under PACI a stage that skipped other steps than global rank 0
    has other values: a skipped step advances neither the count nor the LR)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [dict(scale=float(sc.scale), growth=sc._growth_tracker,
                 hysteresis=sc._hysteresis_tracker, step=_adam_step(opt),
                 lr_scheduler=lr_scheduler.state_dict())
            for opt, sc in zip(subs, (getattr(o, "grad_scaler", None) for o in subs))
            if sc is not None and sc.state_dict()]


def _adam_step(opt) -> Optional[float]:
    for state in getattr(getattr(opt, "optimizer", None), "state", {}).values():
        if "step" in state:
            return float(state["step"])
    return None


def _scaler_sharded(data) -> ShardedObject:
    """Megatron keeps the scaler in the optimizer's common state, written by global rank 0
    only: under PACI every stage has its own scale, so each stage's is stored apart."""
    dp = parallel_state.get_data_parallel_world_size()
    replica = parallel_state.get_tensor_model_parallel_rank() * dp \
        + parallel_state.get_data_parallel_rank()  # the stage's ranks share one scaler
    return ShardedObject("grad_scaler", data, (parallel_state.get_pipeline_model_parallel_world_size(),),
                         (parallel_state.get_pipeline_model_parallel_rank(),), replica_id=replica)


def _load_scaler_states(optimizer, states: list) -> None:
    subs = [o for o in (getattr(optimizer, "chained_optimizers", None) or [optimizer])
            if getattr(o, "grad_scaler", None) is not None and o.grad_scaler.state_dict()]
    for opt, state in zip(subs, states):
        opt.grad_scaler.load_state_dict({
            "scale": torch.tensor([state["scale"]], dtype=torch.float),
            "growth_tracker": state["growth"], "hysteresis_tracker": state["hysteresis"]})
        if state["step"] is None:
            continue
        for param_state in opt.optimizer.state.values():
            if "step" in param_state:
                old = param_state["step"]
                param_state["step"] = torch.full_like(old, state["step"]) \
                    if torch.is_tensor(old) else type(old)(state["step"])


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def writer_queue_dies_with_this_process() -> None:
    """torch_dist saving keeps, for the life of the process, a ``multiprocessing`` Manager
    (spawned; it serves the queue of write results). A worker killed by SIGKILL would leave
    that Manager running, with the worker's memory image and its output pipes, after torchrun
    restarted the job. Create the queue here instead, in a Manager that dies with its worker;
    a no-op where Megatron-Core keeps the queue elsewhere."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", True) is not None \
            or not hasattr(filesystem_async, "_get_write_results_queue"):
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=exit_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def save_checkpoint(root: str, iteration: int, model, optimizer, lr_scheduler,
                    extra: Optional[Dict] = None, fully_reshardable: bool = False) -> str:
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    metadata = optimizer_format(optimizer, fully_reshardable)
    state = _sharded_state(model, optimizer, is_loading=False, metadata=metadata,
                           lr_scheduler=lr_scheduler)
    state["lr_scheduler"] = lr_scheduler.state_dict()
    state["iteration"] = iteration
    state["extra"] = dict(extra or {})
    writer_queue_dies_with_this_process()
    dist_checkpointing.save(state, tmp, content_metadata=metadata)
    _barrier()
    if rank0:
        open(os.path.join(tmp, COMPLETE), "w").close()
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = os.path.join(root, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(str(iteration))
        os.replace(latest_tmp, os.path.join(root, LATEST))
    _barrier()
    return final


def _holds_checkpoint_files(root: str) -> bool:
    return any(name == LATEST or name.startswith("iter_") for name in os.listdir(root))


def find_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint under --load ``root``; None while ``root`` is missing or
    holds no checkpoint at all (Megatron-LM's ``--save DIR --load DIR`` idiom then starts from
    scratch). Raises CheckpointError when ``root`` holds only partial or corrupt ones.

    The newest complete one is the one ``latest_checkpointed_iteration.txt`` names: the file is
    replaced only after the checkpoint's ``iter_N.tmp`` directory was complete and renamed, so
    an ``iter_N.tmp`` (a save that was cut short) is never taken."""
    if not os.path.isdir(root) or not _holds_checkpoint_files(root):
        return None
    latest = os.path.join(root, LATEST)
    if not os.path.exists(latest):
        partial = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
        raise CheckpointError(
            f"--load {root}: no complete checkpoint there ({LATEST} is missing; found only "
            f"{', '.join(partial[:3])}{' ...' if len(partial) > 3 else ''}, from a save that was "
            "cut short?); remove them to start from scratch, or point --load at a directory "
            "written by --save")
    text = open(latest).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {LATEST} is corrupt ({text[:40]!r})")
    path = iteration_dir(root, int(text))
    complete = os.path.exists(os.path.join(path, COMPLETE)) or _is_megatron_lm(path)
    if not complete or not os.path.exists(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {root}: checkpoint {path} is incomplete or corrupt "
                              "(a save was interrupted?); remove it or load an earlier one")
    return path


def _is_megatron_lm(path: str) -> bool:
    """Megatron-LM names the iteration in its tracker file only once the checkpoint's common
    state is written: that file is its mark of completion (ours is ``COMPLETE``). Through
    megatron-core 0.18 the common state is ``common.pt``; from 0.19 on it is a sharded object
    inside the torch_dist files, whose index ``.metadata`` torch writes last."""
    return not os.path.exists(os.path.join(path, COMPLETE)) and any(
        os.path.exists(os.path.join(path, name)) for name in ("common.pt", ".metadata"))


def _common(path: str) -> Dict:
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except Exception as exc:  # torch_dist raises many kinds; the user needs the path
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


# what a Megatron-LM checkpoint records of the run that wrote it, under our fingerprint's names
_MEGATRON_LM_RUN = ("pipeline_model_parallel_size", "tensor_model_parallel_size",
                    "data_parallel_size", "use_distributed_optimizer",
                    "dist_ckpt_optim_fully_reshardable",
                    "virtual_pipeline_model_parallel_size", "num_layers", "hidden_size",
                    "num_attention_heads", "ffn_hidden_size", "seq_length",
                    "max_position_embeddings", "untie_embeddings_and_output_weights",
                    "normalization", "make_vocab_size_divisible_by")
NOT_MAPPED = ("Megatron-LM's RNG states (its own layout: this run keeps its seeded ones)",
              "Megatron-LM's fp16 loss scaler (one for all stages: each stage starts from "
              "--initial-loss-scale)")
NOT_RESHARDED = ("the per-rank RNG states of the old layout (this run keeps its seeded ones)",
                 "the per-stage fp16 loss scalers of the old layout (each stage starts from "
                 "--initial-loss-scale)")


def _layout_now() -> tuple:
    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size())


def read_extra(path: str) -> Dict:
    """The ``extra`` dict a checkpoint was saved with (no process group needed); for a
    Megatron-LM checkpoint, the same fields from its saved arguments."""
    common = _common(path)
    if "extra" in common or "args" not in common:
        return dict(common.get("extra", {}))
    args = common["args"]
    run = {key: getattr(args, key, None) for key in _MEGATRON_LM_RUN}
    run["pipeline_schedule"] = getattr(args, "pipeline_schedule", "1f1b")
    run["paci_accumulation_factor"] = getattr(args, "paci_accumulation_factor", None)
    return {"consumed_samples": getattr(args, "consumed_train_samples", None),
            "schedule": run["pipeline_schedule"], "run": run, "megatron_lm": True}


def scheduler_state(common: Dict) -> Optional[Dict]:
    """The LR scheduler's state: ours, or Megatron-LM's (saved as ``opt_param_scheduler``)."""
    return common.get("lr_scheduler", common.get("opt_param_scheduler"))


def weights_sha256(model: List[torch.nn.Module]) -> str:
    """SHA-256 over this rank's parameters, then its persistent buffers (an MoE router's
    expert bias), as float32 bytes, chunk by chunk in sorted name order: equal digests mean
    bit-identical weights and state."""
    digest = hashlib.sha256()
    for chunk in model:
        for _, tensor in [*sorted(chunk.named_parameters(), key=lambda item: item[0]),
                          *sorted(persistent_buffers(chunk), key=lambda item: item[0])]:
            digest.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def persistent_buffers(module: torch.nn.Module) -> List:
    """(name, tensor) of the buffers a state dict saves (a dense GPT has none)."""
    return [(f"{prefix}.{name}" if prefix else name, buf)
            for prefix, sub in module.named_modules() for name, buf in sub._buffers.items()
            if buf is not None and name not in sub._non_persistent_buffers_set]


def _give_distributed_optimizer_a_state(optimizer) -> None:
    """Without Apex/TE the distributed optimizer's state_dict() reads each parameter's Adam
    'step', which a fresh optimizer does not have yet; Megatron-Core's own placeholder step
    (zero gradients) creates the state that the load then overwrites in place."""
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if getattr(sub.config, "use_distributed_optimizer", False) and not sub.optimizer.state:
            sub._init_optimizer_states_with_dummy_values()


def load_checkpoint(root: str, model, optimizer, lr_scheduler) -> Dict:
    """Restores everything in place from the newest complete checkpoint under ``root`` (which
    must hold one); returns {'iteration': ..., 'extra': {...}, 'path': ...}."""
    path = find_checkpoint(root)
    if path is None:
        raise CheckpointError(f"--load {root}: no checkpoint there")
    _give_distributed_optimizer_a_state(optimizer)
    written = dist_checkpointing.load_content_metadata(path) if optimizer_format(optimizer) \
        else None  # the format the checkpoint was written in, Megatron-LM's or ours
    template = _sharded_state(model, optimizer, is_loading=True,
                              metadata=written or optimizer_format(optimizer))
    megatron_lm = _is_megatron_lm(path)
    saved = layout_of(read_extra(path).get("run") or {})
    not_mapped = NOT_MAPPED if megatron_lm \
        else NOT_RESHARDED if layout_changed(saved, _layout_now()) else ()
    if not_mapped:  # per-rank pieces: in Megatron-LM's own layout, or of another grid
        template.pop("rng_state")
        template.pop("grad_scaler", None)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
        loaded = dist_checkpointing.load(template, path)
    except Exception as exc:  # torch_dist raises many kinds; the user needs the path
        raise CheckpointError(f"--load {root}: cannot read {path}: {type(exc).__name__}: "
                              f"{exc}") from exc
    for key, chunk in zip(_model_keys(model), model):
        _unwrap_ddp(chunk).load_state_dict(loaded[key])
    with torch.no_grad():  # the distributed optimizer copies into views of the parameters
        optimizer.load_state_dict(loaded["optimizer"])
    own = loaded.get("grad_scaler") or []  # this stage's fp16 state
    _load_scaler_states(optimizer, own)
    # loaded once: Megatron's scheduler load advances from where it stands
    lr_scheduler.load_state_dict(own[0]["lr_scheduler"] if own and "lr_scheduler" in own[0]
                                 else scheduler_state(common))
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    return {"iteration": int(common["iteration"]), "extra": read_extra(path), "path": path,
            "not_mapped": not_mapped}
