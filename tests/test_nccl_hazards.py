"""The NCCL hazards of the tied-weight exchange and of first use, as the NCCL model finds them
on the lists as they were before the tied messages moved (and on today's flush plans), and
the order and settings that remove them (pure: ``nccl_model``, no torch).

Each hazard test runs the deadlock twice: with the rule that causes it, and with only that
rule turned off, which must pass; so no test passes because a rule does nothing.
"""

import itertools
import re

import pytest

from paci_megatron.nccl_model import channels_used
from paci_megatron.nccl_warmup import WARMUP_ORDER, run_warmup, warmup_programs
from paci_megatron.schedule import Action, Op, Schedule, build_paci, plan_stream
from paci_megatron.shape import closes_group, tied_lag
from paci_megatron.simulate import (Costs, DeadlockError, NcclModel, run_nccl, run_stream_nccl,
                                    simulate)

COSTS = Costs(1.0, 2.0, 3.0)
# what mcore/ gets today: Megatron's batch_p2p_sync, communicators built and pairs connected
# on first use (one embedding group: the default)
TODAY = dict(batch_sync=True, warmed=False)


def tied_lists_before(schedule: Schedule) -> Schedule:
    """The tied lists as they were: the last stage's SG right after its closing backward,
    and RW (receive and install) right after its step tied_lag steps later, the last L at
    the end."""
    P, a, M = schedule.num_stages, schedule.accumulation, schedule.num_microbatches
    lag = tied_lag(P, a) * a
    last = []
    for act in schedule.stages[-1]:
        if act.op in (Op.SEND_TIED_GRAD, Op.RECV_TIED_WEIGHT):
            continue
        last.append(act)
        if act.op is Op.BACKWARD and closes_group(act.mb, a):
            last.append(Action(Op.SEND_TIED_GRAD, act.mb))
        if act.op is Op.STEP and act.mb >= lag:
            last.append(Action(Op.RECV_TIED_WEIGHT, act.mb - lag))
    last += [Action(Op.RECV_TIED_WEIGHT, m) for m in range(a - 1, M, a) if m + lag >= M]
    return Schedule("before", P, a, M, schedule.stages[:-1] + (tuple(last),), True)


BEFORE = tied_lists_before(build_paci(3, 1, 9, tied=True))


def test_the_helper_rebuilds_the_lists_as_they_were():
    # the last stage of the P=3 a=1 example as docs/design.md printed it before this change
    assert " ".join(map(str, BEFORE.stages[2][:30])) == (
        "RF0 F0 B0 SG0 SB0 RF1 R0 T0 F1 B1 SG1 SB1 RF2 R1 T1 F2 B2 SG2 SB2 RF3 R2 T2 "
        "F3 B3 SG3 SB3 RF4 R3 T3 RW0")
    assert BEFORE.stages[:2] == build_paci(3, 1, 9, tied=True).stages[:2]


def deadlock_of(schedule: Schedule, model: NcclModel) -> str:
    with pytest.raises(DeadlockError) as caught:
        run_nccl(schedule, COSTS, model)
    return str(caught.value).split("deadlock: ", 1)[1]


def test_the_tied_lists_before_deadlock_on_todays_settings():
    assert deadlock_of(BEFORE, NcclModel(**TODAY)) == (
        "stage 0 waits for connecting 1->0 on pipeline (until stage 1 gets there) (after RB0); "
        "stage 1 waits for connecting 2->1 on pipeline (until stage 2 gets there) (after RB0); "
        "stage 2 waits for creating embedding (until stage 0 gets there) "
        "connecting 2->0 on embedding (until stage 0 gets there) (after SG0)")


def test_hazard_1_a_synchronize_waits_for_a_pending_tied_send():
    """Two embedding groups and a warm-up leave only the synchronize: with batch_p2p_sync,
    stage 0's synchronize after its exchange SF3+RB1 waits for SW0, which the last stage
    receives only after its step 3, which needs stage 0's F4."""
    two = dict(tied_groups=2)
    assert deadlock_of(BEFORE, NcclModel(batch_sync=True, **two)) == (
        "stage 0 waits for SW0 (after RB1); stage 1 waits for SF3 RB2 (after RB2); "
        "stage 2 waits for SG1 (after RF2)")
    run_nccl(BEFORE, COSTS, NcclModel(**two))  # the same without the synchronize
    # the shape exchange's synchronize (variable_seq_lengths): the last stage's waits for SG0,
    # posted before its own gradient went back
    assert deadlock_of(BEFORE, NcclModel(shapes=True, **two)).endswith(
        "stage 2 waits for SG0 (after RF1)")
    # any device-wide sync (the allocator's retry): right after SG0
    assert deadlock_of(BEFORE, NcclModel(sync_anywhere=True, **two)).endswith(
        "stage 2 waits for SG0 (after SG0)")


