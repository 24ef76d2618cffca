"""The one-GPU harness (tests/one_gpu.py) on CPU: with ONE_GPU_STAGE_CPU=1 it stages CPU
tensors exactly as it stages CUDA ones, so its plumbing is checked here without a GPU. A P=2
run through it (two sync iterations of stock 1F1B, whose grad norm is an all-reduce over both
stages, then PACI) must equal the same run without it bit for bit, and must have sent every
message and collective through host copies."""

import json

import pytest

from launch import paci_summary, parse_results, run_torchrun

pytestmark = pytest.mark.dist

FLAGS = ["pretrain_gpt_paci.py", "--pipeline-schedule", "paci",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--vocab-size", "128", "--train-iters", "4", "--log-interval", "1",
         "--untie-embeddings-and-output-weights",
         "--distributed-backend", "gloo"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    stats = tmp_path_factory.mktemp("stats")
    _, plain, _ = run_torchrun(FLAGS[0], FLAGS[1:], nproc=2, timeout=240)
    _, staged, _ = run_torchrun("tests/one_gpu.py", FLAGS, nproc=2, timeout=240,
                                env={"ONE_GPU_STAGE_CPU": "1", "ONE_GPU_STATS": str(stats)})
    counts = [json.loads((stats / f"rank{r}.json").read_text()) for r in range(2)]
    return paci_summary(plain), paci_summary(staged), counts


def test_staged_run_equals_plain_run_bit_for_bit(runs):
    plain, staged, _ = runs
    assert len(plain["losses"]) == 4
    assert staged["losses"] == plain["losses"]
    assert staged["weights_sha256"] == plain["weights_sha256"]
    assert staged["validation_loss"] == plain["validation_loss"]
    assert [r["steps"] for r in staged["drift"]] == [4, 4]


def test_every_message_and_collective_went_through_host_copies(runs):
    _, _, (first, last) = runs
    # activations go 0 -> 1 and gradients 1 -> 0: each send has its staged receive
    assert first["isend"] == last["irecv"] > 0
    assert last["isend"] == first["irecv"] > 0
    # the sync iterations' grad norm (and the end's gathers) are collectives over both stages
    for counts in (first, last):
        assert counts.get("all_reduce", 0) >= 2, counts


def test_collectives_with_shard_views_and_keyword_p2p():
    """Megatron's reduce-scatter / all-gather pass a shard view of the output as the input;
    Megatron's p2p passes ``tensor=`` by keyword."""
    _, out, _ = run_torchrun("tests/workers/one_gpu_collectives.py", nproc=2, timeout=120)
    by_rank = {r["rank"]: r for r in parse_results(out)}
    base = list(range(8))
    summed = [a + b for a, b in zip(base, [x + 10 for x in base])]
    for rank, r in by_rank.items():
        mine = slice(4 * rank, 4 * rank + 4)
        assert r["grads"][mine] == summed[mine]  # the reduced shard, not the staged input
        assert r["params"] == [1.0] * 4 + [2.0] * 4
        assert r["total"] == 3.0
        assert r["received"] == 100.0 + (1 - rank)
        assert r["counts"] == {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1,
                               "all_reduce": 1, "isend": 1, "irecv": 1}
    assert sorted(by_rank) == [0, 1]
