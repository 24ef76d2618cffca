"""The start-up exchange: one tiny message over every communicator a PACI stream uses, in one
order every rank follows, so that nothing in the stream meets a first use (``nccl_model``
rule 10); ``run_warmup`` runs it under the model's rules. Pure Python, no torch."""

from __future__ import annotations

from typing import Dict, Hashable, List, Sequence, Set, Tuple

from .nccl_model import NcclModel
from .nccl_world import Comm, CommOp, NcclWorld, PipelineComms, Wait, drive
from .schedule import Action, Op, peer

WARMUP_ORDER = ("data-parallel", "grad-stats", "pipeline", "embedding")


def warmup_programs(num_stages: int, tied: bool, model: NcclModel = NcclModel(),
                    data_parallel: int = 1, grad_stats: int = 1,
                    order: Sequence[str] = WARMUP_ORDER
                    ) -> Dict[Hashable, List[List[CommOp]]]:
    """The start-up exchange that creates and connects every communicator a PACI stream
    uses, before its first action: per rank, a list of steps, each a list of kernels.

    Every rank takes the groups it is in, in one global ``order``: an all-reduce over its
    data-parallel group, one over its stage's grad-stats group (``admission.
    stage_grad_stats_group``), then one batched exchange with both pipeline neighbours, both
    directions (of data and, with ``shapes``, of shapes), then, on stage 0 and the last
    stage, both directions of the tied messages. A group built for a pair (a 2-rank
    communicator) gets its two operations as separate kernels, the lower rank sending first,
    as an unbatched ``isend``/``irecv`` pair that each end waits for in turn. The groups use
    the communicators of rule 9, so under lazy creation each operation must be of the kind
    the run posts (batched on the pipeline group, ``isend``/``irecv`` on the embedding
    group). Ranks are stages, or ``(stage, data-parallel, grad-stats)`` on a larger grid.
    """
    P, D, G = num_stages, data_parallel, grad_stats
    grid = [(s, d, g) for s in range(P) for d in range(D) for g in range(G)]

    def rank(s, d, g):
        return s if D == G == 1 else (s, d, g)

    everyone = frozenset(rank(*c) for c in grid)
    pipelines = {(d, g): PipelineComms(P, model, rank=lambda s, d=d, g=g: rank(s, d, g),
                                suffix="" if D == G == 1 else f" d{d} g{g}", world=everyone)
                 for d in range(D) for g in range(G)}
    collective = {  # a stage's group over data parallelism, over its grad-stats ranks
        "data-parallel": lambda s, d, g: (f"s{s} g{g}", [rank(s, x, g) for x in range(D)]),
        "grad-stats": lambda s, d, g: (f"s{s} d{d}", [rank(s, d, x) for x in range(G)])}
    programs: Dict[Hashable, List[List[CommOp]]] = {}
    for s, d, g in grid:
        steps = []
        for group in order:
            if group in collective:
                where, members = collective[group](s, d, g)
                if len(members) > 1:
                    comm = Comm(f"{group} {where}", frozenset(members))
                    steps.append([[CommOp(rank(s, d, g), f"{group} all-reduce", comm, None)]])
            else:
                steps.append(_p2p_warmup(pipelines[(d, g)], s, group, tied))
        programs[rank(s, d, g)] = [step for step in steps if step]
    return programs


def _p2p_warmup(comms: PipelineComms, s: int, group: str, tied: bool) -> List[List[CommOp]]:
    """Stage ``s``'s kernels that connect both directions of every pair it talks to over
    ``group`` ("pipeline" or "embedding")."""
    P, model = comms.num_stages, comms.model
    if group == "pipeline":
        acts = ([Action(Op.RECV_F, -1), Action(Op.SEND_B, -1)] if s > 0 else []) + \
               ([Action(Op.SEND_F, -1), Action(Op.RECV_B, -1)] if s < P - 1 else [])
        layers = ("data", "shape") if model.shapes else ("data",)
        ops = [comms.op(s, act, layer, f"warm-up {act.op.value}{'(shape)' * (layer == 'shape')}")
               for layer in layers for act in acts]
        once = {(op.comm, op.peer, op.is_send): op for op in reversed(ops)}  # data's first
        ops = [op for op in ops if once[(op.comm, op.peer, op.is_send)] is op]
    elif tied and P > 1 and s in (0, P - 1):
        acts = [Action(Op.RECV_TIED_GRAD, -1), Action(Op.SEND_TIED_WEIGHT, -1)] if s == 0 else \
            [Action(Op.SEND_TIED_GRAD, -1), Action(Op.RECV_TIED_WEIGHT, -1)]
        ops = [comms.op(s, act, label=f"warm-up {act.op.value}") for act in acts]
    else:
        return []
    kernels: List[List[CommOp]] = []
    for comm in sorted({op.comm for op in ops}, key=lambda c: c.name):
        mine = [op for op in ops if op.comm is comm]
        if not comm.single:
            kernels.append(mine)
        else:  # a pair's communicator: the lower rank sends first, the other receives first
            low = s < peer(s, mine[0].action.op, P)
            for first_send in (low, not low):
                kernels += [[op] for op in mine if op.is_send == first_send]
    return kernels


def run_warmup(programs: Dict[Hashable, List[List[CommOp]]], model: NcclModel = NcclModel()
               ) -> Set[Tuple[str, Hashable, Hashable]]:
    """Run the start-up exchange under ``model``'s first-use rules (rule 10, as if nothing
    were connected yet), each kernel waited for before the next; raises DeadlockError if it
    cannot complete. Returns the (communicator, sender, receiver) pairs it connected."""
    cold = NcclModel(model.batched, model.shapes, eager=model.eager, warmed=False,
                     tied_groups=model.tied_groups)
    world = NcclWorld(cold, 0.0)
    host = {rank: 0.0 for rank in programs}
    labels: Dict[Hashable, str] = {}

    def program(rank, steps):
        for step in steps:
            for kernel in step:
                labels[rank] = str(kernel[-1])
                meetings = world.first_uses(rank, kernel, host[rank])
                if meetings:
                    yield meetings
                world.queue(rank, Wait(world.post(rank, kernel, host[rank])), host[rank])
                yield [world.idle(rank, False, host[rank])]

    drive(world, {rank: program(rank, steps) for rank, steps in programs.items()},
           "warm-up", host, labels)
    return {(comm.name, a, b) for comm, a, b in world.p2p}
