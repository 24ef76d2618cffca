"""``compare --project-costs measured``: one stage of the real model is timed before the runs
(a one-stage model of L/P layers with the run's flags), and the projection uses exactly those
costs; the report and stdout say so."""

import json
import sys

import pytest

from launch import REPO, launch
from paci_megatron.tools import tta
from paci_megatron.tools.compare import CompareError, build_parser, _cost_flags, timing_flags
from paci_megatron.simulate import Costs
from paci_megatron.features import WeightPrediction

PREDICT = (WeightPrediction.COST,)  # a run that predicts: its method's pass

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare_costs") / "report"
    proc = launch(
        [sys.executable, "-m", "paci_megatron.tools.compare", "--schedules", "paci",
         "--project-costs", "measured", "--timeout", "400", "--out", str(out), "--",
         "--untie-embeddings-and-output-weights", "--num-layers", "4", "--hidden-size", "32",
         "--seq-length", "16", "--train-iters", "2",
         "--bf16"],  # bf16: the run predicts by default, and the prediction is timed too
        timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_the_projection_uses_the_measured_costs(measured):
    out, stdout = measured
    costs = json.loads((out / "costs.json").read_text())
    assert costs["layers"] == 2 and costs["repeats"] == 8  # 4 layers over P=2
    assert all(costs[k] > 0 for k in ("forward_ms", "backward_ms", "step_ms", "predict_ms"))
    assert (f"measured costs per stage: forward {costs['forward_ms']:.3f} ms, backward "
            f"{costs['backward_ms']:.3f} ms, step {costs['step_ms']:.3f} ms, a predicted "
            f"forward {costs['predict_ms']:.3f} ms more") in stdout
    # P=2, M=8, a=8: the simulator's PACI pace with exactly these costs, stage 0's one stale
    # forward in every 8 paying for its prediction at the run's own measured cost (its move +
    # restore over its forward, stage 0's: the last stage predicts nothing)
    final = [json.loads(l) for l in (out / "paci.jsonl").read_text().splitlines()][-1]
    own = final["predict_ms"][0] / final["method_forward_ms"][0]
    timed = Costs(costs["forward_ms"] / 1e3, costs["backward_ms"] / 1e3,
                  costs["step_ms"] / 1e3, predict=own * costs["forward_ms"] / 1e3)
    _, paci = tta.seconds_per_iteration(tta.RunShape("paci", 2, 8, 8, passes=PREDICT), timed)
    assert paci > tta.seconds_per_iteration(tta.RunShape("paci", 2, 8, 8), timed)[1]
    report = (out / "report.md").read_text()
    row = next(l for l in report.splitlines() if l.startswith("| paci |"))
    assert row.split("|")[7].strip() == f"{paci:.4g}"
    assert "measured on the real model (median of 8; a one-stage model of 2 layers" in report
    assert (f"paci: {own:.3g} forwards a predicted forward (by stage {own:.1f}/-), 0 a step "
            "on this machine (its run's timing)") in report


def test_the_report_says_what_the_prediction_cost_in_the_run(measured):
    """The run's own timing of its predicted forwards (stage 0; the last stage predicts
    none), as its final metrics record carries it, in forwards of the same stage."""
    out, stdout = measured
    final = [json.loads(l) for l in (out / "paci.jsonl").read_text().splitlines()][-1]
    (predict, none), (forward, _) = final["predict_ms"], final["method_forward_ms"]
    assert predict > 0 and forward > 0 and none is None
    line = ("Each method's own cost in the projections with it, in forwards of the same "
            "stage (a predicted forward's move + restore;")
    assert line in (out / "report.md").read_text() and line in stdout
    assert f"forwards a predicted forward (by stage {predict / forward:.1f}/-)" in stdout


def test_timing_flags_make_a_one_stage_model():
    flags = ["--num-layers", "8", "--hidden-size", "64", "--save", "ckpt", "--paci-max-drift",
             "3", "--pipeline-model-parallel-size=4", "--measure-memory", "--lr", "1e-3"]
    assert timing_flags(flags, 2) == ["--hidden-size", "64", "--lr", "1e-3", "--num-layers", "2",
                                      "--pipeline-model-parallel-size", "1",
                                      "--pipeline-schedule", "1f1b"]


def test_measured_costs_and_cost_flags_are_exclusive():
    args = build_parser().parse_args(["--out", "x", "--project-costs", "measured",
                                      "--project-step-ms", "3"])
    with pytest.raises(CompareError, match="--project-step-ms and --project-costs measured"):
        _cost_flags(args)
    args = build_parser().parse_args(["--out", "x"])
    _cost_flags(args)
    assert (args.project_forward_ms, args.project_backward_ms, args.project_step_ms,
            args.project_predict_ms) == (1, 2, 0, 0)
    args = build_parser().parse_args(["--out", "x", "--project-costs", "measured",
                                      "--project-predict-ms", "0.5"])
    with pytest.raises(CompareError, match="--project-predict-ms and --project-costs measured"):
        _cost_flags(args)
