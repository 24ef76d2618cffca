"""Which megatron-core is installed, and whether this plugin runs with it (``versions.py``).

Kept apart from the CPU patches: the schedule hook, the drop-in and the CPU patches all ask
it, on CPU and on CUDA alike. Reading the version imports nothing of Megatron.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Optional

from .versions import MCORE_RANGE, NEWEST_ON_INDEX, NEWEST_TESTED, REFUSED, RELEASES, \
    release_of, tested_pairs

__all__ = ["UnsupportedMegatronVersion", "UntestedMegatronVersion",
           "installed_megatron_core_version", "check_megatron_core_version"]


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is one these patches refuse (too old, yanked, unreadable)."""


class UntestedMegatronVersion(UserWarning):
    """The installed megatron-core is newer than every tested release: it runs, untested."""


def installed_megatron_core_version() -> Optional[str]:
    """``megatron.core.package_info.__version__`` without importing ``megatron.core`` itself.

    Returns None when megatron-core is not installed.
    """
    loaded = sys.modules.get("megatron.core.package_info")
    if loaded is not None:
        return loaded.__version__
    spec = importlib.util.find_spec("megatron")  # a namespace package: importing it is free
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "core", "package_info.py")
        if os.path.isfile(path):
            file_spec = importlib.util.spec_from_file_location("_paci_mcore_package_info", path)
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)  # plain constants, no imports
            return module.__version__
    return None


_WARNED = set()


def check_megatron_core_version() -> str:
    """The installed megatron-core's version, if these patches run with it.

    A release of a tested minor (``versions.RELEASES``) runs; one newer than the newest tested
    runs too, with one :class:`UntestedMegatronVersion` warning a process naming the newest
    tested release (an API change the code detects then stops it where it is detected: the
    drop-in's signature checks, ``mcore/compat.py``). Anything older than ``MCORE_RANGE``, a
    yanked release, or no megatron-core raises :class:`UnsupportedMegatronVersion`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = installed_megatron_core_version()
    fix = _install_hint()
    if version is not None and version in REFUSED:
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is installed, which paci_megatron refuses: "
            f"{REFUSED[version]}. {fix}")
    try:
        parsed = Version(version) if version is not None else None
    except InvalidVersion:
        parsed = None
    if parsed is None or not SpecifierSet(MCORE_RANGE).contains(parsed, prereleases=True):
        found = "not installed" if version is None else f"version {version} is installed"
        raise UnsupportedMegatronVersion(
            f"paci_megatron supports megatron-core {MCORE_RANGE} (tested: {tested_pairs()}), "
            f"but megatron-core {found}. {fix}")
    if (parsed.is_prerelease or release_of(version) is None) and version not in _WARNED:
        _WARNED.add(version)
        warnings.warn(
            f"megatron-core {version} is not a release paci_megatron was tested with (newest "
            f"tested: {NEWEST_TESTED}, Megatron-LM {RELEASES[-1].megatron_lm_tag} at "
            f"{RELEASES[-1].megatron_lm_commit[:12]}; tested: {tested_pairs()}); running "
            "untested", UntestedMegatronVersion, stacklevel=2)
    return version


def _install_hint() -> str:
    """The install line that fits this Python (megatron-core 0.17 and later need 3.12)."""
    if sys.version_info < (3, 12):
        return (f"Install a supported one: pip install megatron-core=={RELEASES[0].tested[-1]} "
                "(megatron-core 0.17 and later need Python 3.12)")
    return f"Install a supported one: pip install megatron-core=={NEWEST_ON_INDEX}"
