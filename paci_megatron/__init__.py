"""PACI for Megatron-Core: a bubble-free asynchronous pipeline schedule with bounded weight
drift, selected with ``--pipeline-schedule paci``. See README.md."""

from .quiet import silence_fallback_warnings

__version__ = "0.2.0"

silence_fallback_warnings()  # before anything imports megatron.core (see quiet.py)
