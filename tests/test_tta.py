"""Time to accuracy (pure): interpolation on synthetic curves, the simulator's projection, and
the compare report built from synthetic metrics records (no training launched)."""

import pytest

from paci_megatron.tools import compare, compare_report, tta
from paci_megatron.simulate import Costs
from paci_megatron.features import Lookahead, WeightPrediction

PREDICT, AHEAD = (WeightPrediction.COST,), (Lookahead.COST,)  # a run's method passes

COSTS = Costs(1.0, 2.0, 0.0)  # tf : tb = 1 : 2, free steps


def curve(values, step=10):
    """Points whose x values are (iteration, 2 x iteration) at every ``step`` iterations."""
    return [((step * (i + 1), 2 * step * (i + 1)), v) for i, v in enumerate(values)]


def test_target_never_reached_is_none():
    assert tta.reach(curve([5.0, 4.0, 3.5]), 3.4) is None
    assert tta.reach([], 1.0) is None


def test_target_reached_at_the_first_point_gives_that_point():
    assert tta.reach(curve([3.0, 2.0]), 3.0) == (10.0, 20.0)
    assert tta.reach(curve([3.0, 2.0]), 4.0) == (10.0, 20.0)


def test_interpolates_between_the_last_point_above_and_the_first_at_or_below():
    # 5.0 at x=10, 4.0 at x=20: 4.2 is 80% of the way
    assert tta.reach(curve([5.0, 4.0, 3.0]), 4.2) == pytest.approx((18.0, 36.0), abs=1e-12)
    assert tta.reach(curve([5.0, 4.0, 3.0]), 4.0) == (20.0, 40.0)  # exact hit: that point


def test_non_monotonic_curve_counts_its_first_crossing():
    values = [5.0, 4.0, 4.5, 3.0]
    # dips to 4.0 at x=10..20, rises again: 4.2 is first reached in the dip, not later
    assert tta.reach(curve(values), 4.2) == pytest.approx((18.0, 36.0), abs=1e-12)
    # 3.5 is first reached between 4.5 (x=30) and 3.0 (x=40), not from the dip at 4.0
    assert tta.reach(curve(values), 3.5) == pytest.approx((30 + 10 * 2 / 3, 60 + 20 * 2 / 3))


@pytest.mark.parametrize("P,M,flush,paci", [(2, 8, 27.0, 24.0), (4, 8, 33.0, 24.0),
                                            (8, 8, 45.0, 24.0), (4, 16, 57.0, 48.0)])
def test_projected_time_per_iteration_is_the_bubble_of_each_schedule(P, M, flush, paci):
    # stock 1F1B: (M + P - 1)(tf + tb); PACI in steady state: M (tf + tb), no bubble
    assert tta.seconds_per_call("flush", P, M, M, COSTS) == flush
    assert tta.seconds_per_call("paci", P, M, M, COSTS) == paci
    shape = tta.RunShape("paci", P, M, M)
    assert tta.seconds_per_iteration(shape, COSTS) == (flush, paci)


def test_step_costs_count_once_per_local_step():
    costs = Costs(1.0, 2.0, 0.5)
    assert tta.seconds_per_call("flush", 4, 8, 8, costs) == 33.5
    assert tta.seconds_per_call("paci", 4, 8, 8, costs) == 24.5
    assert tta.seconds_per_call("paci", 4, 2, 8, costs) == 26.0  # 4 steps per iteration


@pytest.mark.parametrize("P,a,stale", [(4, 8, 3), (8, 8, 7), (4, 4, 6), (8, 4, 8), (2, 1, 8)])
def test_the_predictions_cost_falls_on_the_forwards_the_lists_mark_stale(P, a, stale):
    """--project-predict-ms: stage 0 moves its weights for its P-1 forwards in flight at each
    step (every forward when a <= P-1); the slowest stage sets the pace. Plain PACI and a
    flush (nothing stale) do not pay it."""
    costs = Costs(1.0, 2.0, 0.0, predict=0.5)
    assert tta.seconds_per_call("paci", P, a, 8, costs, predicts=True) == 24 + 0.5 * stale
    assert tta.seconds_per_call("paci", P, a, 8, costs) == 24
    assert tta.seconds_per_call("flush", P, a, 8, costs, predicts=True) == \
        tta.seconds_per_call("flush", P, a, 8, costs)
    predicted = tta.RunShape("paci", P, 8, a, passes=PREDICT)
    assert tta.seconds_per_iteration(predicted, costs)[1] == 24 + 0.5 * stale


