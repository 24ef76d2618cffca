"""Runtime overhead of PACI vs stock Megatron at P=1 (the same arithmetic), per iteration.

``python -m paci_megatron.tools.bench_overhead [--quick] [--json PATH]``

One process, a gloo (NCCL on CUDA) group of one. The same GPT model, optimizer, LR schedule
and batches are built twice: arm ``stock`` runs Megatron-Core's no-pipelining
forward-backward, ``optimizer.step()`` and the LR step (what ``--pipeline-schedule 1f1b``
runs at P=1); arm ``paci`` runs ``PaciRuntime(kind="paci", accumulation=M)``, whose stage
takes its local step after the M-th backward: at P=1 the same arithmetic, so both arms must
produce the same losses bit for bit (reported as ``same_losses``).

Each arm first runs W untimed iterations, then R runs of K timed iterations; within a run
the arms alternate iteration by iteration (ABAB..., the first arm flipping every run), so the
shared machine's load hits both alike. Reported: seconds per iteration (median over runs, and the
spread), per micro-batch, and the per-run ratio PACI / stock (median, min, max). A
``cProfile`` pass over a few more iterations of each arm says where the time goes
(cumulative milliseconds per iteration of the runtime's parts: executor dispatch, drift
bookkeeping, finite check, version counters, optimizer and LR step, zero-grad, ...). On CUDA
that profile is host time (kernel launches, and the waits of host syncs); the timed runs
synchronise the device before reading the clock.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..mcore import build
from ..mcore.runtime import PaciRuntime, get_forward_backward_func

ARMS = ("stock", "paci")
CLOCKS = ("wall", "cpu")

# Profile rows: label -> (end of the source file's path, function name). Where several
# functions match (Megatron's optimizer classes all have ``step``), the outermost (largest
# cumulative time) is taken.
PROFILE_ROWS = {
    "iteration (total)": [("bench_overhead.py", "iteration")],
    "forward_backward (PACI: with its local step)": [("runtime.py", "forward_backward"),
                                 ("schedules.py", "forward_backward_no_pipelining")],
    "forward_step": [("schedules.py", "forward_step")],
    "backward_step": [("schedules.py", "backward_step")],
    "executor dispatch (StageExecutor.run)": [("executor.py", "run")],
    "drift bookkeeping (DriftStats)": [("executor.py", "on_forward"), ("executor.py", "on_backward"),
                                       ("executor.py", "on_step")],
    "plan lookup (StreamPlan.call)": [("schedule.py", "call")],
    "send bookkeeping (reap/finish sends)": [("handlers.py", "reap_sends"),
                                             ("handlers.py", "finish_send_of")],
    "group close (local_step: finish_grads and take_step)": [("local_step.py", "finish_grads"),
                                                             ("local_step.py", "take_step")],
    "finalize_model_grads": [("finalize_model_grads.py", "finalize_model_grads")],
    "local step (step_unless_nonfinite: Megatron's step in its parts)": [
        ("local_step.py", "step_unless_nonfinite")],
    "grads_are_finite (only without clipping)": [("local_step.py", "grads_are_finite")],
    "version counters (keep_version_counters)": [("autograd_versions.py", "keep_version_counters")],
    # stock calls step, which calls step_with_ready_grads; PACI calls the latter itself
    "optimizer.step (PACI: step_with_ready_grads)": [("optimizer.py", "step"),
                                                     ("optimizer.py", "step_with_ready_grads")],
    "LR step": [("optimizer_param_scheduler.py", "step")],
    "zero_grad_buffer": [("distributed_data_parallel.py", "zero_grad_buffer")],
    "optimizer.zero_grad": [("optimizer.py", "zero_grad")],
}
# rows that add up to one function each (several functions listed are summed, not maxed)
SUMMED_ROWS = {"drift bookkeeping (DriftStats)", "send bookkeeping (reap/finish sends)",
               "forward_backward (PACI: with its local step)",
               "group close (local_step: finish_grads and take_step)"}


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    global_batch: int
    bf16: bool
    warmup: int
    iters: int
    runs: int
    profile_iters: int
    seed: int = 1234

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.micro_batch


# --- one arm: a model, its optimizer, schedule and data ------------------------------------

class Arm:
    """One copy of the model trained by one schedule, with its own iterator over the shared
    batches (both arms see the same batches in the same order)."""

    def __init__(self, name: str, cfg: Config, batches: List[dict]):
        self.name, self.cfg = name, cfg
        spec = build.GPTSpec(num_layers=cfg.layers, hidden_size=cfg.hidden,
                             num_attention_heads=cfg.heads, seq_length=cfg.seq,
                             vocab_size=cfg.vocab, untie_embeddings=True, bf16=cfg.bf16)
        self.model = build.build_gpt_model(spec, seed=cfg.seed)
        self.opt = build.build_optimizer(self.model, lr=1e-3, clip_grad=1.0, bf16=cfg.bf16)
        self.sched = build.build_lr_scheduler(self.opt, lr=1e-3, min_lr=1e-4, warmup_steps=0,
                                              decay_steps=10**6)
        self.batches = batches
        self.next_batch = 0
        self.losses: List[str] = []
        self.runtime: Optional[PaciRuntime] = None
        if name == "paci":
            self.runtime = PaciRuntime(kind="paci", accumulation=cfg.microbatches)
            self.runtime.bind(self.opt, self.sched, lr_increment=cfg.global_batch)
            self.forward_backward = self.runtime.forward_backward
        else:
            self.forward_backward = get_forward_backward_func()
        self.data = self._data()

    def _data(self):
        while True:  # an endless stream over the shared batches
            yield self.batches[self.next_batch % len(self.batches)]
            self.next_batch += 1

    def iteration(self) -> None:
        """One training iteration, as ``training.train_step`` runs it for this schedule."""
        if self.runtime is None:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.opt.zero_grad()
        store = self.forward_backward(
            forward_step_func=build.gpt_forward_step, data_iterator=self.data, model=self.model,
            num_microbatches=self.cfg.microbatches, seq_length=self.cfg.seq,
            micro_batch_size=self.cfg.micro_batch, forward_only=False)
        if self.runtime is None:
            ok, _, _ = self.opt.step()
            if ok:
                self.sched.step(increment=self.cfg.global_batch)
        # a host copy per iteration for the equality check, as the training log's loss does
        self.losses.append(float(sum(d["lm loss"] for d in store)).hex())

    def timed(self) -> Dict[str, float]:
        """Seconds of one iteration: wall clock, and this process's CPU time."""
        _sync()
        wall, cpu = time.perf_counter(), time.process_time()
        self.iteration()
        _sync()
        return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_batches(cfg: Config, count: int) -> List[dict]:
    """``count`` micro-batches made before any timing (the generator is Python-heavy)."""
    spec = build.GPTSpec(num_layers=cfg.layers, hidden_size=cfg.hidden,
                         num_attention_heads=cfg.heads, seq_length=cfg.seq, vocab_size=cfg.vocab)
    stream = build.mock_data_iterator(spec, cfg.micro_batch, cfg.seed)
    return [next(stream) for _ in range(count)]


