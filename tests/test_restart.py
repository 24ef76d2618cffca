"""Surviving a lost rank: ``torchrun --max-restarts N ... --save DIR --load DIR``.

A restarted job resumes from the newest complete checkpoint and ends exactly where an
uninterrupted run ends (weights per stage and every iteration's loss, bit for bit on CPU); the
metrics file records each iteration once; a checkpoint of another layout is refused by name;
time-based saves happen at an iteration every stage agrees on."""

import json
import os
import re

import pytest

from launch import paci_summary, read_metrics, run_torchrun

from paci_megatron.restart import (SaveClock, describe_mismatch, describe_reshard,
                                   describe_switch, padded_vocab_size,
                                   run_fingerprint, trim_metrics)

# P=4 under PACI, a=2 (two local steps per stage and iteration), dropout on: RNG state matters
P4 = ["--pipeline-model-parallel-size", "4", "--num-layers", "4", "--hidden-size", "32",
      "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
      "--global-batch-size", "8", "--paci-accumulation-factor", "2",
      "--untie-embeddings-and-output-weights", "--hidden-dropout", "0.1", "--lr", "3e-3",
      "--train-iters", "8", "--distributed-timeout-minutes", "1"]
# timing, and max_drift: the largest drift each stage saw since its process started (after a
# restart it counts again from the resume, where the pipeline refills after the drain)
NOT_REPLAYED = {"wall_s", "elapsed_ms", "tokens_per_sec", "peak_rss_mb", "peak_activation_mb",
                "max_drift", "stage_forward_ms"}



def _fingerprint(argv, world_size):
    from paci_megatron.arguments import parse_and_validate

    args, cfg = parse_and_validate(argv, world_size=world_size)
    return run_fingerprint(vars(args), cfg)

def _stamp(stdout, name):
    """The times a worker printed after ``name``; anywhere in a line, since the ranks share the
    pipe and a killed rank's line can land inside another rank's."""
    return [float(t) for t in re.findall(rf"{name} (\d+\.\d+)", stdout)]


def _replayable(records):
    return [{k: v for k, v in r.items() if k not in NOT_REPLAYED} for r in records]


def _job(tmp_path, name, script="pretrain_gpt_paci.py", fault=None, timeout=400):
    """One launch with --save DIR --load DIR (DIR missing at first); with ``fault`` under
    torchrun --max-restarts 2 and tests/workers/restart_job.py injecting it."""
    ckpt, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
    env = {"PACI_TEST_FAULT": fault} if fault else None
    _, out, err = run_torchrun(
        script, P4 + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3",
                      "--metrics-file", str(metrics)],
        nproc=4, timeout=timeout, env=env, agent=True,  # torchrun's agent store, as restarts
        launcher_args=["--max-restarts", "2"] if fault else ())
    return out, err, read_metrics(metrics), ckpt


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _job(tmp_path_factory.mktemp("uninterrupted"), "run")


def _assert_same_run(restarted, uninterrupted):
    out, _, records, _ = restarted
    base_out, _, base_records, _ = uninterrupted
    assert paci_summary(out)["weights_sha256"] == paci_summary(base_out)["weights_sha256"]
    assert len(paci_summary(out)["weights_sha256"]) == 4  # one digest per stage
    iterations = [r["iteration"] for r in records if "lm_loss" in r]
    assert iterations == list(range(1, 9)), iterations  # each iteration once, in order
    # every record equal (losses, learning rate, grad norm, data position of every iteration;
    # validation and final records), timing and max_drift aside
    assert _replayable(records) == _replayable(base_records)
    assert len(records) == len(base_records) == 9  # 8 iterations and the final record


@pytest.mark.dist
def test_first_launch_with_load_of_a_missing_dir_starts_from_scratch(uninterrupted):
    out, _, records, ckpt = uninterrupted
    assert f"> --load {ckpt}: no checkpoint there yet; starting from scratch" in out
    assert " iteration        1/       8" in out
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006", "iter_0000008",
                                       "latest_checkpointed_iteration.txt"]


