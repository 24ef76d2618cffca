"""Pure tests of the schedule description and the simulator (no torch, no processes)."""

import itertools

import pytest

from paci_megatron.schedule import (
    Action,
    Op,
    Schedule,
    build_flush,
    build_paci,
    drift_bound,
    install_step,
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
    sched = Schedule.parse("bad", 1, ["RB0 F0 SF0 B0 R0 T0", "RF0 F0 B0 SB0 R0 T0"])
    with pytest.raises(DeadlockError, match="stage 0 waits at #0 RB0"):
        simulate(sched)


def test_simulator_rejects_broken_lists():
    with pytest.raises(ScheduleError, match="in flight"):
        simulate(Schedule.parse("greedy", 3, ["F0 SF0 F1 SF1 F2 SF2 RB0 B0 RB1 B1 RB2 B2 R2 T2",
                                              "RF0 F0 B0 SB0 RF1 F1 B1 SB1 RF2 F2 B2 SB2 R2 T2"]))
    with pytest.raises(ScheduleError, match="out of order"):
        simulate(Schedule.parse("swap", 2, ["F0 SF0 F1 SF1 RB0 B0 RB1 B1 R1 T1",
                                            "RF1 F1 B1 SB1 RF0 F0 B0 SB0 R0 T0"]))
    with pytest.raises(ScheduleError, match="steps"):
        simulate(Schedule.parse("nostep", 1, ["F0 B0"]))


# Golden lists, derived by hand from the PACI rule (stage s runs P-1-s forwards ahead, then
# one forward / one backward; a step after every a-th backward; a call ends after its N-th
# backward and, on s > 0, takes the next input its predecessor already sent).
# A group closes with R (its data-parallel sync) and T (the step). PACI receives the next
# forward input before them ("SB j RF k R j T j": one fused exchange, see
# schedule.receive_before_step); the flush baseline has no such receive. With tied embeddings
# (P=2, a=1: lag L = 2) the two ends handle each group's tied messages in the same order: the
# last stage sends its output-layer gradient (SG) as its R's data-parallel reduction left it,
# then posts the receive of stage 0's weight of that group (RW); stage 0 receives the gradient
# before its R (RG), which adds it to its own reduced one, and sends the weight after its T
# (SW). The last stage installs that weight after its own step L later
# (schedule.install_step), from the buffer RW received it into.
GOLDEN_CALLS = {
    ("paci", 2, 2, 4): (
        ["F0 SF0 F1 SF1 RB0 B0 F2 SF2 RB1 B1 R1 T1 F3 SF3 RB2 B2 F4 SF4 RB3 B3 R3 T3",
         "RF0 F0 B0 SB0 RF1 F1 B1 SB1 RF2 R1 T1 F2 B2 SB2 RF3 F3 B3 SB3 RF4 R3 T3"],
        ["F5 SF5 RB4 B4 F6 SF6 RB5 B5 R5 T5 F7 SF7 RB6 B6 F8 SF8 RB7 B7 R7 T7",
         "F4 B4 SB4 RF5 F5 B5 SB5 RF6 R5 T5 F6 B6 SB6 RF7 F7 B7 SB7 RF8 R7 T7"]),
    ("paci", 3, 1, 3): (
        ["F0 SF0 F1 SF1 F2 SF2 RB0 B0 R0 T0 F3 SF3 RB1 B1 R1 T1 F4 SF4 RB2 B2 R2 T2",
         "RF0 F0 SF0 RF1 F1 SF1 RB0 B0 SB0 RF2 R0 T0 F2 SF2 RB1 B1 SB1 RF3 R1 T1 F3 SF3 RB2 B2 SB2 RF4 R2 T2",
         "RF0 F0 B0 SB0 RF1 R0 T0 F1 B1 SB1 RF2 R1 T1 F2 B2 SB2 RF3 R2 T2"],
        ["F5 SF5 RB3 B3 R3 T3 F6 SF6 RB4 B4 R4 T4 F7 SF7 RB5 B5 R5 T5",
         "F4 SF4 RB3 B3 SB3 RF5 R3 T3 F5 SF5 RB4 B4 SB4 RF6 R4 T4 F6 SF6 RB5 B5 SB5 RF7 R5 T5",
         "F3 B3 SB3 RF4 R3 T3 F4 B4 SB4 RF5 R4 T4 F5 B5 SB5 RF6 R5 T5"]),
    ("paci", 2, 1, 1): (
        ["F0 SF0 F1 SF1 RB0 B0 R0 T0", "RF0 F0 B0 SB0 RF1 R0 T0"],
        ["F2 SF2 RB1 B1 R1 T1", "F1 B1 SB1 RF2 R1 T1"]),
    ("paci", 2, 1, 2, True): (
        ["F0 SF0 F1 SF1 RB0 B0 RG0 R0 T0 SW0 F2 SF2 RB1 B1 RG1 R1 T1 SW1",
         "RF0 F0 B0 SB0 RF1 R0 SG0 RW0 T0 F1 B1 SB1 RF2 R1 SG1 RW1 T1"],
        ["F3 SF3 RB2 B2 RG2 R2 T2 SW2 F4 SF4 RB3 B3 RG3 R3 T3 SW3",
         "F2 B2 SB2 RF3 R2 SG2 RW2 T2 F3 B3 SB3 RF4 R3 SG3 RW3 T3"]),
    ("flush", 2, 2, 2): (
        ["F0 SF0 F1 SF1 RB0 B0 RB1 B1 R1 T1", "RF0 F0 B0 SB0 RF1 F1 B1 SB1 R1 T1"],
        ["F2 SF2 F3 SF3 RB2 B2 RB3 B3 R3 T3", "RF2 F2 B2 SB2 RF3 F3 B3 SB3 R3 T3"]),
}


def _text(acts):
    return " ".join(map(str, acts))


@pytest.mark.parametrize("key", sorted(GOLDEN_CALLS),
                         ids=lambda k: "{0[0]}-P{0[1]}-a{0[2]}-N{0[3]}".format(k) + "-tied" * (len(k) > 4))
def test_stream_calls_match_hand_written_lists(key):
    plan = plan_stream(*key)
    call0, call1 = GOLDEN_CALLS[key]
    assert [_text(acts) for acts in plan.call(0)] == call0
    assert [_text(acts) for acts in plan.call(1)] == call1


def _count(acts, op):
    return sum(1 for x in acts if x.op is op)


STREAM_CASES = [(1, 1, 1), (2, 2, 1), (3, 1, 1), (4, 1, 4), (4, 4, 1), (4, 2, 2), (8, 8, 1),
                (8, 3, 2), (8, 1, 1), (5, 7, 1)]


@pytest.mark.parametrize("P,a,k", STREAM_CASES)
def test_stream_calls_are_prefixes_of_one_paci_list(P, a, k):
    """Concatenating calls 0..c gives a prefix of one long PACI list; counted from that
    prefix alone: (c+1)N backwards, (c+1)N/a steps, P-1-s forwards in flight, the next input
    already received on s > 0, and every message sent so far also received."""
    N = a * k
    calls = 4
    plan = plan_stream("paci", P, a, N)
    whole = build_paci(P, a, N * (calls + 2) + P)
    joined = [[] for _ in range(P)]
    for c in range(calls):
        for s in range(P):
            joined[s] += plan.call(c)[s]
            acts = joined[s]
            assert acts == list(whole.stages[s][: len(acts)]), (P, a, N, c, s)
            assert _count(acts, Op.BACKWARD) == (c + 1) * N
            assert _count(acts, Op.STEP) == (c + 1) * N // a
            assert _count(acts, Op.FORWARD) - _count(acts, Op.BACKWARD) == P - 1 - s
            if s > 0:
                assert _count(acts, Op.RECV_F) == _count(acts, Op.FORWARD) + 1
                # the next input comes in before the step that closes the call
                assert [x.op for x in acts[-3:]] == [Op.RECV_F, Op.REDUCE, Op.STEP]
        for s in range(P - 1):  # the link s -> s+1 is empty at the call boundary
            assert _count(joined[s], Op.SEND_F) == _count(joined[s + 1], Op.RECV_F)
            assert _count(joined[s + 1], Op.SEND_B) == _count(joined[s], Op.RECV_B)


@pytest.mark.parametrize("P,a,k", STREAM_CASES)
def test_flush_stream_calls_end_empty(P, a, k):
    N = a * k
    plan = plan_stream("flush", P, a, N)
    for c in range(3):
        for s, acts in enumerate(plan.call(c)):
            mbs = sorted({x.mb for x in acts if x.op is Op.FORWARD})
            assert mbs == list(range(c * N, (c + 1) * N))
            assert _count(acts, Op.BACKWARD) == N and _count(acts, Op.STEP) == N // a


def test_accumulation_must_divide_calls():
    with pytest.raises(ValueError, match="--paci-accumulation-factor 3 must divide"):
        plan_stream("paci", 4, 3, 8)
    with pytest.raises(ValueError, match="--paci-accumulation-factor must be >= 1"):
        build_paci(4, 0, 8)


def test_segments_split_whole_schedule():
    sched = build_paci(4, 2, 8)
    segs = segments(sched, 4)
    assert len(segs) == 2
    for s in range(4):
        assert list(segs[0][s]) + list(segs[1][s]) == list(sched.stages[s])
        assert [_count(seg[s], Op.BACKWARD) for seg in segs] == [4, 4]
    assert segs[1][0][-1] == Action(Op.STEP, 7)  # the last segment runs to the end


@pytest.mark.parametrize("P,a", GRID)
def test_tied_lists_keep_every_invariant_and_carry_each_message_once(P, a):
    """With tied embeddings every group of the last stage sends one output-layer gradient
    (right after its R: as its data-parallel reduction left it) that stage 0 takes before its
    R, stage 0 sends one weight per step, and the last stage receives each of them right after
    sending that group's gradient: both ends meet each group's two messages in the same
    order. It installs them L = ceil(P/a) steps late (install_step)."""
    for M in micro_batch_counts(P, a):
        sched = build_paci(P, a, M, tied=True)
        simulate(sched, Costs(1.0, 2.0))  # invariants; every message received, in order
        if P == 1:
            assert not sched.tied
            continue
        steps = M // a
        first, last = sched.stages[0], sched.stages[-1]
        assert _count(last, Op.SEND_TIED_GRAD) == _count(first, Op.RECV_TIED_GRAD) == steps
        assert _count(first, Op.SEND_TIED_WEIGHT) == _count(last, Op.RECV_TIED_WEIGHT) == steps
        assert all(not any(x.op in (Op.SEND_TIED_GRAD, Op.RECV_TIED_GRAD, Op.SEND_TIED_WEIGHT,
                                    Op.RECV_TIED_WEIGHT) for x in acts) for acts in sched.stages[1:-1])
        assert install_step(a - 1, P, a) == (-(-P // a) + 1) * a - 1
        tied = [x for x in last if x.op in (Op.SEND_TIED_GRAD, Op.RECV_TIED_WEIGHT)]
        assert tied == [Action(op, (g + 1) * a - 1) for g in range(steps)
                        for op in (Op.SEND_TIED_GRAD, Op.RECV_TIED_WEIGHT)]
        tied = [x for x in first if x.op in (Op.RECV_TIED_GRAD, Op.SEND_TIED_WEIGHT)]
        assert tied == [Action(op, (g + 1) * a - 1) for g in range(steps)
                        for op in (Op.RECV_TIED_GRAD, Op.SEND_TIED_WEIGHT)]
        for i, x in enumerate(last):
            if x.op is Op.SEND_TIED_GRAD:  # after its reduction, before its step
                assert (last[i - 1], last[i + 2]) == (Action(Op.REDUCE, x.mb),
                                                      Action(Op.STEP, x.mb)), (P, a, M, i)


def test_misplaced_tied_actions_are_rejected():
    rows = ["F0 SF0 RB0 B0 RG0 R0 T0 SW0", "RF0 F0 B0 SB0 R0 SG0 RW0 T0"]
    simulate(Schedule.parse("tied", 1, rows))
    with pytest.raises(ScheduleError, match=r"SG0 out of place \(after SB0\)"):  # unreduced
        simulate(Schedule.parse("early", 1, [rows[0], rows[1].replace("R0 SG0 RW0",
                                                                       "SG0 RW0 R0")]))
    with pytest.raises(ScheduleError, match=r"RW0 out of place \(after T0\)"):  # the old place
        simulate(Schedule.parse("late", 1, [rows[0], rows[1].replace("RW0 T0", "T0 RW0")]))
    with pytest.raises(ScheduleError, match="RG0 out of place"):  # after the reduction
        simulate(Schedule.parse("late", 1, [rows[0].replace("RG0 R0", "R0 RG0"), rows[1]]))
    with pytest.raises(ScheduleError, match="never received"):  # a gradient nobody takes
        simulate(Schedule.parse("lost", 1, [rows[0].replace("RG0 ", ""), rows[1]]))
    untied = Schedule("untied", 2, 1, 1, Schedule.parse("x", 1, rows).stages, tied=False)
    with pytest.raises(ScheduleError, match="RG0 in a list without a tied weight"):
        simulate(untied)
