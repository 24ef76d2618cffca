"""The README's main job, end to end: pretrain_gpt_paci.py under torchrun, both schedules."""


import pytest

from launch import paci_summary, run_torchrun

pytestmark = pytest.mark.dist

FLAGS = ["--train-iters", "8", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16", "--lr", "3e-3"]
# tied embeddings (Megatron's default), as the README's one-line main job


@pytest.mark.parametrize("schedule,function", [
    ("paci", "PaciRuntime.forward_backward"),
    ("1f1b", "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"),
])
def test_main_job_trains(schedule, function):
    # the README's job as a user runs it: under torchrun, through the interpreter's own exit
    # (the suite's other launches leave through tests/exit_fast.py), so a hang in the
    # product's teardown fails here
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", FLAGS + ["--pipeline-schedule", schedule],
                             nproc=2, timeout=180, agent=True, fast_exit=False)
    assert function in out
    summary = paci_summary(out)
    losses = summary["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert sum(l.startswith(" iteration ") for l in out.splitlines()) == 8
    if schedule == "paci":  # fp32: no main copy to restore a prediction from
        from paci_megatron.features.weight_prediction import DEFAULT_PREDICTION
        assert ("weight prediction (on by default) is off for this run: it needs --bf16 or "
                "--fp16" in out) == DEFAULT_PREDICTION
        assert [row["max"] for row in summary["drift"]] == [1, 0]
        assert [row["steps"] for row in summary["drift"]] == [8, 8]
        # the start-up exchange ran on every communicator, before the stream's first action
        assert [row["startup_exchange"] for row in summary["drift"]] == [
            ["pipeline", "embedding"], ["pipeline", "embedding"]]
    else:
        assert all("startup_exchange" not in row for row in summary.get("drift", []))


CONVERGENCE_FLAGS = ("--paci-weight-prediction", "--paci-lookahead")


def plain_paci_flags():
    """Every convergence flag at its neutral value: the paper's plain PACI."""
    from paci_megatron.config import paci_flags

    flags = []
    for f in paci_flags():
        if f.name in CONVERGENCE_FLAGS:
            flags += ["--no-" + f.name[2:]] if f.negatable else [f.name, str(f.neutral)]
    return flags


def default_is_plain_paci() -> bool:
    from paci_megatron.features.weight_prediction import DEFAULT_PREDICTION

    return not DEFAULT_PREDICTION


def test_the_default_paci_reaches_the_runtime():
    """Whatever the default is (docs/convergence.md, "Which PACI runs by default"): a run with
    the default differs from the same run with every convergence flag at its neutral value
    (the paper's plain PACI) exactly when the default is not plain PACI. bf16, where the
    default can predict."""
    losses = {}
    for name, extra in (("default", []), ("plain", plain_paci_flags())):
        _, out, _ = run_torchrun("pretrain_gpt_paci.py", FLAGS + ["--pipeline-schedule", "paci",
                                                                  "--bf16"] + extra,
                                 nproc=2, timeout=180)
        losses[name] = paci_summary(out)["losses"]
    assert losses["default"][0] == losses["plain"][0]  # no stale micro-batch has stepped yet
    assert (losses["default"] != losses["plain"]) == (not default_is_plain_paci())


def test_interleaved_runs_with_middle_stages():
    """Megatron-Core's interleaved 1F1B at P=4 (v=2): the middle ranks hold no data but still
    hand the schedule one (empty) iterator per model chunk."""
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", [
        "--pipeline-schedule", "interleaved", "--num-layers", "8",
        "--num-layers-per-virtual-pipeline-stage", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "1",
        "--eval-interval", "2", "--eval-iters", "1", "--untie-embeddings-and-output-weights"],
        nproc=4, timeout=180)
    assert "forward_backward_pipelining_with_interleaving" in out
    summary = paci_summary(out)
    assert len(summary["losses"]) == 4 and summary["validation_loss"] is not None
