"""Multi-token prediction (``--mtp-num-layers``) under PACI at P > 1 (issue 50, item 3).

The MTP layers sit on the last stage and read a copy of stage 0's word embedding, whose
gradient stock Megatron all-reduces with stage 0's at every step; PACI keeps that copy with
the tied exchange (``mcore/tied.py``), tied embeddings or not. That the runtime does so exactly
as defined (every loss, every stage's weights after every step, the copy's staleness) is
checked bit for bit against the one-process reference in tests/test_reference.py
(``*mtp*``). Here: the flags and refusals of both entry points, and a P = 2 run through
pretrain_gpt_paci.py."""

import math
import shutil
import types

import pytest
import torch

from launch import megatron_lm_args, paci_summary, parse_results, read_metrics, run_torchrun, \
    train_paci
from paci_megatron import run as paci_run
from paci_megatron.arguments import parse_and_validate
from paci_megatron.flag import ConfigError

MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
P2 = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights", *MTP]


def _refused(argv, capsys, world_size=2):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(argv, world_size=world_size)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# --- the flags ------------------------------------------------------------------------------

def test_mtp_at_p2_plans_the_tied_actions_untied_or_tied():
    """The lists carry the tied actions with MTP whether or not the embeddings are tied (the
    last stage's copy of the embedding): every stage builds them alike."""
    for flags in (P2, [f for f in P2 if f != "--untie-embeddings-and-output-weights"]):
        _args, cfg = parse_and_validate(flags, world_size=2)
        assert cfg.shape.num_stages == 2
    layout = paci_run.megatron_lm_layout(megatron_lm_args(mtp_num_layers=1))
    assert layout.tied and layout.mtp
    layout = paci_run.megatron_lm_layout(megatron_lm_args(mtp_num_layers=1,
                                                          pipeline_model_parallel_size=1,
                                                          world_size=1))
    assert not layout.tied and not layout.mtp


@pytest.mark.parametrize("extra,words", [
    (["--position-embedding-type", "learned_absolute"],
     ["--mtp-num-layers needs --position-embedding-type rope or none"]),
    (["--pipeline-model-parallel-layout", "Et|tttL", "--num-layers", "4"],
     ["--pipeline-model-parallel-layout", "--mtp-num-layers"]),
    (["--paci-accumulation-factor", "auto"], ["--paci-accumulation-factor auto",
                                              "--mtp-num-layers"]),
])
def test_pretrain_gpt_paci_refuses_what_mtp_cannot_run_naming_the_flags(extra, words, capsys):
    err = _refused([*P2, *extra], capsys)
    assert all(word in err for word in words), err


def test_auto_with_mtp_runs_at_one_stage():
    """One stage: nothing is exchanged, so --paci-accumulation-factor auto takes MTP."""
    _args, cfg = parse_and_validate([*MTP, "--pipeline-model-parallel-size", "1",
                                     "--paci-accumulation-factor", "auto"], world_size=1)
    assert cfg.auto


def test_the_drop_in_takes_mtp_and_refuses_it_before_the_last_stage():
    """Megatron-LM's layout may put the MTP layers on any stage; PACI carries their copy of
    the embedding only between stage 0 and the last stage."""
    assert paci_run.validate_flags(megatron_lm_args(mtp_num_layers=1)) is not None
    paci_run.validate_flags(megatron_lm_args(mtp_num_layers=1,
                                             pipeline_model_parallel_layout="Et|tmL"))
    with pytest.raises(ConfigError, match="before the last stage"):
        paci_run.validate_flags(megatron_lm_args(mtp_num_layers=1,
                                                 pipeline_model_parallel_layout="Etm|tL"))
    with pytest.raises(ConfigError, match="--mtp-num-layers"):
        paci_run.validate_flags(megatron_lm_args(mtp_num_layers=1,
                                                 paci_accumulation_factor="auto"))


