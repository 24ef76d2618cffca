"""The throughput benchmark: its simulated side (pure) and a --quick run end to end (one
process per stage, sleep-costed compute, real gloo point-to-point, the real StageExecutor)."""

import json
import math
import subprocess
import sys

import pytest

from launch import REPO, kill_tree
from paci_megatron.bench_throughput import Bench, simulate_stream

TIMEOUT_S = 85  # the quick run takes ~15 s; a hung pipeline must fail, not stall the suite
KEYS = ("P", "M", "a", "sec_per_update_1f1b", "sec_per_update_paci", "sec_per_update_ideal",
        "ratio", "ideal_ratio", "simulated_ratio")


@pytest.mark.parametrize("P,M", [(2, 2), (4, 4), (4, 8), (8, 4)])
def test_simulated_stream_matches_closed_forms(P, M):
    bench = Bench(0.02, 0.04, 0.0, warmup=2, updates=3, tensor_side=8, timeout_s=10)
    flush, _ = simulate_stream("flush", P, M, bench)
    paci, _ = simulate_stream("paci", P, M, bench)
    assert flush == pytest.approx((M + P - 1) * 0.06)
    assert paci == pytest.approx(M * 0.06)  # steady state: no bubble


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    trace = tmp_path_factory.mktemp("bench") / "trace.json"
    cmd = [sys.executable, "-m", "paci_megatron.bench_throughput", "--quick", "--trace",
           str(trace)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the launcher and every stage process
        out, err = proc.communicate()
        pytest.fail(f"benchmark hung past {TIMEOUT_S}s\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows, trace


@pytest.mark.dist
def test_quick_rows_are_complete_and_paci_is_faster(quick_run):
    rows, _ = quick_run
    assert [(r["P"], r["M"]) for r in rows] == [(4, 4)]
    for row in rows:
        for key in KEYS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), key
        assert row["sec_per_update_paci"] < row["sec_per_update_1f1b"]
        assert row["ideal_ratio"] == pytest.approx((row["M"] + row["P"] - 1) / row["M"])


@pytest.mark.dist
def test_measured_ratio_matches_the_simulator(quick_run):
    rows, _ = quick_run
    for row in rows:
        assert row["ratio"] == pytest.approx(row["simulated_ratio"], rel=0.15), row


@pytest.mark.dist
def test_traces_cover_both_schedules_and_every_stage(quick_run):
    _, trace = quick_run
    sim = trace.with_name("trace.sim.json")
    for path in (trace, sim):
        events = json.loads(path.read_text())["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert {(e["pid"], e["tid"]) for e in spans} == {(p, s) for p in (0, 1) for s in range(4)}
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
        forwards = [e for e in spans if e["name"].startswith("F") and e["pid"] == 1]
        assert len(forwards) >= 4 * 4 * 2  # every stage ran several PACI calls of 4 forwards
