"""Megatron-LM's import path: its checkout's folder on ``sys.path`` behind the installed
megatron-core (which provides ``megatron.core``); its prebuilt dataset helpers not recompiled;
without Triton, a stand-in for the one megatron-core module Megatron-LM imports Triton
through."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types

from ..release_check import check_megatron_core_version
from .version import UnsupportedMegatronLM, _refuse_missing_package


_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _batch_invariant_stub() -> types.ModuleType:
    """Stands in for megatron-core's batch-invariant kernels when Triton is not installed.

    ``megatron/training/initialize.py`` imports ``enable_batch_invariant_mode`` from that module
    unconditionally, and the module imports ``triton`` at the top; the CPU torch wheel has no
    Triton. The stub says the mode is off and refuses to turn it on (``--batch-invariant-mode``
    needs Triton and a GPU)."""
    stub = types.ModuleType(_BATCH_INVARIANT)
    stub.__doc__ = "paci_megatron stand-in: Triton is not installed, batch-invariant mode is off"
    stub._paci_stub = True

    def is_batch_invariant_mode_enabled() -> bool:
        return False

    def refuse(*_args, **_kwargs):
        raise RuntimeError("--batch-invariant-mode needs Triton (and a GPU); Triton is not "
                           "installed here")

    def set_batch_invariant_mode(enabled: bool = True):
        if enabled:
            refuse()

    stub.is_batch_invariant_mode_enabled = is_batch_invariant_mode_enabled
    stub.enable_batch_invariant_mode = refuse
    stub.disable_batch_invariant_mode = lambda: None
    stub.set_batch_invariant_mode = set_batch_invariant_mode
    stub.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                    "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    return stub


def _is_dir(entry: str, folder: str) -> bool:
    return os.path.abspath(entry or os.curdir) == folder  # "" on sys.path is the cwd


def prepare_import_path(script_dir: str) -> str:
    """Put Megatron-LM's root (the script's folder) on ``sys.path`` without letting its
    ``megatron/core`` shadow the installed megatron-core.

    ``megatron`` is a namespace package in both places, and the first ``megatron/core`` on
    ``sys.path`` wins. The checkout's root therefore goes right *after* the installed
    megatron-core's folder (``python script.py`` would put it first; so would ``python -m``
    run from inside the checkout, whose cwd entry is taken out here): ``megatron.core`` is
    the installed wheel (with the prebuilt ``helpers_cpp`` dataset extension that a source
    checkout lacks), also in processes that multiprocessing spawns with this ``sys.path``,
    and the checkout contributes only what megatron-core does not ship:
    ``megatron.training``, ``megatron.legacy``, ``megatron.post_training``, ``megatron.rl``
    and the script's own modules (``gpt_builders``, ``model_provider``).
    Returns the installed megatron-core version.
    """
    script_dir = os.path.abspath(script_dir)
    sys.path[:] = [entry for entry in sys.path if not _is_dir(entry, script_dir)]
    version = check_megatron_core_version()
    if importlib.util.find_spec("triton") is None and _BATCH_INVARIANT not in sys.modules:
        sys.modules[_BATCH_INVARIANT] = _batch_invariant_stub()
    import megatron.core

    core_dir = os.path.dirname(os.path.abspath(megatron.core.__file__))
    if core_dir.startswith(script_dir + os.sep):
        raise UnsupportedMegatronLM(
            f"megatron.core was already imported from the Megatron-LM checkout ({core_dir}); "
            f"paci_megatron.run needs the installed megatron-core {version}")
    if getattr(sys.modules["megatron"], "__file__", None):
        raise UnsupportedMegatronLM(
            f"'megatron' is a regular package here ({sys.modules['megatron'].__file__}); "
            f"megatron-core {version} installs it as a namespace package. Reinstall it.")
    site = os.path.dirname(os.path.dirname(core_dir))
    index = next((i for i, entry in enumerate(sys.path) if _is_dir(entry, site)), None)
    sys.path.insert(len(sys.path) if index is None else index + 1, script_dir)
    _import_checkout_training(script_dir, site)
    _use_prebuilt_dataset_helpers()
    return version


def _import_checkout_training(script_dir: str, site: str) -> None:
    """megatron-core 0.17 and later wheels ship a ``megatron.training`` of their own, which
    would win over the checkout's (the checkout goes after the installed package). The
    checkout's is the user's Megatron-LM: import it from there, with the checkout first on
    ``sys.path`` for that one import (``megatron.core`` is already the installed one)."""
    mine = os.path.join(script_dir, "megatron", "training", "__init__.py")
    if not os.path.isfile(mine) or "megatron.training" in sys.modules:
        return
    if not os.path.isfile(os.path.join(site, "megatron", "training", "__init__.py")):
        return  # megatron-core 0.16: the checkout's is the only one
    sys.path.insert(0, script_dir)
    try:
        importlib.import_module("megatron.training")
    except ModuleNotFoundError as exc:
        _refuse_missing_package(exc)  # a package its __init__ imports (yaml, in 0.17 and 0.18)
        raise
    finally:
        sys.path.remove(script_dir)  # the first entry: the one inserted above


def _use_prebuilt_dataset_helpers() -> bool:
    """``initialize_megatron`` runs ``megatron.core.datasets.utils.compile_helpers()`` (``make``
    in the folder of ``megatron.core.datasets``) on rank 0. The megatron-core wheel ships that
    extension prebuilt (``helpers_cpp``) and has no makefile, so ``make`` fails and Megatron-LM
    exits. The replacement builds only when the prebuilt extension cannot be imported."""
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers
    if getattr(original, "_paci_original", None) is not None:
        return False

    @functools.wraps(original)
    def compile_helpers():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None
        return original()

    compile_helpers._paci_original = original
    dataset_utils.compile_helpers = compile_helpers
    return True
