"""Megatron-LM flags under PACI through pretrain_gpt_paci.py: data parallelism (DP=2) with the
distributed optimizer, --overlap-grad-reduce and --overlap-param-gather, and
--rampup-batch-size (the number of micro-batches changes during training)."""

import pytest

from launch import train_paci
from messages import names_flag

from paci_megatron.arguments import ConfigError, build_parser, validate

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--untie-embeddings-and-output-weights", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--log-interval", "1", "--distributed-timeout-minutes", "3",
        "--hidden-dropout", "0.1"]


def _run(tmp, name, flags, nproc):
    run = train_paci(TINY + flags, tmp / f"{name}.jsonl", nproc=nproc, timeout=600)
    return dict(run, records=[r for r in run["records"] if "lm_loss" in r])


# --- flag checks (no process group) ---------------------------------------------------------

def _validate(flags, world=2):
    args = build_parser().parse_args(TINY + flags)
    return args, validate(args, world)


@pytest.mark.parametrize("flags,flag,text", [
    (["--overlap-param-gather"], "--overlap-param-gather", "--use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], "--overlap-param-gather",
     "--overlap-grad-reduce"),
    (["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "4", "4",
      "64", "--paci-accumulation-factor", "4"], "--paci-accumulation-factor",
     "[2, 4, 6, 8] (not [2, 6])"),
    (["--global-batch-size", "8", "--micro-batch-size", "2", "--rampup-batch-size", "8", "4",
      "64"], "--rampup-batch-size", "nothing to ramp up"),
    (["--global-batch-size", "8", "--micro-batch-size", "2", "--rampup-batch-size", "2", "4",
      "64"], "--rampup-batch-size", "steps of INCR"),
    (["--global-batch-size", "8", "--micro-batch-size", "4", "--rampup-batch-size", "4", "2",
      "64"], "--rampup-batch-size", "[6] are not divisible"),
])
def test_bad_combinations_name_the_flag(flags, flag, text):
    with pytest.raises(ConfigError) as info:
        _validate(flags)
    message = str(info.value)
    assert names_flag(message, flag) and text in message, message


def test_rampup_accumulation_defaults_to_the_first_batch():
    args, opts = _validate(["--global-batch-size", "16", "--micro-batch-size", "2",
                            "--rampup-batch-size", "4", "4", "64"])
    assert (opts.shape.per_call, opts.accumulation) == (2, 2)
    assert opts.accumulation_follows
    args, opts = _validate(["--global-batch-size", "16", "--micro-batch-size", "2",
                            "--rampup-batch-size", "4", "4", "64",
                            "--paci-accumulation-factor", "2"])
    assert opts.accumulation == 2 and not opts.accumulation_follows


# --- DP=2 at P=2: plain optimizer vs distributed optimizer with both overlaps -----------------

DP2 = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--paci-accumulation-factor", "2", "--train-iters", "6",
       # clipping would scale by a norm summed in another order over shards; off, the update
       # is elementwise and the two optimizers must agree bit for bit
       "--clip-grad", "0"]
OVERLAPS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    return {"plain": _run(tmp, "plain", DP2, nproc=4),
            "overlapped": _run(tmp, "overlapped", DP2 + OVERLAPS, nproc=4)}


@pytest.mark.dist
@pytest.mark.parametrize("name", ["plain", "overlapped"])
def test_dp2_trains_within_the_drift_bound(dp2_runs, name):
    run = dp2_runs[name]
    assert "P=2 TP=1 DP=2 micro-batches/iteration=4 a=2" in run["out"]
    summary = run["summary"]
    # four micro-batches a call, a local step every two: 2 steps per iteration
    assert [(r["max"], r["bound"], r["steps"]) for r in summary["drift"]] == [(1, 1, 12),
                                                                              (0, 0, 12)]
    losses = [r["lm_loss"] for r in run["records"]]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.mark.dist
def test_distributed_optimizer_with_overlaps_equals_the_plain_optimizer(dp2_runs):
    """fp32, no clipping: reduce-scatter + sharded Adam + all-gather (started by the forward
    pre-hooks, between local steps) computes what all-reduce + Adam computes, bit for bit:
    every loss, learning rate and the final weights of both stages."""
    plain, overlapped = dp2_runs["plain"], dp2_runs["overlapped"]
    key = lambda run: [(r["iteration"], r["lm_loss"], r["lr"]) for r in run["records"]]
    assert key(overlapped) == key(plain)
    assert overlapped["summary"]["weights_sha256"] == plain["summary"]["weights_sha256"]
    assert overlapped["summary"]["validation_loss"] == plain["summary"]["validation_loss"]


@pytest.mark.dist
@pytest.mark.slow
def test_distributed_optimizer_without_overlap_equals_the_overlapped_one(dp2_runs, tmp_path):
    sync = _run(tmp_path, "sync", DP2 + ["--use-distributed-optimizer"], nproc=4)
    overlapped = dp2_runs["overlapped"]
    assert [r["lm_loss"] for r in sync["records"]] == [r["lm_loss"] for r in overlapped["records"]]
    assert sync["summary"]["weights_sha256"] == overlapped["summary"]["weights_sha256"]


# --- --rampup-batch-size at P=2 ---------------------------------------------------------------

# global batch 4 (M=2) for the first 32 samples (8 iterations), then 8 (M=4)
RAMP = ["--micro-batch-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "4", "4",
        "32", "--train-iters", "12"]


@pytest.fixture(scope="module")
def ramp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ramp")
    return {schedule: _run(tmp, schedule, RAMP + ["--pipeline-schedule", schedule], nproc=2)
            for schedule in ("1f1b", "paci")}


