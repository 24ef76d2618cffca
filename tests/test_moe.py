"""MoE GPTs under PACI through pretrain_gpt_paci.py (issue 50, the first part): Megatron-LM's MoE
flags, their refusals, and a P=2 x EP=2 run against stock 1F1B's. That the runtime steps
exactly as defined with MoE layers (the aux loss, shared experts, EP inside a stage, both
dispatchers, the weight prediction) is checked bit for bit against the one-process reference
in tests/test_reference.py (``*moe*``)."""

import re

import pytest

from launch import checkpoint_of_iteration, train_paci
from messages import error_line, names_flag
from paci_megatron.arguments import parse_and_validate

P2_EP2 = ["--pipeline-model-parallel-size", "2", "--num-experts", "4",
          "--expert-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]


def _refused(argv, capsys, world_size=4):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(argv, world_size=world_size)
    assert exit_info.value.code == 2
    return error_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv,flag,fix", [
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size", "--num-experts"),
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias", "--num-experts"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--expert-model-parallel-size",
     "divide"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk", "exceeds"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias", "sigmoid"),
])
def test_megatron_lms_moe_rules_name_the_flag(argv, flag, fix, capsys):
    line = _refused(["--pipeline-model-parallel-size", "2", *argv], capsys)
    assert names_flag(line, flag) and fix in line, line


