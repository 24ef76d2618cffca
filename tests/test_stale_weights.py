"""--paci-stale-grad-weight: the buffer scalings leave w ** drift on every micro-batch's
gradient and a weighted mean at the step, for every drift pattern the schedules produce."""

import random
import re

import pytest

from paci_megatron.executor import DriftStats
from paci_megatron.schedule import Op, build
from paci_megatron.features.stale_weights import StaleGradWeights


def _weighted_by_scaling(weight, drifts, grads):
    """What the runtime's buffer holds: scale by each factor, then add the backward."""
    sw, buf = StaleGradWeights(weight), 0.0
    for d, g in zip(drifts, grads):
        buf = buf * sw.before_backward(d) + g
    return buf * sw.finish()


@pytest.mark.parametrize("weight", [0.5, 0.2, 1.0])
@pytest.mark.parametrize("drifts", [(1, 1, 1, 0), (2, 1, 1, 0, 0), (0, 0), (1,), (3, 2, 1)])
def test_each_gradient_ends_with_weight_to_the_drift_and_the_mean_scale(weight, drifts):
    grads = [random.Random(i).uniform(-1, 1) for i in range(len(drifts))]
    want = sum(weight ** d * g for d, g in zip(drifts, grads))
    want *= len(drifts) / sum(weight ** d for d in drifts)
    assert _weighted_by_scaling(weight, drifts, grads) == pytest.approx(want, rel=1e-12)


def test_fresh_groups_are_left_exactly_alone():
    sw = StaleGradWeights(0.5)
    assert [sw.before_backward(0) for _ in range(4)] == [1.0] * 4
    assert sw.finish() == 1.0


def test_a_rising_drift_is_refused():
    sw = StaleGradWeights(0.5)
    sw.before_backward(0)
    with pytest.raises(RuntimeError, match="drift rose"):
        sw.before_backward(1)


@pytest.mark.parametrize("weight", [0.0, -0.5, 1.5])
def test_weights_outside_the_unit_interval_are_refused(weight):
    with pytest.raises(ValueError, match="--paci-stale-grad-weight"):
        StaleGradWeights(weight)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("accumulation", [1, 2, 3, 4, 8])
def test_the_drift_never_rises_between_two_steps_of_any_paci_stage(stages, accumulation):
    """The property the in-place weighting relies on, on the action lists that run."""
    sched = build("paci", stages, accumulation, 2 * stages * accumulation)
    seen = set()
    for s, actions in enumerate(sched.stages):
        drift, sw = DriftStats(s, None), StaleGradWeights(0.5)
        for act in actions:
            if act.op is Op.FORWARD:
                drift.on_forward(act.mb)
            elif act.op is Op.BACKWARD:
                drift.on_backward(act.mb)
                _mb, fwd, ver = drift.log[-1]
                sw.before_backward(ver - fwd)  # raises if it rose
            elif act.op is Op.STEP:
                sw.finish()
                sw.reset()
                drift.on_step()
        seen |= set(drift.histogram)
    assert max(seen) == -(-(stages - 1) // accumulation)  # the bound is reached


@pytest.mark.parametrize("argv,message", [
    (["--paci-stale-grad-weight", "0"], "--paci-stale-grad-weight 0 must be in (0, 1]"),
    (["--paci-stale-grad-weight", "1.5"], "--paci-stale-grad-weight 1.5 must be in (0, 1]"),
    (["--pipeline-schedule", "1f1b", "--paci-stale-grad-weight", "0.5"], "only applies"),
])
def test_bad_weights_are_refused_by_both_entry_points(argv, message, capsys):
    assert_refused_by_both_entry_points(argv, message, capsys)


def assert_refused_by_both_entry_points(argv, message, capsys):
    """``argv`` ends with one PACI flag and its value (after an optional --pipeline-schedule):
    pretrain_gpt_paci.py's parser and the Megatron-LM drop-in's check both refuse it."""
    from paci_megatron import run as paci_run
    from paci_megatron.arguments import parse_and_validate
    from launch import megatron_lm_args

    with pytest.raises(SystemExit):
        parse_and_validate(["--pipeline-schedule", "paci", "--pipeline-model-parallel-size", "2",
                            "--untie-embeddings-and-output-weights"] + argv, world_size=2)
    assert message in capsys.readouterr().err
    schedule = argv[1] if argv[0] == "--pipeline-schedule" else "paci"
    dest = argv[-2].lstrip("-").replace("-", "_")
    with pytest.raises(ValueError, match=re.escape(message)):
        paci_run.validate_flags(megatron_lm_args(pipeline_schedule=schedule,
                                               **{dest: float(argv[-1])}))


def test_paci_does_not_weigh_by_default_and_the_weights_are_one_flag_away():
    from paci_megatron.arguments import parse_and_validate
    from paci_megatron.features.stale_weights import DEFAULT_WEIGHT

    def weight(*argv):
        _args, opts = parse_and_validate(["--pipeline-model-parallel-size", "2",
                                          "--untie-embeddings-and-output-weights", *argv],
                                         world_size=2)
        return opts.stale_grad_weight

    assert DEFAULT_WEIGHT == 1.0  # the paper-regime study (docs/convergence.md)
    assert weight() == DEFAULT_WEIGHT
    assert weight("--paci-stale-grad-weight", "0.2") == 0.2
    assert weight("--paci-stale-grad-weight", "0.5") == 0.5
    assert weight("--pipeline-schedule", "1f1b") == 1.0
