"""With a whole group's gradient, the weight prediction one step ahead is Megatron's own
optimizer step, to fp32 rounding: real DDP, ``Float16OptimizerWithFloat16Params`` and the
distributed optimizer, clipping active, bf16 and fp16 (a dynamic loss scale), weight decay on
some param groups only, AdamW and L2 Adam, SGD with and without momentum (the worker is
tests/workers/prediction_step_cases.py). The runtime and the emulator share the prediction's
formulas, so this is their independent reference."""


import pytest

from launch import worker_rows

pytestmark = pytest.mark.dist

WORKER = "tests/workers/prediction_step_cases.py"
ONE = ["bf16_adamw", "fp16_adamw", "bf16_adam_l2", "fp16_adam_l2", "bf16_sgd_momentum",
       "bf16_sgd", "bf16_noclip", "layerwise"]
TWO = ["dp2_bf16_adamw", "dp2_distopt_bf16_adamw", "dp2_distopt_fp16_adam_l2",
       "dp2_fp16_sgd_momentum"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return worker_rows(WORKER, tmp_path_factory.mktemp("prediction_step"), [(1, ONE), (2, TWO)])


@pytest.mark.parametrize("case", ONE[:-1] + TWO)
def test_the_prediction_with_the_whole_gradient_is_megatrons_step(case, rows):
    for row in rows[case]:
        # the step moved the weights by ~lr; the prediction made the same move, to within
        # fp32 rounding of the weights themselves
        assert row["step"] > 1e-3
        assert row["moved"] == pytest.approx(row["step"], rel=1e-3)
        assert row["max_diff"] <= 4 * 2 ** -23 * max(1.0, row["max_weight"])
        assert row["max_diff"] <= 1e-4 * row["step"]
        if row["clip"]:
            assert row["grad_norm"] > 3 * row["clip"]  # clipping acted, strongly
        assert row["host_syncs"] == 0
        assert row["klasses"] == 2 and row["minors"] >= 1  # two param groups: one a minor


def test_data_parallel_ranks_agree_where_megatron_agrees(rows):
    """Replicated weights (no distributed optimizer): both ranks predict the same step (the
    group's gradient is reduced); the distributed optimizer: each rank its own shard."""
    for case in TWO:
        first, second = rows[case]
        assert first["grad_norm"] == second["grad_norm"]


def test_the_layer_by_layer_move_is_the_whole_stage_move(rows):
    """--paci-weight-prediction-overlap on CPU (no side stream: the hooks move in place): the
    predicted forward is the whole-stage move's bit for bit, the weights after it are the
    ones before it, and a later plain forward sees no hook."""
    (row,) = rows["layerwise"]
    assert row["layers"] == 2 and row["units"] == 2 and row["outside"] >= 1
    assert row["moved"] and row["equal"] and row["restored"] and row["plain_again"]