@pytest.mark.parametrize("extra", [
    ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"], ["--fp16"]])
def test_the_expert_bias_and_fp16_are_accepted_under_paci(extra):
    """The expert bias moves at each local step by rate x a / N (``mcore/expert_bias.py``) and
    the aux loss's gradient is scaled before each backward at its stage's loss scale
    (``mcore/aux_losses.py``); both are checked bit for bit in test_reference (``*moe*``)."""
    _args, cfg = parse_and_validate([*P2_EP2, "--use-distributed-optimizer", *extra],
                                    world_size=4)
    assert cfg.shape.num_stages == 2


def test_the_prediction_needs_the_distributed_optimizer_with_experts_split_over_ep(capsys):
    """Without the distributed optimizer the dense gradients repeat on every EP rank, and the
    prediction's clipping norm reduces dense and expert gradients over one group: the default
    turns off (the start-up line says why), an explicit request is refused."""
    _args, cfg = parse_and_validate([*P2_EP2, "--bf16"], world_size=4)
    assert cfg.method("weight_prediction") is None
    assert "--use-distributed-optimizer" in cfg.notes[0]
    line = _refused([*P2_EP2, "--bf16", "--paci-weight-prediction"], capsys)
    assert names_flag(line, "--paci-weight-prediction") and "--use-distributed-optimizer" in line
    _args, cfg = parse_and_validate([*P2_EP2, "--bf16", "--use-distributed-optimizer"],
                                    world_size=4)
    assert cfg.method("weight_prediction") is not None


@pytest.mark.dist
def test_a_moe_gpt_trains_under_paci_at_p2_by_ep2_beside_stock_1f1b(tmp_path):
    """8 layers alternating dense and MoE (4 experts top-2, the aux loss, sigmoid scores with
    the expert bias, a shared expert, the alltoall dispatcher), the experts split over the 2 data-parallel ranks of each of 2
    stages, bf16 with the distributed optimizer and the default weight prediction: PACI trains
    with drift at its bound, its stages' start-up exchange covers the expert norm's group, and
    stock 1F1B runs the same config as the baseline (the same first loss: nothing stepped)."""
    flags = [*P2_EP2, "--num-layers", "8", "--moe-layer-freq", "2", "--moe-aux-loss-coeff",
             "0.01", "--moe-shared-expert-intermediate-size", "64", "--moe-router-score-function",
             "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-token-dispatcher-type", "alltoall", "--bf16", "--use-distributed-optimizer",
             "--train-iters", "6", "--lr-warmup-iters", "1"]
    paci = train_paci(flags, tmp_path / "paci.jsonl", nproc=4, timeout=300)
    stock = train_paci(flags + ["--pipeline-schedule", "1f1b"], tmp_path / "stock.jsonl",
                       nproc=4, timeout=300)
    losses = {name: [r["lm_loss"] for r in run["records"] if "lm_loss" in r]
              for name, run in (("paci", paci), ("1f1b", stock))}
    assert len(losses["paci"]) == len(losses["1f1b"]) == 6
    assert losses["paci"][0] == losses["1f1b"][0]
    assert losses["paci"][-1] < losses["paci"][0] - 0.2
    drift = paci["summary"]["drift"]
    assert [row["max"] for row in drift] == [row["bound"] for row in drift] == [1, 0]
    assert drift[0]["predicted_forwards"] and drift[0]["prediction_kernel"] in ("fused", "plain")
    assert all("grad-stats" in row["startup_exchange"] for row in drift)
    # the MoE metrics, stage-local: the iteration log (the last stage's) and every stage's
    # run mean over its own 2 MoE layers; the first iteration's last stage saw the same
    # forwards under both schedules (nothing stepped before), so the same value, bit for bit
    balance = {name: [r["load_balancing_loss"] for r in run["records"] if "lm_loss" in r]
               for name, run in (("paci", paci), ("1f1b", stock))}
    assert len(balance["paci"]) == 6 and balance["paci"][0] == balance["1f1b"][0]
    for run in (paci, stock):
        rows = run["summary"]["moe"]
        assert [(r["moe_layers"], r["iterations"]) for r in rows] == [(2, 6), (2, 6)], rows
        assert all(0.5 < r["means"]["load_balancing_loss"] < 2.0 for r in rows)
    assert "> PACI stage 1 MoE (2 MoE layers, mean over 6 iterations)" in paci["out"]
    # tokens per expert, each router's over the run on this rank: stock routed each of its 6
    # iterations' 8 micro-batches of 2 x 32 tokens to 2 experts; PACI those, and on stage 0
    # the forward the final drain dropped (P - 1 - s = 1); the last stage's run alike
    slots = 2 * 32 * 2
    for run, extra in ((stock, (0, 0)), (paci, (1, 0))):
        rows = run["summary"]["moe"]
        for stage, row in enumerate(rows):
            assert len(row["tokens_per_expert"]) == 2, row  # its 2 MoE layers' routers
            assert all(len(layer) == 4 for layer in row["tokens_per_expert"])
            assert [sum(layer) for layer in row["tokens_per_expert"]] == \
                [(6 * 8 + extra[stage]) * slots] * 2, (stage, row["tokens_per_expert"])
    assert re.search(r"> PACI stage 0 MoE tokens per expert \(this rank's, over the run\): "
                     r"from 0\.\d+ to [12]\.\d+ of the mean, 6272 routed a router", paci["out"])


@pytest.mark.dist
def test_a_moe_gpt_with_the_expert_bias_resumes_bit_for_bit(tmp_path):
    """P = 2 x EP = 2 in bf16, a = 1 of 4 micro-batches, the expert bias moving at every local
    step: 8 iterations saving at 4 (a save drains) equal that checkpoint loaded and 4 more:
    every loss, and every stage's weights and expert bias at the end (a persistent buffer, in
    the checkpoint). The checkpoint holds one copy of the dense weights, so this fails where
    the EP ranks of a stage clip by different norms (their dense weights then differ)."""
    flags = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-experts", "4",
             "--expert-model-parallel-size", "2",
             "--moe-aux-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid",
             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
             "--untie-embeddings-and-output-weights", "--bf16", "--paci-accumulation-factor",
             "1", "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "8"]
    whole = train_paci([*flags, "--save", str(tmp_path / "a"), "--save-interval", "4"],
                       tmp_path / "whole.jsonl", nproc=4)
    second = train_paci([*flags, "--load", checkpoint_of_iteration(tmp_path / "a", 4,
                                                                   tmp_path / "b")],
                        tmp_path / "second.jsonl", nproc=4)
    assert "loaded checkpoint" in second["out"]
    losses = {name: {r["iteration"]: r["lm_loss"] for r in run["records"] if "lm_loss" in r}
              for name, run in (("whole", whole), ("resumed", second))}
    assert sorted(losses["resumed"]) == list(range(5, 9))
    assert losses["resumed"] == {i: losses["whole"][i] for i in range(5, 9)}
    assert second["summary"]["weights_sha256"] == whole["summary"]["weights_sha256"]
