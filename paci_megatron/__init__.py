"""PACI for Megatron-Core: a bubble-free asynchronous pipeline schedule with bounded weight
drift, selected with ``--pipeline-schedule paci``. See README.md."""

__version__ = "0.1.0"
