"""``--load`` and the LR schedule: Megatron-LM's rule for which one wins.

A checkpoint holds the LR scheduler's settings (peak and minimum LR, warmup and decay length in
samples, decay style, weight decay). When the flags describe another schedule, Megatron-LM
refuses to guess: ``--override-opt_param-scheduler`` takes the flags' schedule (continuing at
the checkpoint's position in it), ``--use-checkpoint-opt_param-scheduler`` keeps the
checkpoint's. Without either, a mismatch is an error, found here before any process group
starts (a longer ``--train-iters`` would otherwise train on at the minimum LR of a schedule that
already ended).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional

from megatron.core import dist_checkpointing

from ..quiet import is_rank0
from . import build, checkpoint

OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"

# the flag behind each setting the checkpoint compares (steps are samples: iterations x batch)
_FLAG_OF = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
            "lr_decay_steps": "--train-iters", "lr_decay_style": "--lr-decay-style",
            "start_wd": "--weight-decay", "end_wd": "--weight-decay",
            "wd_incr_steps": "--train-iters"}


@dataclass(frozen=True)
class LrFlags:
    """The flags of the LR schedule and of the choice between two schedules on --load."""

    lr: float
    min_lr: float
    warmup_iters: int
    train_iters: int
    decay_style: str
    weight_decay: float
    global_batch_size: int
    load: Optional[str] = None
    override: bool = False  # --override-opt_param-scheduler
    use_checkpoint: bool = False  # --use-checkpoint-opt_param-scheduler


def scheduler_from_flags(flags: LrFlags):
    """The scheduler ``training.setup`` builds from these flags, on a stand-in optimizer (no
    model, no process group): the same function computes both, so they cannot disagree."""
    optimizer = SimpleNamespace(param_groups=[],
                                config=SimpleNamespace(weight_decay=flags.weight_decay))
    gbs = flags.global_batch_size
    return build.build_lr_scheduler(
        optimizer, lr=flags.lr, min_lr=flags.min_lr, warmup_steps=flags.warmup_iters * gbs,
        decay_steps=flags.train_iters * gbs, decay_style=flags.decay_style)


def saved_scheduler_state(root: str) -> Optional[Dict]:
    """The LR scheduler state of the checkpoint ``--load root`` would load (None: none there;
    whether that is an error is ``checkpoint.find_checkpoint``'s call)."""
    try:
        path = checkpoint.find_checkpoint(root)
    except checkpoint.CheckpointError:
        return None
    if path is None:  # nothing saved yet: the run starts from scratch
        return None
    return checkpoint.scheduler_state(dist_checkpointing.load_common_state_dict(path))


def _shown(key: str, value, gbs: int) -> str:
    if key.endswith("_steps") and isinstance(value, int):
        return f"{value / gbs:g} iterations ({value} samples)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def schedule_mismatches(flags: Dict, saved: Dict, global_batch_size: int) -> List[str]:
    """``"FLAG: A here, B in the checkpoint"`` for each flag whose setting differs (one entry
    per flag: --train-iters sets both the LR decay and the weight-decay length)."""
    found = {}
    for key, flag in _FLAG_OF.items():
        if key in saved and flags.get(key) != saved[key] and flag not in found:
            found[flag] = (f"{flag}: {_shown(key, flags.get(key), global_batch_size)} here, "
                           f"{_shown(key, saved[key], global_batch_size)} in the checkpoint")
    return list(found.values())


def check_lr_schedule_on_load(flags: LrFlags, log=print) -> None:
    """Before any process group: refuse a schedule mismatch that no flag resolves (raises
    ValueError naming both flags), and say which schedule a resolved one trains with."""
    if not flags.load:
        return
    saved = saved_scheduler_state(flags.load)
    if saved is None:
        return
    gbs = flags.global_batch_size
    mismatches = schedule_mismatches(scheduler_from_flags(flags).state_dict(), saved, gbs)
    if not mismatches:
        return
    detail = "; ".join(mismatches)
    rank0 = is_rank0()  # every rank checks (no process group yet); one says it
    if flags.override:
        if rank0:
            log(f"> {OVERRIDE}: training on with the flags' LR schedule from the checkpoint's "
                f"position ({saved['num_steps']} samples): {detail}")
        return
    if flags.use_checkpoint:
        end = saved["lr_decay_steps"] / gbs
        ended = (f"; it ends at iteration {end:g}, so iterations {int(end) + 1}-"
                 f"{flags.train_iters} run at its minimum LR {saved['min_lr']:g}"
                 if saved["lr_decay_style"] != "constant" and end < flags.train_iters else "")
        if rank0:
            log(f"> {USE_CHECKPOINT}: training with the checkpoint's LR schedule, not the "
                f"flags'{ended} ({detail})")
        return
    raise ValueError(
        f"--load {flags.load}: the checkpoint's LR schedule differs from the flags' ({detail}); "
        f"add {OVERRIDE} to train with the flags' schedule (from the checkpoint's position), "
        f"or {USE_CHECKPOINT} to keep the checkpoint's (or restore the original flags)")
