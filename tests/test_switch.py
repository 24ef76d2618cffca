"""Switching the schedule: on --load (a drained PACI checkpoint holds what a 1F1B one holds,
and the other way round) and within one launch (--paci-sync-iters warms up on stock 1F1B,
--paci-cooldown-iters ends on it). Each switch equals its twin bit for bit on CPU: every
training loss and every stage's final weights. P=2, tied embeddings (Megatron's default: the
tied copies must be equal at the switch), a=2 of 4 micro-batches, dropout on."""

import pytest

from launch import train_paci

pytestmark = pytest.mark.dist

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "8", "--log-interval", "1",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
         "--distributed-timeout-minutes", "2"]
PACI = ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "2"]
STOCK = ["--pipeline-schedule", "1f1b"]


def _losses(*runs):
    return {r["iteration"]: r["lm_loss"] for run in runs for r in run["records"] if "lm_loss" in r}


def _train(tmp_path, name, flags):
    return train_paci(FLAGS + flags, tmp_path / f"{name}.jsonl", timeout=240)


def test_cooldown_equals_paci_then_a_load_into_stock_1f1b(tmp_path):
    """PACI for 5 iterations and stock 1F1B for the last 3, in one launch, equals PACI to 5
    (saved, stopped) and --pipeline-schedule 1f1b loading that checkpoint for 6-8."""
    whole = _train(tmp_path, "cooldown", PACI + ["--paci-cooldown-iters", "3"])
    assert "stock 1F1B from iteration 6 on (--paci-cooldown-iters)" in whole["out"]
    ckpt = str(tmp_path / "ckpt")
    first = _train(tmp_path, "paci", PACI + ["--save", ckpt, "--exit-interval", "5"])
    second = _train(tmp_path, "stock", STOCK + ["--load", ckpt])
    assert "this run continues with --pipeline-schedule 1f1b" in second["out"]
    assert sorted(_losses(first, second)) == list(range(1, 9))
    assert _losses(first, second) == _losses(whole)
    assert second["summary"]["weights_sha256"] == whole["summary"]["weights_sha256"]
    # stage 0 drifted under PACI, then took one step per stock iteration: 5 x 2 + 3
    assert whole["summary"]["drift"][0]["steps"] == 5 * 2 + 3


def test_stock_1f1b_checkpoint_continues_under_paci_as_the_warm_start_does(tmp_path):
    """--paci-sync-iters 4 (stock 1F1B for 4 iterations, then PACI) equals stock 1F1B to 4
    (saved, stopped) and PACI loading that checkpoint for 5-8."""
    whole = _train(tmp_path, "warm", PACI + ["--paci-sync-iters", "4"])
    ckpt = str(tmp_path / "ckpt")
    first = _train(tmp_path, "stock", STOCK + ["--save", ckpt, "--exit-interval", "4"])
    second = _train(tmp_path, "paci", PACI + ["--load", ckpt])
    assert "written with --pipeline-schedule 1f1b, this run continues with " \
           "--pipeline-schedule paci (a=2)" in second["out"]
    assert _losses(first, second) == _losses(whole)
    assert second["summary"]["weights_sha256"] == whole["summary"]["weights_sha256"]


def test_the_lookahead_stays_out_of_the_stock_warm_up_and_cool_down(tmp_path):
    """bf16 with --paci-lookahead 2: stock 1F1B for 2 iterations, PACI for 3-6 and stock 1F1B
    for 7-8 in one launch equals the three schedules run apart and chained by checkpoints
    (the warm-up and the cool-down are stock 1F1B, the look-ahead's weights in neither;
    PACI's part looks ahead from its first call, as a --load does). The run's end says what
    the look-ahead's pass cost."""
    ahead = ["--bf16", "--paci-lookahead", "2"]
    whole = _train(tmp_path, "whole", PACI + ahead + ["--paci-sync-iters", "2",
                                                      "--paci-cooldown-iters", "2"])
    assert "look-ahead weights, C=2" in whole["out"]
    assert "> PACI: the look-ahead's cost leaves a projected throughput of" in whole["out"]
    warm, paci = str(tmp_path / "warm"), str(tmp_path / "paci")
    first = _train(tmp_path, "stock", STOCK + ["--bf16", "--save", warm, "--exit-interval", "2"])
    middle = _train(tmp_path, "paci", PACI + ahead + ["--load", warm, "--save", paci,
                                                      "--exit-interval", "6"])
    last = _train(tmp_path, "cool", STOCK + ["--bf16", "--load", paci])
    assert sorted(_losses(first, middle, last)) == list(range(1, 9))
    assert _losses(first, middle, last) == _losses(whole)
    assert last["summary"]["weights_sha256"] == whole["summary"]["weights_sha256"]
