"""P = 16 through pretrain_gpt_paci.py (issue 51), slow: 16 processes of a tiny GPT (a layer
a stage), a = 8 of 16 micro-batches, bf16, tied embeddings and the default prediction. The
run ends with every stage's drift at its bound and the tied copy at its lag, and a run
resumed from its checkpoint at iteration 2 ends as it does, bit for bit. Guarded by default
at P = 2 and 4 (tests/test_tied.py, tests/test_training.py) and, at P = 16, by the emulator
case of tests/test_reference.py (CI's slow step) and the plan checks of tests/test_depth.py.
The drop-in's P = 16 run is in tests/test_megatron_lm.py."""


import pytest

from launch import checkpoint_of_iteration, train_paci

pytestmark = [pytest.mark.dist, pytest.mark.slow]

P, A, ITERS, SAVE_AT = 16, 8, 4, 2
FLAGS = ["--pipeline-model-parallel-size", str(P), "--num-layers", str(P), "--hidden-size",
         "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
         "--global-batch-size", "16", "--train-iters", str(ITERS), "--lr", "3e-3",
         "--lr-warmup-iters", "1", "--bf16", "--pipeline-schedule", "paci",
         "--paci-accumulation-factor", str(A), "--distributed-timeout-minutes", "3"]
BOUNDS = [2] * 7 + [1] * 8 + [0]  # ceil((P - 1 - s) / a)


def test_sixteen_stages_train_with_drift_at_the_bound_and_resume_bit_for_bit(tmp_path):
    whole = train_paci([*FLAGS, "--save", str(tmp_path / "a"), "--save-interval",
                        str(SAVE_AT)], tmp_path / "whole.jsonl", nproc=P, timeout=600)
    start_at = checkpoint_of_iteration(tmp_path / "a", SAVE_AT, tmp_path / "b")
    resumed = train_paci([*FLAGS, "--load", start_at], tmp_path / "resumed.jsonl",
                         nproc=P, timeout=600)
    drift = whole["summary"]["drift"]
    assert [row["max"] for row in drift] == [row["bound"] for row in drift] == BOUNDS
    assert drift[-1]["tied"]["max"] == drift[-1]["tied"]["bound"] == 2  # ceil(P / a)
    assert drift[0]["predicted_forwards"]
    losses = {name: {r["iteration"]: r["lm_loss"] for r in run["records"] if "lm_loss" in r}
              for name, run in (("whole", whole), ("resumed", resumed))}
    assert sorted(losses["whole"]) == list(range(1, ITERS + 1))
    assert sorted(losses["resumed"]) == list(range(SAVE_AT + 1, ITERS + 1))
    assert all(losses["resumed"][i] == losses["whole"][i] for i in losses["resumed"])
    assert resumed["summary"]["weights_sha256"] == whole["summary"]["weights_sha256"]
