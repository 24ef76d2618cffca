"""PACI's action order under NCCL's pairing rules (pure: the simulator's NcclModel, no torch),
with the runtime's settings; tests/test_nccl_hazards.py has today's settings and the tied and
first-use hazards."""

import itertools

import pytest

from paci_megatron.schedule import Op, Schedule, build_flush, build_paci, plan_stream
from paci_megatron.simulate import (
    Costs,
    DeadlockError,
    NcclModel,
    run_stream_nccl,
    simulate,
)

MODELS = [NcclModel(batched, shapes) for batched in (True, False) for shapes in (False, True)]
GRID = list(itertools.product(range(1, 9), range(1, 11)))


def step_then_receive(schedule: Schedule) -> Schedule:
    """The order before the fix: the next forward's receive right after the local step."""
    rows = []
    for acts in schedule.stages:
        acts = list(acts)
        for i in range(len(acts) - 2):
            if acts[i].op is Op.RECV_F and acts[i + 1].op is Op.REDUCE:
                acts[i:i + 3] = acts[i + 1:i + 3] + [acts[i]]
        rows.append(tuple(acts))
    return Schedule("step-then-receive", schedule.num_stages, schedule.accumulation,
                    schedule.num_microbatches, tuple(rows))


@pytest.mark.parametrize("P,a", GRID)
def test_shipped_paci_stream_is_accepted_by_every_nccl_model(P, a):
    # the warm-up calls and two steady calls, each stage waiting for its sends at call ends;
    # with tied embeddings the tied messages too
    for N in sorted({a, 2 * a} if a <= 3 else {a}):
        for tied in (False, True):
            plan = plan_stream("paci", P, a, N, tied)
            for model in MODELS:
                run_stream_nccl(plan, len(plan.first) + 2, Costs(1.0, 2.0, 3.0), model)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_flush_stream_is_accepted_without_shape_exchange(P):
    # with the shape exchange the flush baseline is rejected when N < P - s (README: limits)
    for a in (1, 2, 4, 8):
        for model in MODELS[::2]:
            run_stream_nccl(plan_stream("flush", P, a, a), 3, Costs(1.0, 2.0, 3.0), model)


def test_model_rejects_the_step_before_the_receive():
    old = step_then_receive(build_paci(3, 2, 8))
    assert "SB1 R1 T1 RF2" in " ".join(map(str, old.stages[2]))
    with pytest.raises(DeadlockError, match="unbatched p2p: deadlock: stage 0 waits for RB"):
        simulate(old, nccl=NcclModel(batched=False))
    with pytest.raises(DeadlockError, match="with shape exchange: deadlock"):
        simulate(step_then_receive(build_paci(2, 2, 8)), nccl=NcclModel(shapes=True))
    simulate(step_then_receive(build_paci(2, 2, 8)), nccl=NcclModel(batched=False))  # P=2: own
    simulate(old)  # the gloo-like model (sends never block) cannot see it


def test_model_rejects_hand_made_lists():
    rows = ["F0 SF0 F1 SF1 RB0 B0 R0 T0 RB1 B1 R1 T1",
            "RF0 F0 SF0 RF1 F1 SF1 RB0 B0 SB0 R0 T0 RB1 B1 SB1 R1 T1",
            "RF0 F0 B0 SB0 R0 T0 RF1 F1 B1 SB1 R1 T1"]
    # stage 1 queues send F1 then receive B0 on its link to stage 2, which queues send B0 and
    # only after its step receive F1: two sends face each other on one NCCL stream
    bad = Schedule.parse("hand-made", 1, rows)
    with pytest.raises(DeadlockError, match="stage 1 waits for RB0.*stage 2 waits for RF1"):
        simulate(bad, nccl=NcclModel(batched=False))
    batched = simulate(bad, Costs(1.0, 1.0, 10.0), NcclModel())  # no deadlock, but it waits
    fixed = Schedule.parse("fixed", 1, rows[:2] + [rows[2].replace("SB0 R0 T0 RF1", "SB0 RF1 R0 T0")])
    simulate(fixed, nccl=NcclModel(batched=False))
    assert simulate(fixed, Costs(1.0, 1.0, 10.0), NcclModel()).makespan < batched.makespan
    # a receive posted before the matching send exists anywhere
    with pytest.raises(DeadlockError, match="stage 0 waits for RB0"):
        simulate(Schedule.parse("bad", 1, ["RB0 F0 SF0 B0 R0 T0", "RF0 F0 B0 SB0 R0 T0"]),
                 nccl=NcclModel())


@pytest.mark.parametrize("P", [4, 8])
@pytest.mark.parametrize("step", [1.0, 3.0])
def test_update_time_is_ideal_with_a_costly_step(P, step):
    """tf=1, tb=2: one update of a=8 backwards ideally takes 8*3 + step at every stage."""
    a = 8
    costs = Costs(forward=1.0, backward=2.0, step=step)
    ideal = a * 3.0 + step
    for model in MODELS:
        result = simulate(build_paci(P, a, a * (2 * P + 4)), costs, model)
        assert [result.steady_period(s) for s in range(P)] == [ideal] * P, model
    # the figures for the old order, batched: P=4 a step of 3 forwards costs 36, not 27
    old = simulate(step_then_receive(build_paci(P, a, a * (2 * P + 4))), costs, NcclModel())
    assert old.steady_period(0) == a * 3.0 + P * step
    flush = simulate(build_flush(P, a, a * (2 * P + 4)), costs, NcclModel())
    assert flush.steady_period(0) == (a + P - 1) * 3.0 + step


def test_a_plan_the_checks_reject_is_refused_at_start_up_naming_why():
    """The runtime's admission (mcore/admission.admit_plan) runs the plan it is about to run
    through the simulator: here a stage whose steady call takes two inputs in the wrong
    order. The shipped plans pass (test_shipped_paci_stream_is_accepted_by_every_nccl_model)."""
    import dataclasses
    import types

    pytest.importorskip("megatron.core")
    from paci_megatron.mcore.admission import admit_plan

    good = plan_stream("paci", 3, 1, 2)
    admit_plan(good, types.SimpleNamespace(batch_p2p_comm=True))
    steady = [list(acts) for acts in good.steady]
    receives = [i for i, act in enumerate(steady[2]) if act.op is Op.RECV_F]
    i, j = receives[0], receives[1]
    steady[2][i], steady[2][j] = steady[2][j], steady[2][i]
    bad = dataclasses.replace(good, steady=tuple(map(tuple, steady)))
    with pytest.raises(ValueError, match=r"the paci plan P=3 a=1 N=2 fails its checks: .*"
                                         r"out of order"):
        admit_plan(bad, types.SimpleNamespace(batch_p2p_comm=True))
