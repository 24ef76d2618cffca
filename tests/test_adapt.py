"""--paci-accumulation-factor auto, without processes: changing a between calls moves no
message, cannot deadlock, and keeps every drift within the bound of the factors in force; the
policy maps its signal to a; the flags are checked before anything starts."""

import itertools
import math

import pytest

from paci_megatron import adapt
from paci_megatron.arguments import ConfigError, build_parser, parse_and_validate, validate
from paci_megatron.schedule import Op, Schedule, drift_bound, plan_stream, work_items
from paci_megatron.simulate import NcclModel, run_lockstep, run_nccl


def _pairs(P, N):
    return list(itertools.product(adapt.candidates(P, N, None), repeat=2))


@pytest.mark.parametrize("P", range(2, 9))
def test_every_change_of_a_keeps_each_drift_within_the_bound_in_force(P):
    """Simulated streams with a changed once (every ordered pair of candidates, N = 4, 6, 8):
    each backward's drift is within ceil((P-1-s) / min(a over the calls it spans)), and from
    ceil((P-1-s)/N) calls after the change on within the new a's own bound."""
    for N in (4, 6, 8) if P < 6 else (4, 8):
        for old, new in _pairs(P, N):
            factors = [old] * 3 + [new] * 4
            drift = adapt.stream_drift(adapt.stream_with_factors(P, N, factors))
            for s in range(P):
                assert sorted(drift[s]) == list(range(len(factors)))
                settled = 3 + adapt.window_calls(P, s, N)
                for k, worst in drift[s].items():
                    assert worst <= adapt.bound_in_call(P, s, N, factors, k), (P, N, old, new, s, k)
                    if k >= settled or k < 3 and k >= adapt.window_calls(P, s, N):
                        assert worst == drift_bound(P, s, factors[k]) or N < P, (P, N, s, k)


def test_raising_a_exceeds_the_new_bound_until_the_old_forwards_are_done():
    """Why the guard takes the smaller a while old forwards are in flight: at P=4, N=4 going
    from a=1 to a=4, stage 0's first a=4 call still sees drift 3 (a=4 alone allows 1)."""
    factors = [1, 1, 4, 4]
    drift = adapt.stream_drift(adapt.stream_with_factors(4, 4, factors))
    assert [drift[0][k] for k in range(4)] == [3, 3, 3, 1]
    assert [adapt.bound_in_call(4, 0, 4, factors, k) for k in range(4)] == [3, 3, 3, 1]
    assert drift_bound(4, 0, 4) == 1


def _work_and_exchanges(actions):
    """What a call does but for the group-closing R and T, and its exchanges as the executor
    groups them (``schedule.work_items``)."""
    closing = (Op.REDUCE, Op.STEP)
    work = tuple(x for x in actions if x.op not in closing)
    return work, tuple(i for i in work_items(actions) if isinstance(i, tuple))


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_a_moves_only_the_steps_never_a_message(P):
    """Every candidate's plan runs the same forwards, backwards and exchanges in every call;
    only where the local steps T sit differs."""
    for N in (4, 6, 8):
        seen = {}
        for a in adapt.candidates(P, N, None):
            plan = plan_stream("paci", P, a, N)
            seen[a] = [_work_and_exchanges(plan.call(k)[s]) for k in range(3) for s in range(P)]
        first = seen[N]
        assert all(calls == first for calls in seen.values()), (P, N)
        assert adapt.same_messages(P, N, (N, 1))


@pytest.mark.parametrize("P", [2, 4, 8])
def test_streams_that_change_a_run_without_deadlock(P):
    """Gloo-like lockstep and NCCL's pairing rules (batched, unbatched, shape exchange)."""
    N = 8
    for old, new in _pairs(P, N) if P < 8 else [(8, 1), (1, 8), (2, 4)]:
        rows = adapt.stream_with_factors(P, N, [old, old, new, new])
        sched = Schedule("auto", P, 1, 4 * N, tuple(tuple(a for _, a in r) for r in rows))
        run_lockstep(sched)
        ends = [[i + 1 for i, (k, _) in enumerate(r) if i + 1 == len(r) or r[i + 1][0] != k]
                for r in rows]
        for model in (NcclModel(), NcclModel(batched=False), NcclModel(shapes=True)):
            run_nccl(sched, model=model, call_ends=ends)


