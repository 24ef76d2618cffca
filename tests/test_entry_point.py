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
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", FLAGS + ["--pipeline-schedule", schedule],
                             nproc=2, timeout=180)
    assert function in out
    summary = paci_summary(out)
    losses = summary["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert sum(l.startswith(" iteration ") for l in out.splitlines()) == 8
    if schedule == "paci":
        assert [row["max"] for row in summary["drift"]] == [1, 0]
        assert [row["steps"] for row in summary["drift"]] == [8, 8]


def test_the_default_paci_reaches_the_runtime():
    """Whatever the default is (docs/convergence.md, "Which PACI runs by default"): a run with
    the default differs from the same run with every convergence flag at its neutral value
    (the paper's plain PACI) exactly when the default is not plain PACI."""
    from paci_megatron.config import paci_flags
    from paci_megatron.features.stale_weights import DEFAULT_WEIGHT

    neutral = [f for f in paci_flags() if f.name in ("--paci-stale-grad-weight",
                                                     "--paci-stale-grad-correction")]
    plain_flags = [x for f in neutral for x in (f.name, str(f.neutral))]
    losses = {}
    for name, extra in (("default", []), ("plain", plain_flags)):
        _, out, _ = run_torchrun("pretrain_gpt_paci.py", FLAGS + ["--pipeline-schedule", "paci"]
                                 + extra, nproc=2, timeout=180)
        losses[name] = paci_summary(out)["losses"]
    assert losses["default"][0] == losses["plain"][0]  # no stale micro-batch has stepped yet
    assert (losses["default"] != losses["plain"]) == (DEFAULT_WEIGHT != 1.0)
