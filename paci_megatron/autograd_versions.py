"""Step weights in place while autograd graphs that saved them are still pending."""

import contextlib
from typing import Sequence

import torch


@contextlib.contextmanager
def keep_version_counters(params: Sequence[torch.Tensor]):
    """Run an in-place optimizer step without invalidating in-flight autograd graphs.

    Autograd saves weights by reference and checks their version counters at backward time;
    a step in between bumps them and backward fails ("modified by an inplace operation").
    PACI wants exactly that backward to read the new values (no stash, no copy), so the
    counters are put back after the step. Safe because the values are read at backward time
    from the same storage; nothing derived from the old values is kept.
    """
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        raise RuntimeError(
            "this torch has no torch._C._autograd._unsafe_set_version_counter, which PACI needs "
            "to step weights while micro-batches are in flight; use torch 2.13"
        )
    params = tuple(params)
    versions = tuple(p._version for p in params)
    yield
    setter(params, versions)


# Layers that derive a tensor from a weight in the forward and let autograd save it would
# backpropagate through the forward-time values after a local step (BackwardAudit shows it).
ZERO_CENTERED_GAMMA = (
    "--pipeline-schedule paci does not support --apply-layernorm-1p (zero-centred LayerNorm "
    "gamma): its forward computes weight + 1 and autograd saves that copy, so a backward after "
    "a local step would use the old gamma while PACI's contract is the current weights; drop "
    "--apply-layernorm-1p or use --pipeline-schedule 1f1b")