def test_run_shape_says_whether_the_run_predicts():
    bf16 = ["--bf16", "--pipeline-model-parallel-size", "4", "--num-layers", "4",
            "--global-batch-size", "8", "--micro-batch-size", "1"]
    shape = compare.run_shape  # the flags as pretrain_gpt_paci.py resolves them
    assert shape("p", [*bf16, "--pipeline-schedule", "paci"], 4).predicts  # the default
    assert not shape("p", [*bf16, "--pipeline-schedule", "paci",
                           "--no-paci-weight-prediction"], 4).predicts
    assert not shape("p", [*bf16[1:], "--pipeline-schedule", "paci"], 4).predicts  # fp32
    assert not shape("p", [*bf16, "--pipeline-schedule", "1f1b"], 4).predicts


def test_paci_runs_at_its_pace_and_counts_n_over_a_updates_per_iteration():
    shape = tta.RunShape("paci", 4, 8, 2)
    assert tta.projected_seconds(shape, COSTS, 10) == 10 * 24.0
    assert tta.projected_seconds(shape, COSTS, 2.5) == 2.5 * 24.0
    assert shape.updates(10) == 10 * 4 and shape.updates(2.5) == 10
    assert tta.RunShape("1f1b", 4, 8, 8).updates(10) == 10
    assert tta.projected_seconds(tta.RunShape("1f1b", 4, 8, 8), COSTS, 10) == 330.0


def test_mid_run_target_interpolates_at_half_the_samples():
    assert tta.mid_run_target(curve([5.0, 4.0, 3.0, 2.0]), 0) == 4.0  # x=20 of 40
    assert tta.mid_run_target(curve([5.0, 4.0, 3.0]), 0) == pytest.approx(4.5)  # x=15 of 30


