"""Throughput of 1F1B-flush vs PACI on sleep-costed ("GPU-like") pipeline stages.

``python -m paci_megatron.tools.bench_throughput [--quick] [--trace /tmp/paci_trace.json]``

One process per stage (gloo, 127.0.0.1). Every forward sleeps ``tf`` and every backward ``tb``,
so P sleeping processes on a few cores behave like P accelerators; the per-stage action lists
come from ``schedule.plan_stream`` and run through the real ``StageExecutor``, and activations
and gradients (a small float32 tensor) travel over real gloo point-to-point messages.

For each (P, M) with a = M (one optimizer step per update), each schedule runs W warm-up
updates and K timed ones; time per update is the slowest stage's wall time for the K updates
divided by K, the median over R such runs (the schedules alternate between runs). The same
action lists are timed by ``simulate.run_lockstep`` with the same costs and zero
communication latency ("sim"), and again with the mean message latency and sleep overshoot
measured in the run added ("sim+overheads"), which says how much of the gap to the ideal those
overheads explain.

Interleaved 1F1B is not measured (PACI's executor does not run it): it is reported as
"interleaved (model)", Megatron-Core's order per rank timed by its dependencies at the same
costs (``interleaved.py``; in steady state ``(M + (P-1)/v) * (tf+tb) + step``), where Megatron
accepts it (M % P == 0). The ideal is ``M(tf+tb) + step``: every stage steps once per update.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import SEND_OPS, Action, Op, Schedule, channel, plan_stream
from ..simulate import Costs, Event, NcclModel, run_lockstep, run_stream_nccl
from . import tta
from .sleep_stages import KINDS, Bench, Span, measure

COMPUTE_NAMES = {Op.FORWARD: "compute", Op.BACKWARD: "compute", Op.STEP: "step"}


# --- simulation of the same action lists ---------------------------------------------------

def stream_schedule(kind: str, num_stages: int, microbatches: int, calls: int,
                    tied: bool = False) -> Schedule:
    """The calls 0..calls-1 of the stream, concatenated per stage: what each stage ran."""
    plan = plan_stream(kind, num_stages, microbatches, microbatches, tied)
    return Schedule(f"{kind}-stream", num_stages, microbatches, calls * microbatches,
                    plan.lists(calls), plan.tied)


def simulate_stream(kind: str, num_stages: int, microbatches: int, bench: Bench,
                    costs: Optional[Costs] = None,
                    nccl: Optional[NcclModel] = None) -> Tuple[float, List[List[Event]]]:
    """Simulated time per update (slowest stage over the timed calls) and the timeline.

    ``run_lockstep`` (sends never block, like gloo here) or, with ``nccl``, ``run_stream_nccl``
    (NCCL's pairing rules) rather than ``simulate``: a PACI stream cut after a call still has
    forwards in flight, which ``simulate``'s whole-schedule checks reject by design.
    """
    tied = bool(bench.tied_side)
    plan = plan_stream(kind, num_stages, microbatches, microbatches, tied)
    if nccl is None:
        sched = stream_schedule(kind, num_stages, microbatches, bench.calls, tied)
        events = run_lockstep(sched, costs or bench.costs(num_stages))
    else:
        events = run_stream_nccl(plan, bench.calls, costs or bench.costs(num_stages), nccl)
    worst = 0.0
    warm = plan.lists(bench.warmup)
    for s, evs in enumerate(events):
        before = len(warm[s])
        start = evs[before - 1].end if before else 0.0  # the timer starts as call W is entered
        worst = max(worst, evs[-1].end - start)
    return worst / bench.updates, events


# --- where measured time goes beyond the costs -----------------------------------------------

def message_latencies(stages: List[List[Span]]) -> List[float]:
    """Per message: seconds from the later of its send and its receive being posted to the
    receive completing, i.e. what the transport adds (gloo's rendezvous, thread wake-ups)."""
    sent: Dict[tuple, float] = {}
    received: Dict[tuple, Tuple[float, float]] = {}
    for s, spans in enumerate(stages):
        for name, category, start, end in spans:
            if category != "comm":
                continue
            for act in map(Action.parse, name.split()):
                key = channel(s, act) + (act.mb,)
                if act.op in SEND_OPS:
                    sent[key] = start
                else:
                    received[key] = (start, end)
    return [end - max(start, sent[key]) for key, (start, end) in received.items() if key in sent]


def sleep_overshoot(stages: List[List[Span]], bench: Bench) -> float:
    """Mean seconds a forward or backward sleep lasted beyond its cost (each stage's own)."""
    nominal = {"F": bench.forward_s, "B": bench.backward_s}
    P = len(stages)
    extra = [end - start - nominal[name[0]] * bench.scale_of(s, P)
             for s, spans in enumerate(stages)
             for name, category, start, end in spans if category == "compute"]
    return sum(extra) / len(extra) if extra else 0.0


def overhead_costs(stages: List[List[Span]], bench: Bench) -> Costs:
    """The costs with the measured mean overheads added: if the simulator then matches the
    measurement, those overheads (not the schedule) explain the gap to the ideal."""
    latencies = message_latencies(stages)
    comm = sum(latencies) / len(latencies) if latencies else 0.0
    over = sleep_overshoot(stages, bench)
    scale = bench.stage_scale(len(stages))  # uneven: the overshoot scales with the pace here
    return Costs(bench.forward_s + over, bench.backward_s + over, bench.step_s, comm,
                 stage_scale=scale)


# --- results -----------------------------------------------------------------------------

def per_update(stages: List[dict], bench: Bench) -> float:
    """Seconds per update of one run: its slowest stage's timed wall time over K."""
    return max(st["elapsed"] for st in stages) / bench.updates


def median_run(repeats: List[List[dict]], bench: Bench) -> List[dict]:
    """The repeat with the median time per update (the upper one for an even count); its
    timeline is the one traced and analysed, so all columns describe the same run."""
    return sorted(repeats, key=lambda stages: per_update(stages, bench))[len(repeats) // 2]


def interleaved_model(num_stages: int, microbatches: int, chunks: int,
                      bench: Bench) -> Optional[float]:
    """Interleaved 1F1B's time per update at these costs (the projection's own:
    ``tta.interleaved_seconds_per_iteration``); None where Megatron refuses it."""
    if chunks < 2 or bench.stage_scale(num_stages):
        return None  # the interleaved model takes even stages
    costs = Costs(bench.forward_s, bench.backward_s, bench.step_s)
    return tta.interleaved_seconds_per_iteration(num_stages, microbatches, costs, chunks)


def summarize(num_stages: int, microbatches: int, repeats: Dict[str, List[List[dict]]],
              bench: Bench, chunks: int) -> dict:
    """One configuration's row: measured, ideal, modelled and simulated times per update."""
    P, M = num_stages, microbatches
    runs = {kind: median_run(repeats[kind], bench) for kind in KINDS}
    row = {"P": P, "M": M, "a": M,
           "forward_ms": bench.forward_s * 1e3, "backward_ms": bench.backward_s * 1e3,
           "step_ms": bench.step_s * 1e3, "stage_scale": list(bench.stage_scale(P)),
           "warmup": bench.warmup, "updates": bench.updates,
           "repeats": bench.repeats}
    for kind, suffix in (("flush", "1f1b"), ("paci", "paci")):
        spans = [st["spans"] for st in runs[kind]]
        costs = overhead_costs(spans, bench)
        row[f"sec_per_update_{suffix}"] = per_update(runs[kind], bench)
        row[f"stage_sec_per_update_{suffix}"] = [st["elapsed"] / bench.updates
                                                 for st in runs[kind]]
        row[f"repeats_sec_per_update_{suffix}"] = [per_update(r, bench) for r in repeats[kind]]
        row[f"simulated_sec_per_update_{suffix}"] = simulate_stream(kind, P, M, bench)[0]
        row[f"simulated_with_overheads_sec_per_update_{suffix}"] = \
            simulate_stream(kind, P, M, bench, costs)[0]
        row[f"simulated_nccl_sec_per_update_{suffix}"] = \
            simulate_stream(kind, P, M, bench, nccl=NcclModel())[0]
        row[f"message_latency_ms_{suffix}"] = costs.comm * 1e3
        row[f"sleep_overshoot_ms_{suffix}"] = (costs.forward - bench.forward_s) * 1e3
    # every stage steps once per update: M(tf+tb) + step for PACI at the slowest stage's
    # pace, plus the bubble for 1F1B (even stages: (P-1)(tf+tb); uneven: as simulated)
    per_mb = bench.forward_s + bench.backward_s
    slowest = bench.costs(P).slowest()
    ideal = M * per_mb * slowest + bench.step_s
    flush_ideal = row["simulated_sec_per_update_1f1b"] if bench.stage_scale(P) \
        else (M + P - 1) * per_mb + bench.step_s
    row.update({
        "sec_per_update_interleaved_model": interleaved_model(P, M, chunks, bench),
        "virtual_chunks": chunks,
        "sec_per_update_ideal": ideal,
        "ratio": row["sec_per_update_1f1b"] / row["sec_per_update_paci"],
        "ideal_ratio": flush_ideal / ideal,
        "paci_over_ideal": row["sec_per_update_paci"] / ideal,
        "simulated_nccl_paci_over_ideal": row["simulated_nccl_sec_per_update_paci"] / ideal,
        "simulated_ratio": (row["simulated_sec_per_update_1f1b"]
                            / row["simulated_sec_per_update_paci"]),
    })
    row["ratio_over_ideal"] = row["ratio"] / row["ideal_ratio"]
    for suffix in ("1f1b", "paci"):
        row[f"measured_vs_simulated_{suffix}"] = (
            row[f"sec_per_update_{suffix}"] / row[f"simulated_sec_per_update_{suffix}"] - 1)
    row["measured_vs_simulated_ratio"] = row["ratio"] / row["simulated_ratio"] - 1
    return row


TABLE_COLUMNS = (
    # (header, key, format)
    ("P", "P", "{:d}"), ("M", "M", "{:d}"), ("a", "a", "{:d}"),
    ("1F1B s/upd", "sec_per_update_1f1b", "{:.4f}"),
    ("interleaved (model) s/upd", "sec_per_update_interleaved_model", "{:.4f}"),
    ("PACI s/upd", "sec_per_update_paci", "{:.4f}"),
    ("ratio 1F1B/PACI", "ratio", "{:.3f}"),
    ("ideal ratio", "ideal_ratio", "{:.3f}"),
    ("ratio/ideal", "ratio_over_ideal", "{:.1%}"),
    ("ideal s/upd", "sec_per_update_ideal", "{:.4f}"),
    ("PACI/ideal", "paci_over_ideal", "{:.3f}"),
    ("sim NCCL PACI/ideal", "simulated_nccl_paci_over_ideal", "{:.3f}"),
    ("sim 1F1B", "simulated_sec_per_update_1f1b", "{:.4f}"),
    ("sim PACI", "simulated_sec_per_update_paci", "{:.4f}"),
    ("sim ratio", "simulated_ratio", "{:.3f}"),
    ("meas/sim-1 1F1B", "measured_vs_simulated_1f1b", "{:+.1%}"),
    ("meas/sim-1 PACI", "measured_vs_simulated_paci", "{:+.1%}"),
    ("meas/sim-1 ratio", "measured_vs_simulated_ratio", "{:+.1%}"),
    ("msg latency ms (PACI)", "message_latency_ms_paci", "{:.2f}"),
    ("sleep over ms (PACI)", "sleep_overshoot_ms_paci", "{:.2f}"),
    ("sim+overheads 1F1B", "simulated_with_overheads_sec_per_update_1f1b", "{:.4f}"),
    ("sim+overheads PACI", "simulated_with_overheads_sec_per_update_paci", "{:.4f}"),
)


def format_table(rows: Sequence[dict]) -> str:
    """A Markdown table, one row per configuration ("n/a" where a schedule does not apply)."""
    head = "| " + " | ".join(h for h, _, _ in TABLE_COLUMNS) + " |"
    sep = "|" + "---|" * len(TABLE_COLUMNS)
    body = [
        "| " + " | ".join("n/a" if row[key] is None else fmt.format(row[key])
                          for _, key, fmt in TABLE_COLUMNS) + " |"
        for row in rows
    ]
    return "\n".join([head, sep] + body)


# --- Chrome traces -----------------------------------------------------------------------

def chrome_trace(timelines: Dict[str, List[List[Span]]]) -> dict:
    """{"traceEvents": [...]}: one pid per schedule, one tid per stage, times in microseconds
    from the schedule's earliest span."""
    events: List[dict] = []
    for pid, (label, stages) in enumerate(timelines.items()):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": label}})
        origin = min((sp[2] for spans in stages for sp in spans), default=0.0)
        for tid, spans in enumerate(stages):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"stage {tid}"}})
            events += [
                {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                 "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6}
                for name, cat, start, end in spans
            ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def simulated_spans(events: List[List[Event]]) -> List[List[Span]]:
    # Receives take no time in the simulator (waiting shows as a gap), so only F/B/T appear.
    return [[(str(e.action), COMPUTE_NAMES[e.action.op], e.start, e.end)
             for e in evs if e.action.op in COMPUTE_NAMES] for evs in events]


def sim_trace_path(path: str) -> str:
    stem = path[: -len(".json")] if path.endswith(".json") else path
    return stem + ".sim.json"


def write_traces(path: str, num_stages: int, microbatches: int,
                 runs: Dict[str, List[dict]], bench: Bench) -> Tuple[str, str]:
    label = {"flush": "1F1B flush", "paci": "PACI"}
    measured = {f"{label[k]} measured (P={num_stages} M={microbatches})":
                [st["spans"] for st in runs[k]] for k in KINDS}
    simulated = {f"{label[k]} simulated (P={num_stages} M={microbatches})":
                 simulated_spans(simulate_stream(k, num_stages, microbatches, bench)[1])
                 for k in KINDS}
    sim_path = sim_trace_path(path)
    for target, timelines in ((path, measured), (sim_path, simulated)):
        with open(target, "w") as f:
            json.dump(chrome_trace(timelines), f)
    return path, sim_path


# --- command line ------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m paci_megatron.tools.bench_throughput",
        description="Time per update of 1F1B-flush and PACI on sleep-costed stages (one "
                    "process per stage, gloo P2P, the real StageExecutor), next to the "
                    "simulator's prediction for the same action lists.")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8], metavar="P")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16], metavar="M",
                        help="micro-batches per update; the accumulation factor a is M")
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="each stage's optimizer step (a realistic one costs about one to "
                             "three forwards: try --step-ms = --forward-ms and 3x that)")
    parser.add_argument("--stage-pace", type=float, nargs=3, default=[1.0, 1.0, 1.0],
                        metavar=("FIRST", "MIDDLE", "LAST"),
                        help="uneven stages: the first, middle and last stages' forward and "
                             "backward times over --forward-ms/--backward-ms")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates W (>= 1)")
    parser.add_argument("--updates", type=int, default=5, help="timed updates K")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of W+K updates per schedule; the median run is reported")
    parser.add_argument("--virtual-chunks", type=int, default=2,
                        help="v of the interleaved 1F1B model")
    parser.add_argument("--tensor-side", type=int, default=64,
                        help="messages are side x side float32 tensors")
    parser.add_argument("--tied", action="store_true",
                        help="tied embeddings: PACI's point-to-point tied-weight messages "
                             "between stage 0 and the last stage (mcore/tied.py); the flush "
                             "baseline all-reduces the tied gradient at every step, as stock")
    parser.add_argument("--tied-side", type=int, default=160,
                        help="with --tied: the tied weight (and its gradient) is a side x side "
                             "float32 tensor (default 160: about 6x an activation message)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="gloo timeout: a hung schedule fails instead of waiting forever")
    parser.add_argument("--trace", metavar="PATH",
                        help="write a Chrome trace of one configuration (and PATH .sim.json)")
    parser.add_argument("--trace-config", type=int, nargs=2, metavar=("P", "M"),
                        help="the configuration to trace (default: the first)")
    parser.add_argument("--quick", action="store_true",
                        help="P=4, M=4, 10/20 ms, W=2, K=4: a smoke run of about 15 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.stages, args.microbatches = [4], [4]
        args.forward_ms, args.backward_ms, args.warmup, args.updates = 10.0, 20.0, 2, 4
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.stages) < 1 or min(args.microbatches) < 1:
        parser.error("--stages and --microbatches take positive integers")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: PACI's first update fills the pipeline")
    if args.updates < 1 or args.repeats < 1:
        parser.error("--updates and --repeats must be >= 1")
    if min(args.forward_ms, args.backward_ms, args.step_ms) < 0:
        parser.error("costs must be >= 0 ms")
    if min(args.stage_pace) <= 0:
        parser.error(f"--stage-pace {args.stage_pace}: each pace must be > 0")
    if args.forward_ms + args.backward_ms <= 0:
        parser.error("--forward-ms + --backward-ms must be > 0")
    if args.tied and args.tied_side < 1:
        parser.error(f"--tied-side {args.tied_side}: must be >= 1")
    if args.trace_config is None:
        args.trace_config = [args.stages[0], args.microbatches[0]]
    if args.trace and (args.trace_config[0] not in args.stages
                       or args.trace_config[1] not in args.microbatches):
        parser.error(f"--trace-config {args.trace_config} is not among the measured "
                     "--stages and --microbatches")


def bench_from_args(args: argparse.Namespace) -> Bench:
    return Bench(args.forward_ms / 1e3, args.backward_ms / 1e3, args.step_ms / 1e3,
                 args.warmup, args.updates, args.tensor_side, args.timeout_s, args.repeats,
                 args.tied_side if args.tied else 0, tuple(args.stage_pace))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    bench = bench_from_args(args)
    rows, trace_runs = [], None
    for P in args.stages:
        measured = measure(P, args.microbatches, bench)
        for M in args.microbatches:
            repeats = {kind: measured[(M, kind)] for kind in KINDS}
            rows.append(summarize(P, M, repeats, bench, args.virtual_chunks))
            if args.trace and [P, M] == args.trace_config:
                trace_runs = (P, M, {k: median_run(repeats[k], bench) for k in KINDS})
    tied = f"tied embeddings ({args.tied_side}x{args.tied_side} float32), " if args.tied else ""
    print(f"{tied}tf={args.forward_ms:g} ms, tb={args.backward_ms:g} ms, step={args.step_ms:g} ms, "
          f"W={bench.warmup} warm-up + K={bench.updates} timed updates per schedule, median "
          f"of {bench.repeats} repeats. "
          f"interleaved (model) = Megatron-Core's interleaved order simulated at these costs, "
          f"v={args.virtual_chunks}, not measured. ideal = M(tf+tb) + step; ideal ratio = "
          "((M+P-1)(tf+tb) + step) / ideal. "
          "sim = same action lists, same costs, zero latency; sim NCCL = under NCCL's batched "
          "p2p pairing (simulate.NcclModel); sim+overheads = with the measured mean message "
          "latency and sleep overshoot added.")
    print(format_table(rows))
    for row in rows:
        print(json.dumps(row))
    if trace_runs:
        paths = write_traces(args.trace, *trace_runs, bench)
        print(f"trace (measured): {paths[0]}\ntrace (simulated): {paths[1]}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
