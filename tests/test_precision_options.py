"""Megatron-LM's precision and memory options against PACI's convergence methods, decided when
the flags are read (before the model is built): FP8/FP4 weights and the precision-aware
optimizer turn the default weight prediction off with a start-up line saying why (and an
explicit request is refused, naming both flags); the MXFP8 buffer that is also the gradient
buffer is refused under PACI; CUDA graphs are refused beside the layer-by-layer move. Single
process: the drop-in's validator on Megatron-LM's parsed flags (``megatron_lm_args``), before
and after Megatron-LM's own validate_args has rewritten them. And one launch of 4 gloo ranks:
the grad norm with several distributed-optimizer instances."""

import pytest
import torch

from launch import megatron_lm_args
from messages import names_flag

from paci_megatron import run as paci_run
from paci_megatron.flag import ConfigError

# Megatron-LM's flags that keep weights in uint8 buffers, by release: 0.16 has --fp4-param,
# 0.17 on --fp4-param-gather; --fp8-param-gather (FP8 and MXFP8 recipes) in all of them
LOW_PRECISION = [("--fp8-param-gather", "fp8_param_gather"),
                 ("--fp4-param-gather", "fp4_param_gather"), ("--fp4-param", "fp4_param")]
DIST_OPT = dict(bf16=True, use_distributed_optimizer=True)


def _refused(**flags) -> str:
    with pytest.raises(ConfigError) as info:
        paci_run.validate_flags(megatron_lm_args(**flags))
    return str(info.value)


@pytest.mark.parametrize("flag,dest", LOW_PRECISION)
def test_fp8_and_fp4_weights_turn_the_default_prediction_off_and_say_why(flag, dest):
    """Their weights live in uint8 buffers the prediction's flat state leaves out (every
    linear weight unpredicted, its gradient missing from the clipping norm): the default is
    off at flag time, and the start-up line names the flag and the fix."""
    cfg = paci_run.validate_flags(megatron_lm_args(**DIST_OPT, **{dest: True}))
    assert not cfg.method("weight_prediction")
    line = cfg.notes[0]
    assert line.startswith("> PACI: weight prediction (on by default) is off for this run")
    assert names_flag(line, flag) and "uint8" in line and f"drop {flag}" in line
    assert paci_run.validate_flags(megatron_lm_args(**DIST_OPT)).method("weight_prediction")


@pytest.mark.parametrize("flag,dest", LOW_PRECISION)
def test_asking_for_prediction_or_lookahead_with_fp8_or_fp4_weights_is_refused(flag, dest):
    message = _refused(**DIST_OPT, **{dest: True}, paci_weight_prediction=True)
    assert names_flag(message, "--paci-weight-prediction") and names_flag(message, flag)
    assert f"drop {flag}" in message and "drop --paci-weight-prediction" in message
    message = _refused(**DIST_OPT, **{dest: True}, paci_lookahead=1.0)
    assert message.startswith("--paci-lookahead 1 does not move FP8 or FP4 weights")
    assert names_flag(message, flag)


@pytest.mark.parametrize("flags,named", [
    (dict(use_precision_aware_optimizer=True), ["--use-precision-aware-optimizer"]),
    # Megatron-LM's names before its validate_args, torch dtypes after it
    (dict(use_precision_aware_optimizer=True, main_params_dtype="fp16", exp_avg_dtype="fp8",
          exp_avg_sq_dtype="fp32"),
     ["--use-precision-aware-optimizer", "--main-params-dtype fp16", "--exp-avg-dtype fp8"]),
    (dict(exp_avg_sq_dtype=torch.bfloat16, main_params_dtype=torch.float32),
     ["--exp-avg-sq-dtype bf16"]),
])
def test_the_precision_aware_optimizer_turns_the_default_off_at_flag_time(flags, named):
    """Today's bind-time error came after the model and any checkpoint were built and told the
    user to drop Megatron's flag: the default now turns off when the flags are read, saying
    why; an explicit request is refused then, naming both flags and the fix."""
    cfg = paci_run.validate_flags(megatron_lm_args(**DIST_OPT, **flags))
    assert not cfg.method("weight_prediction")
    line = cfg.notes[0]
    assert all(name in line for name in named), line
    assert "fp32 main copies" in line and f"drop {named[0].split()[0]}" in line
    message = _refused(**DIST_OPT, **flags, paci_weight_prediction=True)
    assert names_flag(message, "--paci-weight-prediction")
    assert all(name in message for name in named)
    assert f"drop {named[0].split()[0]}" in message and "drop --paci-weight-prediction" in message
    message = _refused(**DIST_OPT, **flags, paci_lookahead=2.0)
    assert message.startswith("--paci-lookahead 2 does not support") and named[0] in message