# --- measuring -----------------------------------------------------------------------------

def alternate(arms: Dict[str, Arm], cfg: Config) -> Dict[str, Dict[str, List[float]]]:
    """R runs of K iterations per arm. Within a run the arms alternate iteration by iteration
    (ABAB..., the first arm flipping every run), so both see the same moments of the shared
    machine's load. Returns {clock: {arm: [[seconds of each iteration] of each run]}}."""
    times = {clock: {name: [] for name in arms} for clock in CLOCKS}
    for r in range(cfg.runs):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        for clock in CLOCKS:
            for name in arms:
                times[clock][name].append([])
        for _ in range(cfg.iters):
            for name in order:
                for clock, t in arms[name].timed().items():
                    times[clock][name][-1].append(t)
    return times


def _rows_from_stats(stats: pstats.Stats, iters: int) -> Dict[str, float]:
    """Cumulative milliseconds per iteration of each PROFILE_ROWS entry found."""
    table = stats.stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    out = {}
    for label, wanted in PROFILE_ROWS.items():
        found = [ct for (path, _, func), (_, _, _, ct, _) in table.items()
                 for suffix, name in wanted if func == name and path.endswith(suffix)]
        if found:
            total = sum(found) if label in SUMMED_ROWS else max(found)
            out[label] = 1e3 * total / iters
    return out


