"""PACI's convergence methods, one file each (see ``base.Method``), and their registry.

Plain PACI is no method. ``METHODS`` lists every method, in the order their hooks run: adding
or removing one is its file and its line here. Pure Python at import.
"""

from __future__ import annotations

from typing import List

from .base import Method, StageContext, StageFeature
from .lookahead import Lookahead
from .weight_prediction import WeightPrediction

METHODS = (
    WeightPrediction,  # --paci-weight-prediction (the default), --paci-weight-prediction-overlap
    Lookahead,  # --paci-lookahead C
)


def method_named(name: str) -> type:
    for method in METHODS:
        if method.name == name:
            return method
    raise KeyError(f"no method {name!r}; the methods are {[m.name for m in METHODS]}")


def build_features(cfg) -> List[StageFeature]:
    """The stage features of the methods ``cfg`` (a ``config.PaciConfig``) turns on."""
    return [method_named(name).build(settings) for name, settings in cfg.methods]


def method_cost_lines(rows: List[dict], prefix: str = "> stage") -> List[str]:
    """The end-of-run lines of every method with a cost of its own, from every stage's
    summary; none where none ran."""
    return [line for method in METHODS for line in method.cost_lines(rows, prefix)]


__all__ = ["METHODS", "Lookahead", "Method", "StageContext", "StageFeature", "WeightPrediction",
           "build_features", "method_cost_lines", "method_named"]
