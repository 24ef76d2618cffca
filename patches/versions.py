"""The megatron-core releases and Megatron-LM tags these patches support, one row per minor
release: the one table for what cannot be detected by feature. Plain constants (``setup.py``
reads ``MCORE_RANGE`` from this file as text); no imports beyond the standard library.

Everything an API difference can be detected from (a signature, an attribute) is detected
where it is used (``paci_megatron/mcore/compat.py``, the patches); this table only says which
releases were tested, with which Megatron-LM tag, and which releases are refused and why.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

# what setup.py requires and the version guard admits: the oldest row below and anything
# newer. A release newer than the newest row runs with one warning naming the newest tested
# release (an API change the code detects stops it with an error naming the change).
MCORE_RANGE = ">=0.16.1"


class Release(NamedTuple):
    """One megatron-core minor release and the Megatron-LM tag it was tested with."""

    minor: str                 # "0.19"
    tested: Tuple[str, ...]    # the megatron-core versions the test suites ran on
    megatron_lm_tag: str       # the Megatron-LM tag the drop-in's tests ran on
    megatron_lm_commit: str    # that tag's commit
    python: str                # what the megatron-core wheels of this minor require
    on_index: bool = True      # False: only as a Megatron-LM checkout (pip install -e)


RELEASES: Tuple[Release, ...] = (
    Release("0.16", ("0.16.1",), "core_v0.16.1", "55ac7082517c3878ae653c07c09c534b8aed49f6",
            ">=3.10"),
    Release("0.17", ("0.17.1",), "core_v0.17.1", "266f1c97dca477ca8b92c16087506da2000b0b84",
            ">=3.12"),
    Release("0.18", ("0.18.2",), "core_v0.18.2", "571370c829ca768fe37244f4e2e7f28d8accc4ab",
            ">=3.12"),
    Release("0.19", ("0.19.0", "0.19.2"), "core_v0.19.0",
            "5be9626709af2722333bf54797c954c09edeada3", ">=3.12"),
    # Megatron-LM main as of 2026-08-22: megatron-core 0.20.0, not on the package index
    Release("0.20", ("0.20.0",), "main", "d98e8a64ddf34856e74b24714e3bedb2f5a39553",
            ">=3.12", on_index=False),
)

# releases inside MCORE_RANGE that are refused, with the reason the refusal gives
REFUSED: Dict[str, str] = {
    "0.18.1": "it was yanked from the package index ('wrong version'); use 0.18.2",
    "0.19.1": "it was yanked from the package index ('wrong version'); use 0.19.2",
}

TESTED_MCORE_VERSIONS: Tuple[str, ...] = tuple(v for r in RELEASES for v in r.tested)
NEWEST_TESTED = TESTED_MCORE_VERSIONS[-1]
# the newest tested release pip can install (the install hints name it)
NEWEST_ON_INDEX = [v for r in RELEASES if r.on_index for v in r.tested][-1]


def minor_of(version: str) -> str:
    """``"0.19.2"`` -> ``"0.19"`` (pre-release and local parts ignored)."""
    return ".".join(version.split(".")[:2])


def release_of(version: str) -> Optional[Release]:
    """The row of a megatron-core (or Megatron-LM checkout) version; None outside the table."""
    minor = minor_of(version)
    return next((r for r in RELEASES if r.minor == minor), None)


def tested_pairs() -> str:
    """``megatron-core 0.16.1 with Megatron-LM core_v0.16.1, ...`` for messages."""
    return ", ".join(f"megatron-core {'/'.join(r.tested)} with Megatron-LM {r.megatron_lm_tag}"
                     for r in RELEASES)
