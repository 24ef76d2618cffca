"""Runtime patches to stock Megatron-Core (installed as ``paci_megatron.patches``).

Only relative imports here: this folder is importable both as ``paci_megatron.patches`` and,
from a source checkout with the repo root on ``PYTHONPATH``, as ``patches``.
"""

from .cpu_gloo import (
    CPU_PATCHES,
    MCORE_RANGE,
    SUPPORTED_MCORE_VERSIONS,
    UnsupportedMegatronVersion,
    applied_cpu_patches,
    apply_cpu_patches,
    check_megatron_core_version,
    installed_megatron_core_version,
)

__all__ = [
    "CPU_PATCHES",
    "MCORE_RANGE",
    "SUPPORTED_MCORE_VERSIONS",
    "UnsupportedMegatronVersion",
    "applied_cpu_patches",
    "apply_cpu_patches",
    "check_megatron_core_version",
    "installed_megatron_core_version",
]
