"""An optimizer Megatron-LM does not build (``--optimizer nadam``) in Megatron-LM's own run.

Megatron-LM's ``--optimizer`` takes the extra choice; right after parsing, the args say
``adam`` again (``take_optimizer_choice``), so that Megatron-LM checks, builds, saves and loads
exactly what it does for Adam (from 0.18 on its validator treats any other name as an
"emerging" optimizer and turns the distributed optimizer off). The choice is kept in
``args.paci_optimizer``; ``install_inner_optimizer`` then hands each optimizer
``get_megatron_optimizer`` builds to the caller's ``replace(optimizer, config)``, before any
checkpoint is loaded into it.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, List

from .version import _replace, _resolve


def add_optimizer_choice(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    """``name`` as one more choice of Megatron-LM's ``--optimizer`` (if this parser has it)."""
    action = parser._option_string_actions.get("--optimizer")  # argparse keeps no public map
    if action is None or action.choices is None or name in action.choices:
        return
    action.choices = [*action.choices, name]
    action.help = f"{action.help or ''} {help_text}".strip()


def take_optimizer_choice(args: argparse.Namespace, name: str) -> None:
    """After parsing: ``--optimizer name`` becomes ``adam`` for Megatron-LM, ``name`` stays in
    ``args.paci_optimizer``."""
    if getattr(args, "optimizer", None) == name:
        args.paci_optimizer, args.optimizer = name, "adam"


def install_inner_optimizer(replace: Callable[[Any, Any], None]) -> List[str]:
    """Wrap ``get_megatron_optimizer`` where ``setup_model_and_optimizer`` looks it up: each
    optimizer it returns goes to ``replace(optimizer, config)`` first. Returns the names
    patched."""
    from megatron.training import training as mlm_training

    original = _resolve("megatron.training.training.get_megatron_optimizer")[2]

    @functools.wraps(original)
    def get_megatron_optimizer(config, *args, **kwargs):
        optimizer = original(config, *args, **kwargs)
        replace(optimizer, config)
        return optimizer

    return ["get_megatron_optimizer"] if _replace(mlm_training, "get_megatron_optimizer",
                                                  get_megatron_optimizer) else []
