"""A real two-node launch on one machine: two torchrun agents (one per "node") that meet at a
c10d rendezvous on 127.0.0.1, one worker each, so pipeline stage 0 and stage 1 of a PACI job
live under different agents (examples/multinode_torchrun.sh is the same command line for two
real machines)."""

import os
import re
import socket
import subprocess
import time

import pytest

from launch import REPO, STDOUT, kill_tree, start, torchrun_cmd

pytestmark = pytest.mark.dist

FLAGS = ["--pipeline-schedule", "paci", "--untie-embeddings-and-output-weights",
         "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
         "--seq-length", "16", "--train-iters", "4"]
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _agent(node_rank: int, port: int, log_path: str):
    cmd = torchrun_cmd(os.path.join(REPO, "pretrain_gpt_paci.py"), FLAGS, nproc=None,
                       standalone=False, launcher_args=[
                           "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                           str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           f"127.0.0.1:{port}", "--rdzv-id", f"paci-multinode-{port}",
                           "--max-restarts", "0"])
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", ""))
                                          if p))
    env.setdefault("OMP_NUM_THREADS", "1")
    log = open(log_path, "w")
    try:
        return start(cmd, cwd=REPO, env=env, stdout=log, stderr=STDOUT)
    finally:
        log.close()  # the child keeps its own descriptor


def test_two_agents_one_stage_each(tmp_path):
    port = _free_port()
    logs = [str(tmp_path / f"node{rank}.log") for rank in (0, 1)]
    agents = [_agent(rank, port, logs[rank]) for rank in (0, 1)]
    deadline = time.monotonic() + TIMEOUT
    timed_out = False
    try:
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent.pid)  # torchrun and its worker (in a session of its own)
                agent.wait()
    outputs = [open(path).read() for path in logs]
    report = "\n".join(f"--- node {rank} (exit {agents[rank].returncode}) ---\n{out[-4000:]}"
                       for rank, out in enumerate(outputs))
    assert not timed_out, f"timed out after {TIMEOUT}s (both agents killed)\n{report}"
    assert [agent.returncode for agent in agents] == [0, 0], report

    counts = [sum(line.startswith(" iteration ") for line in out.splitlines())
              for out in outputs]
    assert sorted(counts) == [0, 4], report  # only the last stage logs, under one agent
    last = outputs[counts.index(4)]
    assert re.search(r"stage 0: max drift 1 \(bound 1\)", last), report
    assert re.search(r"stage 1: max drift 0 \(bound 0\)", last), report
