"""Tied input/output embeddings under PACI through pretrain_gpt_paci.py (mcore/tied.py).

Per pipeline size two launches share a module fixture: an uninterrupted run of 8 iterations
that saves at 4 and 8 (each save drains), and a run resumed from the checkpoint the first one
wrote at iteration 4. P=2 with a=1 (lag ceil(P/a) = 2), P=4 with a=2 (lag 2; ``-m slow``).
That the runtime implements the exchange exactly as defined (every loss, every stage's weights
after every step, the staleness of every micro-batch, with a drain and an evaluation without
drain) is checked against the one-process reference in tests/test_reference.py (``*_tied``).
"""

import math
import shutil

import pytest

from launch import train_paci

pytestmark = pytest.mark.dist

ITERS, SAVE_AT, MICRO_BATCHES = 8, 4, 4
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--distributed-timeout-minutes", "2", "--pipeline-schedule", "paci",
        "--hidden-dropout", "0.1", "--train-iters", str(ITERS)]
ACCUMULATION = {2: 1, 4: 2}


def _run(tmp, name, stages, flags):
    run = train_paci(TINY + ["--paci-accumulation-factor", str(ACCUMULATION[stages])] + flags,
                     tmp / f"{name}.jsonl", nproc=stages, timeout=300 if stages == 2 else 480)
    records = run["records"]
    return dict(run["summary"], final=records[-1],
                metric_losses={r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r})


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)],
                ids=["P2", "P4"])
def runs(request, tmp_path_factory):
    stages = request.param
    tmp = tmp_path_factory.mktemp(f"tied_p{stages}")
    whole = _run(tmp, "whole", stages, ["--save", str(tmp / "a"), "--save-interval",
                                        str(SAVE_AT)])
    # the checkpoint the uninterrupted run wrote at iteration 4, alone in a --load dir
    tag = f"iter_{SAVE_AT:07d}"
    shutil.copytree(tmp / "a" / tag, tmp / "b" / tag)
    (tmp / "b" / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    resumed = _run(tmp, "resumed", stages, ["--load", str(tmp / "b")])
    return stages, whole, resumed


def test_tied_copies_are_bit_identical_after_the_drain(runs):
    """At the end (after the final drain) stage 0's embedding and the last stage's output
    layer, with their optimizers' master copies, are equal; middle stages hold neither."""
    stages, whole, resumed = runs
    for summary in (whole, resumed):
        digests = summary["tied_sha256"]
        assert len(digests) == stages and digests[0] is not None
        assert digests[0] == digests[-1]
        assert digests[1:-1] == [None] * (stages - 2)


def test_drift_and_tied_staleness_stay_within_their_bounds(runs):
    """Stage drift reaches ceil((P-1-s)/a) exactly; the tied weight's staleness (owner steps
    between the version a last-stage forward used and the owner step applying its gradient)
    reaches lag = ceil(P/a) and no more: in each stream (a save's drain starts a new one)
    group g < lag sees staleness g, every later group lag."""
    stages, whole, _ = runs
    a = ACCUMULATION[stages]
    lag = math.ceil(stages / a)
    for row in whole["drift"]:
        assert row["max"] == row["bound"] == math.ceil((stages - 1 - row["stage"]) / a)
    tied = whole["drift"][-1]["tied"]
    assert tied["bound"] == lag and tied["max"] == lag
    streams = ITERS // SAVE_AT
    expected = {str(g): a * streams for g in range(lag)}
    expected[str(lag)] = ITERS * MICRO_BATCHES - lag * a * streams
    assert tied["histogram"] == expected
    assert whole["final"]["tied_max_staleness"] == [None] * (stages - 1) + [lag]
    assert all("tied" not in row for row in whole["drift"][:-1])


def test_loss_goes_down(runs):
    _, whole, _ = runs
    losses = [whole["metric_losses"][i] for i in range(1, ITERS + 1)]
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_resume_equals_the_uninterrupted_run(runs):
    """Resumed from the checkpoint at iteration 4: iterations 5-8 and every stage's final
    weights equal the uninterrupted run's bit for bit."""
    _, whole, resumed = runs
    later = {i: whole["metric_losses"][i] for i in range(SAVE_AT + 1, ITERS + 1)}
    assert resumed["metric_losses"] == later
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    assert resumed["tied_sha256"] == whole["tied_sha256"]
