"""The throughput benchmark's stages: one process per pipeline stage, compute as a sleep of
the given cost and communication as real gloo point-to-point messages, driven by the same
executor and action lists as the runtime."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

from ..executor import DriftStats, StageExecutor
from ..schedule import RECV_OPS, SEND_OPS, Action, Op, plan_stream, peer
from ..shape import drift_bound
from ..simulate import Costs

KINDS = ("flush", "paci")

# One traced action: (name, category, start seconds, end seconds).
Span = Tuple[str, str, float, float]


@dataclass(frozen=True)
class Bench:
    """What every configuration shares: per-action costs (seconds) and how long to run."""

    forward_s: float
    backward_s: float
    step_s: float
    warmup: int
    updates: int
    tensor_side: int
    timeout_s: float
    repeats: int = 1
    tied_side: int = 0  # > 0: tied embeddings, a tied_side x tied_side float32 weight
    # the first, middle and last stages' forward and backward over the costs above: uneven
    # stages (the embedding's, the loss's), whose pipeline runs at the slowest one's pace
    pace: Tuple[float, float, float] = (1.0, 1.0, 1.0)

    def stage_scale(self, num_stages: int) -> Tuple[float, ...]:
        """Each stage's pace at P = num_stages; () when all are even."""
        if self.pace == (1.0, 1.0, 1.0) or num_stages < 2:
            return ()
        first, middle, last = self.pace
        return (first,) + (middle,) * (num_stages - 2) + (last,)

    def costs(self, num_stages: int) -> Costs:
        return Costs(self.forward_s, self.backward_s, self.step_s,
                     stage_scale=self.stage_scale(num_stages))

    def scale_of(self, stage: int, num_stages: int) -> float:
        scale = self.stage_scale(num_stages)
        return scale[stage] if scale else 1.0

    @property
    def calls(self) -> int:
        return self.warmup + self.updates


def _tag(action: Action) -> int:
    # Activations and gradients on different tags, so a pair's two directions never mix even
    # if both ever ran over one (src, dst) pair; gloo keeps order per (peer, tag).
    return 0 if action.op in (Op.SEND_F, Op.RECV_F) else 1


TIED_GRAD_TAG, TIED_WEIGHT_TAG = 2, 3


class SleepStage:
    """Executor handlers: compute is a sleep, communication is real gloo P2P.

    Sends are posted with ``isend`` and only waited on in ``finish``: a gloo send completes
    when the receiver posts its receive, so waiting on it at once would deadlock 1F1B's
    crossing send/receive pattern. Each payload carries its micro-batch id, which the receiver
    checks, so a mismatched message fails loudly instead of skewing the timings.

    Tied embeddings (``bench.tied_side``): PACI's lists carry the tied-weight messages
    (SG/RG, SW/RW, as ``mcore/tied.py`` sends them); the flush baseline all-reduces the tied
    gradient at every R over ``tied_group``, as stock does.
    """

    def __init__(self, stage: int, num_stages: int, bench: Bench, tied_group=None):
        self.stage, self.last = stage, num_stages - 1
        self.bench = bench
        self.scale = bench.scale_of(stage, num_stages)  # this stage's pace
        self.tied_group = tied_group  # flush with tied embeddings: stage 0 and the last stage
        self.pending: list = []  # (Work, tensor): the tensor must outlive the send
        self.spans: List[Span] = []
        self.steps = self.weights_received = 0  # the last stage's drain takes the rest

    def forward(self, mb: int) -> None:
        self._sleep(f"F{mb}", "compute", self.bench.forward_s * self.scale)

    def backward(self, mb: int) -> None:
        self._sleep(f"B{mb}", "compute", self.bench.backward_s * self.scale)

    def reduce(self, mb: int) -> None:
        start = time.perf_counter()
        if self.tied_group is not None:
            import torch.distributed as dist

            dist.all_reduce(self._tied_tensor(), group=self.tied_group)
        self.spans.append((f"R{mb}", "reduce", start, time.perf_counter()))

    def step(self, mb: int) -> None:
        self._sleep(f"T{mb}", "step", self.bench.step_s)
        self.steps += 1

    def send_tied_grad(self, mb: int) -> None:
        self._send_tied(f"SG{mb}", 0, TIED_GRAD_TAG)

    def send_tied_weight(self, mb: int) -> None:
        self._send_tied(f"SW{mb}", self.last, TIED_WEIGHT_TAG)

    def recv_tied_grad(self, mb: int) -> None:
        self._recv_tied(f"RG{mb}", self.last, TIED_GRAD_TAG)

    def recv_tied_weight(self, mb: int) -> None:
        self._recv_tied(f"RW{mb}", 0, TIED_WEIGHT_TAG)
        self.weights_received += 1

    def communicate(self, actions: Sequence[Action]) -> None:
        start = time.perf_counter()
        for act in actions:  # post every send first: they never block
            if act.op in SEND_OPS:
                self.pending.append(self._isend(act))
        receives = [(act,) + self._irecv(act) for act in actions if act.op in RECV_OPS]
        for act, work, buf in receives:
            work.wait()
            if int(buf[0, 0]) != act.mb:
                raise RuntimeError(f"stage {self.stage}: {act} received micro-batch "
                                   f"{int(buf[0, 0])}")
        self.spans.append((" ".join(map(str, actions)), "comm", start, time.perf_counter()))

    def finish(self, tied_drain: bool = False) -> None:
        """Wait for every send; ``tied_drain`` (PACI's last stage, tied): first take stage 0's
        weights that no step installed yet, as a drain does."""
        while tied_drain and self.weights_received < self.steps:
            self._recv_tied(None, 0, TIED_WEIGHT_TAG)
            self.weights_received += 1
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    def _sleep(self, name: str, category: str, seconds: float) -> None:
        start = time.perf_counter()
        if seconds > 0:
            time.sleep(seconds)
        self.spans.append((name, category, start, time.perf_counter()))

    def _tied_tensor(self):
        import torch

        return torch.zeros((self.bench.tied_side,) * 2)

    def _send_tied(self, name: str, dst: int, tag: int) -> None:
        import torch.distributed as dist

        start, tensor = time.perf_counter(), self._tied_tensor()
        self.pending.append((dist.isend(tensor, dst=dst, tag=tag), tensor))
        self.spans.append((name, "tied", start, time.perf_counter()))

    def _recv_tied(self, name: Optional[str], src: int, tag: int) -> None:
        import torch.distributed as dist

        start = time.perf_counter()
        dist.irecv(self._tied_tensor(), src=src, tag=tag).wait()
        if name is not None:
            self.spans.append((name, "tied", start, time.perf_counter()))

    def _isend(self, act: Action) -> tuple:
        import torch
        import torch.distributed as dist

        payload = torch.full((self.bench.tensor_side,) * 2, float(act.mb))
        return dist.isend(payload, dst=peer(self.stage, act.op), tag=_tag(act)), payload

    def _irecv(self, act: Action) -> tuple:
        import torch
        import torch.distributed as dist

        buf = torch.empty((self.bench.tensor_side,) * 2)
        return dist.irecv(buf, src=peer(self.stage, act.op), tag=_tag(act)), buf


