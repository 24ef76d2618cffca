"""The P=1 overhead benchmark's interface: a --quick run's report (no timing threshold: the
figures live in benchmarks/studies/05-overhead-p1.md). Its one hard check is behaviour: at
P=1 PACI with a=M does stock Megatron's arithmetic, so both arms' losses are equal bit for
bit."""

import json
import os
import sys

import pytest

from launch import REPO, launch
from paci_megatron.tools.bench_overhead import ARMS, CLOCKS, parse_args

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("overhead") / "report.json"
    cmd = [sys.executable, "-m", "paci_megatron.tools.bench_overhead", "--quick", "--json", str(path)]
    proc = launch(cmd, cwd=REPO, timeout=TIMEOUT_S,  # past it: the tree killed, a failure
                  env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    return json.loads(path.read_text()), stdout


def test_quick_run_reports_both_arms_and_clocks(report):
    rep, stdout = report
    assert rep["config"]["runs"] == 2 and rep["config"]["iters"] == 1
    for clock in CLOCKS:
        block = rep[clock]
        for name in ARMS:
            assert len(block["runs"][name]) == 2
            assert block["s_per_iter"][name] > 0
            assert block["ms_per_microbatch"][name] == pytest.approx(
                1e3 * block["s_per_iter"][name] / 8)
        ratios = [p / s for p, s in zip(block["runs"]["paci"], block["runs"]["stock"])]
        assert block["ratio_min"] == min(ratios) and block["ratio_max"] == max(ratios)
    assert "PACI / stock per run: median" in stdout
    assert any(line.startswith("OVERHEAD_JSON ") for line in stdout.splitlines())


def test_both_arms_compute_the_same_losses(report):
    rep, _ = report
    # warm-up 1 + 2 runs x 1 + 1 profiled iteration per arm
    assert rep["iterations"] == 4
    assert rep["same_losses"] is True


def test_profile_names_paci_parts(report):
    rep, _ = report
    stock, paci = rep["profile_ms_per_iter"]["stock"], rep["profile_ms_per_iter"]["paci"]
    for part in ("local step (step_unless_nonfinite: Megatron's step in its parts)",
                 "group close (local_step: finish_grads and take_step)",
                 "executor dispatch (StageExecutor.run)", "drift bookkeeping (DriftStats)"):
        assert paci[part] > 0 and part not in stock
    for part in ("forward_step", "backward_step", "optimizer.step (PACI: step_with_ready_grads)",
                 "iteration (total)"):
        assert stock[part] > 0 and paci[part] > 0


@pytest.mark.parametrize("argv,flag", [(["--runs", "0"], "--runs"),
                                       (["--global-batch-size", "6"], "--global-batch-size"),
                                       (["--warmup", "-1"], "--warmup")])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err.splitlines()[-1]
    assert "error:" in err and flag in err