# --- the policy -----------------------------------------------------------------------------

def test_candidates_are_the_divisors_within_max_drift():
    assert adapt.candidates(4, 8, None) == (8, 4, 2, 1)
    assert adapt.candidates(4, 8, 1) == (8, 4)  # ceil(3/2) = 2 > 1
    assert adapt.candidates(4, 12, 2) == (12, 6, 4, 3, 2)
    assert adapt.candidates(8, 8, 1) == (8,)


def test_policy_takes_the_smallest_a_whose_predicted_staleness_fits():
    opts = (8, 4, 2, 1)
    # signal = relative weight change per step x (P-1-s); staleness at a = signal / a
    assert adapt.choose_factor(0.5, opts, 0.01) == 8  # weights move fast: closest to 1F1B
    assert adapt.choose_factor(0.08, opts, 0.01) == 8  # 0.08/8 = 0.01: just fits
    assert adapt.choose_factor(0.0801, opts, 0.01) == 8  # fits nowhere: the largest
    assert adapt.choose_factor(0.04, opts, 0.01) == 4
    assert adapt.choose_factor(0.03, opts, 0.01) == 4
    assert adapt.choose_factor(0.02, opts, 0.01) == 2
    assert adapt.choose_factor(0.005, opts, 0.01) == 1  # settled weights: most updates
    assert adapt.choose_factor(0.0, opts, 0.01) == 1
    assert adapt.choose_factor(math.inf, opts, 0.01) == 8
    assert adapt.choose_factor(math.nan, opts, 0.01) == 8
    with pytest.raises(ValueError):
        adapt.choose_factor(0.1, (), 0.01)


def test_default_tolerance_is_plain_pacis_peak_staleness():
    """Without --paci-adapt-tolerance a decision keeps signal / a within the largest signal
    seen so far divided by N (plain PACI's worst staleness): a = N while the weights move as
    fast as ever, smaller a as they settle."""
    ad = adapt.Adaptive(4, 8, (8, 4, 2, 1), interval=1, tolerance=0.0)
    assert [ad.decide(s) for s in (0.002, 0.004, 0.003, 0.002, 0.0011, 0.001, 0.0004,
                                   0.0006, 0.005)] == [8, 8, 8, 4, 4, 2, 1, 2, 8]


def test_staleness_signal_and_the_schedule_of_decisions():
    assert adapt.staleness(0.01, 4, 0) == pytest.approx(0.03)
    assert adapt.staleness(0.01, 4, 3) == 0.0  # the last stage holds nothing in flight
    ad = adapt.Adaptive(4, 8, (8, 4, 2, 1), interval=3, tolerance=0.01)
    assert ad.current == 8
    assert [c for c in range(10) if ad.request_due(c)] == [3, 6, 9]
    assert [ad.decide(s) for s in (0.5, 0.03, 0.001)] == [8, 4, 1]
    assert ad.last_signal == 0.001
    cyc = adapt.Adaptive(4, 8, (8, 4, 2, 1), interval=1, tolerance=0.01, policy="cycle")
    assert [cyc.decide(123.0) for _ in range(5)] == [4, 2, 1, 8, 4]
    for call, a in enumerate([8, 8, 4, 4, 1]):
        cyc.record_call(call, a)
    assert cyc.changes == [(0, 8), (2, 4), (4, 1)] and cyc.factors == [8, 8, 4, 4, 1]
    with pytest.raises(ValueError, match="--paci-adapt-policy"):
        adapt.Adaptive(4, 8, (8,), interval=1, tolerance=0.01, policy="random")


