"""Evaluation under PACI without a drain leaves training unchanged, bit for bit.

The README's claim, through the real entry point (pretrain_gpt_paci.py under torchrun, mock
data, dropout on): a run that evaluates every 2 iterations equals the same run without
evaluation in every training loss (as float hex) and in every stage's final weights (the
SHA-256 per stage in PACI_SUMMARY). Dropout makes the check cover the RNG
stream too: a forward run twice (a drain replays in-flight micro-batches) or a dropout mask
drawn during evaluation would shift every later mask. A run that drains before each evaluation
must differ, which shows the comparison can fail.
"""


import pytest

from launch import train_paci

pytestmark = pytest.mark.dist

# a=2 with 4 micro-batches per iteration: local steps inside each iteration, and stage s keeps
# P-1-s forwards in flight across each evaluation; constant LR so the last steps move weights
FLAGS = ["--pipeline-schedule", "paci", "--untie-embeddings-and-output-weights",
         "--train-iters", "6", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--paci-accumulation-factor", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--lr", "3e-3", "--lr-decay-style", "constant",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-iters", "2",
         "--distributed-timeout-minutes", "2"]
EVAL = ["--eval-interval", "2"]


def _run(P, name, extra, tmp_path):
    run = train_paci(FLAGS + ["--num-layers", str(P)] + extra, tmp_path / f"p{P}_{name}.jsonl",
                     nproc=P, timeout=60 + 40 * P)
    records = run["records"]
    return dict(run, losses=[float(r["lm_loss"]).hex() for r in records if "lm_loss" in r],
                evals=[r["iteration"] for r in records
                       if "validation_loss" in r and not r.get("final")])


VARIANTS = {"plain": [], "eval": EVAL, "drain": EVAL + ["--paci-drain-before-eval"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(P, variant): one launch each, shared by the tests of this module."""
    tmp = tmp_path_factory.mktemp("eval_no_drain")
    done = {}

    def get(P, name):
        if (P, name) not in done:
            done[(P, name)] = _run(P, name, VARIANTS[name], tmp)
        return done[(P, name)]

    return get


# P=4 (slow) adds stages with drift 2..0; P=2 and test_reference's evaluations cover the rest
@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_evaluation_without_drain_leaves_training_unchanged(P, runs):
    plain, evaluated = runs(P, "plain"), runs(P, "eval")
    assert evaluated["evals"] == [2, 4, 6] and plain["evals"] == []
    assert evaluated["out"].count("PACI pipeline not drained") == 3
    assert len(plain["losses"]) == 6
    assert evaluated["losses"] == plain["losses"]  # every training loss, as float hex
    # the metrics file holds the same values the summary carries (nothing rounded on the way)
    assert [x.hex() for x in evaluated["summary"]["losses"]] == evaluated["losses"]
    digests = evaluated["summary"]["weights_sha256"]
    assert len(digests) == P and len(set(digests)) == P  # one digest per stage
    assert digests == plain["summary"]["weights_sha256"]  # every stage's weights, bit for bit
    # stage 0 really kept forwards in flight across each evaluation (and over the whole run)
    assert [row["max"] for row in evaluated["summary"]["drift"]] == \
        [-(-(P - 1 - s) // 2) for s in range(P)]


def test_a_drain_before_evaluation_is_detected(runs):
    """--paci-drain-before-eval drains at each evaluation and replays stage 0's in-flight
    forward with a new dropout mask: the comparison above must see that (else it could not
    fail)."""
    plain, drained = runs(2, "plain"), runs(2, "drain")
    for it in (2, 4, 6):
        assert f"> PACI: drained the pipeline before evaluation at iteration {it} " \
            in drained["out"] and f" validation loss at iteration {it} " in drained["out"]
    assert "not drained" not in drained["out"]
    assert [row["max"] for row in drained["summary"]["drift"]] == [1, 0]
    assert drained["losses"][:2] == plain["losses"][:2]  # identical up to the first drain
    assert drained["losses"][2:] != plain["losses"][2:]
    assert drained["summary"]["weights_sha256"] != plain["summary"]["weights_sha256"]