def test_tied_mtp_with_checkpoints_is_refused_before_the_run_in_both_entry_points(capsys):
    """Megatron-Core's MTP stage keeps an output-layer weight nothing reads, and its
    sharded_state_dict asserts it absent: tied + MTP at P > 1 fails at the first save, under
    stock 1F1B too (run by hand at P = 4 x EP = 2 on 0.16.1). PACI says so before the run;
    untied, or without --save, it trains."""
    tied = [f for f in P2 if f != "--untie-embeddings-and-output-weights"]
    err = _refused([*tied, "--save", "/tmp/ckpt"], capsys)
    assert "--untie-embeddings-and-output-weights" in err and "--save" in err, err
    parse_and_validate([*P2, "--save", "/tmp/ckpt"], world_size=2)
    parse_and_validate(tied, world_size=2)
    with pytest.raises(ConfigError, match="add --untie-embeddings-and-output-weights"):
        paci_run.validate_flags(megatron_lm_args(mtp_num_layers=1, save="/tmp/ckpt",
                                                 untie_embeddings_and_output_weights=False))
    paci_run.validate_flags(megatron_lm_args(mtp_num_layers=1, save="/tmp/ckpt",
                                             untie_embeddings_and_output_weights=True))


def test_the_runtime_refuses_mtp_layers_off_the_last_stage():
    from paci_megatron.mcore.admission import check_no_cross_stage_grad_reduction

    def check(**model):
        config = types.SimpleNamespace(mtp_num_layers=1, has_cond_embedder=False, timers=None)
        pg = types.SimpleNamespace(pp=types.SimpleNamespace(size=lambda: 2), pos_embd=None)
        check_no_cross_stage_grad_reduction(types.SimpleNamespace(config=config, **model), pg)

    check(mtp_process=True, post_process=True)  # the last stage
    check(mtp_process=False, post_process=False)  # stage 0, a middle stage
    for model in (dict(mtp_process=True, post_process=False),
                  dict(mtp_process=False, post_process=True)):
        with pytest.raises(ValueError, match="last stage"):
            check(**model)