def profile(arm: Arm, iters: int) -> Dict[str, float]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        arm.iteration()
    _sync()
    prof.disable()
    return _rows_from_stats(pstats.Stats(prof), iters)


def summarize(iteration_times: Dict[str, List[List[float]]], cfg: Config) -> dict:
    """One clock's figures. Ratios are paired (the same moments' load): per run (mean of its K
    iterations) and per iteration (each PACI iteration with the stock one next to it; the
    median of these shrugs off another job's bursts best)."""
    times = {name: [statistics.fmean(run) for run in runs]
             for name, runs in iteration_times.items()}
    ratios = [p / s for p, s in zip(times["paci"], times["stock"])]
    pairs = [p / s for run_p, run_s in zip(iteration_times["paci"], iteration_times["stock"])
             for p, s in zip(run_p, run_s)]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "s_per_iter": med,
        "s_per_iter_min": {name: min(ts) for name, ts in times.items()},
        "s_per_iter_max": {name: max(ts) for name, ts in times.items()},
        "ms_per_microbatch": {name: 1e3 * t / cfg.microbatches for name, t in med.items()},
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_of_medians": med["paci"] / med["stock"],
        "overhead_pct": 100 * (statistics.median(ratios) - 1),
        "iteration_ratio_median": statistics.median(pairs),
        "iteration_ratio_quartiles": statistics.quantiles(pairs, n=4) if len(pairs) > 1
        else [pairs[0]] * 3,
        "runs": times,
    }


def run(cfg: Config) -> dict:
    """Build both arms, warm up, alternate, profile; the report as a dict."""
    total = cfg.warmup + cfg.runs * cfg.iters + cfg.profile_iters
    batches = make_batches(cfg, total * cfg.microbatches)
    arms = {name: Arm(name, cfg, batches) for name in ARMS}
    for _ in range(cfg.warmup):
        for name in ARMS:
            arms[name].iteration()
    times = alternate(arms, cfg)
    report = {clock: summarize(times[clock], cfg) for clock in CLOCKS}
    report["profile_ms_per_iter"] = {name: profile(arms[name], cfg.profile_iters)
                                     for name in ARMS} if cfg.profile_iters else {}
    report["same_losses"] = arms["stock"].losses == arms["paci"].losses
    report["iterations"] = len(arms["paci"].losses)
    report["config"] = asdict(cfg)
    report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report["threads"] = torch.get_num_threads()
    return report


