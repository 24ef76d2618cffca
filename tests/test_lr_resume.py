"""--load with other schedule flags (Megatron-LM's semantics): a longer --train-iters without
--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler is refused before any
process group starts; with the override the new schedule applies from the checkpoint's
position (LR > 0 after the old end); with use-checkpoint the old one does, and the log says so."""

import math

import pytest

from launch import read_metrics, run_torchrun
from messages import error_messages, names_flag

LR, WARMUP, GBS = 3e-3, 2, 8
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", str(GBS),
        "--untie-embeddings-and-output-weights", "--lr", str(LR), "--lr-warmup-iters",
        str(WARMUP), "--log-interval", "1", "--distributed-timeout-minutes", "2",
        "--pipeline-schedule", "paci"]


def _lrs(path):
    return {r["iteration"]: r["lr"] for r in read_metrics(path) if "lm_loss" in r}


def _cosine_lr(iteration, train_iters):
    """Megatron's OptimizerParamScheduler after ``iteration`` iterations (one step of every
    stage per iteration), computed the way it computes it."""
    steps, warmup, decay = iteration * GBS, WARMUP * GBS, train_iters * GBS
    if steps <= warmup:
        return LR * float(steps) / float(warmup)
    if steps > decay:
        return 0.0
    ratio = float(steps - warmup) / float(decay - warmup)
    return 0.0 + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (LR - 0.0)


@pytest.fixture(scope="module")
def six_iterations(tmp_path_factory):
    """A checkpoint at the end of a 6-iteration schedule (its LR has decayed to 0)."""
    root = tmp_path_factory.mktemp("lr_resume")
    metrics = root / "first.jsonl"
    _, out, err = run_torchrun(
        "pretrain_gpt_paci.py", TINY + ["--train-iters", "6", "--save", str(root / "ckpt"),
                                        "--metrics-file", str(metrics)], nproc=2, timeout=300)
    lrs = _lrs(metrics)
    assert lrs == {i: _cosine_lr(i, 6) for i in range(1, 7)} and lrs[6] == 0.0
    (root / "stdout.txt").write_text(out)
    (root / "stderr.txt").write_text(err)
    return root


def _resume(root, flags, metrics=None, check=True):
    extra = ["--metrics-file", str(metrics)] if metrics else []
    return run_torchrun("pretrain_gpt_paci.py", TINY + ["--train-iters", "12", "--load",
                                                        str(root / "ckpt"), *flags, *extra],
                        nproc=2, timeout=300, check=check)


@pytest.mark.dist
def test_longer_train_iters_without_a_scheduler_flag_is_refused(six_iterations):
    code, out, err = _resume(six_iterations, [], check=False)
    assert code != 0
    messages = error_messages(out + err)
    assert len(messages) == 1, out[-2000:] + err[-3000:]  # once, not once per rank
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
                 "--train-iters", "--load"):
        assert names_flag(messages[0], flag), messages[0]
    assert "12 iterations (96 samples) here, 6 iterations (48 samples) in the checkpoint" \
        in messages[0]
    assert "[paci] rank" not in out and " iteration " not in out  # refused before training


@pytest.mark.dist
def test_override_trains_with_the_new_schedule(six_iterations, tmp_path):
    metrics = tmp_path / "resumed.jsonl"
    _, out, _ = _resume(six_iterations, ["--override-opt_param-scheduler"], metrics)
    assert "> --override-opt_param-scheduler: training on with the flags' LR schedule" in out
    lrs = _lrs(metrics)
    assert sorted(lrs) == list(range(7, 13))
    assert lrs == {i: _cosine_lr(i, 12) for i in range(7, 13)}  # bit for bit
    assert all(lrs[i] > 0 for i in range(7, 12))


@pytest.mark.dist
@pytest.mark.slow  # one more resumed run (~40 s on 2 loaded cores)
def test_use_checkpoint_keeps_the_finished_schedule_and_says_so(six_iterations, tmp_path):
    metrics = tmp_path / "resumed.jsonl"
    _, out, _ = _resume(six_iterations, ["--use-checkpoint-opt_param-scheduler"], metrics)
    assert ("it ends at iteration 6, so iterations 7-12 run at its minimum LR 0" in out), \
        out[-3000:]
    assert out.count("--use-checkpoint-opt_param-scheduler: training with") == 1  # rank 0
    assert _lrs(metrics) == {i: 0.0 for i in range(7, 13)}


def test_both_scheduler_flags_are_exclusive(capsys):
    from paci_megatron.arguments import parse_and_validate

    with pytest.raises(SystemExit) as exc:
        parse_and_validate(["--untie-embeddings-and-output-weights",
                            "--override-opt_param-scheduler",
                            "--use-checkpoint-opt_param-scheduler"], world_size=2)
    assert exc.value.code == 2
    assert "are exclusive" in capsys.readouterr().err


def test_mismatches_name_each_flag_once():
    from paci_megatron.mcore.lr_resume import schedule_mismatches

    saved = {"max_lr": 3e-3, "min_lr": 0.0, "lr_warmup_steps": 16, "lr_decay_steps": 48,
             "lr_decay_style": "cosine", "start_wd": 0.01, "end_wd": 0.01, "wd_incr_steps": 48}
    assert schedule_mismatches(dict(saved), saved, 8) == []
    flags = dict(saved, max_lr=1e-3, lr_decay_steps=96, wd_incr_steps=96, lr_decay_style="linear")
    assert schedule_mismatches(flags, saved, 8) == [
        "--lr: 0.001 here, 0.003 in the checkpoint",
        "--train-iters: 12 iterations (96 samples) here, 6 iterations (48 samples) in the "
        "checkpoint",
        "--lr-decay-style: linear here, cosine in the checkpoint"]


@pytest.mark.dist
def test_fallback_warnings_once_per_job(six_iterations):
    """(Shares the launch above.) Megatron-Core's per-module "Transformer Engine and Apex are
    not installed" warnings (about 6 per rank, from training and the checkpoint writer) are
    replaced by one line from rank 0."""
    out = (six_iterations / "stdout.txt").read_text()
    err = (six_iterations / "stderr.txt").read_text()
    assert "not installed. Falling back to" not in out + err, err[-3000:]
    notice = [line for line in (out + err).splitlines() if "are not installed: Megatron-Core "
              "uses its local torch fallbacks" in line]
    assert notice == ["> Transformer Engine and Apex are not installed: Megatron-Core uses its "
                      "local torch fallbacks (optimizers, norms, multi-tensor kernels); its "
                      "per-module warnings about it are silenced"]
