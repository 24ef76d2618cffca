"""PACI on a real Megatron-Core GPTModel, CPU + gloo, several processes.

Each fixture is one torchrun launch running several cases (tests/workers/paci_cases.py); the
tests below assert on what each rank wrote.
"""

import json
import os

import pytest

from launch import run_torchrun

pytestmark = pytest.mark.dist


def _launch(tmp_path_factory, name, nproc, cases, timeout):
    out = tmp_path_factory.mktemp(name)
    run_torchrun("tests/workers/paci_cases.py", ["--out", str(out), *cases], nproc=nproc,
                 timeout=timeout, env={"PACI_TEST_HANG_S": str(timeout - 30)})

    def load(case):
        files = sorted(f for f in os.listdir(out) if f.startswith(case + ".rank"))
        assert len(files) == nproc, f"{case}: results from {len(files)} of {nproc} ranks"
        return [json.load(open(os.path.join(out, f))) for f in files]

    return load


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "p2", 2,
                   ["flush_equals_stock_p2", "paci_drift_p2", "drain_replays", "nonfinite_skip"],
                   timeout=240)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "p4", 4,
                   ["flush_equals_stock_p4", "paci_drift_p4", "layout_tp1_pp2", "layout_tp2_pp2"],
                   timeout=420)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _launch(tmp_path_factory, "p1", 1, ["p1_equals_accumulation", "nonfinite_abort"],
                   timeout=180)


@pytest.mark.parametrize("P", [2, 4])
def test_flush_action_list_equals_stock_1f1b_bitwise(P, two_ranks, four_ranks):
    ranks = (two_ranks if P == 2 else four_ranks)(f"flush_equals_stock_p{P}")
    last = [r for r in ranks if r["stock"]]
    assert len(last) == 1 and len(last[0]["stock"]) == 10 * 4  # 10 updates of 4 micro-batches
    for r in ranks:
        assert r["flush"] == r["stock"]  # every micro-batch loss, as float hex
        assert r["flush_digest"] == r["stock_digest"]  # every weight, bit for bit
        assert r["steps"] == 10 and r["drift"] == 0


def _drift_rows(load, case):
    return sorted(load(case), key=lambda r: next(iter(r.values()))["stage"])


@pytest.mark.parametrize("P", [2, 4])
def test_paci_drift_equals_bound_per_stage(P, two_ranks, four_ranks):
    rows = _drift_rows(two_ranks if P == 2 else four_ranks, f"paci_drift_p{P}")
    expected = {"2": {1: [1, 0], 2: [1, 0]},
                "4": {1: [3, 2, 1, 0], 2: [2, 1, 1, 0], 4: [1, 1, 1, 0]}}[str(P)]
    for a, bounds in expected.items():
        measured = [row[str(a)]["max"] for row in rows]
        assert measured == bounds, f"P={P} a={a}"
        for row in rows:
            r = row[str(a)]
            assert r["bound"] == bounds[r["stage"]]
            assert r["backwards"] == r["iters"] * r["n"] and r["steps"] == r["backwards"] // a


@pytest.mark.parametrize("P", [2, 4])
def test_paci_loss_goes_down(P, two_ranks, four_ranks):
    rows = _drift_rows(two_ranks if P == 2 else four_ranks, f"paci_drift_p{P}")
    for a, r in rows[-1].items():
        first, last = r["loss_first_last"]
        assert last < first - 0.1, f"a={a}: loss {first:.3f} -> {last:.3f}"


def test_backward_reads_weights_updated_after_forward(four_ranks):
    """No stash and no copy: every weight autograd saved in a forward and read by a backward
    after a local step holds the new values; with no step in between, the same values."""
    for row in _drift_rows(four_ranks, "paci_drift_p4"):
        for a, r in row.items():
            if r["stage"] < 3:
                assert r["stepped_reads"] > 0, f"stage {r['stage']} a={a}: nothing crossed a step"
            assert r["stepped_reads_new_values"] == r["stepped_reads"]
            assert r["plain_reads_same_values"] == r["plain_reads"] > 0


def test_drain_drops_in_flight_and_replays_their_data(two_ranks):
    first, last = sorted(two_ranks("drain_replays"), key=lambda r: r["stage"])
    # stage 0 ran 3 calls (micro-batches 0..11 and 12 ahead), drained (dropping 12) and ran 3
    # more calls from an empty pipeline (indices restart at 0): item 12 is read again by the
    # first forward after the drain, nothing is lost; the last stage holds nothing in flight
    assert first["dropped"] == 1 and last["dropped"] == 0
    before = [[m, m] for m in range(13)]
    assert [r[:2] for r in first["seen"]] == before + [[m, 12 + m] for m in range(13)]
    assert [r[:2] for r in last["seen"]] == before[:12] + [[m, 12 + m] for m in range(12)]
    for r in (first, last):  # the item numbered n is the n-th item of the stream, unchanged
        assert [x[2] for x in r["seen"]] == [r["reference"][x[1]] for x in r["seen"]]
        assert len(set(r["reference"])) == len(r["reference"])  # distinct micro-batches


def test_p1_paci_equals_gradient_accumulation(one_rank):
    (r,) = one_rank("p1_equals_accumulation")
    assert len(r["stock"]) == 40
    assert r["paci"] == r["stock"] and r["paci_digest"] == r["stock_digest"]
    assert r["drift"] == 0 and r["steps"] == 10


@pytest.mark.parametrize("layout", ["layout_tp1_pp2", "layout_tp2_pp2"])
def test_paci_runs_with_data_or_tensor_parallel_stages(layout, four_ranks):
    ranks = four_ranks(layout)
    for r in ranks:
        assert r["steps"] == 5 and r["drift"] == r["bound"]
        if r["info"]["is_last"]:
            assert len(r["losses"]) == 20 and all(0 < x < 10 for x in r["losses"])
    dims = {(r["info"]["tp_size"], r["info"]["dp_size"]) for r in ranks}
    assert dims == ({(1, 2)} if layout == "layout_tp1_pp2" else {(2, 1)})


@pytest.mark.slow
def test_paci_drift_equals_bound_at_p8(tmp_path_factory):
    """Eight stages on a real GPT (eight processes; about 40 s on 2 cores): run with -m slow."""
    load = _launch(tmp_path_factory, "p8", 8, ["paci_drift_p8"], timeout=600)
    rows = _drift_rows(load, "paci_drift_p8")
    for a in (1, 2, 4, 8):
        assert [row[str(a)]["max"] for row in rows] == [-(-(7 - s) // a) for s in range(8)]


def test_nonfinite_gradient_skips_that_stage_update(two_ranks):
    for r in two_ranks("nonfinite_skip"):
        # micro-batch 9 belongs to the third group of 4: that step, and only it, is skipped
        assert r["skipped"] == 1 and r["ok"] == [True, True, False, True, True, True]
        assert r["digest_finite"]
        if r["losses"]:
            finite = [x for i, x in enumerate(r["losses"]) if i != 9]
            assert all(0 < x < 10 for x in finite)


def test_nonfinite_abort_names_stage_and_step(one_rank):
    (r,) = one_rank("nonfinite_abort")
    assert "stage 0: non-finite gradient at the local step after micro-batch 7" in r["message"]
    assert "--paci-on-nonfinite abort" in r["message"]
