"""Runtime patches to stock Megatron-Core (installed as ``paci_megatron.patches``).

Only relative imports here: this folder is importable both as ``paci_megatron.patches`` and,
from a source checkout with the repo root on ``PYTHONPATH``, as ``patches``.
"""

from .cpu_gloo import CPU_PATCHES, applied_cpu_patches, apply_cpu_patches
from .release_check import (
    UnsupportedMegatronVersion,
    UntestedMegatronVersion,
    check_megatron_core_version,
    installed_megatron_core_version,
)
from .versions import MCORE_RANGE, TESTED_MCORE_VERSIONS

__all__ = [
    "CPU_PATCHES",
    "MCORE_RANGE",
    "TESTED_MCORE_VERSIONS",
    "UnsupportedMegatronVersion",
    "UntestedMegatronVersion",
    "applied_cpu_patches",
    "apply_cpu_patches",
    "check_megatron_core_version",
    "installed_megatron_core_version",
]
