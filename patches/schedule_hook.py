"""Make Megatron's ``get_forward_backward_func()`` return a chosen schedule.

Megatron-Core 0.16 to 0.19 has no schedule registry: callers (Megatron-LM's training loop,
user scripts) call ``get_forward_backward_func(pp_size, vp_size)`` (0.19 adds
``schedule_pg_collection``), which picks one of its built-in functions. We replace that
function where it is looked up; ``uninstall`` restores it. Only done for schedules that are
not Megatron's own, so ``1f1b`` stays stock.
"""

import sys
from typing import Callable, List, Tuple

from .release_check import check_megatron_core_version

# modules that hold a reference to get_forward_backward_func under that name
_HOLDERS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel",
    "megatron.training.training",  # Megatron-LM, if imported
)


def install_forward_backward_func(func: Callable) -> Callable[[], None]:
    """Route ``get_forward_backward_func`` to ``func``; returns an ``uninstall`` callable."""
    check_megatron_core_version()
    import megatron.core.pipeline_parallel  # noqa: F401  (make sure the holders exist)

    def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None):
        if type(schedule_pg_collection).__name__ == "MultiModuleProcessGroupCollection":
            # megatron-core 0.17+: a pipeline of several modules on their own grids
            raise NotImplementedError(
                "--pipeline-schedule paci runs one model on one pipeline; a "
                "MultiModuleProcessGroupCollection (several modules on their own process "
                "grids) needs Megatron's own schedule: use --pipeline-schedule 1f1b")
        return func

    get_forward_backward_func.paci_hooked = True
    saved: List[Tuple[object, Callable]] = []
    for name in _HOLDERS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_forward_backward_func"):
            saved.append((module, module.get_forward_backward_func))
            module.get_forward_backward_func = get_forward_backward_func

    def uninstall() -> None:
        for module, original in saved:
            module.get_forward_backward_func = original

    return uninstall
