"""Resharding: a checkpoint written by one parallel layout loads into another P, TP or DP
(Megatron-Core's sharded checkpoints hold every tensor whole, by its global name). A PACI
checkpoint of P=2 is the source; what is claimed is exact on CPU:
- P=2 -> P=4: the next iteration (stock 1F1B on both sides, so the weights do not move within
  it) gives the same loss and the same checkpoint, bit for bit, as the resume in P=2; and
  P=4 -> P=2 keeps every tensor;
- P=2 -> P=1 TP=2 DP=2: loading and saving again keeps every weight and optimizer moment,
  and the next iteration's loss equals the P=2 resume's to float rounding.
Dropout is off (the per-rank RNG states of the old layout are not taken) and so is clipping
(the grad norm sums per-stage squares, in another order for another P)."""

import pytest

from launch import same_tensors, train_paci

pytestmark = pytest.mark.dist

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--vocab-size", "255", "--lr", "3e-3", "--lr-warmup-iters", "2", "--clip-grad", "0",
         "--log-interval", "1", "--distributed-timeout-minutes", "2"]
STOCK = ["--pipeline-schedule", "1f1b"]


def _layout(p, tp=1):
    return ["--pipeline-model-parallel-size", str(p), "--tensor-model-parallel-size", str(tp)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """P=2 under PACI (a=2) of 8 iterations, saved and stopped at iteration 4."""
    root = tmp_path_factory.mktemp("reshard")
    train_paci(FLAGS + _layout(2) + ["--pipeline-schedule", "paci", "--paci-accumulation-factor",
                                     "2", "--train-iters", "8", "--exit-interval", "4",
                                     "--save", str(root / "p2")],
               root / "p2.jsonl", timeout=240)
    return root


def _resume(root, name, layout, nproc, iters):
    """Load the source in ``layout``, train to ``iters`` (none for 4: load, save) and save."""
    stop = (["--train-iters", "8", "--exit-interval", str(iters)] if iters > 4
            else ["--train-iters", "4", "--use-checkpoint-opt_param-scheduler"])
    return train_paci(FLAGS + layout + STOCK + stop + [
        "--load", str(root / "p2"), "--save", str(root / name)],
        root / f"{name}.jsonl", nproc=nproc, timeout=300)


@pytest.fixture(scope="module")
def resumed(source):
    """The source resumed in its own layout for iteration 5."""
    return _resume(source, "p2_again", _layout(2), 2, 5)


def _loss(run, iteration):
    return next(r["lm_loss"] for r in run["records"]
                if r["iteration"] == iteration and "lm_loss" in r)


def test_more_pipeline_stages_continue_bit_for_bit(source, resumed):
    wider = _resume(source, "p4", _layout(4), 4, 5)
    assert "resharding the checkpoint from P=2 TP=1 DP=1 to P=4 TP=1 DP=1" in wider["out"]
    assert "not taken from the checkpoint: the per-rank RNG states of the old layout" \
           in wider["out"]
    assert "resharding" not in resumed["out"]
    assert _loss(wider, 5) == _loss(resumed, 5)
    found = same_tensors(source / "p4" / "iter_0000005", source / "p2_again" / "iter_0000005",
                         "29631")
    assert found["total"] > 40 and found["same"] == found["total"], found
    # and back: the P=4 checkpoint loaded and saved at P=2 keeps every tensor
    back = train_paci(FLAGS + _layout(2) + STOCK + [
        "--train-iters", "5", "--use-checkpoint-opt_param-scheduler", "--load",
        str(source / "p4"), "--save", str(source / "back")], source / "back.jsonl", timeout=240)
    assert "from P=4 TP=1 DP=1 to P=2 TP=1 DP=1" in back["out"]
    found = same_tensors(source / "p4" / "iter_0000005", source / "back" / "iter_0000005",
                         "29634")
    assert found["total"] > 40 and found["same"] == found["total"], found


@pytest.mark.slow  # CI runs it (.ci/slow-tests)
def test_tensor_and_data_parallel_layouts_keep_every_tensor(source, resumed):
    moved = _resume(source, "tp2dp2", _layout(1, tp=2), 4, 4)
    assert "from P=2 TP=1 DP=1 to P=1 TP=2 DP=2" in moved["out"]
    found = same_tensors(source / "p2" / "iter_0000004", source / "tp2dp2" / "iter_0000004",
                         "29632")
    assert found["total"] > 40 and found["same"] == found["total"], found
    # and compute what P=2 computes: TP splits the matmuls and DP the batch, so the sums run
    # in another order
    on = _resume(source, "tp2dp2_on", _layout(1, tp=2), 4, 5)
    assert _loss(on, 5) == pytest.approx(_loss(resumed, 5), rel=1e-5)


@pytest.mark.slow  # CI runs it (.ci/slow-tests)
def test_a_fully_reshardable_distributed_optimizer_checkpoint_moves_to_any_layout(tmp_path):
    """--dist-ckpt-optim-fully-reshardable writes the distributed optimizer's state per
    parameter: PACI at P=2 (untied: the distributed optimizer with tied embeddings needs P=1)
    loads at P=1 TP=2 DP=2 and saves again with every weight, fp32 main copy and moment the
    same. The default format would be refused before any process group (test_restart)."""
    flags = FLAGS + ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
                     "--dist-ckpt-optim-fully-reshardable"]
    train_paci(flags + _layout(2) + ["--pipeline-schedule", "paci", "--train-iters", "8",
                                     "--exit-interval", "4", "--save", str(tmp_path / "p2")],
               tmp_path / "p2.jsonl", timeout=240)
    moved = train_paci(flags + _layout(1, tp=2) + STOCK + [
        "--train-iters", "4", "--use-checkpoint-opt_param-scheduler", "--load",
        str(tmp_path / "p2"), "--save", str(tmp_path / "moved")], tmp_path / "moved.jsonl",
        nproc=4, timeout=300)
    assert "from P=2 TP=1 DP=1 to P=1 TP=2 DP=2" in moved["out"]
    found = same_tensors(tmp_path / "p2" / "iter_0000004", tmp_path / "moved" / "iter_0000004",
                         "29633")
    assert found["total"] > 60 and found["same"] == found["total"], found
