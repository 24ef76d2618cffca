"""Pure tests of the schedule description and the simulator (no torch, no processes)."""

import itertools

import pytest

from paci_megatron.schedule import (
    Action,
    Op,
    Schedule,
    build_flush,
    build_paci,
    cut_points,
    drift_bound,
    plan_stream,
    segments,
)
from paci_megatron.simulate import Costs, DeadlockError, ScheduleError, simulate

GRID = list(itertools.product(range(1, 9), range(1, 11)))


def micro_batch_counts(P, a):
    # short (warm-up never reaches steady state), exact groups, and long with a ragged tail
    return sorted({1, P, 2 * a + P, 4 * a + P + 1})


@pytest.mark.parametrize("P,a", GRID)
def test_paci_invariants_and_exact_drift(P, a):
    for M in micro_batch_counts(P, a):
        result = simulate(build_paci(P, a, M), Costs(1.0, 2.0))
        bounds = [drift_bound(P, s, a) for s in range(P)]
        assert all(d <= b for d, b in zip(result.max_drift(), bounds))
        assert all(peak <= P - s for s, peak in enumerate(result.max_in_flight))
        if M >= 2 * a + P:  # steady state reached: the bound is met exactly
            assert result.max_drift() == bounds, (P, a, M)


@pytest.mark.parametrize("P,a", GRID)
def test_flush_invariants_no_drift(P, a):
    for M in micro_batch_counts(P, a):
        result = simulate(build_flush(P, a, M))
        assert result.max_drift() == [0] * P


@pytest.mark.parametrize("P,a", GRID)
def test_steady_state_bubble(P, a):
    M = a * (2 * P + 4)  # long enough that the middle step interval is steady state
    costs = Costs(forward=1.0, backward=1.0)
    paci = simulate(build_paci(P, a, M), costs)
    flush = simulate(build_flush(P, a, M), costs)
    for s in range(P):
        assert paci.steady_bubble(s) == pytest.approx(0.0, abs=1e-12)
        assert flush.steady_bubble(s) == pytest.approx((P - 1) / (a + P - 1), abs=1e-12)


def test_steps_follow_every_ath_backward():
    sched = build_paci(4, 3, 10)
    for acts in sched.stages:
        steps = [a.mb for a in acts if a.op is Op.STEP]
        assert steps == [2, 5, 8]


def test_makespan_matches_closed_forms():
    P, a, M = 4, 4, 16
    flush = simulate(build_flush(P, a, M), Costs(1.0, 1.0))
    assert flush.makespan == (M // a) * (a + P - 1) * 2
    paci = simulate(build_paci(P, a, M), Costs(1.0, 1.0))
    assert paci.makespan == (M + P - 1) * 2
    assert "stage 3:" in paci.timeline()


def test_action_text_round_trip():
    sched = build_paci(3, 2, 6)
    again = Schedule.parse("paci", 2, [" ".join(map(str, acts)) for acts in sched.stages])
    assert again.stages == sched.stages
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("X3")


def test_simulator_detects_deadlock():
    # stage 0 waits for a gradient before it ever sends an activation
    sched = Schedule.parse("bad", 1, ["RB0 F0 SF0 B0 T0", "RF0 F0 B0 SB0 T0"])
    with pytest.raises(DeadlockError, match="stage 0 waits at #0 RB0"):
        simulate(sched)


def test_simulator_rejects_broken_lists():
    with pytest.raises(ScheduleError, match="in flight"):
        simulate(Schedule.parse("greedy", 3, ["F0 SF0 F1 SF1 F2 SF2 RB0 B0 RB1 B1 RB2 B2 T2",
                                              "RF0 F0 B0 SB0 RF1 F1 B1 SB1 RF2 F2 B2 SB2 T2"]))
    with pytest.raises(ScheduleError, match="out of order"):
        simulate(Schedule.parse("swap", 2, ["F0 SF0 F1 SF1 RB0 B0 RB1 B1 T1",
                                            "RF1 F1 B1 SB1 RF0 F0 B0 SB0 T0"]))
    with pytest.raises(ScheduleError, match="steps"):
        simulate(Schedule.parse("nostep", 1, ["F0 B0"]))


@pytest.mark.parametrize("P,a,k", [(1, 1, 1), (2, 2, 1), (4, 1, 4), (4, 4, 1), (4, 2, 2),
                                   (8, 8, 1), (8, 3, 2), (5, 7, 1)])
def test_stream_calls_are_balanced_and_periodic(P, a, k):
    N = a * k
    plan = plan_stream("paci", P, a, N)
    for s in range(P):
        # PACI keeps P-1-s forwards in flight across a call boundary
        fwd = sum(1 for x in plan.first[s] if x.op is Op.FORWARD)
        bwd = sum(1 for x in plan.first[s] if x.op is Op.BACKWARD)
        assert bwd == N and fwd == N + min(P - 1 - s, N * 10)
    flush = plan_stream("flush", P, a, N)
    assert flush.call(3) == tuple(tuple(x.shifted(2 * N) for x in acts) for acts in flush.steady)
    # concatenating calls gives back the full schedule the simulator checked
    sched = build_paci(P, a, 5 * N)
    cuts = cut_points(sched, 3 * N)
    for s in range(P):
        joined = sum((list(plan.call(c)[s]) for c in range(3)), [])
        assert joined == list(sched.stages[s][: cuts[s]])


def test_accumulation_must_divide_calls():
    with pytest.raises(ValueError, match="--paci-accumulation-factor 3 must divide"):
        plan_stream("paci", 4, 3, 8)
    with pytest.raises(ValueError, match="--paci-accumulation-factor must be >= 1"):
        build_paci(4, 0, 8)


def test_segments_split_whole_schedule():
    sched = build_paci(4, 2, 8)
    segs = segments(sched, 4)
    for s in range(4):
        assert sum(len(seg[s]) for seg in segs) == len(sched.stages[s])