def test_fp32_state_dtypes_change_nothing():
    for value in ("fp32", torch.float32):
        cfg = paci_run.validate_flags(megatron_lm_args(
            **DIST_OPT, main_params_dtype=value, exp_avg_dtype=value, exp_avg_sq_dtype=value,
            use_precision_aware_optimizer=False))
        assert cfg.method("weight_prediction") and cfg.notes == ()


def test_the_mxfp8_buffer_shared_with_the_gradients_is_refused_under_paci():
    """--reuse-grad-buf-for-mxfp8-param-ag makes the weights' all-gather buffer the gradient
    buffer; under PACI weights are gathered while it holds a group's partial gradient, so
    the flag is refused under paci (named, with the fix), not under 1f1b."""
    flags = dict(**DIST_OPT, fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)
    message = _refused(**flags)
    assert names_flag(message, "--reuse-grad-buf-for-mxfp8-param-ag")
    assert "drop --reuse-grad-buf-for-mxfp8-param-ag" in message and "1f1b" in message
    for explicit in (dict(paci_weight_prediction=False), dict(paci_lookahead=None)):
        assert "--reuse-grad-buf-for-mxfp8-param-ag" in _refused(**flags, **explicit)
    stock = megatron_lm_args(**flags)
    stock.pipeline_schedule = "1f1b"
    assert paci_run.validate_flags(stock) is None


GRAPHS = [(dict(enable_cuda_graph=True), "--enable-cuda-graph"),
          (dict(external_cuda_graph=True), "--external-cuda-graph"),
          # after Megatron-LM's validate_args, which turns the two into --cuda-graph-impl
          (dict(cuda_graph_impl="local"), "--cuda-graph-impl local"),
          (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl transformer_engine")]


@pytest.mark.parametrize("graphs,named", GRAPHS)
def test_cuda_graphs_are_refused_beside_the_layer_by_layer_move(graphs, named):
    """A CUDA graph replays a layer without its forward hooks, where the layer-by-layer move
    runs: refused when the flags are read, naming both flags and the fix."""
    message = _refused(bf16=True, paci_weight_prediction_overlap=True, **graphs)
    assert names_flag(message, "--paci-weight-prediction-overlap") and named in message
    assert "drop --paci-weight-prediction-overlap" in message
    assert f"drop {named.split()[0]}" in message
    cfg = paci_run.validate_flags(megatron_lm_args(bf16=True, **graphs))
    assert not cfg.method("weight_prediction").overlap  # the whole-stage move
    assert paci_run.validate_flags(megatron_lm_args(
        bf16=True, paci_weight_prediction_overlap=True, cuda_graph_impl="none")).method("weight_prediction").overlap


@pytest.mark.dist
def test_with_several_optimizer_instances_the_norm_counts_each_shard_once(tmp_path):
    """--num-distributed-optimizer-instances N: every instance holds every shard of a stage's
    gradient, so a norm summed over the stage's whole tensor x data-parallel group is sqrt(N)
    too large and the step over-clips (with the prediction off too). The group PACI hands the
    optimizer is the stage's part of this rank's instance, as Megatron's own (over all
    stages) is: the norm is the stage gradient's (tests/workers/grad_stats_cases.py, 4 ranks
    on gloo). With one instance it stays the stage's whole group."""
    from launch import worker_rows

    rows = worker_rows("tests/workers/grad_stats_cases.py", tmp_path,
                       [(4, ["p1_n2", "p2_n2", "p2_n1"])], timeout=180)
    for case in ("p1_n2", "p2_n2", "p2_n1"):
        assert len(rows[case]) == 4
        for row in rows[case]:
            assert row["norm"] == pytest.approx(row["expected"], rel=1e-6), (case, row)
            assert set(row["group"]) <= set(row["stage_ranks"])  # stage-local
            assert len(row["group"]) * row["instances"] == len(row["stage_ranks"])
