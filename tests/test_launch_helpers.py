"""The test launcher's helpers: the result parser (ranks share one pipe, so a rank's
``RESULT {json}`` can land after another rank's unfinished line, or two results can share a
line), tests/exit_fast.py, which every worker of the suite runs through, and tests/ranks.py,
the plain launcher most of the suite's jobs start under."""

import os
import re
import sys

import pytest

import exit_fast
import ranks
from launch import (EXIT_FAST, RANKS, launch, parse_results, ranks_cmd, run_torchrun,
                    torchrun_cmd)


def test_a_result_after_another_ranks_unfinished_line_is_found():
    out = ('iteration 11/12 | loss 3.2RESULT {"rank": 0, "count": 5}\n'
           'RESULT {"rank": 1, "count": 5}RESULT {"rank": 2, "count": 5}\n\n'
           '  RESULT {"rank": 3, "count": 5}\n')
    assert [r["rank"] for r in parse_results(out)] == [0, 1, 2, 3]


def test_the_prefix_in_plain_text_is_not_a_result():
    out = 'print("RESULT " + json.dumps(x))\nRESULT {"rank": 0}\nPACI_SUMMARY {"a": [1]}\n'
    assert parse_results(out) == [{"rank": 0}]
    assert parse_results(out, prefix="PACI_SUMMARY ") == [{"a": [1]}]


EXIT_AS = """
import sys
print("argv", sys.argv[1:], "path0", sys.path[0], "name", __name__)
mode = sys.argv[1]
if mode == "raise":
    raise ValueError("boom")
if mode != "ok":
    sys.exit(int(mode) if mode.isdigit() else mode)
"""
# what a job leaves for the exit: a non-daemon thread still running, an atexit handler
LEAVES_WORK = """
import atexit, concurrent.futures, threading, time
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
# a pool never shut down: its idle worker ends only when the interpreter's shutdown says so
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(print, "pool ran").result()
"""


@pytest.mark.parametrize("mode,code", [("ok", 0), ("0", 0), ("3", 3), ("bad --flag", 1)])
def test_the_target_runs_as_main_with_its_argv_path_and_exit_code(mode, code, tmp_path, capsys,
                                                                   monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(EXIT_AS)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert exit_fast.run_target([str(script), mode]) == code
    out, err = capsys.readouterr()
    assert f"argv ['{mode}'] path0 {tmp_path} name __main__" in out
    assert ("bad --flag" in err) == (mode == "bad --flag")


@pytest.mark.dist
@pytest.mark.parametrize("mode,code", [("ok", 0), ("3", 3), ("raise", 1)])
def test_it_joins_threads_runs_atexit_and_keeps_the_exit_code(mode, code, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(LEAVES_WORK + EXIT_AS)
    done = launch([sys.executable, EXIT_FAST, str(script), mode], timeout=60)
    assert done.returncode == code, done.stderr
    assert "thread joined" in done.stdout and "atexit ran" in done.stdout
    assert "pool ran" in done.stdout
    assert ("ValueError: boom" in done.stderr) == (mode == "raise")


def test_torchrun_workers_run_through_it_unless_asked_not_to():
    cmd = torchrun_cmd("job.py", ["--x"], nproc=2)
    assert cmd[-3:] == [EXIT_FAST, "job.py", "--x"]
    cmd = torchrun_cmd("paci_megatron.run", ["s.py"], module=True)
    assert cmd[-4:] == [EXIT_FAST, "-m", "paci_megatron.run", "s.py"]
    assert EXIT_FAST not in torchrun_cmd("job.py", fast_exit=False)
    assert os.path.isfile(EXIT_FAST)


def test_each_rank_gets_its_place_in_the_job_and_one_free_port():
    envs = [ranks.rank_env(r, 3, 29999) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] \
        == [("0", "0", "3", "3"), ("1", "1", "3", "3"), ("2", "2", "3", "3")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", "29999")}
    assert ranks_cmd("job.py", ["--x", 1], nproc=4) == [sys.executable, RANKS, "4", "job.py",
                                                         "--x", "1"]
    assert ranks_cmd("m", module=True, nproc=2)[-3:] == ["2", "-m", "m"]
    with pytest.raises(ValueError, match="agent=True"):
        run_torchrun("job.py", launcher_args=["--max-restarts", "1"])


# rank 1 fails at once; rank 0 would sleep for a minute if nothing ended it
RANK_JOB = """
import os, sys, time, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
import torch
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
print(f"rank {rank} of {dist.get_world_size()} sum {x.item():g}", flush=True)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(7)
time.sleep(60 if sys.argv[1] == "fail" else 0)
"""


@pytest.mark.dist
def test_the_ranks_meet_and_the_first_to_fail_ends_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(RANK_JOB)
    done = launch(ranks_cmd(str(script), ["ok"], nproc=2), timeout=60)
    assert done.returncode == 0, done.stderr
    # the ranks share one pipe: a line may land inside another's
    assert sorted(re.findall(r"rank \d of \d sum \d", done.stdout)) == \
        ["rank 0 of 2 sum 3", "rank 1 of 2 sum 3"]
    done = launch(ranks_cmd(str(script), ["fail"], nproc=2), timeout=45)  # not the sleep's 60
    assert done.returncode == 7
    assert "ranks.py: rank 1 exited with 7: ending the others" in done.stderr