def records(values, samples_per_iteration=16, eval_every=2):
    """Metrics records as pretrain_gpt_paci.py writes them: train, evaluations, final."""
    out = []
    for i in range(1, 2 * len(values) + 1):
        out.append({"iteration": i, "consumed_samples": i * samples_per_iteration,
                    "wall_s": 0.5 * i, "lm_loss": 6.0, "tokens_per_sec": 100.0,
                    "max_drift": [1, 0, 0, 0]})
        if i % eval_every == 0:
            out.append({"iteration": i, "validation_loss": values[i // eval_every - 1]})
    out.append({"final": True, "iteration": 2 * len(values),
                "consumed_samples": 2 * len(values) * samples_per_iteration,
                "validation_loss": values[-1], "wall_s": len(values) + 0.1,
                "peak_rss_mb": [1.0] * 4, "peak_activation_mb": [2.0] * 4})
    return out


def test_equal_curves_give_the_projected_throughput_ratio_as_tta_speed_up():
    shapes = {"1f1b": tta.RunShape("1f1b", 4, 8, 8), "paci": tta.RunShape("paci", 4, 8, 8)}
    seeds = ([5.0, 4.0, 3.0, 2.5], [5.1, 4.1, 3.1, 2.6])
    runs = {name: [compare.summarize(name, records(v), shape, COSTS, seed)
                   for seed, v in zip((1, 2), seeds)] for name, shape in shapes.items()}
    targets = compare.targets_per_seed(runs["1f1b"], [4.5])
    assert [label for label, _ in targets] == ["1f1b final", "1f1b mid-run", "1f1b at 75%",
                                               "1f1b at 90%", "4.5"]
    assert targets[0][1] == [2.5, 2.6] and targets[1][1] == [4.0, 4.1]
    # 75% of 8 iterations is 6 (3.0 / 3.1), 90% is 7.2: 3.0 - 0.6 x 0.5
    assert targets[2][1] == [3.0, 3.1] and targets[3][1] == pytest.approx([2.7, 2.8])
    rows = {(r["run"], r["target"]): r for r in compare.time_to_accuracy(runs, "1f1b", targets)}
    for label, _ in targets:
        assert rows[("paci", label)]["speedup"] == pytest.approx([33 / 24] * 2, rel=1e-12)
        assert rows[("1f1b", label)]["speedup"] == [1.0, 1.0]
    hit = rows[("paci", "4.5")]["hits"][0]  # 5.0 at iteration 2, 4.0 at 4: iteration 3
    assert hit[:4] == pytest.approx((48.0, 3.0, 1.5, 3 * 24.0))
    assert hit[5] == hit[3]  # plain PACI has no cost of its own
    text = compare.tta_table(list(rows.values()), "1f1b")
    assert "| paci | 1f1b final | 2.5500 ± 0.0707 |" in text
    assert text.count("| 1.375 ± 0.000 |") == 5 and text.count("(no cost)") == 10
    main = compare.report_table(runs, "1f1b")
    assert "| paci | 2 | 2.5500 ± 0.0707 |" in main and "| 24 | 1.375 |" in main


def test_a_target_some_seeds_miss_is_reported_as_such():
    shape = tta.RunShape("paci", 4, 8, 8)
    base = [compare.summarize("1f1b", records([5.0, 3.0]), tta.RunShape("1f1b", 4, 8, 8), COSTS)
            for _ in range(2)]
    slow = [compare.summarize("paci", records(v), shape, COSTS) for v in ([5.0, 3.0], [5.0, 3.5])]
    rows = compare.time_to_accuracy({"1f1b": base, "paci": slow}, "1f1b",
                                    [("1f1b final", [3.0, 3.0])])
    assert rows[1]["hits"][1] is None and len(rows[1]["speedup"]) == 1
    assert "(1/2 seeds)" in compare.tta_table(rows, "1f1b")
    rows = compare.time_to_accuracy({"1f1b": base, "paci": slow}, "1f1b",
                                    [("2", [2.0, 2.0])])
    assert compare.tta_table(rows, "1f1b").count("not reached") >= 2


@pytest.mark.parametrize("argv,match", [
    (["--run", "bad name=--x"], "--run"),
    (["--run", "paci-a4"], "NAME="),
    (["--run", "x=--pipeline-schedule paci --paci-max-drift -1"], "--paci-max-drift"),
    (["--run", "x=--pipeline-schedule 1f1b --paci-max-drift 2"], "--paci-max-drift"),
    (["--run", "x=--pipeline-schedule paci --paci-sync-iters 2"], "--paci-sync-iters"),
    (["--schedules", "1f1b", "--run", "1f1b=--pipeline-schedule 1f1b"], "given twice"),
    (["--schedules", "1f1b", "--seeds", "1,x"], "--seeds"),
    (["--schedules", "1f1b", "--seeds", "1,1"], "--seeds"),
    (["--schedules", "1f1b", "--seeds", "1,2", "--run", "x=--seed 3"], "--seed"),
    (["--schedules", "1f1b", "--baseline", "paci"], "--baseline"),
    (["--schedules", "nope"], "--schedules"),
    (["--schedules", "1f1b", "--project-backward-ms", "-1"], "--project-backward-ms"),
    (["--schedules", "1f1b", "--project-predict-ms", "-1"], "--project-predict-ms"),
])
def test_bad_compare_flags_fail_before_any_run(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        compare.main(argv + ["--out", str(tmp_path / "out"), "--",
                             "--untie-embeddings-and-output-weights"])
    assert info.value.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing was launched


def test_loss_at_interpolates_and_clamps_to_the_ends():
    points = curve([5.0, 4.0, 3.0])  # x = 10, 20, 30
    assert tta.loss_at(points, 0, 15) == pytest.approx(4.5)
    assert tta.loss_at(points, 1, 30) == pytest.approx(4.5)  # second x is 2 x iteration
    assert tta.loss_at(points, 0, 20) == 4.0
    assert tta.loss_at(points, 0, 5) == 5.0 and tta.loss_at(points, 0, 99) == 3.0
    assert tta.loss_at([], 0, 1.0) is None


def test_gaps_at_fractions_of_the_baseline_run():
    base = curve([5.0, 4.0, 3.0, 2.0])          # x = 10..40
    run = curve([5.5, 4.4, 3.3, 2.2, 2.1])      # 10% above, one evaluation longer
    gaps = tta.gaps_at(base, run, 0, (0.25, 0.5, 1.0))
    # at 25% of 40 = x 10, 50% = x 20, 100% = x 40: the run's extra point is not used
    assert gaps == pytest.approx([10.0, 10.0, 10.0])
    assert tta.gaps_at(base, curve([4.0, 4.0, 3.0, 2.0]), 0, (0.25, 0.375)) == \
        pytest.approx([-20.0, 100 * (4.0 / 4.5 - 1)])
    assert tta.gaps_at([], run, 0, (1.0,)) == [None]


def _runs(curves, shapes, records_of=records):
    return {name: [compare.summarize(name, records_of(v), shapes[name], COSTS, seed)
                   for seed, v in zip((1, 2), per_seed)] for name, per_seed in curves.items()}


def test_time_to_the_75_90_100_targets_against_1f1b_and_interleaved():
    """With PACI's curve equal to 1F1B's at equal samples, the speed-up to every target is
    the projected throughput ratio (33/24 at P=4, M=8), and over interleaved 1F1B (v=2, its
    curve 1F1B's, pace (M + (P-1)/2)(tf+tb) = 28.5) 28.5/24; a run whose loss lags gets
    less; a measured interleaved run is used where there is one."""
    seeds = ([6.0, 5.0, 4.0, 3.5, 3.2, 3.0], [6.1, 5.1, 4.1, 3.6, 3.3, 3.1])
    shapes = {"1f1b": tta.RunShape("1f1b", 4, 8, 8), "paci": tta.RunShape("paci", 4, 8, 8),
              "paci-lag": tta.RunShape("paci", 4, 8, 8)}
    lagging = tuple([v * 1.01 for v in s] for s in seeds)
    runs = _runs({"1f1b": seeds, "paci": seeds, "paci-lag": lagging}, shapes)
    targets = compare.targets_per_seed(runs["1f1b"], [])
    rows = {(r["run"], r["target"]): r
            for r in compare.time_to_accuracy(runs, "1f1b", targets, COSTS)}
    for label in ("1f1b at 75%", "1f1b at 90%", "1f1b final"):
        assert rows[("paci", label)]["speedup"] == pytest.approx([33 / 24] * 2, rel=1e-12)
        assert rows[("paci", label)]["vs_interleaved"] == pytest.approx([28.5 / 24] * 2)
        assert rows[("1f1b", label)]["vs_interleaved"] == pytest.approx([28.5 / 33] * 2)
        lag = rows[("paci-lag", label)]["speedup"]
        assert all(x < 33 / 24 for x in lag)
    assert rows[("paci-lag", "1f1b final")]["speedup"] == []  # never gets there
    text = compare.tta_table(list(rows.values()), "1f1b")
    assert "vs interleaved, with its cost" in text and "| 1.188 ± 0.000 |" in text
    shapes["interleaved"] = tta.RunShape("interleaved", 4, 8, 8, virtual_chunks=2)
    measured = _runs({"1f1b": seeds, "paci": seeds, "interleaved": lagging}, shapes)
    rows = compare.time_to_accuracy(measured, "1f1b", targets[1:2], COSTS)
    paci = next(r for r in rows if r["run"] == "paci")
    assert all(x > 28.5 / 24 for x in paci["vs_interleaved"])  # interleaved's own, later hit
    at_p1 = _runs({"1f1b": seeds}, {"1f1b": tta.RunShape("1f1b", 1, 8, 8)})
    assert compare.time_to_accuracy(at_p1, "1f1b", targets[:1], COSTS)[0]["vs_interleaved"] \
        is None


def test_budget_comparison_gives_no_credit_for_the_longer_cosine_alone():
    """PACI and the 1F1B control both train 1.5x longer (the cosine stretched); the control
    ends lower than 1F1B on its own shorter schedule, and so does PACI. Against the control,
    PACI with the control's curve at equal samples is exactly its throughput ratio faster to
    the control's final loss, with no gap; the loss at the baseline's projected time is read
    off each long curve."""
    short = ([6.0, 5.0, 4.0, 3.5], [6.2, 5.2, 4.2, 3.7])
    long = ([6.0, 5.0, 4.2, 3.6, 3.2, 3.0], [6.2, 5.2, 4.4, 3.8, 3.4, 3.2])
    shapes = {"1f1b": tta.RunShape("1f1b", 4, 8, 8), "1f1b-long": tta.RunShape("1f1b", 4, 8, 8),
              "paci-long": tta.RunShape("paci", 4, 8, 8)}
    runs = _runs({"1f1b": short, "1f1b-long": long, "paci-long": long}, shapes)
    rows = {r["run"]: r for r in compare.budget_rows(runs, "1f1b", "1f1b-long")}
    assert set(rows) == {"1f1b-long", "paci-long"}
    paci, control = rows["paci-long"], rows["1f1b-long"]
    assert paci["speedup_to_control_final"] == pytest.approx([33 / 24] * 2)
    assert control["speedup_to_control_final"] == [1.0, 1.0]
    assert paci["gap_to_control"] == [0.0, 0.0]
    assert paci["final"] == [3.0, 3.2] and paci["base_final"] == [3.5, 3.7]
    # the budget is 1F1B's 8 iterations x 33 s; PACI's 24 s iterations: 11 of them, between
    # its evaluations at 10 (3.2) and 12 (3.0); the control at 8 iterations: 3.6
    assert paci["budget_loss"] == pytest.approx([3.1, 3.3])
    assert control["budget_loss"] == pytest.approx([3.6, 3.8])
    text = compare.budget_table(list(rows.values()), "1f1b", "1f1b-long")
    assert "| paci-long | 3.2000 ± 0.1414 | 3.6000 ± 0.1414 | 3.1000 ± 0.1414 | 0.00 ± 0.00 % | " \
        "1.375 ± 0.000 |" in text


def _final(records_, **extra):
    records_[-1].update(extra)
    return records_


@pytest.mark.parametrize("method,extra,cpu_pace", [
    # prediction at 0.5 forwards each: stage 0 predicts its 3 forwards in flight (P-1)
    (dict(passes=PREDICT), dict(predict_ms=[0.5, 0.5, 0.5, None]), 24 + 0.5 * 3),
    # the look-ahead: 0.25 forwards a step, one step an iteration at a = M = 8
    (dict(passes=AHEAD), dict(lookahead_ms=[0.25, 0.25, 0.25, None]), 24 + 0.25),
])
def test_the_costed_projection_on_synthetic_curves(method, extra, cpu_pace):
    """Equal curves: each speed-up is the pace ratio. With the run's own timed cost (in
    forwards: 1 ms forwards here) on this machine's 1 : 2 : 0 costs; on the GPU by hand:
    gpt2-medium at P=4 is 6 layers a stage, a forward 6 x 4096 x (24 x 1024^2 + 4 x 1024^2)
    flops at 396 TFLOP/s, a step 30 B x 6 x (12 x 1024^2 + 13 x 1024) at 4 TB/s, the
    prediction 24 B and the look-ahead 14 B a parameter of the stage."""
    base_shape, shape = tta.RunShape("1f1b", 4, 8, 8), tta.RunShape("paci", 4, 8, 8, **method)
    values = [5.0, 4.0, 3.0, 2.5]
    timed = dict(extra, method_forward_ms=[1.0, 1.0, 1.0, None])
    runs = {"1f1b": [compare.summarize("1f1b", records(values), base_shape, COSTS)],
            "m": [compare.summarize("m", _final(records(values), **timed), shape, COSTS)]}
    rows = {r["run"]: r for r in compare.time_to_accuracy(runs, "1f1b", [("t", [3.0])])}
    row = rows["m"]
    assert row["speedup"] == pytest.approx([33 / cpu_pace], rel=1e-12)
    assert row["speedup_cost_left_out"] == pytest.approx([33 / 24], rel=1e-12)
    forward = 6 * 4096 * (24 * 1024 ** 2 + 4 * 1024 ** 2) / 396e12
    params = 6 * (12 * 1024 ** 2 + 13 * 1024)
    step = 30 * params / 4e12
    if method["passes"] == AHEAD:
        gpu_pace = 24 * forward + step + 14 * params / 4e12
    else:
        moved = 24 * params / 4e12
        gpu_pace = 24 * forward + step + 3 * moved
    assert row["speedup_gpu"] == pytest.approx([(33 * forward + step) / gpu_pace], rel=1e-9)
    assert rows["1f1b"]["speedup_gpu"] == [1.0]
    text = compare.tta_table(list(rows.values()), "1f1b", "gpt2-medium")
    assert f"| {33 / cpu_pace:.3f} | {row['speedup_gpu'][0]:.3f} | {33 / 24:.3f} |" in text


def test_a_speed_up_with_the_cost_left_out_is_never_printed_alone():
    row = {"run": "m", "target": "t", "target_values": [3.0], "hits": [(1, 1, 1, 1, 1, 1)],
           "speedup": None, "speedup_gpu": None, "speedup_cost_left_out": [1.4]}
    with pytest.raises(ValueError, match="printed only beside the ones with it"):
        compare.tta_table([row], "1f1b")
    with pytest.raises(ValueError, match="printed only beside"):
        compare_report.speedup_cells(dict(row, speedup=[1.2]), "speedup")  # the GPU's missing
    assert compare_report.speedup_cells(dict(row, speedup=[1.2], speedup_gpu=[1.3]),
                                        "speedup") == [[1.2], [1.3], [1.4]]


def test_the_gpu_arithmetic_by_hand():
    """gpt2-medium (hidden 1024, micro-batch 4 x 1024) at P=4: 6 layers a stage."""
    costs = tta.gpu_costs(tta.GPU_MODELS["gpt2-medium"], 4)
    assert costs.forward == pytest.approx(6 * 120_259_084_288 / 396e12, rel=1e-12)
    assert costs.backward == 2 * costs.forward
    assert costs.step == pytest.approx(30 * 75_577_344 / 4e12, rel=1e-12)
    predict = tta.gpu_method_cost(tta.RunShape("paci", 4, 8, 8, passes=PREDICT),
                                  tta.GPU_MODELS["gpt2-medium"])
    # a quarter of a forward (24 B a parameter at 4 TB/s against the forward's flops)
    assert predict.per_predicted_forward == pytest.approx(24 * 75_577_344 / 4e12
                                                          / costs.forward, rel=1e-12)
    assert 0.24 < predict.per_predicted_forward < 0.26 and predict.per_step == 0
    assert tta.gpu_method_cost(tta.RunShape("paci", 4, 8, 8), tta.GPU_MODELS["gpt2-medium"]).free


def test_a_method_whose_cost_nobody_timed_is_refused_not_left_out():
    """A run that predicts but carries no timing of its own (older than the timing), and no
    --project-predict-ms: compare refuses, naming the flags, rather than print it free."""
    shape = tta.RunShape("paci", 4, 8, 8, passes=PREDICT)
    with pytest.raises(compare.CompareError, match="--project-predict-ms"):
        compare.summarize("p", records([5.0, 3.0]), shape, COSTS)
    given = compare.summarize("p", records([5.0, 3.0]), shape, Costs(1.0, 2.0, 0.0, predict=2.0))
    assert given["method_cost"].per_predicted_forward == 2.0
    assert given["method_cost"].source == "--project-predict-ms"
    with pytest.raises(compare.CompareError, match="lookahead_ms"):
        compare.summarize("l", records([5.0, 3.0]), tta.RunShape("paci", 4, 8, 8,
                                                                 passes=AHEAD), COSTS)