def format_report(rep: dict) -> str:
    cfg = rep["config"]
    lines = [
        f"P=1, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads, seq "
        f"{cfg['seq']}, micro-batch {cfg['micro_batch']}, global batch {cfg['global_batch']} "
        f"(M={cfg['global_batch'] // cfg['micro_batch']}), {'bf16' if cfg['bf16'] else 'fp32'}, "
        f"{rep['device']}, {rep['threads']} thread(s)",
        f"{cfg['runs']} runs x {cfg['iters']} iterations per arm, alternating by iteration "
        f"(after {cfg['warmup']} warm-up)",
        "",
        "| clock | arm | s/iteration (median) | min | max | ms/micro-batch |",
        "|---|---|---|---|---|---|",
    ]
    for clock in CLOCKS:
        c = rep[clock]
        for name in ARMS:
            lines.append(f"| {clock} | {name} | {c['s_per_iter'][name]:.4f} | "
                         f"{c['s_per_iter_min'][name]:.4f} | {c['s_per_iter_max'][name]:.4f} | "
                         f"{c['ms_per_microbatch'][name]:.2f} |")
    lines.append("")
    for clock in CLOCKS:
        c = rep[clock]
        lines.append(
            f"{clock}: PACI / stock per run: median {c['ratio_median']:.4f} (min "
            f"{c['ratio_min']:.4f}, max {c['ratio_max']:.4f}); ratio of medians "
            f"{c['ratio_of_medians']:.4f}; overhead {c['overhead_pct']:+.2f}%; per iteration "
            f"pair: median {c['iteration_ratio_median']:.4f} (quartiles "
            f"{c['iteration_ratio_quartiles'][0]:.4f}-{c['iteration_ratio_quartiles'][2]:.4f})")
    lines.append(f"same losses bit for bit over {rep['iterations']} iterations: "
                 f"{rep['same_losses']}")
    prof = rep["profile_ms_per_iter"]
    if prof:
        lines += ["", "cProfile, cumulative ms per iteration (profiler overhead included):",
                  "| part | stock | paci |", "|---|---|---|"]
        for label in PROFILE_ROWS:
            cells = [f"{prof[n][label]:.3f}" if label in prof[n] else "-" for n in ARMS]
            if any(c != "-" for c in cells):
                lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


# --- process setup -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_single_process() -> None:
    """A process group of one (torchrun's environment when launched by it)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if int(os.environ["WORLD_SIZE"]) != 1:
        raise SystemExit("bench_overhead: error: runs in one process (P=1); launch it with "
                         "python -m paci_megatron.tools.bench_overhead or torchrun --nproc-per-node 1")
    build.init_distributed(pp=1, timeout_s=300)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m paci_megatron.tools.bench_overhead",
        description="P=1 runtime overhead of PACI vs stock Megatron (same arithmetic)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gpu-model", action="store_true",
                        help="8 layers, hidden 1024, 16 heads, seq 1024, micro-batch 4, global "
                             "batch 32, bf16, vocab 32768 (the issue's GPU configuration)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per arm")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations K per run")
    parser.add_argument("--runs", type=int, default=7, help="runs R of K iterations per arm "
                        "(>= 5 for a median worth quoting)")
    parser.add_argument("--profile-iters", type=int, default=5,
                        help="iterations per arm under cProfile (0: no profile)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steadier on a shared machine)")
    parser.add_argument("--quick", action="store_true",
                        help="1 warm-up, 2 runs of 1 iteration, 1 profiled: a smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    if args.gpu_model:
        args.num_layers, args.hidden_size, args.num_attention_heads = 8, 1024, 16
        args.seq_length, args.micro_batch_size, args.global_batch_size = 1024, 4, 32
        args.bf16, args.vocab_size = True, 32768
    if args.quick:
        args.warmup, args.iters, args.runs, args.profile_iters = 1, 1, 2, 1
    if args.global_batch_size % args.micro_batch_size:
        parser.error(f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
                     f"--micro-batch-size ({args.micro_batch_size})")
    for flag in ("warmup", "profile_iters"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("iters", "runs", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    return args


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(layers=args.num_layers, hidden=args.hidden_size,
                  heads=args.num_attention_heads, seq=args.seq_length, vocab=args.vocab_size,
                  micro_batch=args.micro_batch_size, global_batch=args.global_batch_size,
                  bf16=args.bf16, warmup=args.warmup, iters=args.iters, runs=args.runs,
                  profile_iters=args.profile_iters)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    init_single_process()
    try:
        rep = run(config_from_args(args))
    finally:
        build.destroy_distributed()
    print(format_report(rep), flush=True)
    print("OVERHEAD_JSON " + json.dumps(rep), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
