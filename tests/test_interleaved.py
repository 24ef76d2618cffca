"""Megatron-Core's interleaved 1F1B as the projections time it (``interleaved.py``): the order
is Megatron-Core's own, every action runs once and after what it needs, and the simulated
time equals the schedule's known bubble, (M + (P-1)/v)(tf+tb), wherever M is a multiple of P."""

import pytest

from paci_megatron import interleaved
from paci_megatron.interleaved import ChunkAction, rank_order
from paci_megatron.simulate import Costs
from paci_megatron.tools import tta

GRID = [(P, M, v) for P in (2, 3, 4, 8) for M in (P, 2 * P, 3 * P) for v in (2, 3, 4)]


@pytest.mark.parametrize("P,M,v", GRID)
def test_every_forward_and_backward_runs_once_and_backwards_follow_forwards(P, M, v):
    for rank in range(P):
        order = rank_order(P, rank, M, v)
        pairs = {(mb, c) for mb in range(M) for c in range(v)}
        assert sorted((a.mb, a.chunk) for a in order if a.op == "F") == sorted(pairs)
        assert sorted((a.mb, a.chunk) for a in order if a.op == "B") == sorted(pairs)
        seen = set()
        for a in order:
            if a.op == "F":
                seen.add((a.mb, a.chunk))
            else:
                assert (a.mb, a.chunk) in seen, (rank, a)


@pytest.mark.parametrize("P,M,v", GRID)
@pytest.mark.parametrize("tf,tb", [(1.0, 1.0), (1.0, 2.0), (2.0, 3.0)])
def test_simulated_time_is_the_interleaved_bubble(P, M, v, tf, tb):
    assert interleaved.makespan(P, M, v, Costs(tf, tb)) == pytest.approx(
        (M + (P - 1) / v) * (tf + tb), abs=1e-9)


def test_the_last_rank_runs_one_forward_then_one_backward_of_the_last_chunk():
    # P=4, M=8, v=2: no warm-up beyond one group of chunk 0 on the last rank
    order = rank_order(4, 3, 8, 2)
    assert [str(a) for a in order[:8]] == ["F0.0", "F1.0", "F2.0", "F3.0", "F0.1", "B0.1",
                                           "F1.1", "B1.1"]
    assert order[-4:] == [ChunkAction("B", mb, 0) for mb in (4, 5, 6, 7)]


def test_message_latency_lengthens_the_iteration():
    quick = interleaved.makespan(4, 8, 2, Costs(1.0, 2.0))
    assert interleaved.makespan(4, 8, 2, Costs(1.0, 2.0, comm=0.1)) > quick


def test_the_projection_times_interleaved_with_its_simulated_order():
    costs = Costs(1.0, 2.0, 0.5)
    shape = tta.RunShape("interleaved", 4, 8, 8, virtual_chunks=2)
    assert tta.seconds_per_iteration(shape, costs) == (33.5, 28.5 + 0.5)
    assert tta.interleaved_seconds_per_iteration(8, 8, costs) == 34.5 + 0.5
    assert tta.interleaved_seconds_per_iteration(4, 6, costs) is None  # M not a multiple of P


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _Communicator:
    def __init__(self, stages, rank, chunks):
        self.pp_group = _Group(stages, rank)
        self.virtual_pipeline_model_parallel_size = chunks


@pytest.mark.parametrize("P,M,v", [(2, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2), (4, 4, 4)])
def test_the_order_is_megatron_cores(P, M, v):
    """The schedule table and each rank's warm-up count, from the installed Megatron-Core."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    assert interleaved.schedule_table(M, v, P) == schedules.get_schedule_table(M, v, P)
    for rank in range(P):
        _, _, warm, _ = schedules.get_pp_rank_microbatches(
            M, v, P, p2p_communicator=_Communicator(P, rank, v))
        assert interleaved.warmup_forwards(P, rank, M, v, P) == warm
        order = rank_order(P, rank, M, v)
        assert all(a.op == "F" for a in order[:warm]) and order[warm + 1].op == "B"


def test_the_throughput_benchmark_reports_the_projections_interleaved_time():
    from paci_megatron.tools.bench_throughput import interleaved_model
    from paci_megatron.tools.sleep_stages import Bench

    bench = Bench(0.001, 0.002, 0.0005, warmup=1, updates=1, tensor_side=1, timeout_s=1.0)
    assert interleaved_model(4, 8, 2, bench) == pytest.approx(28.5e-3 + 0.5e-3, abs=1e-12)
    assert interleaved_model(4, 8, 1, bench) is None  # no virtual chunks
    assert interleaved_model(4, 6, 2, bench) is None  # M not a multiple of P
