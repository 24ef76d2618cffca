"""The one place the tests start processes: ``start`` (a handle), ``launch`` (run to the end,
bounded), ``run_python`` (a ``python -c`` snippet), ``run_torchrun`` (the ranks of one job:
through tests/ranks.py, or torchrun's agent as ``torchrun_cmd`` makes it), and the readers of
what workers print.

Every process starts in a session of its own, and a timeout kills its whole tree
(``kill_tree``) and raises an AssertionError carrying the tail of its output, so a hung child
fails its test instead of stalling the suite. tests/conftest.py refuses all of them in the fast
tier."""

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT


class ProcessRefused(RuntimeError):
    """Raised by tests/conftest.py's guard where a fast-tier test starts a process."""

    MESSAGE = ("a fast-tier test launched a process: mark it dist (or add it to the deny-list "
               "in conftest.py)")

    def __init__(self, how: str = ""):
        super().__init__(f"{self.MESSAGE}{f' ({how})' if how else ''}")


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and all its descendants: torchrun starts each worker in a session of
    its own, so killing the launcher's process group alone would leave the workers running."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def start(cmd: Sequence, *, cwd=None, env: Optional[Dict[str, str]] = None,
          stdout=PIPE, stderr=PIPE) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (text mode) and hand back its Popen, for a test
    that must watch it, signal its children or run two at once; end it with ``stop``.
    ``cwd`` and ``env`` as subprocess takes them (None: this process's); ``stdout`` and
    ``stderr``: PIPE, a file, STDOUT (stderr only) or None (this process's)."""
    return subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                            text=True, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s whole tree if it still runs, and reap it."""
    if proc.poll() is None:
        kill_tree(proc.pid)
    proc.wait()


def _output(captured: Optional[str], stream) -> str:
    """What a stream received: the captured text, or the file it was sent to."""
    if captured is not None:
        return captured
    name = getattr(stream, "name", None)
    if isinstance(name, str) and os.path.isfile(name):
        with open(name, errors="replace") as f:
            return f.read()
    return ""


def _failure(what: str, cmd: Sequence, out: str, err: str) -> AssertionError:
    return AssertionError(f"{what}: {' '.join(map(str, cmd))}\n"
                          f"--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}")


def launch(cmd: Sequence, *, timeout: float, cwd=None, env: Optional[Dict[str, str]] = None,
           stdout=PIPE, stderr=PIPE, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end (``start``'s arguments) and return its CompletedProcess (text;
    ``stdout``/``stderr`` None where not piped). Past ``timeout`` seconds its whole tree is
    killed and an AssertionError carrying its output's tail is raised; so is one on a non-zero
    exit when ``check``."""
    proc = start(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the command and everything it started
        out, err = proc.communicate()
        raise _failure(f"timed out after {timeout}s (hang?)", cmd, _output(out, stdout),
                       _output(err, stderr)) from None
    if check and proc.returncode != 0:
        raise _failure(f"exit code {proc.returncode}", cmd, _output(out, stdout),
                       _output(err, stderr))
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def launch_together(cmds: Sequence[Sequence], *, timeout: float, **kwargs
                    ) -> List[subprocess.CompletedProcess]:
    """``launch`` each of ``cmds`` at once (single-process commands that mostly import: two
    run side by side on 2 cores) and wait for all; ``kwargs`` as ``launch`` takes them. Past
    ``timeout`` every tree still running is killed and an AssertionError raised."""
    import time

    procs = [start(cmd, **kwargs) for cmd in cmds]
    deadline, done = time.monotonic() + timeout, []
    try:
        for cmd, proc in zip(cmds, procs):
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out, err = "", ""
                raise _failure(f"timed out after {timeout}s (hang?)", cmd, out, err) from None
            done.append(subprocess.CompletedProcess(list(cmd), proc.returncode, out, err))
    finally:
        for proc in procs:
            stop(proc)
    return done


def run_python(code: str, args: Sequence[str] = (), *, timeout: float, python_flags=(),
               cwd=None, env: Optional[Dict[str, str]] = None,
               check: bool = False) -> subprocess.CompletedProcess:
    """``python [python_flags] -c code args`` in a fresh interpreter, through ``launch``."""
    return launch([sys.executable, *python_flags, "-c", code, *map(str, args)], timeout=timeout,
                  cwd=cwd, env=env, check=check)


EXIT_FAST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_fast.py")


def torchrun_cmd(target: str, args: Sequence = (), *, nproc: Optional[int] = 1,
                 standalone: bool = True, module: bool = False,
                 launcher_args: Sequence[str] = (), fast_exit: bool = True) -> List[str]:
    """``python -m torch.distributed.run [--standalone] [--nproc-per-node=N] LAUNCHER_ARGS
    [exit_fast.py] [-m] TARGET ARGS``: ``module`` runs TARGET as ``-m`` does; ``nproc`` None
    leaves the count to ``launcher_args`` (a multi-node agent); ``--standalone`` picks a free
    rendezvous port, so launches never collide; ``fast_exit`` runs each worker through
    tests/exit_fast.py (no interpreter teardown once the job has ended: a second or more a
    worker)."""
    target_argv = [*(["-m"] if module else []), target, *map(str, args)]
    if fast_exit:
        target_argv = [EXIT_FAST, *target_argv]
    return [sys.executable, "-m", "torch.distributed.run",
            *(["--standalone"] if standalone else []),
            *([f"--nproc-per-node={nproc}"] if nproc is not None else []),
            *launcher_args, *target_argv]


RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranks.py")


def ranks_cmd(target: str, args: Sequence = (), *, nproc: int = 1,
              module: bool = False) -> List[str]:
    """``python tests/ranks.py NPROC [-m] TARGET ARGS``: NPROC ranks started the plain way
    (tests/ranks.py), without torchrun's agent."""
    return [sys.executable, RANKS, str(nproc), *(["-m"] if module else []), target,
            *map(str, args)]


def run_torchrun(
    script: str,
    args: Sequence[str] = (),
    nproc: int = 1,
    timeout: float = 120,
    env: Optional[Dict[str, str]] = None,
    check: bool = True,
    launcher_args: Sequence[str] = (),
    fast_exit: bool = True,
    agent: bool = False,
) -> Tuple[int, str, str]:
    """Run ``script args`` as ``nproc`` ranks of one job from the repo root.

    ``agent``: under ``torchrun --standalone`` (its agent, its store), as ``torchrun_cmd``
    makes it, with ``launcher_args`` for torchrun itself (e.g. ``--max-restarts 2``) and
    ``fast_exit`` as ``torchrun_cmd`` takes it; otherwise through tests/ranks.py (the same
    ranks and environment the plain way, a 2-rank job 1.3-1.5 s sooner). ``env`` is added to
    this process's, with the repo first on PYTHONPATH. Returns ``(returncode, stdout,
    stderr)``. On a timeout the whole tree is killed and an AssertionError carrying the output
    is raised; so is one on a non-zero exit when ``check``.
    """
    if (launcher_args or not fast_exit) and not agent:
        raise ValueError("launcher_args and fast_exit=False are torchrun's: pass agent=True")
    script_path = script if os.path.isabs(script) else os.path.join(REPO, script)
    cmd = torchrun_cmd(script_path, args, nproc=nproc, launcher_args=launcher_args,
                       fast_exit=fast_exit) if agent else ranks_cmd(script_path, args,
                                                                    nproc=nproc)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, full_env.get("PYTHONPATH", "")) if p)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    done = launch(cmd, cwd=REPO, env=full_env, timeout=timeout, check=check)
    return done.returncode, done.stdout, done.stderr


def parse_results(stdout: str, prefix: str = "RESULT ") -> List[dict]:
    """The JSON objects printed by the workers as ``<prefix>{json}``, found anywhere in the
    output: ranks share one pipe, so a result can land after another rank's unfinished line
    (a CI run lost rank 0's that way) or share a line with another result."""
    decoder, found, pos = json.JSONDecoder(), [], stdout.find(prefix)
    while pos >= 0:
        try:
            obj, end = decoder.raw_decode(stdout, pos + len(prefix))
            found.append(obj)
        except json.JSONDecodeError:  # the prefix quoted in text, not a result
            end = pos + len(prefix)
        pos = stdout.find(prefix, end)
    return found


def paci_summary(stdout: str) -> dict:
    """The one ``PACI_SUMMARY`` a training run prints (rank 0, at the end)."""
    found = parse_results(stdout, prefix="PACI_SUMMARY ")
    assert len(found) == 1, stdout[-3000:]
    return found[0]


def read_metrics(path) -> List[dict]:
    """The records of a ``--metrics-file`` (one JSON object per line)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def worker_rows(worker: str, out, launches: Sequence[Tuple[int, Sequence[str]]],
                timeout: float = 300) -> Dict[str, List[dict]]:
    """Run a case worker (``--out DIR CASE...``) once per (process count, cases) and read back
    what its ranks wrote, ``DIR/*.json``, as case -> one row a rank."""
    import glob

    for nproc, cases in launches:
        run_torchrun(worker, ["--out", str(out), *cases], nproc=nproc, timeout=timeout,
                     env={"PACI_TEST_HANG_S": str(int(timeout) - 30)})
    found: Dict[str, List[dict]] = {}
    for path in sorted(glob.glob(os.path.join(str(out), "*.json"))):
        with open(path) as f:
            row = json.load(f)
        found.setdefault(row["case"], []).append(row)
    return found


def results_by_case(stdout: str) -> Dict[str, dict]:
    """``parse_results`` keyed by each result's ``case``."""
    return {r["case"]: r for r in parse_results(stdout)}


def megatron_lm_args(**overrides):
    """Megatron-LM's parsed flags as the drop-in's validator sees them (before Megatron-LM's
    validate_args): PACI's flags at their defaults from the one table, ``--pipeline-schedule
    paci``, 2 untied stages on 2 ranks, 8 micro-batches, and Megatron-LM's own defaults for
    the fields the validator reads."""
    from paci_megatron import run as paci_run

    args = paci_run.parse_paci_arguments(["--pipeline-schedule", "paci"])
    for key, value in dict(
            num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
            pipeline_model_parallel_size=2, tensor_model_parallel_size=1,
            context_parallel_size=1, world_size=2, micro_batch_size=2, global_batch_size=16,
            untie_embeddings_and_output_weights=True, rampup_batch_size=None,
            decrease_batch_size_if_needed=False, overlap_param_gather=False,
            overlap_grad_reduce=False, use_distributed_optimizer=False, fp16=False,
            initial_loss_scale=2.0 ** 32, min_loss_scale=1.0, loss_scale=None,
            rerun_mode="validate_results", calculate_per_token_loss=False, timing_log_level=0,
            exit_duration_in_mins=None, exit_signal_handler=False, mtp_num_layers=None,
            num_experts=None, log_params_norm=False, apply_layernorm_1p=False,
            optimizer="adam", sgd_momentum=0.9).items():
        setattr(args, key, value)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def train_paci(flags: Sequence[str], metrics, nproc: int = 2, timeout: float = 300,
               env: Optional[Dict[str, str]] = None) -> dict:
    """``pretrain_gpt_paci.py FLAGS --metrics-file METRICS`` under torchrun: its stdout, its
    ``PACI_SUMMARY`` and every metrics record."""
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", [*flags, "--metrics-file", str(metrics)],
                             nproc=nproc, timeout=timeout, env=env)
    return {"out": out, "summary": paci_summary(out), "records": read_metrics(metrics)}


PLAIN_TENSORS = """
import json, os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import dist_checkpointing
a, b = (dist_checkpointing.load_plain_tensors(p) for p in sys.argv[1:3])
keys = sorted(k for k in a if torch.is_tensor(a[k]))
same = [k for k in keys if k in b and torch.equal(a[k], b[k])]
print("TENSORS " + json.dumps(dict(total=len(keys), same=len(same),
                                    differ=[k for k in keys if k not in same][:5])))
"""


def same_tensors(path_a, path_b, port: str) -> dict:
    """Every tensor of checkpoint ``path_a`` (model weights and optimizer moments, read whole by
    Megatron-Core whatever layout wrote it) compared with ``path_b``'s: total, same, differ."""
    out = run_python(PLAIN_TENSORS, [path_a, path_b, port], cwd=REPO, timeout=180,
                     env={**os.environ, "PYTHONPATH": REPO})
    line = next((l for l in out.stdout.splitlines() if l.startswith("TENSORS ")), None)
    assert line, _tail(out.stdout + out.stderr)
    return json.loads(line[len("TENSORS "):])


def checkpoint_of_iteration(root, iteration: int, dest) -> str:
    """A --load folder ``dest`` holding only ``root``'s checkpoint of ``iteration`` (a copy, and
    Megatron's tracker file naming it): a run that saved along the way is then resumed from
    the middle without a launch that stops there."""
    import shutil

    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(str(root), name), os.path.join(str(dest), name))
    with open(os.path.join(str(dest), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return str(dest)