def test_hazard_2_first_use_blocks_the_host():
    """Built and connected lazily, the last stage's first tied message (SG0) blocks its host
    until stage 0 reaches its own, RG0; stage 0's host is blocked connecting its first
    gradient receive, whose sender is blocked the same way, down to the last stage's first
    SB0, which comes after SG0. Eager creation leaves the connection; the warm-up removes
    both."""
    two = dict(tied_groups=2)
    lazy = deadlock_of(BEFORE, NcclModel(warmed=False, **two))
    assert lazy.endswith("stage 2 waits for creating embedding G (until stage 0 gets there) "
                         "connecting 2->0 on embedding G (until stage 0 gets there) (after SG0)")
    assert lazy.startswith("stage 0 waits for connecting 1->0 on pipeline")
    assert deadlock_of(BEFORE, NcclModel(warmed=False, eager=True, **two)).endswith(
        "stage 2 waits for connecting 2->0 on embedding G (until stage 0 gets there) "
        "(after SG0)")
    run_nccl(BEFORE, COSTS, NcclModel(**two))


def test_hazard_3_both_tied_directions_on_one_stream():
    """One embedding group: stage 0's SW0 heads its stream until the last stage's RW0, behind
    SG1 on the last stage's stream, which waits for stage 0's RG1, behind SW0."""
    assert deadlock_of(BEFORE, NcclModel()) == (
        "stage 0 waits for RG1 (after T1); stage 1 waits for SB2 RF4 (after T2); "
        "stage 2 waits for SB3 RF4 (after T3)")
    assert deadlock_of(BEFORE, NcclModel(batched=False)).startswith(
        "stage 0 waits for RG1 (after T1)")
    run_nccl(BEFORE, COSTS, NcclModel(tied_groups=2))  # a stream per direction


def test_the_new_tied_lists_pass_every_setting_that_broke_the_old():
    new = build_paci(3, 1, 9, tied=True)
    for model in (NcclModel(**TODAY), NcclModel(batch_sync=True, tied_groups=2),
                  NcclModel(shapes=True, sync_anywhere=True, **TODAY),
                  NcclModel(eager=True, sync_anywhere=True, **TODAY),
                  NcclModel(batched=False, sync_anywhere=True, **TODAY), NcclModel()):
        simulate(new, COSTS, model)


def test_a_pipeline_pair_first_meeting_in_opposite_orders_deadlocks_the_flush_plan():
    """The flush plan (stock 1F1B, the baseline) at P=3, a=N=2: stage 0's
    first gradient receive shares an exchange with its last warm-up send (SF1+RB0); its host
    blocks connecting 1->0 until stage 1's first SB0, and stage 1's host is blocked in the
    synchronize after SF0+RF1, whose RF1 is in stage 0's unposted exchange."""
    plan = plan_stream("flush", 3, 2, 2)
    assert " ".join(map(str, plan.call(0)[0])) == "F0 SF0 F1 SF1 RB0 B0 RB1 B1 R1 T1"

    def run(**settings):
        run_stream_nccl(plan, 3, COSTS, NcclModel(**settings))

    with pytest.raises(DeadlockError, match=re.escape(
            "stage 0 waits for connecting 1->0 on pipeline (until stage 1 gets there) (after "
            "RB0); stage 1 waits for RF1 (after RF1)")):
        run(**TODAY)
    run(batch_sync=True)  # the warm-up connected the pair
    run(warmed=False)  # without the synchronize, stage 1's host runs on to its SB0
    with pytest.raises(DeadlockError, match="stage 0 waits for connecting 1->0"):
        run(warmed=False, sync_anywhere=True)  # but any device-wide sync there deadlocks
    run(sync_anywhere=True)


