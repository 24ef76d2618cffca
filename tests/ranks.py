"""``python ranks.py NPROC SCRIPT ARGS`` (or ``NPROC -m MODULE ARGS``): NPROC ranks of one job
on this machine, as a plain multi-process launcher starts them (Slurm's ``srun``, ``mpirun``):
each with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT,
rank 0 hosting the rendezvous store (torch's env:// default), each through exit_fast.py.

torchrun's agent imports torch before it starts a worker: a 2-rank job of the suite ends
1.3-1.5 s sooner without it on 2 cores (measured), and the default suite launches some
hundred and fifty jobs. The tests of what the agent itself does (restarts,
several nodes, its agent store, the README's command) launch torchrun (``launch.run_torchrun``
with ``agent=True``).

As torchrun does, the first rank to fail ends the others (SIGTERM, then SIGKILL after a
grace period) and the launcher exits non-zero; a signal to the launcher ends every rank. The
ranks share this process's stdout and stderr."""

import os
import signal
import socket
import subprocess
import sys
import time

EXIT_FAST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_fast.py")
GRACE_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    return env


def end(procs) -> None:
    """SIGTERM every rank still running, SIGKILL those left after the grace period."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(nproc: int, target: list) -> int:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, EXIT_FAST, *target], env=rank_env(r, nproc, port))
             for r in range(nproc)]
    signal.signal(signal.SIGTERM, lambda *_: (end(procs), os._exit(143)))
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                rank = codes.index(failed)
                print(f"ranks.py: rank {rank} exited with {failed}: ending the others",
                      file=sys.stderr, flush=True)
                end(procs)
                return failed if failed > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        end(procs)
        return 130


if __name__ == "__main__":
    sys.exit(run(int(sys.argv[1]), sys.argv[2:]))