@pytest.mark.parametrize("per_token", [False, True])
def test_the_mtp_gradient_scale_is_set_before_each_backward_in_both(per_token):
    """MTPLossAutoScaler holds one scale for the process, set at every forward. Before each
    backward the runtime (``aux_losses.set_for_backward``) and the emulator (where every
    stage shares the process) set it from the backward's stage: its loss scale now, over a
    (per-token: not divided). Under PACI the last stage, which holds the MTP layers, runs
    each backward right after its forward, so in the runtime this only guards the order;
    the fp16 reference case (p2_fp16_mtp) checks the numbers."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from paci_megatron.mcore import aux_losses
    from paci_megatron.mcore.reference import PipelineEmulator

    config = types.SimpleNamespace(num_moe_experts=None, mtp_num_layers=1,
                                   calculate_per_token_loss=per_token,
                                   grad_scale_func=lambda one: one * 2.0 ** 12)
    want = 2.0 ** 12 / (1 if per_token else 4)
    MTPLossAutoScaler.set_loss_scale(torch.tensor([3.0]))
    aux_losses.set_for_backward(config, accumulation=4, cp_size=1)
    assert MTPLossAutoScaler.main_loss_backward_scale.tolist() == [want]
    MTPLossAutoScaler.set_loss_scale(torch.tensor([3.0]))
    emulator = types.SimpleNamespace(accumulation=4)
    PipelineEmulator._scale_aux_losses(emulator, types.SimpleNamespace(config=config), 2.0 ** 12)
    assert MTPLossAutoScaler.main_loss_backward_scale.tolist() == [want]


# --- a run through pretrain_gpt_paci.py -------------------------------------------------------

ITERS, SAVE_AT, A = 8, 4, 1
LAG = math.ceil(2 / A)
RUN = [*P2, "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--bf16", "--hidden-dropout", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "2",
       "--paci-accumulation-factor", str(A), "--train-iters", str(ITERS), "--mock-data",
       "--distributed-timeout-minutes", "2", "--pipeline-schedule", "paci"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run of 8 iterations saving at 4 and 8 (a save drains), every
    collective counted outside the saves; and the run resumed from its checkpoint at 4."""
    tmp = tmp_path_factory.mktemp("mtp")
    metrics = tmp / "whole.jsonl"
    _, out, _ = run_torchrun("tests/workers/count_collectives.py",
                             [*RUN, "--save", str(tmp / "a"), "--save-interval", str(SAVE_AT),
                              "--metrics-file", str(metrics)], nproc=2, timeout=300)
    whole = dict(out=out, summary=paci_summary(out), records=read_metrics(metrics),
                 counted=parse_results(out))
    tag = f"iter_{SAVE_AT:07d}"
    shutil.copytree(tmp / "a" / tag, tmp / "b" / tag)
    (tmp / "b" / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    resumed = train_paci([*RUN, "--load", str(tmp / "b")], tmp / "resumed.jsonl", nproc=2)
    return whole, resumed


@pytest.mark.dist
def test_mtp_trains_and_its_embedding_copy_follows_stage_0(runs):
    """The last stage's copy of the embedding trails stage 0's by lag = ceil(P/a) = 2 owner
    steps (every micro-batch of group g of a stream used version max(0, g - lag)) and equals
    it bit for bit, with its master copy, after the final drain; drift at its bound; the loss
    goes down."""
    whole, _ = runs
    summary = whole["summary"]
    digests = summary["tied_sha256"]
    assert digests[0] is not None and digests[0] == digests[1]
    assert [row["max"] for row in summary["drift"]] == [row["bound"] for row in summary["drift"]]
    tied = summary["drift"][-1]["tied"]
    streams = ITERS // SAVE_AT
    warm = {str(g): A * streams for g in range(LAG)}
    assert tied == dict(max=LAG, bound=LAG, histogram={**warm, str(LAG): ITERS * 4 - LAG * A
                                                       * streams})
    losses = [r["lm_loss"] for r in whole["records"] if "lm_loss" in r]
    assert len(losses) == ITERS and sum(losses[-2:]) < sum(losses[:2]), losses


@pytest.mark.dist
def test_the_mtp_loss_is_logged_every_iteration_from_the_last_stage_alone(runs):
    """Megatron's MTP loss tracker, reported within the last stage (``mcore/mtp_metrics.py``):
    in every iteration's log line and metrics record, and no collective of the steady state
    (the tied exchange, the log, the local steps) spans two stages."""
    whole, _ = runs
    logged = [r["mtp_1 loss"] for r in whole["records"] if "lm_loss" in r]
    assert len(logged) == ITERS and all(0.0 < v < 10.0 for v in logged), logged
    assert whole["out"].count("| mtp_1 loss: ") == ITERS
    counted = whole["counted"]
    assert sorted(r["rank"] for r in counted) == [0, 1]
    assert all(r["count"] == 0 for r in counted), counted


@pytest.mark.dist
def test_mtp_resumes_bit_for_bit(runs):
    """Resumed from the checkpoint at iteration 4: iterations 5-8 (the LM and MTP losses),
    every stage's weights and both copies of the embedding equal the uninterrupted run's."""
    whole, resumed = runs

    def later(run, key):
        return {r["iteration"]: r[key] for r in run["records"]
                if "lm_loss" in r and r["iteration"] > SAVE_AT}

    assert "loaded checkpoint" in resumed["out"]
    for key in ("lm_loss", "mtp_1 loss"):
        assert later(resumed, key) == later(whole, key) and len(later(whole, key)) == 4
    assert resumed["summary"]["weights_sha256"] == whole["summary"]["weights_sha256"]
    assert resumed["summary"]["tied_sha256"] == whole["summary"]["tied_sha256"]