# --- the flags ------------------------------------------------------------------------------

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--untie-embeddings-and-output-weights"]


def _validate(*flags, world=4):
    args = build_parser().parse_args(BASE + list(flags))
    return args, validate(args, world)


def test_auto_flag_starts_at_n_with_its_defaults():
    args, opts = _validate("--paci-accumulation-factor", "auto")
    assert opts.auto and opts.accumulation == 8
    assert (opts.adapt_interval, opts.adapt_tolerance, opts.adapt_policy) == (10, 0.0,
                                                                             "staleness")
    args, opts = _validate("--paci-accumulation-factor", "auto", "--paci-adapt-interval", "3",
                           "--paci-adapt-policy", "cycle", "--paci-adapt-tolerance", "0.2")
    assert (opts.adapt_interval, opts.adapt_tolerance, opts.adapt_policy) == (3, 0.2, "cycle")
    args, opts = _validate("--paci-accumulation-factor", "4")
    assert not opts.auto and opts.adapt_interval == 0 and opts.accumulation == 4


@pytest.mark.parametrize("flags,message", [
    (["--paci-adapt-interval", "5"], "--paci-adapt-interval only applies with "
                                     "--paci-accumulation-factor auto"),
    (["--paci-adapt-policy", "cycle"], "--paci-adapt-policy only applies"),
    (["--paci-accumulation-factor", "auto", "--pipeline-schedule", "1f1b"],
     "--paci-accumulation-factor only applies to --pipeline-schedule paci"),
])
def test_auto_flags_misused_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        _validate(*flags)


def test_auto_with_tied_embeddings_is_refused_before_launch():
    """The tied copy's lag ceil(P/a) is fixed for the a at the start."""
    args = build_parser().parse_args(
        [f for f in BASE if f != "--untie-embeddings-and-output-weights"]
        + ["--paci-accumulation-factor", "auto"])
    with pytest.raises(ConfigError, match="--untie-embeddings-and-output-weights"):
        validate(args, 4)
    args = build_parser().parse_args(
        [f for f in BASE if f != "--untie-embeddings-and-output-weights"]
        + ["--paci-accumulation-factor", "auto", "--pipeline-model-parallel-size", "1"])
    validate(args, 1)  # one stage: nothing is exchanged


@pytest.mark.parametrize("value", ["automatic", "0", "-2", "", "1.5"])
def test_bad_factor_values_name_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        parse_and_validate(BASE + ["--paci-accumulation-factor", value], world_size=4)
    assert "--paci-accumulation-factor" in capsys.readouterr().err


def test_weight_change_per_step_is_measured_on_a_fixed_sample():
    """The signal's r: ||w_new - w_old|| / ||w_old|| over a strided sample (~256 entries a
    parameter), averaged over the steps since the last take."""
    import torch

    from paci_megatron.plan_policy import WeightChange

    w, b = torch.ones(1000), torch.full((3,), 2.0)
    probe = WeightChange()
    for scale in (1.01, 1.03):
        with probe.measured((w, b)):
            w.mul_(scale), b.mul_(scale)
    assert probe.take() == pytest.approx(0.02, rel=1e-5)
    assert probe.take() == 0.0
    with probe.measured((w, b)):
        w[1] += 100.0  # off the sample (every 3rd entry of 1000): unseen
    assert probe.take() == 0.0


def test_the_cycle_policy_is_a_hidden_test_hook():
    """--paci-adapt-policy cycle changes a regardless of the signal: the tests use it, users
    never see it in --help."""
    text = build_parser().format_help()
    assert "--paci-adapt-policy" not in text and "cycle" not in text
    assert "--paci-accumulation-factor" in text
    _args, opts = _validate("--paci-accumulation-factor", "auto", "--paci-adapt-policy", "cycle")
    assert opts.adapt_policy == "cycle"
