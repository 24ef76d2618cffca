"""pretrain_gpt_paci.py as a user runs it: real data, evaluation, checkpoints, metrics, errors."""

import os
import shutil
import sys

import pytest

from launch import REPO, checkpoint_of_iteration, launch, read_metrics, run_torchrun
from messages import error_line, error_messages, names_flag

SHAKESPEARE = os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--untie-embeddings-and-output-weights", "--lr", "3e-3", "--lr-warmup-iters", "2",
        "--log-interval", "1", "--distributed-timeout-minutes", "2"]


def _train(flags, nproc=2, timeout=240):
    return run_torchrun("pretrain_gpt_paci.py", TINY + flags, nproc=nproc, timeout=timeout)


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    if not os.path.exists(SHAKESPEARE):
        pytest.skip(f"{SHAKESPEARE} is absent (the shared corpus is not on this machine)")
    out = tmp_path_factory.mktemp("shakespeare")
    proc = launch(
        [sys.executable, "-m", "paci_megatron.tools.preprocess_data", "--input", SHAKESPEARE,
         "--output-prefix", str(out / "shakespeare"), "--tokenizer-model",
         str(out / "spm.model"), "--vocab-size", "512"],
        timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = proc.stdout.strip().splitlines()[-1].split()
    assert "--data-path" in flags and "--tokenizer-model" in flags
    return flags


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_shakespeare_trains_evaluates_and_writesread_metrics(schedule, shakespeare, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _, out, _ = _train(shakespeare + ["--pipeline-schedule", schedule, "--train-iters", "30",
                                      "--eval-interval", "10", "--eval-iters", "2",
                                      "--metrics-file", str(metrics), "--split", "90,10,0",
                                      "--tensorboard-dir", str(tmp_path / "tb")])
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
    records = read_metrics(metrics)
    logged = [r for r in records if "lm_loss" in r]
    assert len(logged) == 30
    for r in logged:
        for key in ("iteration", "consumed_samples", "lm_loss", "lr", "elapsed_ms",
                    "tokens_per_sec", "max_drift"):
            assert key in r, key
        assert len(r["max_drift"]) == 2
    evals = {r["iteration"]: r["validation_loss"] for r in records
             if "validation_loss" in r and not r.get("final")}
    assert sorted(evals) == [10, 20, 30]
    final = records[-1]
    # the run ends on an evaluation (iteration 30): the final record reports it, not a new one
    assert final["final"] is True and final["validation_loss"] == evals[30]
    assert out.count(" validation loss at iteration ") == 3
    assert evals[30] < evals[10], evals
    assert " validation loss at iteration 10 " in out
    if schedule == "paci":
        # per iteration the logging stage knows only its own drift; every stage's at the end
        assert logged[-1]["max_drift"] == [None, 0] and final["max_drift"] == [1, 0]
        assert "PACI pipeline not drained" in out


def _losses(path):
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(path) if "lm_loss" in r}


@pytest.mark.dist
@pytest.mark.parametrize("schedule", [
    # stock 1F1B's own resume is Megatron's; test_switch resumes 1F1B checkpoints by default
    pytest.param("1f1b", marks=pytest.mark.slow), "paci",
    # NAdam's mu_product is not in Megatron's checkpoint: derived again from the step; slow:
    # test_nadam resumes NAdam inside Megatron's distributed optimizer bit for bit
    # (test_inside_megatrons_wrappers_it_is_torchs_nadam_and_resumes_bit_for_bit)
    pytest.param("paci --optimizer nadam --adam-beta1 0.99 --bf16 --use-distributed-optimizer",
                 marks=pytest.mark.slow)])
def test_resume_is_exact(schedule, tmp_path):
    """train 8 saving at 4 (PACI drains there); load that checkpoint, train 5..8: the same
    losses bit for bit. (A run that stops at its save, --exit-interval, and resumes:
    test_switch, test_reshard.)"""
    flags = ["--pipeline-schedule", *schedule.split(), "--hidden-dropout", "0.1"]
    one = tmp_path / "one.jsonl"
    _train(flags + ["--train-iters", "8", "--save", str(tmp_path / "a"), "--save-interval", "4",
                    "--metrics-file", str(one)])
    second = tmp_path / "second.jsonl"
    _, out, _ = _train(flags + ["--train-iters", "8", "--load", checkpoint_of_iteration(
        tmp_path / "a", 4, tmp_path / "b"), "--metrics-file", str(second)])
    assert "loaded checkpoint" in out
    optimizer = "nadam" if "nadam" in schedule else "adam"
    assert out.count(f"> optimizer {optimizer} (") == 1, out[-3000:]
    whole, resumed = _losses(one), _losses(second)
    assert sorted(resumed) == list(range(5, 9))
    assert resumed == {i: whole[i] for i in range(5, 9)}  # bit for bit (JSON floats round-trip)


BAD_INPUT = [
    ("missing_idx", "--data-path"),
    ("truncated_bin", "--data-path"),
    ("no_tokenizer", "--tokenizer-model"),
    ("batch", "--global-batch-size 6 is not divisible"),
    ("schedule", "argument --pipeline-schedule: invalid choice: 'zb'"),
    ("partial_load", "--load"),
    ("corrupt_load", "--load"),
]


def _bad_input(case, tmp_path):
    """The flags (and the files they name) of one bad input."""
    prefix = tmp_path / "data_text_document"
    flags = ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]
    if case in ("missing_idx", "truncated_bin"):
        (tmp_path / "data_text_document.bin").write_bytes(b"\0" * 10)
        if case == "truncated_bin":
            (tmp_path / "data_text_document.idx").write_bytes(b"MMIDIDX\x00\x00garbage")
    elif case == "no_tokenizer":
        for ext in (".bin", ".idx"):
            (tmp_path / f"data_text_document{ext}").write_bytes(b"x")
        flags = ["--data-path", str(prefix), "--tokenizer-model", str(tmp_path / "nope.model")]
    elif case == "batch":
        flags = ["--global-batch-size", "6", "--micro-batch-size", "4"]
    elif case == "schedule":
        flags = ["--pipeline-schedule", "zb"]
    elif case == "partial_load":  # only a save cut short (an empty --load starts afresh)
        (tmp_path / "ckpt" / "iter_0000002.tmp").mkdir(parents=True)
        flags = ["--load", str(tmp_path / "ckpt")]
    elif case == "corrupt_load":
        (tmp_path / "ckpt" / "iter_0000004").mkdir(parents=True)
        (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
        flags = ["--load", str(tmp_path / "ckpt")]
    return TINY + flags + ["--train-iters", "2"]


@pytest.mark.parametrize("case,match", BAD_INPUT)
def test_bad_input_is_found_before_any_process_group(case, match, tmp_path, capsys):
    """What the entry point checks before it starts a process group (the flags, then the
    files: tokenizer, dataset, checkpoint), in this process: the error names the flag."""
    from paci_megatron.arguments import ConfigError, parse_and_validate
    from paci_megatron.training import preflight

    argv = _bad_input(case, tmp_path)
    try:
        args, opts = parse_and_validate(argv, world_size=2)
        with pytest.raises(ConfigError) as found:
            preflight(args, opts)
        message = str(found.value)
    except SystemExit as stop:  # a bad flag: argparse's error, exit status 2
        assert stop.code == 2
        message = error_line(capsys.readouterr().err)
    assert match in message and names_flag(message, match.split()[0]), message


@pytest.mark.dist
@pytest.mark.parametrize("case,match", [c for c in BAD_INPUT if c[0] in ("batch", "corrupt_load")])
def test_bad_input_fails_before_training(case, match, tmp_path):
    """Through the entry point on 2 ranks, a bad flag and a bad file: every rank's error line,
    a non-zero exit, nothing trained (the other inputs: in process, above)."""
    code, out, err = run_torchrun("pretrain_gpt_paci.py", _bad_input(case, tmp_path),
                                  nproc=2, timeout=120, check=False)
    assert code != 0
    messages = error_messages(out + err)  # each rank's "error:" line, not the usage text
    assert messages and all(match in m and names_flag(m, match.split()[0]) for m in messages), \
        out[-2000:] + err[-3000:]
    assert " iteration " not in out  # nothing trained


def test_load_refuses_partial_checkpoint(tmp_path):
    from paci_megatron.mcore.checkpoint import CheckpointError, find_checkpoint

    root = tmp_path / "ckpt"
    (root / "iter_0000002.tmp").mkdir(parents=True)  # killed while saving, never renamed
    with pytest.raises(CheckpointError, match="no complete checkpoint there"):
        find_checkpoint(str(root))
    shutil.rmtree(root)


@pytest.mark.dist
def test_recompute_keeps_dropout_masks_and_runs_under_paci(tmp_path):
    """Full recomputation replays the forward's RNG: with dropout, 1f1b with and without it
    gives the same losses bit for bit; PACI runs with it (its recompute reads current weights)."""
    common = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "3"]
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    runs = {}
    for name, extra in [("plain", []), ("recompute", recompute)]:
        path = tmp_path / f"{name}.jsonl"
        _train(common + extra + ["--pipeline-schedule", "1f1b", "--metrics-file", str(path)])
        runs[name] = _losses(path)
    assert runs["plain"] == runs["recompute"] and len(runs["plain"]) == 3
    path = tmp_path / "paci.jsonl"
    _train(common + recompute + ["--pipeline-schedule", "paci", "--metrics-file", str(path)])
    losses = _losses(path)
    assert len(losses) == 3 and all(0 < v < 10 for v in losses.values())
