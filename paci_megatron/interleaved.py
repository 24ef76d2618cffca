"""Megatron-Core's interleaved 1F1B as per-rank orders, timed by their dependencies.

Pure Python, no torch. PACI's runtime never runs this schedule (``--pipeline-schedule
interleaved`` is stock Megatron-Core's); it is here so projections time it the way the
simulator times the schedules PACI runs, from the order each rank really follows, instead of
from a formula. ``rank_order`` rebuilds Megatron-Core's order (its schedule table of
(micro-batch, chunk), and its warm-up count per rank; a test checks both against the installed
Megatron-Core). ``makespan`` times all ranks in lockstep: an action starts when its rank is
free and what it needs is done (sends never block, as ``lockstep.py`` assumes), which is how
the order's wrap-around from the last rank back to the first, chunk after chunk, comes in.

    python -m paci_megatron.interleaved -P 4 -M 8 -v 2      # print each rank's order
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .lockstep import Costs


class ChunkAction(NamedTuple):
    """A forward ("F") or backward ("B") of micro-batch ``mb`` through model chunk ``chunk``
    of a rank; printed like ``F3.1``."""

    op: str
    mb: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.op}{self.mb}.{self.chunk}"


def schedule_table(microbatches: int, chunks: int, group: int) -> List[Tuple[int, int]]:
    """(micro-batch, chunk) of each forward, in order: groups of ``group`` micro-batches go
    through chunk 0, then chunk 1, ...; the last group takes what is left."""
    table = []
    for first in range(0, microbatches, group):
        last = microbatches if first + group >= microbatches else first + group
        table += [(mb, c) for c in range(chunks) for mb in range(first, last)]
    return table


def warmup_forwards(stages: int, rank: int, microbatches: int, chunks: int, group: int) -> int:
    """Forwards a rank runs before its first backward."""
    return min(microbatches * chunks, (stages - rank - 1) * 2 + (chunks - 1) * group)


def rank_order(stages: int, rank: int, microbatches: int, chunks: int,
               group: Optional[int] = None) -> List[ChunkAction]:
    """The rank's forwards and backwards in the order Megatron-Core runs them (``group``:
    ``microbatch_group_size_per_vp_stage``, P by default); backwards take the chunks in
    reverse, each chunk's micro-batches in forward order."""
    group = group or stages
    table = schedule_table(microbatches, chunks, group)
    warm = warmup_forwards(stages, rank, microbatches, chunks, group)

    def forward(k: int) -> ChunkAction:
        return ChunkAction("F", *table[k])

    def backward(k: int) -> ChunkAction:
        mb, chunk = table[k]
        return ChunkAction("B", mb, chunks - 1 - chunk)

    order = [forward(k) for k in range(warm)]
    for k in range(len(table) - warm):  # steady state: one forward, then one backward
        order += [forward(warm + k), backward(k)]
    return order + [backward(k) for k in range(len(table) - warm, len(table))]


def _needs(action: ChunkAction, rank: int, stages: int, chunks: int) -> List[Tuple]:
    """What must be done before ``action``: keyed (op, mb, virtual stage), where virtual
    stage chunk * P + rank is the model's order of layers."""
    virtual = action.chunk * stages + rank
    if action.op == "F":
        return [("F", action.mb, virtual - 1)] if virtual else []
    later = [("B", action.mb, virtual + 1)] if virtual < chunks * stages - 1 else []
    return [("F", action.mb, virtual)] + later


def _latency(need: Tuple, rank: int, stages: int, costs: Costs) -> float:
    """A message's latency when what is needed ran on another rank."""
    return 0.0 if need[2] % stages == rank else costs.comm


def makespan(stages: int, microbatches: int, chunks: int, costs: Costs,
             group: Optional[int] = None) -> float:
    """Time from the first forward to the last backward of one iteration; a chunk's forward
    and backward cost 1/chunks of the stage's (``costs`` are per stage). Raises ValueError
    on an order that cannot finish."""
    orders = [rank_order(stages, r, microbatches, chunks, group) for r in range(stages)]
    done: Dict[Tuple, float] = {}
    clock, position = [0.0] * stages, [0] * stages
    cost = {"F": costs.forward / chunks, "B": costs.backward / chunks}
    while any(p < len(o) for p, o in zip(position, orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = order[position[rank]]
                needs = _needs(action, rank, stages, chunks)
                if any(n not in done for n in needs):
                    break
                start = max([clock[rank]] + [done[n] + _latency(n, rank, stages, costs)
                                             for n in needs])
                clock[rank] = start + cost[action.op]
                done[(action.op, action.mb, action.chunk * stages + rank)] = clock[rank]
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"interleaved P={stages} M={microbatches} v={chunks}: the orders "
                             f"deadlock at {[o[p] for p, o in zip(position, orders) if p < len(o)]}")
    return max(clock)


def seconds_per_iteration(stages: int, microbatches: int, chunks: int, costs: Costs) -> float:
    """One iteration: the forwards and backwards, then the step (every rank steps at once)."""
    return makespan(stages, microbatches, chunks, costs) + costs.step


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Print Megatron-Core's interleaved 1F1B order "
                                                 "per rank and its simulated time.")
    parser.add_argument("-P", "--stages", type=int, default=4)
    parser.add_argument("-M", "--microbatches", type=int, default=8)
    parser.add_argument("-v", "--chunks", type=int, default=2)
    parser.add_argument("--forward", type=float, default=1.0, help="forward cost per stage")
    parser.add_argument("--backward", type=float, default=2.0, help="backward cost per stage")
    args = parser.parse_args(argv)
    for rank in range(args.stages):
        order = rank_order(args.stages, rank, args.microbatches, args.chunks)
        print(f"rank {rank}: " + " ".join(map(str, order)))
    costs = Costs(args.forward, args.backward)
    print(f"makespan {makespan(args.stages, args.microbatches, args.chunks, costs):g} "
          f"(M(tf+tb) = {args.microbatches * (args.forward + args.backward):g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
