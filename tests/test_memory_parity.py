"""PACI's whole-stage peak memory is 1F1B's (CPU live-tensor meter), at P=4 with Adam."""


import pytest

from launch import read_metrics, run_torchrun

pytestmark = pytest.mark.dist

# the first stage's 4000 x 128 embedding makes Adam's state and step a visible share
FLAGS = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "32",
         "--vocab-size", "4000", "--train-iters", "3", "--log-interval", "3",
         "--untie-embeddings-and-output-weights", "--measure-memory",
         "--measure-activation-memory"]


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    out = {}
    for schedule in ("1f1b", "paci"):
        metrics = tmp_path_factory.mktemp(schedule) / "metrics.jsonl"
        run_torchrun("pretrain_gpt_paci.py", FLAGS + [
            "--pipeline-schedule", schedule, "--metrics-file", str(metrics)], nproc=4,
            timeout=300)
        final = read_metrics(metrics)[-1]
        assert final["final"]
        out[schedule] = final
    return out


def test_paci_peak_memory_per_stage_is_1f1b_s(peaks):
    paci, stock = peaks["paci"]["peak_memory_mb"], peaks["1f1b"]["peak_memory_mb"]
    assert len(paci) == len(stock) == 4
    for stage, (p, s) in enumerate(zip(paci, stock)):
        assert p <= 1.02 * s, (stage, p, s)


def test_meter_counts_more_than_activations(peaks):
    """Weights, gradients and Adam's state are counted: the first stage holds 4000 x 128 x 4
    bytes x 4 (weight, gradient, two moments) of embedding alone, beside its activations."""
    for final in peaks.values():
        whole, saved = final["peak_memory_mb"], final["peak_activation_mb"]
        assert whole[0] - saved[0] >= 4000 * 128 * 4 * 4 / 2**20
        assert all(w > a for w, a in zip(whole, saved))