@pytest.mark.dist
@pytest.mark.slow  # CI runs it (.ci/slow-tests)
def test_killed_rank_restarts_and_ends_like_an_uninterrupted_run(uninterrupted, tmp_path):
    """Rank 2 (stage 2) is SIGKILLed as iteration 5 starts (after the save at 3; the last
    stage has logged iteration 4 by then): torchrun restarts all 4 workers, they resume from
    iteration 3 and finish with exit 0."""
    run = _job(tmp_path, "run", script="tests/workers/restart_job.py",
               fault="before_iteration:2:5")
    out, err, _, ckpt = run
    assert len(_stamp(out, "PACI_TEST_KILLED")) == 1
    assert "(exitcode: -9) local_rank: 2" in out + err  # torchrun saw the SIGKILL
    assert "> restart 1 of this job (torchrun TORCHELASTIC_RESTART_COUNT=1, --max-restarts 2):" \
           " resumed from iteration 3" in out
    assert f"> loaded checkpoint from {ckpt} at iteration 3 " in out
    assert "dropped 1 records after iteration 3" in out  # iteration 4, logged before the kill
    killed, = _stamp(out, "PACI_TEST_KILLED")
    first, = _stamp(out, "PACI_TEST_FIRST_ITERATION")
    print(f"restart time (SIGKILL to the first iteration after the resume): {first - killed:.1f}s")
    _assert_same_run(run, uninterrupted)


@pytest.mark.dist
@pytest.mark.slow
def test_kill_during_a_save_resumes_from_the_previous_checkpoint(uninterrupted, tmp_path):
    """Rank 1 dies inside the save of iteration 6 (iter_0000006.tmp exists, incomplete): the
    restart takes the complete checkpoint of iteration 3, never the .tmp."""
    run = _job(tmp_path, "run", script="tests/workers/restart_job.py",
               fault="during_save:1:6")
    out, _, _, ckpt = run
    assert len(_stamp(out, "PACI_TEST_KILLED")) == 1
    assert "> saved checkpoint at iteration 6" in out  # by the restarted job, once
    assert out.count("> saved checkpoint at iteration 6") == 1
    assert "resumed from iteration 3" in out
    assert f"> loaded checkpoint from {ckpt} at iteration 3 " in out
    _assert_same_run(run, uninterrupted)


def _args(flags, world_size):
    """Parsed and resolved flags: (args, PACI configuration)."""
    from paci_megatron.arguments import parse_and_validate

    return parse_and_validate(flags, world_size=world_size)


@pytest.mark.dist
@pytest.mark.parametrize("change,world,message", [
    (["--pipeline-model-parallel-size", "2", "--num-layers", "8"], 2,
     "--num-layers: checkpoint 4, this run 8"),
    (["--hidden-size", "64"], 4, "--hidden-size: checkpoint 32, this run 64"),
])
def test_checkpoint_of_another_run_is_refused_naming_what_differs(uninterrupted, change, world,
                                                                  message):
    """The check the entry point runs before any process group (training.preflight)."""
    from paci_megatron.arguments import ConfigError
    from paci_megatron.training import preflight

    ckpt = uninterrupted[3]
    preflight(*_args(P4 + ["--load", str(ckpt)], 4))  # the same run: accepted
    with pytest.raises(ConfigError, match="was written by a different run") as error:
        preflight(*_args(P4 + ["--load", str(ckpt)] + change, world))
    assert message in str(error.value)


@pytest.mark.dist
def test_a_checkpoint_may_switch_the_schedule_a_or_layout_with_one_line(uninterrupted, capsys):
    from paci_megatron.training import preflight

    ckpt = uninterrupted[3]
    at = P4.index("--paci-accumulation-factor")
    preflight(*_args(P4[:at] + P4[at + 2:] + ["--pipeline-schedule", "1f1b", "--load",
                                              str(ckpt)], 4))
    preflight(*_args(P4 + ["--paci-accumulation-factor", "4", "--load", str(ckpt)], 4))
    preflight(*_args(P4 + ["--pipeline-model-parallel-size", "2", "--load", str(ckpt)], 2))
    out = capsys.readouterr().out
    assert "resharding the checkpoint from P=4 TP=1 DP=1 to P=2 TP=1 DP=1" in out
    assert "written with --pipeline-schedule paci (a=2), this run continues with " \
           "--pipeline-schedule 1f1b" in out
    assert "this run continues with --pipeline-schedule paci (a=4)" in out


@pytest.mark.dist
@pytest.mark.slow  # the check itself is tested above, in process
def test_checkpoint_of_another_model_stops_the_entry_point(uninterrupted):
    code, out, err = run_torchrun(
        "pretrain_gpt_paci.py", P4 + ["--pipeline-model-parallel-size", "2", "--num-layers", "8",
                                      "--load", str(uninterrupted[3])],
        nproc=2, timeout=180, check=False)
    assert code != 0
    assert "--num-layers: checkpoint 4, this run 8" in err
    assert " iteration " not in out and "[paci] rank" not in out  # stopped before training


