"""Deep pipelines, pure: the plans a run at P = 2..32 may use pass the checks a run's own plan
passes at start-up (``check_plan``: the schedule's invariants, its first calls in lockstep,
and under an NCCL model), with each stage's drift exactly at its bound and exactly P - s
micro-batches in flight at the peak. ``a`` ranges over the divisors of N = 16 (every factor
``auto`` may pick at N = 16, and 16 itself); the NCCL model, the slowest check, takes one
``a`` and one setting per P so that every setting meets every depth class. P <= 16 are in
the fast tier; P = 17..32 in the default suite."""

import itertools
import math

import pytest

from paci_megatron import adapt
from paci_megatron.schedule import build, plan_stream
from paci_megatron.shape import drift_bound
from paci_megatron.simulate import NcclModel, check_lists, check_plan

N = 16
DEPTHS = range(2, 33)
SHALLOW, DEEP = range(2, 17), range(17, 33)
FACTORS = adapt.candidates(32, N, None)  # (16, 8, 4, 2, 1): what auto may pick at N = 16
SETTINGS = list(itertools.product((True, False), (False, True), (False, True)))


def test_the_factors_auto_may_pick_at_n16_are_the_divisors():
    assert FACTORS == (16, 8, 4, 2, 1)


@pytest.mark.parametrize("P", SHALLOW)
def test_every_plan_passes_its_start_up_checks_with_drift_at_the_bound(P):
    check_every_plan(P)


# P = 17..32 take about a minute on 2 cores: the default suite runs them, the fast tier not
# (tests/conftest.py NOT_FAST)
@pytest.mark.parametrize("P", DEEP)
def test_every_deep_plan_passes_its_start_up_checks_with_drift_at_the_bound(P):
    check_every_plan(P)
    check_under_nccl(P)


def check_every_plan(P):
    for a, tied in itertools.product(FACTORS, (False, True)):
        check_plan(plan_stream("paci", P, a, N, tied))
        drifts, peaks = check_lists(build("paci", P, a, 2 * P + a, tied))
        bounds = [drift_bound(P, s, a) for s in range(P)]
        assert bounds == [math.ceil((P - 1 - s) / a) for s in range(P)]
        assert [max(d.values()) for d in drifts] == bounds, (P, a, tied)
        assert peaks == [P - s for s in range(P)], (P, a, tied)


@pytest.mark.parametrize("P", SHALLOW)
def test_every_depth_passes_under_an_nccl_model(P):
    """One (a, tied, setting) per P, chosen round-robin: over P = 2..32 every a, both tied
    and untied, and every one of the eight settings (batched, shape exchange, eager) meet
    deep pipelines (P >= 16) too. A device-wide sync may come after any action. (P = 17..32:
    in the deep test above.)"""
    check_under_nccl(P)


def check_under_nccl(P):
    a = FACTORS[P % len(FACTORS)]
    tied = P % 2 == 0
    batched, shapes, eager = SETTINGS[P % len(SETTINGS)]
    model = NcclModel(batched, shapes, eager=eager, sync_anywhere=True)
    check_plan(plan_stream("paci", P, a, N, tied), model)


def test_the_round_robin_covers_every_factor_and_setting_at_depth():
    deep = [P for P in DEPTHS if P >= 16]
    assert {FACTORS[P % len(FACTORS)] for P in deep} == set(FACTORS)
    assert {P % len(SETTINGS) for P in deep} == set(range(len(SETTINGS)))


@pytest.mark.parametrize("P", [16, 32])
def test_changing_a_at_depth_keeps_each_drift_within_the_bound_in_force(P):
    """auto changes a between calls; at depth a forward can be several calls old when its
    backward runs (window_calls up to 2 at P = 32, N = 16). Each backward's drift stays within
    the smallest a in force over the calls it spans, for each ordered pair of a's."""
    for old, new in itertools.permutations((16, 4, 1), 2):
        factors = [old] * 3 + [new] * 4
        drift = adapt.stream_drift(adapt.stream_with_factors(P, N, factors))
        for s in range(P):
            for k, worst in drift[s].items():
                assert worst <= adapt.bound_in_call(P, s, N, factors, k), (P, old, new, s, k)
            assert drift[s][len(factors) - 1] == drift_bound(P, s, new), (P, old, new, s)
