"""PACI adds no host sync of its own to stock 1F1B's steady state (counted on CPU by
tests/workers/count_host_syncs.py: scalar reads and device-to-host copies, over the training
steps of the steady-state iterations, per rank), at P=4 with the features that used to add
them: bf16 with weight prediction and tied embeddings; fp16 loss scaling, per-token loss and
the distributed optimizer (their metadata and scales stay on the device)."""

import pytest

from launch import parse_results, run_torchrun

pytestmark = pytest.mark.dist

BASE = ["--train-iters", "5", "--pipeline-model-parallel-size", "4", "--num-layers", "4",
        "--global-batch-size", "16", "--micro-batch-size", "2", "--log-interval", "100"]
CONFIGS = {
    "bf16_tied_prediction": ["--bf16"],
    "fp16_per_token_distopt": ["--fp16", "--untie-embeddings-and-output-weights",
                               "--calculate-per-token-loss", "--use-distributed-optimizer"],
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def counted(request):
    out, logs = {}, {}
    for schedule in ("paci", "1f1b"):
        _, logs[schedule], _ = run_torchrun(
            "tests/workers/count_host_syncs.py",
            BASE + CONFIGS[request.param] + ["--pipeline-schedule", schedule],
            nproc=4, timeout=300)
        out[schedule] = {r["rank"]: r for r in parse_results(logs[schedule])}
    return request.param, out, logs["paci"]


def test_paci_syncs_no_more_than_stock_1f1b_per_steady_state_iteration(counted):
    name, out, stdout = counted
    assert sorted(out["paci"]) == sorted(out["1f1b"]) == [0, 1, 2, 3]
    for rank in range(4):
        paci, stock = out["paci"][rank], out["1f1b"][rank]
        assert paci["iterations"] == stock["iterations"] == 2
        assert paci["per_iteration"] <= stock["per_iteration"], (name, rank, paci["calls"])
        assert stock["per_iteration"] >= 1  # the count sees stock's own (the clipping norm)
    if name == "bf16_tied_prediction":
        assert "stale forwards on predicted weights" in stdout
