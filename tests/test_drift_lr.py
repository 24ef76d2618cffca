"""--paci-drift-lr-damping C [--paci-drift-lr-anneal-iters N] through the real entry point
(P=2, a = M = 8, mock data): the LR factor each stage applies equals 1 / (1 + C w d), with d
the mean drift of the step's micro-batches as the schedule implies it and w the linear fade;
stage 1 (drift 0) is never damped; a run whose factors are all 1 equals plain PACI bit for bit
(weights of every stage), while damping changes stage 0's weights; and (slow) a run stopped at
a checkpoint and resumed takes the same factors and ends with the same weights."""


import pytest

from launch import paci_summary, read_metrics, run_torchrun
from paci_megatron.mcore.runtime import drift_lr_factor

pytestmark = pytest.mark.dist

ITERS, M, C, N = 4, 8, 2.0, 8
FLAGS = ["--pipeline-schedule", "paci", "--untie-embeddings-and-output-weights",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", str(M),
         "--lr", "3e-3", "--lr-decay-style", "constant", "--train-iters", str(ITERS),
         "--distributed-timeout-minutes", "3"]
DAMP = ["--paci-drift-lr-damping", str(C), "--paci-drift-lr-anneal-iters", str(N)]


def _run(tmp, name, extra):
    metrics = tmp / f"{name}.jsonl"
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", FLAGS + extra + ["--metrics-file",
                             str(metrics)], nproc=2, timeout=400)
    return paci_summary(out), read_metrics(metrics)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drift_lr")
    done = {}

    def get(name):
        if name not in done:
            extra = {"plain": [], "damped": DAMP,
                     # w = 0 from iteration 1 on, and iteration 0's step has drift 0
                     "faded": ["--paci-drift-lr-damping", str(C),
                               "--paci-drift-lr-anneal-iters", "1"]}[name]
            done[name] = _run(tmp, name, extra)
        return done[name]

    return get


def expected_stage0_factors():
    """At P=2 with a = M, stage 0's first step has drift 0 on all 8 micro-batches; every
    later one carries exactly one micro-batch whose forward ran before the previous step
    (drift 1), so its mean drift is 1/8. The step of iteration k fades with w = 1 - k/N."""
    return [drift_lr_factor(C, N, k, 0.0 if k == 0 else 1 / M) for k in range(ITERS)]


def test_the_factor_formula():
    assert drift_lr_factor(1.0, 0, 123, 0.75) == 1 / 1.75
    assert drift_lr_factor(2.0, 10, 5, 0.5) == 1 / 1.5
    assert drift_lr_factor(2.0, 10, 10, 0.5) == drift_lr_factor(2.0, 10, 40, 0.5) == 1.0
    assert drift_lr_factor(3.0, 0, 0, 0.0) == 1.0


def test_each_stage_applies_the_factor_of_its_measured_drift(runs):
    summary, records = runs("damped")
    stage0, stage1 = (row["lr_factor"] for row in summary["drift"])
    want = expected_stage0_factors()
    assert stage0 == {"min": min(want), "max": 1.0, "mean": sum(want) / len(want),
                      "last": want[-1], "damped_steps": ITERS - 1}
    assert want[1] == 1 / (1 + C * (1 - 1 / N) / M) < want[-1] < 1.0  # fading out
    assert stage1 == {"min": 1.0, "max": 1.0, "mean": 1.0, "last": 1.0, "damped_steps": 0}
    assert [row["histogram"] for row in summary["drift"]] == [
        {"0": ITERS * M - (ITERS - 1), "1": ITERS - 1}, {"0": ITERS * M}]
    final = next(r for r in records if r.get("final"))
    assert final["lr_factor_mean"] == [sum(want) / len(want), 1.0]
    assert final["lr_factor_min"] == [min(want), 1.0]


def test_damping_changes_stage_0_and_factors_of_one_change_nothing(runs):
    plain, plain_records = runs("plain")
    damped, damped_records = runs("damped")
    assert "lr_factor" not in plain["drift"][0]
    assert damped["weights_sha256"][0] != plain["weights_sha256"][0]
    # the LR schedule itself is untouched: the logged LR (after each scheduler step) is equal
    assert [r["lr"] for r in damped_records if "lr" in r] == \
        [r["lr"] for r in plain_records if "lr" in r]
    faded, _ = runs("faded")
    assert [row["lr_factor"]["damped_steps"] for row in faded["drift"]] == [0, 0]
    assert faded["weights_sha256"] == plain["weights_sha256"]
    assert faded["losses"] == plain["losses"]


@pytest.mark.slow
def test_a_resumed_run_takes_the_same_factors(tmp_path):
    """Save at iteration 2 (a drain: the next step again has drift 0), stop, load, go on."""
    save = ["--save-interval", "2"]
    straight, _ = _run(tmp_path, "straight", DAMP + save + ["--save", str(tmp_path / "a")])
    ckpt = str(tmp_path / "b")
    _run(tmp_path, "first", DAMP + save + ["--save", ckpt, "--exit-interval", "2"])
    resumed, _ = _run(tmp_path, "resumed", DAMP + save + ["--save", ckpt, "--load", ckpt])
    want = [drift_lr_factor(C, N, k, 0.0 if k in (0, 2) else 1 / M) for k in range(ITERS)]
    assert straight["drift"][0]["lr_factor"]["mean"] == sum(want) / ITERS
    assert resumed["drift"][0]["lr_factor"]["mean"] == sum(want[2:]) / 2
    assert resumed["drift"][0]["lr_factor"]["last"] == want[-1] != 1.0
    assert resumed["weights_sha256"] == straight["weights_sha256"]
    assert resumed["losses"] == straight["losses"][2:]
