"""Faults at P=4: a stage that raises, is killed, or stalls stops the whole job in bounded
time with a message naming the rank and stage (no hang)."""

import os
import signal
import time

import psutil
import pytest

from launch import REPO, STDOUT, kill_tree, run_torchrun, start, torchrun_cmd

pytestmark = pytest.mark.dist

JOB = ["--pipeline-model-parallel-size", "4", "--num-layers", "4", "--hidden-size", "32",
       "--seq-length", "16", "--global-batch-size", "8", "--micro-batch-size", "2",
       "--untie-embeddings-and-output-weights", "--train-iters", "100000",
       "--distributed-timeout-minutes", "0.25"]


def _start_job(tmp_path):
    log = open(tmp_path / "job.log", "w+")
    cmd = torchrun_cmd(os.path.join(REPO, "pretrain_gpt_paci.py"), JOB, nproc=4)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = start(cmd, cwd=REPO, stdout=log, stderr=STDOUT, env=env)
    return proc, log


def _wait_for(log, text, deadline_s):
    end = time.time() + deadline_s
    while time.time() < end:
        log.seek(0)
        if text in log.read():
            return
        time.sleep(0.5)
    log.seek(0)
    raise AssertionError(f"{text!r} not seen in {deadline_s}s:\n{log.read()[-3000:]}")


def _worker_pid(proc, rank):
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "pretrain_gpt_paci" in " ".join(
                    child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker with RANK={rank}")


def _fault_and_time(tmp_path, sig):
    proc, log = _start_job(tmp_path)
    try:
        _wait_for(log, " iteration        3/", 120)
        victim = _worker_pid(proc, 2)
        t0 = time.time()
        os.kill(victim, sig)
        proc.wait(timeout=150)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGKILL)
            except (ProcessLookupError, UnboundLocalError):
                pass
    log.seek(0)
    return proc.returncode, elapsed, log.read()


def test_killed_stage_stops_the_job(tmp_path):
    code, elapsed, out = _fault_and_time(tmp_path, signal.SIGKILL)
    assert code != 0
    assert elapsed < 60, f"took {elapsed:.1f}s"
    print(f"killed stage: job exited {elapsed:.1f}s after SIGKILL")
    assert "rank 2 = pipeline stage 2" in out  # the start-up map of ranks to stages
    assert "exitcode  : -9" in out and "rank      : 2 (local_rank: 2)" in out  # torchrun's report


@pytest.mark.slow  # a minute mostly waiting for the timeout: CI runs it (.ci/slow-tests)
def test_stalled_stage_times_out(tmp_path):
    code, elapsed, out = _fault_and_time(tmp_path, signal.SIGSTOP)
    assert code != 0
    assert elapsed < 75, f"took {elapsed:.1f}s"  # 15 s timeout + torchrun 30 s SIGTERM grace
    print(f"stalled stage: job exited {elapsed:.1f}s after SIGSTOP")
    # a neighbour of the stalled stage gives up after --distributed-timeout-minutes (15 s here)
    assert "pipeline stage 2 (global rank 2)" in out, out[-4000:]


def test_exception_in_forward_stops_the_job(tmp_path):
    t0 = time.time()
    code, out, err = run_torchrun("tests/workers/paci_cases.py",
                                  ["--out", str(tmp_path), "raise_in_forward"], nproc=4,
                                  timeout=200, check=False, env={"PACI_TEST_HANG_S": "170"},
                                  agent=True)  # the job ends as torchrun ends it
    assert code != 0 and time.time() - t0 < 150
    assert "stage 1 failed at F10: RuntimeError: injected failure in forward" in out + err


def test_job_killed_while_saving_leaves_previous_checkpoint_loadable(tmp_path):
    """Kill the whole job the moment a new checkpoint's .tmp directory appears: the last
    complete checkpoint stays the one --load takes, and training resumes from it."""
    from paci_megatron.mcore.checkpoint import find_checkpoint

    ckpt = tmp_path / "ckpt"
    log = open(tmp_path / "job.log", "w+")
    cmd = torchrun_cmd(os.path.join(REPO, "pretrain_gpt_paci.py"), [
        "--untie-embeddings-and-output-weights", "--num-layers", "2", "--hidden-size", "32",
        "--seq-length", "16", "--train-iters", "1000", "--save", str(ckpt), "--save-interval",
        "1"], nproc=2)
    proc = start(cmd, cwd=REPO, stdout=log, stderr=STDOUT,
                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    caught = None
    try:
        end = time.time() + 150
        while time.time() < end and caught is None:
            done = ckpt / "latest_checkpointed_iteration.txt"
            if done.exists():
                partial = [p for p in ckpt.iterdir() if p.name.endswith(".tmp")]
                if partial:
                    kill_tree(proc.pid)
                    caught = partial[0].name
            time.sleep(0.005)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    assert caught, "never saw a save in progress"
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert caught == f"iter_{latest + 1:07d}.tmp"
    assert find_checkpoint(str(ckpt)).endswith(f"iter_{latest:07d}")
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", [
        "--untie-embeddings-and-output-weights", "--num-layers", "2", "--hidden-size", "32",
        "--seq-length", "16", "--train-iters", str(latest + 1), "--load", str(ckpt),
        "--override-opt_param-scheduler"],  # one more iteration, not the saved 1000-iteration run
        nproc=2, timeout=120)
    assert f"loaded checkpoint from {ckpt} at iteration {latest} " in out, (latest, out[:600])