@pytest.mark.dist
def test_time_based_saves_happen_where_every_stage_agrees(tmp_path):
    """--save-interval-minutes 0.002 (0.12 s) with rank 1's clock running 5 times too fast:
    rank 0 decides at check points every rank knows in advance, so both save at the same
    iterations; a save the stages did not agree on would deadlock (and time out)."""
    ckpt = tmp_path / "ckpt"
    _, out, _ = run_torchrun("tests/workers/restart_job.py", [
        "--untie-embeddings-and-output-weights", "--num-layers", "2", "--hidden-size", "32",
        "--seq-length", "16", "--train-iters", "16", "--save", str(ckpt),
        "--save-interval-minutes", "0.002", "--distributed-timeout-minutes", "0.5"],
        nproc=2, timeout=150, env={"PACI_TEST_FAULT": "fast_clock:1:5"})
    timed = [l for l in out.splitlines() if "--save-interval-minutes 0.002 passed" in l]
    saved = [l for l in out.splitlines() if l.startswith("> saved checkpoint at iteration")]
    assert timed and len(saved) == len(timed) + 1  # + the final save at 16
    saved_dirs = sorted(p for p in os.listdir(ckpt) if p.startswith("iter_"))
    assert len(saved_dirs) == len(saved) and not any(p.endswith(".tmp") for p in saved_dirs)


# --- pure pieces --------------------------------------------------------------------------

def test_load_of_a_missing_or_empty_dir_finds_nothing_but_partial_ones_are_refused(tmp_path):
    from paci_megatron.mcore.checkpoint import CheckpointError, find_checkpoint

    assert find_checkpoint(str(tmp_path / "missing")) is None
    (tmp_path / "empty").mkdir()
    assert find_checkpoint(str(tmp_path / "empty")) is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    assert find_checkpoint(str(tmp_path / "other")) is None
    (tmp_path / "partial" / "iter_0000002.tmp").mkdir(parents=True)  # a first save cut short
    with pytest.raises(CheckpointError, match="no complete checkpoint there .*iter_0000002.tmp"):
        find_checkpoint(str(tmp_path / "partial"))


def test_describe_mismatch_names_each_flag():
    saved = _fingerprint(P4, 4)
    same = dict(saved)
    assert describe_mismatch(saved, same) == []
    assert describe_mismatch(None, same) == []  # a checkpoint from before fingerprints
    other = dict(saved, pipeline_model_parallel_size=2, num_layers=8)
    assert describe_mismatch(saved, other) == ["--num-layers: checkpoint 4, this run 8"]
    # the schedule may switch between paci and 1f1b, and a may change: one line says so
    stock = dict(saved, pipeline_schedule="1f1b", paci_accumulation_factor=4)
    assert describe_mismatch(saved, stock) == []
    assert describe_switch(saved, stock) == (
        "the checkpoint was written with --pipeline-schedule paci (a=2), this run continues "
        "with --pipeline-schedule 1f1b (a drained checkpoint holds what either needs)")
    assert describe_switch(saved, dict(saved, paci_accumulation_factor=4)).endswith(
        "continues with --pipeline-schedule paci (a=4) (a drained checkpoint holds what either "
        "needs)")
    assert describe_switch(saved, same) is None
    interleaved = dict(saved, pipeline_schedule="interleaved",
                       virtual_pipeline_model_parallel_size=2)
    assert describe_mismatch(saved, interleaved) == [
        "--num-layers-per-virtual-pipeline-stage (chunks): checkpoint None, this run 2",
        "--pipeline-schedule: checkpoint paci, this run interleaved"]


def test_a_checkpoint_reshards_over_p_tp_and_dp_with_one_line():
    saved = _fingerprint(P4, 4)
    assert describe_reshard(saved, saved) is None
    assert describe_reshard(None, saved) is None
    layouts = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                   data_parallel_size=2)
    moved = dict(saved, **layouts)
    assert describe_mismatch(saved, moved) == []
    assert describe_reshard(saved, moved).startswith(
        "resharding the checkpoint from P=4 TP=1 DP=1 to P=2 TP=2 DP=2 (")
    # an older checkpoint that did not record DP: only what changed is claimed
    assert "from P=4 TP=1 DP=? to P=2" in describe_reshard(
        {k: v for k, v in saved.items() if k != "data_parallel_size"}, moved)
    # the distributed optimizer's state reshards over DP, not over P or TP
    dist = dict(saved, use_distributed_optimizer=True)
    assert describe_mismatch(dist, dict(dist, data_parallel_size=2)) == []
    assert describe_mismatch(dist, dict(dist, pipeline_model_parallel_size=2)) == [
        "--pipeline-model-parallel-size: checkpoint 4, this run 2 (this distributed-optimizer "
        "checkpoint reshards over data parallelism only: keep its P and TP, or write it with "
        "--dist-ckpt-optim-fully-reshardable)"]
    anywhere = dict(dist, dist_ckpt_optim_fully_reshardable=True)
    assert describe_mismatch(anywhere, dict(dist, pipeline_model_parallel_size=2,
                                            tensor_model_parallel_size=2)) == []


