"""Stage features: PACI's convergence methods and options, one object each (see ``base``).

Plain PACI is the empty list. ``FEATURES`` lists every feature with flags, in the order their
hooks run; ``build_features`` makes the ones a resolved configuration asks for.
"""

from __future__ import annotations

from typing import List

from . import lookahead, weight_prediction
from .base import StageContext, StageFeature
from .lookahead import Lookahead
from .stale_correction import StaleGradCorrection
from .stale_weights import StaleGradWeights
from .weight_prediction import WeightPrediction

FEATURES = (StaleGradWeights, StaleGradCorrection, WeightPrediction, Lookahead)


def build_features(cfg) -> List[StageFeature]:
    """The features ``cfg`` (a ``config.PaciConfig``, or anything with its fields) turns on."""
    return [f for f in (cls.from_config(cfg) for cls in FEATURES) if f is not None]


def method_cost_lines(rows: List[dict], prefix: str = "> stage") -> List[str]:
    """The end-of-run lines of every method with a cost of its own (the prediction's move
    and restore, the look-ahead's pass), from every stage's summary; none where none ran."""
    return (weight_prediction.cost_lines(rows, prefix)
            + lookahead.cost_lines(rows, prefix))


__all__ = ["FEATURES", "Lookahead", "StageContext", "StageFeature", "StaleGradCorrection",
           "StaleGradWeights", "WeightPrediction", "build_features", "method_cost_lines"]
