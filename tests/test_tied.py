"""Tied input/output embeddings under PACI through pretrain_gpt_paci.py (mcore/tied.py).

Per configuration two launches share a module fixture: an uninterrupted run of 8 iterations
that saves at 4 and 8 (each save drains), and a run resumed from the checkpoint the first one
wrote at iteration 4. P=2 with a=1 (lag ceil(P/a) = 2); the same at DP=2 with Megatron's
realistic flags: the distributed optimizer, --overlap-grad-reduce and --overlap-param-gather
in bf16, and the distributed optimizer and --overlap-grad-reduce in fp16 (a loss scaler per
stage, overflows skipped); both at P=4 x DP=2 too (8 ranks, a=2: lag 2); P=4 with a=2
(``-m slow``). That the runtime implements the
exchange exactly as defined (every loss, every stage's weights after every step, the
staleness of every micro-batch, with a drain and an evaluation without drain) is checked
against the one-process reference in tests/test_reference.py (``*_tied*``).
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
# data parallelism 2 (4 micro-batches an iteration per replica) with Megatron's realistic
# flags: the distributed optimizer and overlapped reductions, in bf16 and in fp16
REALISTIC = {
    "bf16-distopt-overlaps": ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                              "--overlap-param-gather"],
    "fp16-distopt-overlap": ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window",
                             "2", "--use-distributed-optimizer", "--overlap-grad-reduce"],
}
# name -> (stages, ranks, flags)
CONFIGS = {"P2": (2, 2, []), "P4": (4, 4, [])}
CONFIGS.update({
    f"P{P}xDP2-{name}": (P, 2 * P, ["--pipeline-model-parallel-size", str(P),
                                    "--global-batch-size", "16"] + flags)
    for P in (2, 4) for name, flags in REALISTIC.items()})


def _run(tmp, name, config, flags):
    stages, ranks, extra = CONFIGS[config]
    run = train_paci(TINY + ["--paci-accumulation-factor", str(ACCUMULATION[stages])] + extra
                     + flags, tmp / f"{name}.jsonl", nproc=ranks,
                     timeout={2: 300, 4: 480}.get(ranks, 900))
    records = run["records"]
    return dict(run["summary"], final=records[-1],
                metric_losses={r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r})


# P=4 x DP=2 (8 ranks on 2 cores, 3 minutes) is slow: the same exchange at P=4 x DP=2 with
# these flags is checked bit for bit against the emulator, drain and evaluations included, in
# tests/test_reference.py (p4_dp2_tied_*, -m slow; p2_dp2_tied_* by default), and these
# entry-point checks hold at P=2 x DP=2 here. fp16 at P=2 x DP=2 (50 s) is slow too: that
# exchange is checked bit for bit, drain included, by tests/test_reference.py
# (p2_dp2_tied_fp16_distopt_overlap, p2_tied_fp16), and fp16's exact resume by
# tests/test_fp16_per_token.py's (CI's slow step); the tied resume stays here at P2 and in bf16
@pytest.fixture(scope="module", params=[
    "P2", "P2xDP2-bf16-distopt-overlaps",
    pytest.param("P2xDP2-fp16-distopt-overlap", marks=pytest.mark.slow),
    pytest.param("P4xDP2-bf16-distopt-overlaps", marks=pytest.mark.slow),
    pytest.param("P4xDP2-fp16-distopt-overlap", marks=pytest.mark.slow),
    pytest.param("P4", marks=pytest.mark.slow)])
def runs(request, tmp_path_factory):
    config = request.param
    stages = CONFIGS[config][0]
    tmp = tmp_path_factory.mktemp(f"tied_{config}")
    whole = _run(tmp, "whole", config, ["--save", str(tmp / "a"), "--save-interval",
                                        str(SAVE_AT)])
    # the checkpoint the uninterrupted run wrote at iteration 4, alone in a --load dir
    tag = f"iter_{SAVE_AT:07d}"
    shutil.copytree(tmp / "a" / tag, tmp / "b" / tag)
    (tmp / "b" / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    resumed = _run(tmp, "resumed", config, ["--load", str(tmp / "b")])
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