def measure_stage(stage: int, num_stages: int, kind: str, microbatches: int,
                  bench: Bench, tied_group=None) -> dict:
    """Run W + K calls of one schedule on this stage; time the last K."""
    import torch.distributed as dist

    plan = plan_stream(kind, num_stages, microbatches, microbatches, tied=bool(bench.tied_side))
    # The executor enforces the drift bound, so the benchmark also checks what it runs.
    bound = drift_bound(num_stages, stage, microbatches) if kind == "paci" else 0
    stock_tied = bench.tied_side and kind != "paci" and stage in (0, num_stages - 1)
    handlers = SleepStage(stage, num_stages, bench, tied_group if stock_tied else None)
    executor = StageExecutor(stage, handlers, DriftStats(stage, bound))
    dist.barrier()  # all stages start the schedule together
    for k in range(bench.warmup):
        executor.run(plan.call(k)[stage])
    start = time.perf_counter()
    for k in range(bench.warmup, bench.calls):
        executor.run(plan.call(k)[stage])
    elapsed = time.perf_counter() - start
    handlers.finish(tied_drain=bool(bench.tied_side) and kind == "paci"
                    and stage == num_stages - 1 and num_stages > 1)
    dist.barrier()  # nobody starts the next schedule while a peer still sends this one's
    return {"elapsed": elapsed, "spans": handlers.spans}


def _worker(rank: int, num_stages: int, port: int, microbatches: Sequence[int], bench: Bench,
            out_path: str) -> None:
    """Process entry: every (M, schedule) for this P; rank 0 writes all stages' results."""
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # P processes share few cores; they must only sleep and talk
    dist.init_process_group("gloo", rank=rank, world_size=num_stages,
                            timeout=timedelta(seconds=bench.timeout_s))
    try:
        # every rank creates the group; only stage 0 and the last stage use it (stock's
        # tied-embedding all-reduce in the flush baseline)
        tied_group = dist.new_group([0, num_stages - 1]) if bench.tied_side \
            and num_stages > 1 else None
        results = []
        for m in microbatches:
            # Schedules alternate within each repeat, so a burst of load from other processes
            # on the machine hits one repeat of both rather than all repeats of one.
            for _ in range(bench.repeats):
                for kind in KINDS:
                    run = measure_stage(rank, num_stages, kind, m, bench, tied_group)
                    gathered = [None] * num_stages if rank == 0 else None
                    dist.gather_object(run, gathered, dst=0)
                    results.append({"M": m, "kind": kind, "stages": gathered})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(num_stages: int, microbatches: Sequence[int],
            bench: Bench) -> Dict[Tuple[int, str], List[List[dict]]]:
    """Launch P stage processes once and measure every M and schedule in them (a launch
    costs seconds of imports). Returns, per (M, kind), the repeats' per-stage results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.spawn(_worker, nprocs=num_stages, join=True,
                 args=(num_stages, _free_port(), list(microbatches), bench, out_path))
        with open(out_path) as f:
            results = json.load(f)
    runs: Dict[Tuple[int, str], List[List[dict]]] = {}
    for r in results:
        runs.setdefault((r["M"], r["kind"]), []).append(r["stages"])
    return runs
