"""The version guard: which megatron-core and Megatron-LM these patches were written for, and
the signature of every Megatron-LM function they replace. Anything else stops with
:class:`UnsupportedMegatronLM` naming the versions that work."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
from typing import Dict, List, Optional

from ..cpu_gloo import SUPPORTED_MCORE_VERSIONS, UnsupportedMegatronVersion, \
    check_megatron_core_version

SUPPORTED_MEGATRON_LM_VERSIONS = ("0.16.1",)
VERIFIED_MEGATRON_LM_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"  # tag core_v0.16.1


class UnsupportedMegatronLM(UnsupportedMegatronVersion):
    """The Megatron-LM checkout (or megatron-core) is not one these patches support."""


def _supported() -> str:
    return (f"Megatron-LM {', '.join(SUPPORTED_MEGATRON_LM_VERSIONS)} (e.g. git tag core_v0.16.1, "
            f"commit {VERIFIED_MEGATRON_LM_COMMIT[:12]}) with megatron-core "
            f"{', '.join(SUPPORTED_MCORE_VERSIONS)}")


_VERSION_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(.+?)\s*(#.*)?$", re.M)


def megatron_lm_checkout_version(root: str) -> Optional[str]:
    """``MAJOR.MINOR.PATCH[PRE_RELEASE]`` from a checkout's ``megatron/core/package_info.py``,
    read as text (newer checkouts run git in that file). None if the file is absent."""
    path = os.path.join(root, "megatron", "core", "package_info.py")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    fields = {m.group(1): m.group(2).strip("'\"") for m in _VERSION_FIELD.finditer(text)}
    if not {"MAJOR", "MINOR", "PATCH"} <= set(fields):
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"


def _params(fn) -> List[str]:
    return list(inspect.signature(fn).parameters)


# function -> the parameters it had when these patches were written (Megatron-LM 0.16.1)
_EXPECTED_SIGNATURES: Dict[str, List[str]] = {
    "megatron.training.arguments.parse_args": ["extra_args_provider", "ignore_unknown_args"],
    "megatron.training.initialize.initialize_megatron": [
        "extra_args_provider", "args_defaults", "ignore_unknown_args", "allow_no_cuda",
        "skip_mpu_initialization", "get_embedding_ranks", "get_position_embedding_ranks",
        "parsed_args", "store"],
    "megatron.training.training.setup_model_and_optimizer": [
        "model_provider_func", "model_type", "checkpointing_context"],
    "megatron.training.training.train_step": [
        "forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler",
        "config", "forward_backward_func", "iteration"],
    "megatron.training.training.train": [
        "forward_step_func", "model", "optimizer", "opt_param_scheduler", "train_data_iterator",
        "valid_data_iterator", "process_non_loss_data_func", "config", "checkpointing_context",
        "non_loss_data_func", "inference_model"],
    "megatron.training.training.save_checkpoint": [
        "iteration", "model", "optimizer", "opt_param_scheduler",
        "num_floating_point_operations_so_far", "checkpointing_context", "pipeline_rank",
        "expert_rank", "tensor_rank", "pipeline_parallel", "expert_parallel",
        "non_persistent_ckpt", "train_data_iterator", "preprocess_common_state_dict_fn",
        "release", "tp_group", "pp_group", "dp_cp_group"],
    "megatron.training.training.get_model": [
        "model_provider_func", "model_type", "wrap_with_ddp", "config", "pg_collection"],
    "megatron.training.training.logical_and_across_model_parallel_group": ["input"],
    "megatron.training.training.reduce_max_stat_across_model_parallel_group": ["stat"],
    "megatron.training.training.get_forward_backward_func": ["pp_size", "vp_size"],
    "megatron.training.training.evaluate_and_print_results": [
        "prefix", "forward_step_func", "data_iterator", "model", "iteration",
        "process_non_loss_data_func", "config", "verbose", "write_to_tensorboard",
        "non_loss_data_func"],
    "megatron.training.training.evaluate": [
        "forward_step_func", "data_iterator", "model", "process_non_loss_data_func", "config",
        "verbose", "non_loss_data_func", "eval_iters"],
    "megatron.training.initialize._warmup_jit_function": [],
    "megatron.legacy.fused_kernels.load": ["args"],
    "megatron.training.utils.get_batch_on_this_tp_rank": ["data_iterator", "mtp_on_this_rank"],
}


def _resolve(dotted: str):
    module_name, attr = dotted.rsplit(".", 1)
    module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    return module, attr, getattr(fn, "_paci_original", fn)


def check_megatron_lm() -> Dict[str, str]:
    """Check megatron-core, the Megatron-LM checkout and every function patched here.

    Returns ``{"megatron_core": version, "megatron_lm": version or "unknown",
    "megatron_lm_root": path}``; raises :class:`UnsupportedMegatronLM` on any mismatch."""
    try:
        mcore = check_megatron_core_version()
    except UnsupportedMegatronVersion as exc:
        raise UnsupportedMegatronLM(f"{exc} paci_megatron.run supports {_supported()}.") from None
    spec = importlib.util.find_spec("megatron.training")
    if spec is None or not spec.origin:
        raise UnsupportedMegatronLM(
            "megatron.training (Megatron-LM) is not importable: pass the path of "
            "pretrain_gpt.py inside a Megatron-LM checkout. paci_megatron.run supports "
            f"{_supported()}.")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))))
    checkout = megatron_lm_checkout_version(root)
    if checkout is not None and checkout not in SUPPORTED_MEGATRON_LM_VERSIONS:
        raise UnsupportedMegatronLM(
            f"the Megatron-LM checkout at {root} is version {checkout}; paci_megatron.run "
            f"supports {_supported()}. Check out that version (git checkout core_v0.16.1).")
    changed = []
    for dotted, expected in _EXPECTED_SIGNATURES.items():
        try:
            _module, _attr, fn = _resolve(dotted)
        except ModuleNotFoundError as exc:
            _refuse_missing_package(exc)
            changed.append(f"{dotted}: cannot import ({exc})")
            continue
        except ImportError as exc:
            changed.append(f"{dotted}: cannot import ({exc})")
            continue
        if fn is None:
            changed.append(f"{dotted}: missing")
        elif _params(fn) != expected:
            changed.append(f"{dotted}{inspect.signature(fn)}: expected parameters {expected}")
    if changed:
        raise UnsupportedMegatronLM(
            f"the Megatron-LM at {root} (version {checkout or 'unknown'}) differs from the one "
            f"these patches were written for ({_supported()}):\n  " + "\n  ".join(changed))
    return {"megatron_core": mcore, "megatron_lm": checkout or "unknown", "megatron_lm_root": root}


def _refuse_missing_package(exc: ModuleNotFoundError) -> None:
    """A third-party package Megatron-LM's training code imports is absent: say so (and how to
    install it), rather than report a version mismatch."""
    top = (exc.name or "").split(".")[0]
    if top and top != "megatron":
        raise UnsupportedMegatronLM(
            f"Megatron-LM's training code imports {top!r}, which is not installed: "
            f"pip install -e \".[megatron-lm]\" (in paci-megatron's folder) installs what "
            f"Megatron-LM's pretrain_gpt.py needs, or install the package providing {top!r} "
            f"({exc})") from exc


def _replace(module, attr: str, new) -> bool:
    """Set ``module.attr = new`` (keeping the original on ``new._paci_original``); False if a
    paci_megatron replacement is already there."""
    old = getattr(module, attr)
    if getattr(old, "_paci_original", None) is not None:
        return False
    new._paci_original = old
    setattr(module, attr, new)
    return True
