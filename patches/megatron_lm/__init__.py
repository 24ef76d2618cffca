"""Version-guarded patches that run Megatron-LM's own training loop (``pretrain_gpt.py``) with
PACI, used by ``python -m paci_megatron.run path/to/Megatron-LM/pretrain_gpt.py ...``. One
module per job, in the order ``paci_megatron.run.install`` applies them:

* ``imports``: the checkout's folder on ``sys.path`` behind the installed megatron-core;
* ``version``: megatron-core and Megatron-LM must be the versions these patches were written
  for, and every patched function must still have the signature they expect;
* ``cpu``: the places in ``megatron/training`` that assume a GPU (only without CUDA);
* ``parser``: PACI's flags (the caller's table) in Megatron-LM's argument parser;
* ``optimizer``: ``--optimizer nadam``, an optimizer Megatron-LM does not build (any schedule);
* ``hooks``: the PACI runtime in Megatron-LM's training loop (``--pipeline-schedule paci``).

Everything patched is looked up where Megatron-LM looks it up (module globals of
``megatron.training.training`` etc.). Only relative imports: the PACI runtime and its flags
are passed in by the caller (``paci_megatron/run.py``), so this package depends on nothing
outside ``patches/``.
"""

from .cpu import MEGATRON_LM_CPU_PATCHES, apply_megatron_lm_cpu_patches
from .hooks import (LocalStepOptimizer, LocalStepScheduler, PaciTrainingHooks,
                    stage_local_logical_and, stage_local_max_stat)
from .imports import prepare_import_path
from .optimizer import add_optimizer_choice, install_inner_optimizer, take_optimizer_choice
from .parser import install_arguments
from .version import (SUPPORTED_MEGATRON_LM_VERSIONS, VERIFIED_MEGATRON_LM_COMMITS,
                      UnsupportedMegatronLM, check_megatron_lm, megatron_lm_checkout_version)

__all__ = [
    "MEGATRON_LM_CPU_PATCHES", "LocalStepOptimizer", "LocalStepScheduler", "PaciTrainingHooks",
    "SUPPORTED_MEGATRON_LM_VERSIONS", "UnsupportedMegatronLM", "VERIFIED_MEGATRON_LM_COMMITS",
    "add_optimizer_choice", "apply_megatron_lm_cpu_patches", "check_megatron_lm",
    "install_arguments", "install_inner_optimizer", "megatron_lm_checkout_version",
    "prepare_import_path", "stage_local_logical_and", "stage_local_max_stat",
    "take_optimizer_choice",
]
