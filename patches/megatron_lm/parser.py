"""PACI's flags in Megatron-LM's own argument parser, wherever ``parse_args`` is called from.
The flags themselves come from the caller (``paci_megatron.config``'s table)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

from .version import _replace, _resolve

# exit_silently(code): how a rank that leaves a start-up error to the reporting rank exits (the
# caller's; it must not exit before the reporting rank printed, as torchrun then stops that one)
ExitSilently = Callable[[int], None]


def _one_line_errors(parser: argparse.ArgumentParser, exit_silently: ExitSilently) -> None:
    """Every rank parses the same flags: a usage error is printed once per node (local rank
    0) as one line, not Megatron-LM's whole usage text once per rank."""
    def error(message: str):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            parser.exit(2, f"{parser.prog}: error: {message}\n")
        exit_silently(2)

    parser.error = error


def install_arguments(add_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
                      exit_silently: ExitSilently,
                      validate: Optional[Callable[[argparse.Namespace], None]] = None) -> None:
    """Add PACI's flags to Megatron-LM's ``parse_args`` wherever it is called from.

    ``parse_args(extra_args_provider, ignore_unknown_args)`` builds its parser, then calls the
    script's ``extra_args_provider(parser)``: the replacement passes a provider that runs the
    script's one (if any) and then ``add_arguments``. ``validate(args)`` (optional) checks the
    parsed PACI flags and raises ``ValueError``, reported as a usage error by one rank; the
    others leave by ``exit_silently(2)``.
    """
    from megatron.training import arguments as mlm_arguments
    from megatron.training import initialize as mlm_initialize

    original = _resolve("megatron.training.arguments.parse_args")[2]

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            _one_line_errors(parser, exit_silently)
            return add_arguments(parser)

        args = original(provider, ignore_unknown_args)
        if validate is not None and not ignore_unknown_args:
            try:
                validate(args)
            except ValueError as exc:
                if args.rank != 0:
                    exit_silently(2)
                print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr,
                      flush=True)
                sys.exit(2)
        return args

    parse_args.__doc__ = original.__doc__
    # initialize.py holds its own reference until 0.17 (from ... import parse_args); others
    # call arguments.parse_args (ft_integration, inprocess_restart, and from 0.18 on
    # arguments.parse_and_validate_args, which pretrain_gpt.py calls itself)
    _replace(mlm_arguments, "parse_args", parse_args)
    if getattr(mlm_initialize, "parse_args", None) is original:
        _replace(mlm_initialize, "parse_args", parse_args)