def test_a_tp_change_must_keep_the_padded_vocabulary():
    run = dict(vocab_size=257, tensor_model_parallel_size=1, make_vocab_size_divisible_by=1,
               pipeline_schedule="paci")
    assert padded_vocab_size(257, 1, 1) == 257 and padded_vocab_size(257, 2, 64) == 384
    assert describe_mismatch(run, dict(run, tensor_model_parallel_size=2)) == [
        "--make-vocab-size-divisible-by: the checkpoint's embedding has 257 rows, this run pads "
        "the vocabulary to 258 (no --make-vocab-size-divisible-by gives 257 rows at TP=2: a "
        "checkpoint meant for another TP is written with a divisor that covers it, e.g. 128)"]
    wide = dict(run, make_vocab_size_divisible_by=128)  # 384 rows
    assert describe_mismatch(wide, dict(wide, tensor_model_parallel_size=2)) == [
        "--make-vocab-size-divisible-by: the checkpoint's embedding has 384 rows, this run pads "
        "the vocabulary to 512 (--make-vocab-size-divisible-by 64 keeps 384 rows at TP=2)"]
    assert describe_mismatch(wide, dict(wide, tensor_model_parallel_size=2,
                                        make_vocab_size_divisible_by=64)) == []


def test_trim_metrics_keeps_each_iteration_once(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"iteration": i, "lm_loss": i / 10} for i in range(1, 6)]
    lines.insert(3, {"iteration": 3, "validation_loss": 1.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"iteration": 6, "lm')
    assert trim_metrics(str(path), 3) == (4, 3)  # 4 and 5 dropped, and the line cut short
    assert [r["iteration"] for r in read_metrics(path)] == [1, 2, 3, 3]
    assert trim_metrics(str(path), 3) == (4, 0)
    assert trim_metrics(str(tmp_path / "absent.jsonl"), 3) == (0, 0)


def test_save_clock_checks_about_ten_times_per_interval_whatever_the_iteration_time():
    for per_iteration in (0.01, 1.0, 100.0, 1000.0):
        clock, now, saves, checks = SaveClock(600.0, 0, 0.0), 0.0, [], 0
        for iteration in range(1, max(int(3000 / per_iteration), 10) + 1):
            now += per_iteration
            if clock.is_check_point(iteration):
                checks += 1
                due, next_check = clock.propose(iteration, now)
                clock.agree(iteration, next_check, now)
                if due:
                    clock.saved(now)
                    saves.append(now)
        gaps = [b - a for a, b in zip([0.0] + saves, saves)]
        assert saves, per_iteration
        # never more than the interval + a tenth of it + one iteration of lost work
        assert max(gaps) <= 600.0 * 1.1 + per_iteration, (per_iteration, max(gaps))
        assert min(gaps) >= 600.0  # never early
        expected = now / 60.0 + 1  # ~10 checks per 600 s interval
        assert checks <= max(expected * 1.2, 1), (per_iteration, checks, expected)


def test_a_megatron_lm_checkpoint_directory_is_complete_without_our_marker(tmp_path):
    """Megatron-LM names an iteration in its tracker file once the checkpoint's common state is
    written; it writes no paci_complete marker. Ours without the marker stays refused."""
    from paci_megatron.mcore.checkpoint import CheckpointError, find_checkpoint

    it = tmp_path / "mlm" / "iter_0000004"
    it.mkdir(parents=True)
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("4")
    (it / "metadata.json").write_text("{}")
    with pytest.raises(CheckpointError, match="incomplete or corrupt"):
        find_checkpoint(str(tmp_path / "mlm"))
    (it / "common.pt").write_bytes(b"")
    assert find_checkpoint(str(tmp_path / "mlm")) == str(it)
