"""The compare tool end to end on mock data: a built-in run and a named variant
(``--run``), two seeds (``--seeds``), a report with time to accuracy and plots; and, from the
same runs, the variant's local steps and drift beside stock 1F1B."""

import json
import math
import sys

import pytest

from launch import REPO, launch, paci_summary, read_metrics

pytestmark = pytest.mark.dist

SEEDS = (1234, 1235)
ITERS = 6
NAME = "paci-a4"  # a = 4 of M = 8: two local steps an iteration


def _compare(out, *extra, iters=ITERS):
    return launch(
        [sys.executable, "-m", "paci_megatron.tools.compare", "--schedules", "1f1b",
         "--run", f"{NAME}=--pipeline-schedule paci --paci-accumulation-factor 4",
         "--seeds", ",".join(map(str, SEEDS)), "--timeout", "400", "--out", str(out), *extra,
         "--", "--untie-embeddings-and-output-weights", "--num-layers", "2", "--hidden-size",
         "32", "--seq-length", "16", "--train-iters", str(iters), "--measure-activation-memory"],
        timeout=1200, cwd=REPO)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "report"
    proc = _compare(out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, proc.stdout


def _rows(lines, header_has):
    """The rows under the first header line containing ``header_has``."""
    i = next(i for i, l in enumerate(lines) if header_has in l)
    header = [c.strip() for c in lines[i].strip("|").split("|")]
    rows = []
    for line in lines[i + 1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "run":
            break
        rows.append(dict(zip(header, cells)))
    return header, rows


def test_compare_reports_time_to_accuracy_over_seeds(compared):
    out, stdout = compared
    lines = [l for l in (out / "report.md").read_text().splitlines() if l.startswith("| ")]
    header, runs = _rows(lines, "final val loss")
    for column in ("run", "seeds", "final val loss", "best val loss", "tokens/s",
                   "projected s/iteration", "projected throughput vs 1f1b",
                   "peak activation MB per stage", "max drift per stage"):
        assert column in header
    runs = {r["run"]: r for r in runs}
    assert set(runs) == {"1f1b", NAME}
    for row in runs.values():
        assert row["seeds"] == "2"
        mean, sd = (float(x) for x in row["final val loss"].split(" ± "))
        assert math.isfinite(mean) and 0 <= sd < 0.5
    assert runs[NAME]["max drift per stage"] == "1/0"
    # P=2, M=8, tf:tb = 1:2: stock 1F1B (M+P-1)(tf+tb) = 27 ms per iteration, PACI M(tf+tb) = 24
    assert runs["1f1b"]["projected s/iteration"] == "0.027"
    assert runs[NAME]["projected throughput vs 1f1b"] == "1.125"

    costed = "speed-up vs 1f1b, with its cost"
    _, tta = _rows(lines, costed)
    targets = {(r["run"], r["target"]): r for r in tta}
    assert {t for _, t in targets} == {"1f1b final", "1f1b mid-run", "1f1b at 75%",
                                       "1f1b at 90%"}
    for target in ("1f1b final", "1f1b mid-run"):
        assert targets[("1f1b", target)][costed] == "1.000 ± 0.000"
        assert targets[("1f1b", target)]["the same, gpt2-medium costs"] == "1.000 ± 0.000"
    mid = targets[(NAME, "1f1b mid-run")]
    assert mid[costed] != "not reached"
    assert mid["the same, its cost left out"] == "(no cost)"  # plain PACI: none of its own
    assert (f"{NAME}: projected time-to-accuracy speed-up vs 1f1b to 1f1b mid-run") in stdout
    assert "(projected throughput ratio with its cost 1.125)" in stdout
    assert "No run's method has a cost of its own. GPU costs by arithmetic: gpt2-medium" \
        in stdout
    for png in ("loss_vs_samples.png", "loss_vs_wall.png", "loss_vs_projected.png"):
        assert (out / png).stat().st_size > 5000
    assert f"peak activation memory {NAME}/1f1b per stage: 1.000 1.000" in stdout


def _metrics(out, name, seed):
    return read_metrics(out / f"{name}.seed{seed}.jsonl")


def _train(records, key):
    return [r[key] for r in records if "lm_loss" in r]


def _summary(out, name, seed):
    return paci_summary((out / f"{name}.seed{seed}.log").read_text())


@pytest.mark.parametrize("seed", SEEDS)
def test_the_named_variant_runs_paci_beside_stock_1f1b(compared, seed):
    out, _ = compared
    stock, paci = _metrics(out, "1f1b", seed), _metrics(out, NAME, seed)
    stock_loss = [float(x).hex() for x in _train(stock, "lm_loss")]
    paci_loss = [float(x).hex() for x in _train(paci, "lm_loss")]
    assert len(stock_loss) == len(paci_loss) == ITERS
    # a local step inside every iteration: from the first on, every loss differs
    assert all(a != b for a, b in zip(paci_loss, stock_loss))
    assert _train(paci, "lr") == _train(stock, "lr")  # two steps of 4 = one of 8, for the LR
    drift = _summary(out, NAME, seed)["drift"]
    assert [row["max"] for row in drift] == [row["bound"] for row in drift] == [1, 0]
    assert [row["steps"] for row in drift] == [ITERS * 2] * 2
    # at P=2 each step leaves one stage-0 forward in flight across it (drift 1), except the
    # last one, whose forward the final drain drops
    assert drift[0]["histogram"].get("1") == ITERS * 2 - 1


def test_runs_that_do_not_predict_say_nothing_of_its_cost(compared):
    out, stdout = compared  # fp32: no fp32 main copy to restore from, so no prediction
    assert "Weight prediction's cost" not in (out / "report.md").read_text() + stdout


def test_seeds_change_the_run(compared):
    out, _ = compared
    losses = [_train(_metrics(out, "1f1b", seed), "lm_loss") for seed in SEEDS]
    assert losses[0] != losses[1]


def test_gap_table_pairs_each_seed_with_the_baseline(compared):
    out, _ = compared
    lines = [l for l in (out / "report.md").read_text().splitlines() if l.startswith("| ")]
    header, rows = _rows(lines, "gap at 25% of training")
    assert header[1:] == [f"gap at {p}% of training" for p in (25, 50, 100)]
    rows = {r["run"]: r for r in rows}
    assert all(rows["1f1b"][c] == "0.00 ± 0.00 %" for c in header[1:])
    # at 100%: the final validation losses of the same seed
    finals = {name: [_metrics(out, name, s)[-1]["validation_loss"] for s in SEEDS]
              for name in ("1f1b", NAME)}
    gaps = [100 * (r / b - 1) for r, b in zip(finals[NAME], finals["1f1b"])]
    mean = sum(gaps) / 2
    assert rows[NAME]["gap at 100% of training"].startswith(f"{mean:.2f} ± ")


def test_reuse_reads_finished_runs_back_and_reruns_changed_ones(compared, tmp_path):
    out, _ = compared
    before = (out / "report.md").read_text()
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.jsonl")}
    proc = _compare(out, "--reuse")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("reusing ") == 2 * len(SEEDS)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.jsonl")} == stamps
    # same runs, same report (wall-clock figures included: they are read back)
    assert (out / "report.md").read_text() == before
    # a run whose flags or process count changed is not reused
    from paci_megatron.tools.compare import NO_METHOD, _finished_with
    stem = out / f"1f1b.seed{SEEDS[0]}"
    flags = json.loads((out / f"{stem.name}.flags.json").read_text())["flags"]
    metrics, record = f"{stem}.jsonl", f"{stem}.flags.json"
    assert _finished_with(metrics, record, flags, 2, NO_METHOD)
    assert not _finished_with(metrics, record, flags + ["--lr", "1e-3"], 2, NO_METHOD)
    assert not _finished_with(metrics, record, flags, 4, NO_METHOD)
    assert not _finished_with(metrics, str(tmp_path / "none.json"), flags, 2, NO_METHOD)
    # nor one whose PACI method differs: fp32 leaves this one plain, by default
    stem = out / f"{NAME}.seed{SEEDS[0]}"
    kept = json.loads((out / f"{stem.name}.flags.json").read_text())
    assert kept["method"] == "plain"
    paci = (f"{stem}.jsonl", f"{stem}.flags.json", kept["flags"], 2)
    assert _finished_with(*paci, {"method": "plain", "by_default": True})
    assert not _finished_with(*paci, {"method": "prediction per-forward", "by_default": True})
    # a record kept before compare kept the method: reused only where the flags name it
    legacy = tmp_path / "legacy.flags.json"
    legacy.write_text(json.dumps({"flags": kept["flags"], "nproc_per_node": 2}))
    assert not _finished_with(paci[0], str(legacy), kept["flags"], 2,
                              {"method": "plain", "by_default": True})
    assert _finished_with(paci[0], str(legacy), kept["flags"], 2,
                          {"method": "plain", "by_default": False})


@pytest.mark.parametrize("extra,method,by_default", [
    (["--bf16"], "prediction per-forward", True),  # today's default
    ([], "plain", True),  # fp32: the prediction needs a main copy
    (["--bf16", "--no-paci-weight-prediction"], "plain", False),
    (["--bf16", "--paci-lookahead", "0.5"], "look-ahead C=0.5", False),
    (["--bf16", "--paci-weight-prediction"], "prediction per-forward", False),
])
def test_run_method_names_the_method_and_whether_the_default_chose_it(extra, method, by_default):
    from paci_megatron.tools.compare import run_method

    flags = ["--pipeline-schedule", "paci", "--untie-embeddings-and-output-weights", *extra]
    assert run_method("r", flags, 2) == {"method": method, "by_default": by_default}
    assert run_method("r", ["--pipeline-schedule", "1f1b", "--bf16"], 2) == {
        "method": "", "by_default": False}
