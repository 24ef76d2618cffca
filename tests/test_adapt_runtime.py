"""--paci-accumulation-factor auto on the real runtime at P=4 (one torchrun launch): with the
cycle policy a changes every two iterations (4, 2, 1, 4, ...), every stage's measured drift in
every call equals the simulator's for the same factors and stays within the bound in force,
the LR stays a function of samples, a is logged per iteration, and the only collectives that
cross stages in the steady state are the decisions' all-reduces."""

import math

import pytest

from launch import paci_summary, parse_results, read_metrics, run_torchrun
from paci_megatron import adapt
from paci_megatron.schedule import drift_bound

P = 4
N = 4
ITERS = 12
LR = 1e-3
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", str(N),
         "--untie-embeddings-and-output-weights", "--mock-data", "--log-interval", "1",
         "--train-iters", str(ITERS), "--lr", str(LR), "--distributed-timeout-minutes", "3",
         "--pipeline-schedule", "paci", "--paci-accumulation-factor", "auto",
         "--paci-adapt-interval", "1", "--paci-adapt-policy", "cycle"]
# decisions are requested after calls 0, 2, 4, ... (one in flight at a time) and applied two
# calls later; cycle takes the candidates (4, 2, 1) in turn from the second
FACTORS = [4, 4, 2, 2, 1, 1, 4, 4, 2, 2, 1, 1]


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("auto") / "metrics.jsonl"
    _, out, _ = run_torchrun("tests/workers/count_collectives.py",
                             FLAGS + ["--metrics-file", str(metrics)], nproc=P, timeout=600)
    return paci_summary(out), parse_results(out), read_metrics(metrics), out


@pytest.mark.dist
def test_a_changes_and_every_drift_matches_the_simulator_within_the_bound(auto_run):
    summary, _, records, out = auto_run
    rows = summary["drift"]
    assert len(rows) == P
    for row in rows:
        assert [tuple(c) for c in row["factor_changes"]] == [
            (k, a) for k, a in enumerate(FACTORS) if k == 0 or FACTORS[k - 1] != a]
    assert len(set(FACTORS)) == 3  # a did change, down and up
    simulated = adapt.stream_drift(adapt.stream_with_factors(P, N, FACTORS))
    for s, row in enumerate(rows):
        measured = row["call_drift"]
        assert measured == [simulated[s][k] for k in range(ITERS)], s
        for k, worst in enumerate(measured):
            assert worst <= adapt.bound_in_call(P, s, N, FACTORS, k)
            if FACTORS[k] == FACTORS[k - 1]:  # the previous call ran the same a: its bound
                assert worst <= drift_bound(P, s, FACTORS[k])
        assert row["steps"] == sum(N // a for a in FACTORS)  # local steps: N/a per call
        assert sum(row["histogram"].values()) == N * ITERS
    # raising a from 1 to 4 at call 6: stage 0 still sees drift 3 > 4's bound of 1 once
    assert rows[0]["call_drift"][6] == 3 and rows[0]["call_drift"][7] == 1
    logged = [r for r in records if "lm_loss" in r]
    assert [r["accumulation_factor"] for r in logged] == FACTORS
    assert out.count(" | PACI a ") == ITERS


@pytest.mark.dist
def test_lr_stays_a_function_of_samples(auto_run):
    """Each local step advances the scheduler by a x micro-batch samples, whatever a: the LR
    after iteration i is the cosine schedule at i x N samples (no warm-up, min LR 0)."""
    _, _, records, _ = auto_run
    logged = [r for r in records if "lm_loss" in r]
    for i, r in enumerate(logged, 1):
        assert r["lr"] == pytest.approx(0.5 * LR * (1 + math.cos(math.pi * i / ITERS)),
                                        rel=1e-9, abs=1e-15)


@pytest.mark.dist
def test_only_the_decisions_cross_stages(auto_run):
    """Counted from the end of iteration 1 to the start of iteration 12 (calls 1-10): the
    requests after calls 2, 4, 6, 8 and 10, one MAX all-reduce each, nothing else."""
    _, counts, _, _ = auto_run
    assert sorted(r["rank"] for r in counts) == list(range(P))
    for r in counts:
        assert r["count"] == 5, r["calls"]
        assert all(c["fn"] == "all_reduce" and c["ranks"] == list(range(P)) for c in r["calls"])
