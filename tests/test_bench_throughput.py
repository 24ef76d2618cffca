"""The throughput benchmark: its simulated side (pure), and what its stage processes execute
(one process per stage, real gloo point-to-point, the real StageExecutor) with zero compute
cost. No wall-clock threshold here: the timings live in the benchmark's output only."""

import json
import math
import os
import sys

import pytest

from launch import REPO, launch
from paci_megatron.tools.bench_throughput import (Bench, chrome_trace, parse_args, simulate_stream,
                                            summarize)
from paci_megatron.schedule import Action, Op, build_flush, build_paci

TIMEOUT_S = 150  # ~10 s of CPU for 4 processes; a hung pipeline must fail, not stall the suite
P, MS, CALLS = 4, (2, 4), 3  # the worker runs W=1 + K=2 updates per schedule and M


@pytest.mark.parametrize("P,M", [(2, 2), (4, 4), (4, 8), (8, 4)])
def test_simulated_stream_matches_closed_forms(P, M):
    bench = Bench(0.02, 0.04, 0.0, warmup=2, updates=3, tensor_side=8, timeout_s=10)
    flush, _ = simulate_stream("flush", P, M, bench)
    paci, _ = simulate_stream("paci", P, M, bench)
    assert flush == pytest.approx((M + P - 1) * 0.06)
    assert paci == pytest.approx(M * 0.06)  # steady state: no bubble


def test_uneven_stages_run_at_the_slowest_ones_pace():
    """--stage-pace 1.5 1 2: the last stage's forward and backward take twice the others'.
    PACI's update is then M x (tf + tb) x 2 (no bubble: the slowest stage never waits in the
    steady state); 1F1B's is longer, and the interleaved model (even stages only) is left
    out rather than reported on the wrong costs."""
    P, M = 4, 8
    bench = Bench(0.02, 0.04, 0.0, warmup=2, updates=3, tensor_side=8, timeout_s=10,
                  pace=(1.5, 1.0, 2.0))
    assert bench.stage_scale(P) == (1.5, 1.0, 1.0, 2.0)
    assert bench.costs(P).stage_scale == (1.5, 1.0, 1.0, 2.0) and bench.costs(P).slowest() == 2
    paci, _ = simulate_stream("paci", P, M, bench)
    flush, _ = simulate_stream("flush", P, M, bench)
    assert paci == pytest.approx(M * 0.06 * 2)
    assert flush > paci and flush > (M + P - 1) * 0.06
    even = Bench(0.02, 0.04, 0.0, warmup=2, updates=3, tensor_side=8, timeout_s=10)
    assert even.stage_scale(P) == () and even.costs(P) == even.costs(P - 1)
    from paci_megatron.tools.bench_throughput import interleaved_model
    assert interleaved_model(P, M, 2, bench) is None and interleaved_model(P, M, 2, even)
    assert parse_args(["--stage-pace", "1.5", "1", "2"]).stage_pace == [1.5, 1.0, 2.0]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """{(M, kind): [spans of stage 0, ..., stage P-1]} from one launch of P processes."""
    out = tmp_path_factory.mktemp("bench") / "actions.json"
    cmd = [sys.executable, "tests/workers/bench_actions.py", str(out), str(P), *map(str, MS)]
    # past TIMEOUT_S the launcher and every stage process are killed, and the test fails
    proc = launch(cmd, cwd=REPO, timeout=TIMEOUT_S,
                  env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    return {(r["M"], r["kind"]): [st["spans"] for st in r["stages"]]
            for r in json.loads(out.read_text())}


def _actions(spans):
    """What the stage executed, in order: every span's actions (a comm span holds several)."""
    return [Action.parse(a) for name, _, _, _ in spans for a in name.split()]


def _count(acts, op):
    return sum(1 for a in acts if a.op is op)


@pytest.mark.dist
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("kind", ["flush", "paci"])
def test_each_stage_executes_its_schedule_in_order(executed, kind, M):
    """Flush: exactly the 1F1B-flush list of CALLS*M micro-batches; PACI: a prefix of one
    never-flushing PACI list with CALLS*M backwards and P-1-s forwards still in flight."""
    for s, spans in enumerate(executed[(M, kind)]):
        acts = _actions(spans)
        if kind == "flush":
            assert acts == list(build_flush(P, M, CALLS * M).stages[s]), s
        else:
            assert acts == list(build_paci(P, M, CALLS * M + P).stages[s][: len(acts)]), s
            assert _count(acts, Op.FORWARD) - _count(acts, Op.BACKWARD) == P - 1 - s
        assert _count(acts, Op.BACKWARD) == CALLS * M
        assert _count(acts, Op.STEP) == CALLS  # a = M: one local step per update and stage
        categories = [cat for _, cat, _, _ in spans]  # adjacent send/recv fused into one call
        assert not any(a == b == "comm" for a, b in zip(categories, categories[1:])), s


@pytest.mark.dist
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("kind", ["flush", "paci"])
def test_messages_per_link(executed, kind, M):
    """Every message sent on a link is received (the receiver checks each payload's
    micro-batch id); PACI's forward links carry the P-1-s micro-batches sent ahead too."""
    stages = [_actions(spans) for spans in executed[(M, kind)]]
    for s in range(P - 1):
        ahead = P - 1 - s if kind == "paci" else 0
        assert _count(stages[s], Op.SEND_F) == _count(stages[s + 1], Op.RECV_F) \
            == CALLS * M + ahead
        assert _count(stages[s + 1], Op.SEND_B) == _count(stages[s], Op.RECV_B) == CALLS * M
    assert _count(stages[0], Op.RECV_F) == _count(stages[0], Op.SEND_B) == 0
    assert _count(stages[-1], Op.SEND_F) == _count(stages[-1], Op.RECV_B) == 0


@pytest.mark.dist
def test_report_row_and_traces_from_the_run(executed):
    """The benchmark's row and Chrome trace are built from these runs (values finite; no
    bound on them: timing is the benchmark's business)."""
    bench = Bench(0.01, 0.02, 0.0, warmup=1, updates=2, tensor_side=4, timeout_s=60)
    M = MS[-1]
    repeats = {kind: [[{"elapsed": 1.0, "spans": spans}
                       for spans in executed[(M, kind)]]] for kind in ("flush", "paci")}
    row = summarize(P, M, repeats, bench, chunks=2)
    for key in ("sec_per_update_1f1b", "sec_per_update_paci", "message_latency_ms_paci",
                "sleep_overshoot_ms_paci", "ratio", "ideal_ratio"):
        assert isinstance(row[key], float) and math.isfinite(row[key]), key
    assert row["ideal_ratio"] == (M + P - 1) / M
    trace = chrome_trace({kind: executed[(M, kind)] for kind in ("flush", "paci")})
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == {(p, s) for p in (0, 1) for s in range(P)}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert sum(e["pid"] == 1 and e["name"].startswith("F") for e in spans) == \
        sum(CALLS * M + P - 1 - s for s in range(P))


def test_quick_flags_and_refusals(capsys):
    args = parse_args(["--quick"])
    assert (args.stages, args.microbatches, args.warmup, args.updates) == ([4], [4], 2, 4)
    with pytest.raises(SystemExit):
        parse_args(["--warmup", "0"])
    assert "--warmup must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--stage-pace", "1", "0", "1"])
    assert "--stage-pace [1.0, 0.0, 1.0]: each pace must be > 0" in capsys.readouterr().err
