"""Uneven pipeline stages under PACI through pretrain_gpt_paci.py (issue 51): P = 3 with six
layers split 1/4/1, once by Megatron-LM's first/last flags and once by the layout
``Et|tttt|tL``, two launches of 3 processes. Each stage holds the layers it should, every
stage's drift reaches its bound, and the two ways of saying the split train the same model."""

import math
import re

import pytest

from launch import train_paci

pytestmark = pytest.mark.dist

P, A = 3, 1  # a = 1: the bounds are 2, 1, 0
TINY = ["--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "4", "--lr", "3e-3", "--hidden-dropout", "0.1",
        "--pipeline-schedule", "paci", "--paci-accumulation-factor", str(A),
        "--distributed-timeout-minutes", "2"]
SPLITS = {"flags": ["--decoder-first-pipeline-num-layers", "1",
                    "--decoder-last-pipeline-num-layers", "1"],
          "layout": ["--pipeline-model-parallel-layout", "Et|tttt|tL"]}
LAYERS = [[1], [2, 3, 4, 5], [6]]  # Megatron's global layer numbers, per stage
DRIFT = re.compile(r"> stage (\d+): max drift (\d+) \(bound (\d+)\)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven")
    return {name: train_paci(TINY + flags, out / f"{name}.jsonl", nproc=P, timeout=240)
            for name, flags in SPLITS.items()}


@pytest.mark.parametrize("split", SPLITS)
def test_each_stage_holds_the_layers_of_its_split(split, runs):
    run = runs[split]
    assert run["summary"]["layers"] == LAYERS  # read from each stage's built model
    for stage, text in enumerate(["transformer layer 1", "transformer layers 2-5",
                                  "transformer layer 6"]):
        assert f"= pipeline stage {stage} ({text})," in run["out"]


@pytest.mark.parametrize("split", SPLITS)
def test_every_stage_drift_reaches_its_bound(split, runs):
    run = runs[split]
    lines = {int(s): (int(most), int(bound)) for s, most, bound in DRIFT.findall(run["out"])}
    bounds = [math.ceil((P - 1 - s) / A) for s in range(P)]
    assert bounds == [2, 1, 0]
    assert lines == {s: (bounds[s], bounds[s]) for s in range(P)}
    assert [row["max"] for row in run["summary"]["drift"]] == bounds
    assert all(math.isfinite(x) for x in run["summary"]["losses"])


def test_the_layout_trains_as_the_first_and_last_flags(runs):
    """The same split said two ways builds the same stages: every loss and every stage's
    weights at the end are equal, bit for bit."""
    flags, layout = runs["flags"]["summary"], runs["layout"]["summary"]
    assert len(flags["losses"]) == 4
    assert layout["losses"] == flags["losses"]
    assert layout["weights_sha256"] == flags["weights_sha256"]
    assert len(set(flags["weights_sha256"])) == P


def test_every_stage_times_its_own_forwards_for_the_cost_lines(runs):
    """Each stage's mean forward (``stage_forward_ms``), which the end-of-run projection
    takes as that stage's pace, reaches the summary and the stage's drift line."""
    for run in runs.values():
        paces = [row["stage_forward_ms"] for row in run["summary"]["drift"]]
        assert len(paces) == P and all(ms > 0 for ms in paces)
        assert len(re.findall(r"> stage \d+: max drift .*, forward \d+\.\d\d ms", run["out"])) == P
