"""How the transformer layers are split over the pipeline stages: Megatron-LM's flags for
uneven stages, checked and counted in pure Python before any process group starts.

Deep pipelines give the first and the last stage fewer transformer layers, as they also hold
the embedding and the output layer with the loss. Megatron-Core places the layers itself, from
its TransformerConfig fields (``LayerSplit.config_fields``); this module counts each stage's
layers by the same rules, so that a bad combination stops at the command line with the flag
and the fix named, not inside Megatron's config on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .flag import ConfigError

FIRST = "--decoder-first-pipeline-num-layers"
LAST = "--decoder-last-pipeline-num-layers"
EMBEDDING = "--account-for-embedding-in-pipeline-split"
LOSS = "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"
UNEVEN_FLAGS = (FIRST, LAST, EMBEDDING, LOSS, LAYOUT)

# a layout's letters (Megatron-LM's): E embedding, t transformer layer, L loss, m MTP layer
LAYOUT_LETTERS = "EtLm"


@dataclass(frozen=True)
class LayerSplit:
    """The uneven-stage flags as given; all unset is Megatron's even split."""

    first: Optional[int] = None  # --decoder-first-pipeline-num-layers
    last: Optional[int] = None  # --decoder-last-pipeline-num-layers
    embedding: bool = False  # --account-for-embedding-in-pipeline-split
    loss: bool = False  # --account-for-loss-in-pipeline-split
    layout: Optional[str] = None  # --pipeline-model-parallel-layout

    def given(self) -> List[str]:
        """The flags set, as the user types them."""
        values = (self.first is not None, self.last is not None, self.embedding, self.loss,
                  self.layout is not None)
        return [flag for flag, on in zip(UNEVEN_FLAGS, values) if on]

    @property
    def even(self) -> bool:
        return not self.given()

    def config_fields(self) -> dict:
        """Megatron-Core's TransformerConfig fields for this split."""
        return dict(num_layers_in_first_pipeline_stage=self.first,
                    num_layers_in_last_pipeline_stage=self.last,
                    account_for_embedding_in_pipeline_split=self.embedding,
                    account_for_loss_in_pipeline_split=self.loss,
                    pipeline_model_parallel_layout=self.layout)

    def layers_per_stage(self, num_layers: int, stages: int) -> Tuple[int, ...]:
        """The transformer layers each of ``stages`` pipeline stages builds, as Megatron-Core
        places them; raises ConfigError naming the flag and the fix."""
        self._check_combination(stages)
        if self.layout is not None:
            return tuple(stage.count("t") for stage in
                         layout_stages(self.layout, stages, num_layers))
        if self.first is not None or self.last is not None:
            return _first_and_last(num_layers, stages, self.first, self.last)
        return _accounted(num_layers, stages, self.embedding, self.loss)

    def _check_combination(self, stages: int) -> None:
        given = self.given()
        if self.layout is not None and len(given) > 1:
            raise ConfigError(f"{LAYOUT} places every layer itself: drop "
                              f"{', '.join(g for g in given if g != LAYOUT)} (as in Megatron-LM)")
        if (self.first is not None or self.last is not None) and (self.embedding or self.loss):
            counts = [g for g in given if g in (FIRST, LAST)]
            accounts = [g for g in given if g in (EMBEDDING, LOSS)]
            raise ConfigError(f"{' and '.join(counts)} set the end stages' layers directly: "
                              f"drop {' and '.join(accounts)} (as in Megatron-LM), or count "
                              "one layer fewer there yourself")
        if stages == 1 and (self.first is not None or self.last is not None):
            flags = " and ".join(g for g in given if g in (FIRST, LAST))
            raise ConfigError(f"{flags} need --pipeline-model-parallel-size > 1: with one "
                              "stage every layer is on it")


