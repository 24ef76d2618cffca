"""Less noise per rank: Megatron-Core's fallback warnings and bad-flag errors, once per job.

Without Transformer Engine and Apex (any CPU machine) about a dozen megatron-core modules each
warn at import that they fall back to local implementations, on every rank (twice as many
through Megatron-LM's training code). Importing ``paci_megatron`` silences exactly those
warnings (``silence_fallback_warnings``); the entry points print ``fallback_notice()`` once,
on rank 0, instead.
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from typing import NoReturn, Optional

# How long a rank that leaves a start-up error to local rank 0 waits before it exits: torchrun
# stops every rank as soon as one exits, so a silent rank that exits first can stop local
# rank 0 before it printed (seen under load: a bad --pipeline-schedule exited 2 with no
# message). Local rank 0 exits as soon as it has printed, so the wait costs nothing then.
REPORTER_WAIT_S = 30.0

# "Transformer Engine and Apex are not installed. Falling back to Torch optimizers." and
# "Apex is not installed. Falling back to Torch Norm" (megatron-core 0.16.1 and Megatron-LM)
FALLBACK_WARNING = (r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) "
                    r"not installed\. Falling back to ")


def silence_fallback_warnings() -> None:
    warnings.filterwarnings("ignore", message=FALLBACK_WARNING, category=UserWarning)


def fallback_notice() -> Optional[str]:
    """One line naming the fused-kernel packages that are absent (None: both installed)."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"),
                                         ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    verb = "are" if len(missing) > 1 else "is"
    return (f"> {' and '.join(missing)} {verb} not installed: Megatron-Core uses its local "
            "torch fallbacks (optimizers, norms, multi-tensor kernels); its per-module "
            "warnings about it are silenced")


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def is_local_rank0() -> bool:
    """Under torchrun every rank of a node shares the terminal: errors found before any
    process group (each rank finds the same one) are printed by local rank 0 only."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def exit_after_local_rank0(code: int = 2) -> NoReturn:
    """A rank that found the error local rank 0 reports: exit once local rank 0 has had the
    time to print it (torchrun stops this rank sooner, when local rank 0 exits)."""
    time.sleep(REPORTER_WAIT_S)
    raise SystemExit(code)