@pytest.mark.parametrize("P", range(2, 9))
def test_shipped_plans_pass_today_and_any_device_sync(P):
    """P=2..8, a in {1, 2, P-1, 8}, N in {a, 2a}, tied and untied, batched or not, with or
    without the shape exchange, built lazily or eagerly: today's settings with a device-wide
    sync after every action. That covers the runtime's settings too: a warm-up, no
    batch_p2p_sync and fewer syncs only remove waits."""
    for a in sorted({1, 2, P - 1, 8}):
        for N, tied in itertools.product((a, 2 * a), (False, True)):
            plan = plan_stream("paci", P, a, N, tied)
            for batched, shapes, eager in itertools.product((True, False), repeat=3):
                model = NcclModel(batched, shapes, eager=eager, sync_anywhere=True, **TODAY)
                run_stream_nccl(plan, len(plan.first) + 2, COSTS, model)


@pytest.mark.parametrize("P", [4, 8])
def test_tied_update_time_is_ideal_without_batch_p2p_sync(P):
    """tf=1, tb=2, step 3, a=8: M(tf+tb) + step = 27 per update at every stage with the
    runtime's settings. With batch_p2p_sync (or the shape exchange's synchronize) the last
    stage's syncs wait for its posted RW until stage 0's step: 30 at P=4, 38 at P=8."""
    a = 8
    sched = build_paci(P, a, a * (2 * P + 4), tied=True)
    for model in (NcclModel(), NcclModel(batched=False)):
        result = simulate(sched, COSTS, model)
        assert [result.steady_period(s) for s in range(P)] == [27.0] * P
    slower = {4: 30.0, 8: 38.0}[P]
    for model in (NcclModel(batch_sync=True), NcclModel(shapes=True)):
        result = simulate(sched, COSTS, model)
        assert max(result.steady_period(s) for s in range(P)) == slower


# --- the start-up exchange ------------------------------------------------------------------

def _labels(programs):
    return {rank: [[[f"{op}@{op.comm}" for op in kernel] for kernel in step] for step in steps]
            for rank, steps in programs.items()}


def test_warmup_order_at_p3():
    assert WARMUP_ORDER == ("data-parallel", "grad-stats", "pipeline", "embedding")
    assert _labels(warmup_programs(3, tied=True)) == {
        0: [[["warm-up SF@pipeline", "warm-up RB@pipeline"]],
            [["warm-up SW@embedding"], ["warm-up RG@embedding"]]],
        1: [[["warm-up RF@pipeline", "warm-up SB@pipeline", "warm-up SF@pipeline",
              "warm-up RB@pipeline"]]],
        2: [[["warm-up RF@pipeline", "warm-up SB@pipeline"]],
            [["warm-up RW@embedding"], ["warm-up SG@embedding"]]]}
    grid = _labels(warmup_programs(2, tied=False, data_parallel=2, grad_stats=2))
    assert grid[(1, 0, 1)] == [[["data-parallel all-reduce@data-parallel s1 g1"]],
                               [["grad-stats all-reduce@grad-stats s1 d0"]],
                               [["warm-up RF@pipeline d0 g1", "warm-up SB@pipeline d0 g1"]]]


@pytest.mark.parametrize("P", range(2, 9))
def test_warmup_is_deadlock_free_and_connects_what_the_stream_uses(P):
    settings = itertools.product((True, False), (False, True), (False, True), (1, 2))
    for (batched, shapes, eager, groups), tied in itertools.product(settings, (False, True)):
        model = NcclModel(batched, shapes, eager=eager, tied_groups=groups)
        for dp, gs in ((2, 1), (1, 2), (2, 2)):
            run_warmup(warmup_programs(P, tied, model, dp, gs), model)
        connected = run_warmup(warmup_programs(P, tied, model), model)
        for a in sorted({1, P}):
            plan = plan_stream("paci", P, a, a, tied)
            assert channels_used(plan, len(plan.first) + 2, model) <= connected, (model, a)


def test_a_warmup_in_different_orders_on_two_ranks_deadlocks():
    programs = warmup_programs(2, tied=True)
    programs[0] = programs[0][::-1]  # stage 0: the embedding group first
    with pytest.raises(DeadlockError, match=re.escape(
            "stage 0 waits for connecting 0->1 on embedding (until stage 1 gets there)")):
        run_warmup(programs, NcclModel(eager=True))
    run_warmup(warmup_programs(2, tied=True), NcclModel(eager=True))
