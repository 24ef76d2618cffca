"""Adapters around Megatron-Core: builders (``build``) and the runtime used by the executor.

Together with ``paci_megatron.patches`` these are the only modules that import Megatron internals.
"""
