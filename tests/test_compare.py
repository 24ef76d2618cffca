"""The compare tool end to end on mock data: two schedules, a report with its table and plots."""

import math
import os
import subprocess
import sys

import pytest

from launch import REPO

pytestmark = pytest.mark.dist


def test_compare_writes_report_and_plots(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "paci_megatron.compare", "--schedules", "1f1b,paci", "--out",
         str(out), "--", "--untie-embeddings-and-output-weights", "--num-layers", "2",
         "--hidden-size", "32", "--seq-length", "16", "--train-iters", "6",
         "--measure-activation-memory"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    lines = [l for l in report.splitlines() if l.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for column in ("run", "final val loss", "best val loss", "iters to 1F1B final",
                   "wall s to 1F1B final", "tokens/s", "peak RSS MB per stage",
                   "peak activation MB per stage", "max drift per stage"):
        assert column in header
    rows = {l.split("|")[1].strip(): [c.strip() for c in l.strip("|").split("|")]
            for l in lines[1:] if not l.startswith("|---")}
    assert set(rows) == {"1f1b", "paci"}
    for name, cells in rows.items():
        row = dict(zip(header, cells))
        assert math.isfinite(float(row["final val loss"])) and float(row["tokens/s"]) > 0
        assert all(math.isfinite(float(x)) for x in row["peak activation MB per stage"].split("/"))
    assert rows["paci"][header.index("max drift per stage")] == "1/0"
    assert rows["1f1b"][header.index("iters to 1F1B final")] == "6"
    for png in ("loss_vs_samples.png", "loss_vs_wall.png"):
        assert (out / png).stat().st_size > 5000
    assert "peak activation memory paci/1f1b per stage: 1.000 1.000" in proc.stdout
