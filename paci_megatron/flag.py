"""One command-line flag as data, and the value parsers the flags share.

Pure Python. A ``Flag`` is added to any argparse parser (``pretrain_gpt_paci.py``'s or
Megatron-LM's, through ``patches/megatron_lm``), so PACI's flags are written once
(``config.paci_flags``). A parser's errors name the flag: argparse prefixes them with it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence


class ConfigError(ValueError):
    """A bad flag or combination of flags; the message names the flag and the fix."""


def bounded_int(name: str, low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a whole number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {value}")
        return value

    return parse


def positive(name: str):
    return bounded_int(name, 1)


def bounded_float(name: str, low: float = 0.0, high: float = float("inf"),
                  low_open: bool = False, high_open: bool = False):
    """A finite number in [low, high] (or open ends)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a number, got {text!r}")
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if not math.isfinite(value) or too_low or too_high:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"{name} must be a finite number in {span}, "
                                             f"got {text}")
        return value

    return parse


def non_negative_float(name: str):
    return bounded_float(name)


def probability(name: str):
    return bounded_float(name, 0.0, 1.0, high_open=True)


def path(name: str):
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} needs a path, got an empty string")
        return text

    return parse


@dataclass(frozen=True)
class Flag:
    """One flag: its argparse arguments, and the value that means "not asked for" (a flag
    set to anything else is refused under a schedule it does not apply to)."""

    name: str
    help: str
    type: Optional[Callable[[str], Any]] = None
    default: Any = None
    choices: Optional[Sequence[str]] = None
    metavar: Optional[str] = None
    switch: bool = False  # store_true
    negatable: bool = False  # --name and --no-name; None when neither is given (the default)
    hidden: bool = False  # left out of --help (a test hook)
    neutral: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, group, default: Any = None) -> None:
        kwargs: Dict[str, Any] = {"help": argparse.SUPPRESS if self.hidden else self.help,
                                  "default": self.default if default is None else default}
        if self.switch:
            kwargs["action"] = "store_true"
        elif self.negatable:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=self.type, choices=self.choices, metavar=self.metavar)
        kwargs.update(self.extra)
        group.add_argument(self.name, **kwargs)

    def is_set(self, args) -> bool:
        value = getattr(args, self.dest, None)
        return value is not None and value != self.neutral and value is not False


@dataclass(frozen=True)
class RemovedFlag:
    """A flag a release took out: given, it stops the parse with what replaced it (kept for
    one release after the removal, then dropped from the table)."""

    name: str
    release: str  # the release that removed it
    instead: str  # what replaced it, as a sentence that names the flags to use

    def message(self) -> str:
        return f"was removed in paci-megatron {self.release}: {self.instead}"

    def add_to(self, group) -> None:
        removed = self

        class Refuse(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):
                raise argparse.ArgumentError(self, removed.message())

        group.add_argument(self.name, nargs="?", action=Refuse, dest=argparse.SUPPRESS,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)
