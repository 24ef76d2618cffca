"""No synchronisation between stages in PACI's steady state: logging every iteration runs no
collective over the pipeline group, and flags that would put one there are refused."""

import re
import types

import pytest

from launch import megatron_lm_args, parse_results, read_metrics, run_torchrun
from paci_megatron import run as paci_run
from test_megatron_lm import checkout, run_pretrain_gpt  # noqa: F401 (checkout: a fixture)

P = 2
ITERS = 6
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--untie-embeddings-and-output-weights", "--mock-data", "--log-interval", "1",
         "--train-iters", str(ITERS), "--distributed-timeout-minutes", "2",
         "--pipeline-schedule", "paci"]


@pytest.fixture(scope="module")
def counted_run(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("nosync") / "metrics.jsonl"
    _, out, _ = run_torchrun("tests/workers/count_collectives.py",
                             FLAGS + ["--metrics-file", str(metrics)], nproc=P, timeout=300)
    return parse_results(out), out, read_metrics(metrics)


# dense and MoE layers, the experts over EP = 2 with the alltoall dispatcher, the aux loss,
# the z-loss and the expert bias (their metrics reported every iteration)
MOE = ["--pipeline-model-parallel-size", str(P), "--num-layers", "4", "--moe-layer-freq", "2",
       "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-shared-expert-intermediate-size", "64",
       "--moe-token-dispatcher-type", "alltoall", "--bf16", "--use-distributed-optimizer",
       "--paci-accumulation-factor", "2"]


@pytest.fixture(scope="module")
def counted_moe_run(tmp_path_factory):
    _, out, _ = run_torchrun("tests/workers/count_collectives.py", FLAGS[2:] + MOE, nproc=2 * P,
                             timeout=300)
    return parse_results(out), out


def _no_collective_spans_stages(results, world):
    assert sorted(r["rank"] for r in results) == list(range(world))
    for r in results:
        assert r["count"] == 0, r["calls"]


@pytest.mark.dist
def test_no_pipeline_collective_between_first_and_last_iteration(counted_run):
    _no_collective_spans_stages(counted_run[0], P)


@pytest.mark.dist
def test_no_pipeline_collective_with_moe_layers_split_over_ep(counted_moe_run):
    """Every collective of the steady state, the experts' all-to-alls, their gradients',
    norms' and metrics' reductions among them, stays within a stage."""
    results, out = counted_moe_run
    _no_collective_spans_stages(results, 2 * P)
    assert "> PACI stage 1 MoE (1 MoE layers" in out


@pytest.mark.dist
def test_no_pipeline_collective_through_the_drop_in_with_moe(checkout):
    """Megatron-LM's own pretrain_gpt.py, dense and MoE layers with the expert bias, every
    iteration's training log (its MoE metrics among it) after the first: no collective spans
    two stages. Megatron-LM's timer barriers all ranks at each --log-interval (documented in
    docs/megatron-lm.md), so the interval is beyond the run."""
    from test_megatron_lm import CPU_FLAGS, MODEL_FLAGS, MOE_FLAGS

    at = MODEL_FLAGS.index("--num-layers")
    flags = [*CPU_FLAGS, *MODEL_FLAGS[:at], *MODEL_FLAGS[at + 2:], *MOE_FLAGS,
             "--pipeline-schedule", "paci", "--paci-accumulation-factor", "2",
             "--train-iters", "6", "--log-interval", "100", "--eval-interval", "100"]
    env = {"PYTHONPATH": checkout.pythonpath, "OMP_NUM_THREADS": "1"}
    _, out, _ = run_torchrun("tests/workers/count_collectives.py",
                             ["--drop-in", checkout.script, *flags], nproc=P, timeout=300,
                             env=env)
    _no_collective_spans_stages(parse_results(out), P)


@pytest.mark.dist
def test_log_shows_own_stage_and_the_table_comes_at_the_end(counted_run):
    _, out, records = counted_run
    logged = [r for r in records if "lm_loss" in r]
    assert len(logged) == ITERS
    # the logging (last) stage knows its own drift; the others' are only known at the end
    assert all(r["max_drift"] == [None, 0] for r in logged)
    assert records[-1]["final"] is True and records[-1]["max_drift"] == [1, 0]
    assert records[-1]["skipped_steps"] == [0, 0]
    assert len(re.findall(r"\| PACI drift max \(this stage\) 0 \|", out)) == ITERS
    assert "> stage 0: max drift 1 (bound 1)" in out


@pytest.mark.parametrize("overrides,message", [
    (dict(timing_log_level=1), "--timing-log-level 1"),
    (dict(timing_log_level=2), "--timing-log-level 2"),
    (dict(exit_duration_in_mins=30), "--exit-duration-in-mins"),
    (dict(exit_signal_handler=True), "--exit-signal-handler"),
    (dict(mtp_num_layers=1, pipeline_model_parallel_layout="Etm|tL"), "before the last stage"),
    (dict(num_experts=8, flextron=True), "--flextron"),
    (dict(log_params_norm=True), "--log-params-norm"),
])
def test_megatron_lm_flags_with_stage_crossing_collectives_are_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        paci_run.validate_flags(megatron_lm_args(**overrides))
    paci_run.validate_flags(megatron_lm_args(pipeline_schedule="1f1b", **overrides))  # stock
    if {"mtp_num_layers", "flextron", "log_params_norm"} & set(overrides):  # one stage
        paci_run.validate_flags(megatron_lm_args(pipeline_model_parallel_size=1, **overrides))


def test_runtime_refuses_collectives_inside_the_local_step():
    from paci_megatron.mcore.admission import check_no_cross_stage_grad_reduction

    def check(**config):
        base = dict(mtp_num_layers=None, has_cond_embedder=False, timers=None,
                    barrier_with_L1_time=True)
        model = types.SimpleNamespace(share_embeddings_and_output_weights=False,
                                      config=types.SimpleNamespace(**{**base, **config}))
        pg = types.SimpleNamespace(pp=types.SimpleNamespace(size=lambda: 2), pos_embd=None)
        check_no_cross_stage_grad_reduction(model, pg)

    check()
    check(timers=types.SimpleNamespace(_log_level=0))
    check(timers=types.SimpleNamespace(_log_level=1), barrier_with_L1_time=False)
    check(mtp_num_layers=1)  # MTP is carried by the tied exchange (placement: test_mtp.py)
    for config, message in ((dict(has_cond_embedder=True), "conditional embedders"),
                            (dict(timers=types.SimpleNamespace(_log_level=1)),
                             "--timing-log-level 0")):
        with pytest.raises(ValueError, match=message):
            check(**config)


@pytest.mark.dist
def test_megatron_lm_parser_refuses_timing_barriers(checkout, tmp_path):
    rc, out, err = run_pretrain_gpt(checkout, ["--pipeline-schedule", "paci",
                                               "--timing-log-level", "1"], tmp_path)
    assert rc != 0
    assert "error: --pipeline-schedule paci cannot run --timing-log-level 1" in out + err