def _first_and_last(num_layers: int, stages: int, first: Optional[int],
                    last: Optional[int]) -> Tuple[int, ...]:
    """The given end stages take their counts; the stages between share the rest evenly."""
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = stages - (first is not None) - (last is not None)
    given = " + ".join(f"{flag} {n}" for flag, n in ((FIRST, first), (LAST, last))
                       if n is not None)
    if middle_stages == 0 and middle_layers != 0:
        raise ConfigError(f"{given} must add up to --num-layers {num_layers} at "
                          f"--pipeline-model-parallel-size {stages} (no stage in between)")
    if middle_stages and (middle_layers <= 0 or middle_layers % middle_stages):
        raise ConfigError(
            f"--num-layers {num_layers} less {given} leaves {middle_layers} layers for the "
            f"{middle_stages} other stages of --pipeline-model-parallel-size {stages}: they "
            f"need a positive multiple of {middle_stages}")
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [per_middle] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _accounted(num_layers: int, stages: int, embedding: bool, loss: bool) -> Tuple[int, ...]:
    """An even split of the layers plus the embedding and the loss, each counted as a layer
    where asked; the first (last) stage builds one transformer layer fewer for it."""
    total = num_layers + embedding + loss
    if total % stages:
        counted = "".join(f" + 1 ({flag})" for flag, on in ((EMBEDDING, embedding),
                                                              (LOSS, loss)) if on)
        fix = (f"pick --num-layers so that the sum is a multiple of {stages}" if counted else
               f"pick a multiple of {stages}, or give the end stages their own count with "
               f"{FIRST} / {LAST}")
        summed = f"{counted} = {total}" if counted else ""
        raise ConfigError(f"--num-layers {num_layers}{summed} is not divisible by "
                          f"--pipeline-model-parallel-size {stages}; {fix}")
    counts = [total // stages] * stages
    counts[0] -= embedding
    counts[-1] -= loss
    return tuple(counts)


def expand_layout(text: str) -> str:
    """A layout with its repetitions written out and its commas (cosmetic) dropped:
    ``E(tt|)*2tL`` is ``Ett|tt|tL``; ``x*n`` repeats one character (``|`` too), ``(...)*n`` a
    group, and groups may nest."""
    plain = "".join(text.split()).replace(",", "")
    expanded, end = _expand(plain, 0)
    if end != len(plain):
        raise ConfigError(f"{LAYOUT} {text!r}: ')' at position {end} closes no '('")
    return expanded


def _expand(text: str, i: int) -> Tuple[str, int]:
    """Expand from ``i`` up to an unmatched ')' or the end; returns (text, where it stopped)."""
    out = []
    while i < len(text) and text[i] != ")":
        if text[i] == "(":
            piece, i = _expand(text, i + 1)
            if i == len(text):
                raise ConfigError(f"{LAYOUT} {text!r}: a '(' is never closed")
            i += 1
        elif text[i] == "*":
            raise ConfigError(f"{LAYOUT} {text!r}: '*' at position {i} repeats nothing")
        else:
            piece, i = text[i], i + 1
        count, i = _repeat(text, i)
        out.append(piece * count)
    return "".join(out), i


def _repeat(text: str, i: int) -> Tuple[int, int]:
    """The ``*n`` after a piece (1 without one) and the position after it."""
    if i == len(text) or text[i] != "*":
        return 1, i
    end = i + 1
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == i + 1:
        raise ConfigError(f"{LAYOUT} {text!r}: '*' at position {i} needs a count after it")
    return int(text[i + 1:end]), end


def layout_stages(text: str, stages: int, num_layers: int) -> List[str]:
    """The letters of each stage of a layout, checked against the run: one stage per pipeline
    rank, the embedding opening the first and the loss closing the last, --num-layers 't's,
    and a layer on every stage in between (a stage without weights has nothing to step)."""
    parts = expand_layout(text).split("|")
    if not "".join(parts):
        raise ConfigError(f"{LAYOUT} {text!r} is empty; e.g. 'Et|tt|tL' (E embedding, t a "
                          "transformer layer, L loss, '|' between stages)")
    odd = sorted({c for c in "".join(parts) if c not in LAYOUT_LETTERS})
    if odd:
        raise ConfigError(f"{LAYOUT} {text!r}: unknown letter(s) {' '.join(odd)}; a layout "
                          "holds E (embedding), t (transformer layer), L (loss), '|' between "
                          "stages, '(...)*n' and 'x*n' to repeat, commas to read")
    if len(parts) != stages:
        virtual = len(parts) % stages == 0
        raise ConfigError(
            f"{LAYOUT} {text!r} has {len(parts)} stages ('|' between them), "
            f"--pipeline-model-parallel-size is {stages}; give one stage per pipeline rank"
            + (" (virtual stages through a layout are not supported here; "
               "--num-layers-per-virtual-pipeline-stage takes an even split)" if virtual else ""))
    if "m" in "".join(parts):
        raise ConfigError(f"{LAYOUT} {text!r}: MTP layers ('m') are not supported by "
                          "pretrain_gpt_paci.py")
    letters = "".join(parts)
    if letters.count("E") != 1 or not parts[0].startswith("E") or \
            letters.count("L") != 1 or not parts[-1].endswith("L"):
        raise ConfigError(f"{LAYOUT} {text!r}: 'E' (the embedding) must open the first stage "
                          "and 'L' (the loss) close the last, once each")
    if letters.count("t") != num_layers:
        raise ConfigError(f"{LAYOUT} {text!r} holds {letters.count('t')} transformer layers "
                          f"('t'), --num-layers is {num_layers}; make them agree")
    empty = [s for s in range(1, stages - 1) if "t" not in parts[s]]
    if empty:
        raise ConfigError(f"{LAYOUT} {text!r}: stage {empty[0]} holds no transformer layer; "
                          "a stage between the first and the last needs at least one 't'")
    return parts
