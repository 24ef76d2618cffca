"""Switching the schedule on --load: a drained PACI checkpoint holds what a 1F1B one holds,
and the other way round (how a run starts or ends on stock 1F1B since 0.2.0 removed
--paci-sync-iters and --paci-cooldown-iters, whose one-launch runs these chains equalled bit
for bit). P=2, tied embeddings (Megatron's default: the tied copies must be equal at the
switch), a=2 of 4 micro-batches, dropout on."""

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


def _lrs(*runs):
    return {r["iteration"]: r["lr"] for run in runs for r in run["records"] if "lm_loss" in r}


@pytest.mark.slow  # CI runs it (.ci/slow-tests)
def test_a_paci_checkpoint_continues_under_stock_1f1b(tmp_path):
    """PACI to 5 (saved: drained, stopped), then --pipeline-schedule 1f1b loading it for 6-8:
    the first part is the uninterrupted PACI run's to 5 bit for bit, and the LR goes on from
    the samples PACI's local steps advanced it by, as the uninterrupted run's does."""
    whole = _train(tmp_path, "whole", PACI)
    ckpt = str(tmp_path / "ckpt")
    first = _train(tmp_path, "paci", PACI + ["--save", ckpt, "--exit-interval", "5"])
    second = _train(tmp_path, "stock", STOCK + ["--load", ckpt])
    assert "this run continues with --pipeline-schedule 1f1b" in second["out"]
    assert sorted(_losses(first, second)) == list(range(1, 9))
    assert _losses(first) == {k: v for k, v in _losses(whole).items() if k <= 5}
    assert _lrs(first, second) == _lrs(whole)


def test_a_stock_1f1b_checkpoint_continues_under_paci(tmp_path):
    """Stock 1F1B to 4 (saved, stopped), then PACI loading it for 5-8 (how a run starts on
    1F1B and goes on under PACI): the first part is the uninterrupted stock run's bit for bit,
    and the LR goes on as the uninterrupted stock run's does (two local steps of a = 2 advance
    it as one step of 4)."""
    whole = _train(tmp_path, "whole", STOCK)
    ckpt = str(tmp_path / "ckpt")
    first = _train(tmp_path, "stock", STOCK + ["--save", ckpt, "--exit-interval", "4"])
    second = _train(tmp_path, "paci", PACI + ["--load", ckpt])
    assert "written with --pipeline-schedule 1f1b, this run continues with " \
           "--pipeline-schedule paci (a=2)" in second["out"]
    assert sorted(_losses(first, second)) == list(range(1, 9))
    assert _losses(first) == {k: v for k, v in _losses(whole).items() if k <= 4}
    assert _lrs(first, second) == _lrs(whole)
    # the local-step count goes on from the load as if iterations 1-4 had been PACI's (4 x 2),
    # then 4 iterations of 2 steps
    assert [row["steps"] for row in second["summary"]["drift"]] == [4 * 2 + 4 * 2] * 2
