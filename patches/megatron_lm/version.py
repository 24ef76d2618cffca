"""The version guard: which megatron-core and Megatron-LM these patches support
(``patches/versions.py``), and, for every Megatron-LM function they replace or wrap, the
parameters the patch relies on. Anything else stops with :class:`UnsupportedMegatronLM`
naming the versions that work."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
from typing import Dict, List, Optional, Tuple

from ..release_check import UnsupportedMegatronVersion, check_megatron_core_version
from ..versions import MCORE_RANGE, RELEASES, minor_of, release_of, tested_pairs

SUPPORTED_MEGATRON_LM_VERSIONS = tuple(r.megatron_lm_tag[len("core_v"):] for r in RELEASES)
VERIFIED_MEGATRON_LM_COMMITS = {r.megatron_lm_tag: r.megatron_lm_commit for r in RELEASES}


class UnsupportedMegatronLM(UnsupportedMegatronVersion):
    """The Megatron-LM checkout (or megatron-core) is not one these patches support."""


def _supported() -> str:
    return f"the tested pairs: {tested_pairs()}"


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


# function -> the parameters its patch relies on: (names that must lead the signature, in
# order, because the patch passes them by position; names it passes by keyword, anywhere).
_NEEDED: Dict[str, Tuple[List[str], List[str]]] = {
    "megatron.training.arguments.parse_args": (["extra_args_provider", "ignore_unknown_args"], []),
    "megatron.training.initialize.initialize_megatron": ([], ["allow_no_cuda"]),
    "megatron.training.training.setup_model_and_optimizer": ([], []),
    "megatron.training.training.train_step": ([], ["optimizer", "opt_param_scheduler"]),
    "megatron.training.training.train": ([], []),
    "megatron.training.training.save_checkpoint": ([], []),
    "megatron.training.training.get_model": ([], []),
    "megatron.training.training.get_megatron_optimizer": (["config", "model_chunks"], []),
    "megatron.training.training.logical_and_across_model_parallel_group": (["input"], []),
    "megatron.training.training.reduce_max_stat_across_model_parallel_group": (["stat"], []),
    "megatron.training.training.get_forward_backward_func": (["pp_size", "vp_size"], []),
    "megatron.training.training.evaluate_and_print_results": ([], []),
    "megatron.training.training.evaluate": ([], []),
    "megatron.training.training.build_pretraining_data_loader": ([], []),
    "megatron.training.initialize._warmup_jit_function": ([], []),
}
# present in some supported releases only (the patch is skipped where they are absent)
OPTIONAL = {
    "megatron.legacy.fused_kernels.load": (["args"], []),  # removed in 0.17
}


def _mismatch(fn, needed: Tuple[List[str], List[str]]) -> Optional[str]:
    positional, keywords = needed
    params = _params(fn)
    if params[:len(positional)] != positional:
        return f"expected its parameters to start with {positional}"
    missing = [name for name in keywords if name not in params]
    if missing:
        return f"expected parameters {missing}"
    return None


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
    if checkout is not None:
        _check_pair(root, checkout, mcore)
    changed = []
    for dotted, needed in {**_NEEDED, **OPTIONAL}.items():
        try:
            _module, _attr, fn = _resolve(dotted)
        except ModuleNotFoundError as exc:
            if dotted in OPTIONAL and (exc.name or "").startswith("megatron"):
                continue
            _refuse_missing_package(exc)
            changed.append(f"{dotted}: cannot import ({exc})")
            continue
        except ImportError as exc:
            changed.append(f"{dotted}: cannot import ({exc})")
            continue
        if fn is None:
            if dotted not in OPTIONAL:
                changed.append(f"{dotted}: missing")
            continue
        reason = _mismatch(fn, needed)
        if reason:
            changed.append(f"{dotted}{inspect.signature(fn)}: {reason}")
    if changed:
        raise UnsupportedMegatronLM(
            f"the Megatron-LM at {root} (version {checkout or 'unknown'}) differs from the ones "
            f"these patches were written for ({_supported()}):\n  " + "\n  ".join(changed))
    return {"megatron_core": mcore, "megatron_lm": checkout or "unknown", "megatron_lm_root": root}


def _check_pair(root: str, checkout: str, mcore: str) -> None:
    """A checkout of a supported release (a tested one, or a newer one, which the megatron-core
    guard warns about) whose minor release is the installed megatron-core's (Megatron-LM's
    training code calls megatron-core internals of its own release). By minor, as for
    megatron-core: the tag core_v0.19.0's package_info.py already reads 0.19.1."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        inside = SpecifierSet(MCORE_RANGE).contains(Version(checkout), prereleases=True)
    except InvalidVersion:
        inside = False
    if not inside:
        raise UnsupportedMegatronLM(
            f"the Megatron-LM checkout at {root} is version {checkout}; paci_megatron.run "
            f"supports {_supported()}. Check out one of those tags (git checkout "
            f"{RELEASES[-1].megatron_lm_tag}).")
    if minor_of(checkout) != minor_of(mcore):
        mine = release_of(checkout)
        install = (f"Install megatron-core=={mine.tested[-1]}" if mine and mine.on_index else
                   "Install that checkout's own megatron-core (pip install --no-deps of it)")
        theirs = release_of(mcore)
        other = f", or check out {theirs.megatron_lm_tag}" if theirs else ""
        raise UnsupportedMegatronLM(
            f"the Megatron-LM checkout at {root} is version {checkout}, but megatron-core "
            f"{mcore} is installed: Megatron-LM's training code needs the megatron-core of its "
            f"own minor release. {install}{other}.")


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