@pytest.mark.dist
def test_rampup_drains_where_the_batch_grows(ramp_runs):
    paci, stock = ramp_runs["paci"], ramp_runs["1f1b"]
    consumed = [r["consumed_samples"] for r in paci["records"]]
    assert consumed == [4 * i for i in range(1, 9)] + [32 + 8 * i for i in range(1, 5)]
    assert consumed == [r["consumed_samples"] for r in stock["records"]]
    # one drain, at the change; a (default) follows M: one local step per iteration
    assert paci["out"].count("(--rampup-batch-size), accumulation factor") == 1
    assert "> PACI: 4 micro-batches per iteration from iteration 9 (--rampup-batch-size), " \
           "accumulation factor 4; drained the pipeline" in paci["out"]
    drift = paci["summary"]["drift"]
    assert [(r["max"], r["bound"], r["steps"]) for r in drift] == [(1, 1, 12), (0, 0, 12)]
    # the LR advances by samples: 1F1B steps once per iteration by the batch size of that
    # iteration, PACI once per local step by a x micro-batch; the same LR after each iteration
    assert [r["lr"] for r in paci["records"]] == [r["lr"] for r in stock["records"]]
    # a = M: the first iteration's forwards all ran on the initial weights, as in 1F1B
    assert paci["records"][0]["lm_loss"] == stock["records"][0]["lm_loss"]
    losses = [r["lm_loss"] for r in paci["records"]]
    assert sum(losses[-3:]) < sum(losses[:3]), losses


@pytest.mark.dist
@pytest.mark.slow
def test_rampup_with_a_fixed_accumulation_factor(ramp_runs, tmp_path):
    run = _run(tmp_path, "a2", RAMP + ["--paci-accumulation-factor", "2"], nproc=2)
    assert "(--rampup-batch-size)" in run["out"]  # M changes, a stays 2: a drain all the same
    assert "accumulation factor 2; drained" in run["out"]
    # 8 iterations of 2 micro-batches (1 step each) + 4 of 4 (2 steps each)
    drift = run["summary"]["drift"]
    assert [(r["max"], r["bound"], r["steps"]) for r in drift] == [(1, 1, 16), (0, 0, 16)]
    assert [r["lr"] for r in run["records"]] == [r["lr"] for r in ramp_runs["1f1b"]["records"]]


# --- why overlapped parameter gathers are complete before every backward ----------------------

@pytest.mark.parametrize("kind", ["paci", "flush"])
def test_a_local_step_is_followed_by_a_forward_not_a_backward(kind):
    """With --overlap-param-gather the forward pre-hooks complete the all-gather of the shards
    a step updated (paci_megatron/mcore/param_gather.py). That needs the next compute action
    of the stage after a step to be a forward, in every call (0 and steady) and across the
    boundary between calls, for every P <= 8, a <= 4 and M = a, 2a (flush: the sync warm-up)."""
    from paci_megatron.schedule import COMPUTE_OPS, Op, plan_stream

    checked = 0
    for stages in range(1, 9):
        for a in range(1, 5):
            for m in (a, 2 * a):
                plan = plan_stream(kind, stages, a if kind == "paci" else m, m)
                for s in range(stages):
                    ops = [act.op for k in range(4) for act in plan.call(k)[s]
                           if act.op in COMPUTE_OPS or act.op == Op.STEP]
                    for i, op in enumerate(ops[:-1]):
                        if op == Op.STEP:
                            assert ops[i + 1] == Op.FORWARD, (kind, stages, a, m, s, ops)
                            checked += 1
    assert checked > 300


@pytest.mark.dist
@pytest.mark.slow  # test_tied's P2xDP2-bf16-distopt-overlaps resume guards the same flags, tied
def test_resume_with_the_distributed_optimizer_and_overlaps_is_exact(tmp_path):
    """DP=2, distributed optimizer, both overlaps: train 3 of 6, save (a drain, which completes
    the parameter all-gather), stop, load, train to 6 == train 6 saving at 3."""
    flags = DP2 + OVERLAPS
    whole = _run(tmp_path, "whole", flags + ["--save", str(tmp_path / "a"),
                                             "--save-interval", "3"], nproc=4)
    first = _run(tmp_path, "first", flags + ["--save", str(tmp_path / "b"),
                                             "--exit-interval", "3"], nproc=4)
    second = _run(tmp_path, "second", flags + ["--load", str(tmp_path / "b")], nproc=4)
    assert "loaded checkpoint" in second["out"]
    losses = lambda *runs: {r["iteration"]: r["lm_loss"] for run in runs for r in run["records"]}
    assert sorted(losses(first, second)) == list(range(1, 7))
    assert losses(first, second) == losses(whole)
    assert second["summary"]["weights_sha256"] == whole["summary"]["weights_sha256"]


@pytest.mark.parametrize("follows,accumulation,expected", [
    (True, 2, 10),   # a = M: one local step per iteration
    (False, 2, 12),  # 8 iterations of M=2 (1 step each), then 2 of M=4 (2 each)
    (False, 1, 24),  # 8 iterations of M=2 (2 steps each), then 2 of M=4 (4 each)
])
def test_resume_counts_the_local_steps_of_a_ramp(follows, accumulation, expected):
    """After --load at iteration 10 of the RAMP run, weight versions continue from the local
    steps already taken (M = 2 for 32 samples of 4, then 4)."""
    import types

    from paci_megatron.config import PaciConfig
    from paci_megatron.mcore.build import BatchRamp
    from paci_megatron.shape import StreamShape
    from paci_megatron.training import _local_steps_before

    opts = PaciConfig("paci", StreamShape(2, accumulation, 2, 2, 1),
                      accumulation_follows=follows)
    job = types.SimpleNamespace(opts=opts, iteration=10, ramp=BatchRamp([4, 4, 32], 8, 2, 1))
    assert _local_steps_before(job) == expected
