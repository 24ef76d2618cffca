"""fp16 with a loss scaler per stage, and --calculate-per-token-loss, under PACI at P=2.

One torchrun launch (tests/workers/precision_cases.py) runs every case; the tests assert on
what each rank wrote.
"""

import json
import os
import types

import pytest

from launch import paci_summary, run_torchrun

CASES = ["fp16_flush_equals_stock", "fp16_paci", "fp16_overflow", "fp16_rescale",
         "per_token_flush_equals_stock", "per_token_paci"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision")
    timeout = 420
    run_torchrun("tests/workers/precision_cases.py", ["--out", str(out), *CASES], nproc=2,
                 timeout=timeout, env={"PACI_TEST_HANG_S": str(timeout - 30)})

    def load(case):
        files = sorted(f for f in os.listdir(out) if f.startswith(case + ".rank"))
        assert len(files) == 2, f"{case}: results from {len(files)} of 2 ranks"
        rows = [json.load(open(os.path.join(out, f))) for f in files]
        return sorted(rows, key=lambda r: r["stage"] if "stage" in r else r["same"]["stage"])

    return load


def _mean_losses(rows):
    """Per micro-batch loss of the last stage (per-token: loss sum / tokens)."""
    values = []
    for logged in rows[-1]["losses"]:
        x = [float.fromhex(v) for v in logged]
        values.append(x[0] / x[1] if len(x) == 2 else x[0])
    return values


@pytest.mark.dist
@pytest.mark.parametrize("case", ["fp16_flush_equals_stock", "per_token_flush_equals_stock"])
def test_flush_runtime_equals_stock_1f1b_bitwise(case, ranks):
    """The runtime with the gradient metadata on, running the flush list, is stock 1F1B:
    every logged value and every weight bit for bit; fp16: the same scales and skipped steps
    (the case starts at 2^20, so some steps overflow)."""
    rows = ranks(case)
    assert len(rows[-1]["stock"]) == 5 * 4
    for r in rows:
        assert r["losses"] == r["stock"] and r["digest"] == r["stock_digest"]
        assert r["scales"] == r["stock_scales"] and r["ok"] == r["stock_ok"]
    if case.startswith("fp16"):
        assert False in rows[0]["ok"] and True in rows[0]["ok"]  # overflow skips happened
        assert len(set(rows[0]["scales"])) > 1


@pytest.mark.dist
@pytest.mark.parametrize("case", ["fp16_paci", "per_token_paci"])
def test_paci_trains_within_the_drift_bound(case, ranks):
    rows = ranks(case)
    for r in rows:
        assert r["drift"] == r["bound"] == (1 if r["stage"] == 0 else 0)
        assert r["steps"] == 8 * 4 // 2 and r["weights_finite"]
    losses = _mean_losses(rows)
    head, tail = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert tail < head - 0.2, (head, tail)


@pytest.mark.dist
def test_fp16_scalers_drift_apart_and_gradients_are_rescaled(ranks):
    """With window 2 and no hysteresis the stages' scales grow and overflow on their own
    schedule: by the end they differ, so gradients were rescaled (and training went down)."""
    first, last = ranks("fp16_paci")
    assert first["scales"] != last["scales"]
    assert first["ok"] != last["ok"]  # each stage skipped on its own


@pytest.mark.dist
def test_fp16_overflow_is_skipped_at_that_stage_only(ranks):
    first, last = ranks("fp16_overflow")
    # micro-batch 9 is in stage 0's third group of 4: that step, and only it, is skipped
    assert first["ok"] == [True, True, False, True, True] and first["skipped"] == 1
    assert first["scales"] == [4096.0, 4096.0, 2048.0, 2048.0, 2048.0]  # halved (hysteresis 1)
    assert last["ok"] == [True] * 5 and last["skipped"] == 0
    assert last["scales"] == [4096.0] * 5
    assert first["weights_finite"] and last["weights_finite"]
    losses = _mean_losses([first, last])
    assert len(losses) == 20 and all(0 < x < 10 for x in losses)


@pytest.mark.dist
def test_fp16_gradient_is_rescaled_to_the_receivers_scale(ranks):
    """Stage 0's scaler starts at half of stage 1's. Its gradients arrive at stage 1's scale
    and are multiplied by 1/2 (exact), so its first unscaled gradient equals that of a run
    with equal scalers bit for bit (without the rescale its norm would double); later steps
    agree to 1e-3 (fp16 rounding near the subnormal range depends on the scale)."""
    first, last = ranks("fp16_rescale")
    assert first["half"]["scales"] == [2048.0] * 3 and last["half"]["scales"] == [4096.0] * 3
    assert first["half"]["grad_norms"][0] == first["same"]["grad_norms"][0]
    for row in (first, last):
        for same, half in zip(row["same"]["grad_norms"], row["half"]["grad_norms"]):
            assert abs(half - same) <= 1e-3 * same, (same, half)


@pytest.mark.dist
def test_per_token_each_stage_divides_by_its_groups_token_count(ranks):
    """Masks keep 1..16 tokens per row: each stage's step divides by the sum over its own
    group of a micro-batches (the last stage counts, stage 0 receives the counts)."""
    first, last = ranks("per_token_paci")
    assert first["step_tokens"] == last["step_tokens"] == first["expected_tokens"]
    assert len(set(first["step_tokens"])) > 3


def test_no_metadata_without_fp16_or_per_token_loss():
    """fp32/bf16 without per-token loss: no extra message (grad_meta_for returns None)."""
    pytest.importorskip("megatron.core")
    from paci_megatron.mcore.grad_meta import grad_meta_for

    plain = types.SimpleNamespace(fp16=False, calculate_per_token_loss=False)
    scaler = types.SimpleNamespace(grad_scaler=object())
    assert grad_meta_for(plain, types.SimpleNamespace(grad_scaler=None)) is None
    meta = grad_meta_for(plain, scaler)
    assert meta.fp16 and not meta.per_token
    per_token = types.SimpleNamespace(fp16=False, calculate_per_token_loss=True)
    meta = grad_meta_for(per_token, types.SimpleNamespace(grad_scaler=None))
    assert meta.per_token and not meta.fp16


def test_entry_point_takes_the_fp16_and_per_token_flags():
    torch = pytest.importorskip("torch")
    from paci_megatron import training
    from paci_megatron.arguments import parse_and_validate
    from paci_megatron.job_log import mean_loss

    args, _ = parse_and_validate(
        ["--untie-embeddings-and-output-weights", "--fp16", "--initial-loss-scale", "4096",
         "--min-loss-scale", "2", "--loss-scale-window", "7", "--hysteresis", "1",
         "--calculate-per-token-loss"], world_size=2)
    assert (args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window,
            args.hysteresis, args.loss_scale) == (4096.0, 2.0, 7, 1, None)
    spec = training._gpt_spec(args)
    assert spec.fp16 and spec.calculate_per_token_loss and not spec.bf16
    # per-token logging: [loss sum, tokens] per micro-batch, averaged over all tokens
    logged = [{"lm loss": torch.tensor([6.0, 2.0])}, {"lm loss": torch.tensor([3.0, 4.0])}]
    assert mean_loss(logged) == 1.5
    assert mean_loss([{"lm loss": torch.tensor(2.0)}, {"lm loss": 4.0}]) == 3.0


@pytest.mark.slow
@pytest.mark.dist
def test_pretrain_gpt_paci_fp16_with_per_token_loss(tmp_path):
    """The entry point end to end, fp16 and per-token loss together, P=2."""
    _, out, _ = run_torchrun(
        "pretrain_gpt_paci.py",
        ["--pipeline-schedule", "paci", "--untie-embeddings-and-output-weights", "--fp16",
         "--initial-loss-scale", "65536", "--loss-scale-window", "5", "--hysteresis", "1",
         "--calculate-per-token-loss", "--train-iters", "20", "--log-interval", "10"],
        nproc=2, timeout=400)
    summary = paci_summary(out)
    losses = summary["losses"]
    assert all(0 < x < 10 for x in losses) and sum(losses[-3:]) / 3 < losses[0] - 0.5
    assert [row["max"] for row in summary["drift"]] == [1, 0]


@pytest.mark.dist
@pytest.mark.slow  # CI runs it (.ci/slow-tests)
def test_fp16_save_and_resume_equals_an_uninterrupted_run(tmp_path):
    """Each stage's own loss scaler, Adam step count and LR schedule come back from the
    checkpoint (Megatron keeps one of each, global rank 0's, in the common state; under PACI
    the stages skip different steps, and a skipped step advances none of them): train to 8
    saving at 4 == train to 4, save, load, go on, bit for bit."""
    flags = ["--pipeline-schedule", "paci", "--untie-embeddings-and-output-weights",
             "--train-iters", "8", "--fp16", "--initial-loss-scale", "131072",
             "--loss-scale-window", "2", "--hysteresis", "1", "--paci-accumulation-factor", "4"]
    runs = [["--save", str(tmp_path / "whole"), "--save-interval", "4"],
            ["--save", str(tmp_path / "part"), "--exit-interval", "4"],
            ["--save", str(tmp_path / "part"), "--load", str(tmp_path / "part")]]
    whole, first, second = (paci_summary(run_torchrun("pretrain_gpt_paci.py", flags + extra,
                                                  nproc=2, timeout=400)[1]) for extra in runs)
    assert first["losses"] + second["losses"] == whole["losses"]
    assert second["weights_sha256"] == whole["weights_sha256"]
    skipped = [[row["skipped_steps"] for row in run["drift"]] for run in (whole, first)]
    assert skipped[1][0] != skipped[1][1]  # the stages' scalers differ at the save


class _Buffer:
    """A stage's gradient buffer as GradMeta scales it (Megatron DDP's scale_gradients)."""

    def __init__(self, grad):
        self.grad = grad

    def scale_gradients(self, factor):
        self.grad = self.grad * factor


def test_per_token_r_divides_the_group_by_its_token_count_then_starts_again():
    """Stage 0 with tied embeddings and --calculate-per-token-loss: R divides its own group
    sum plus the last stage's output-layer half (added at R, as stock's all-reduce adds it)
    by the group's token count, counted on the device; the next group counts from zero.
    Checked on GradMeta's arithmetic by hand, not against the emulator."""
    torch = pytest.importorskip("torch")
    from paci_megatron.mcore.grad_meta import GradMeta

    tokens = (3, 5, 8)
    own = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 4.0]), torch.tensor([-1.0, 3.0])]
    output_half = torch.tensor([6.0, -9.0])  # the last stage's raw sum over the same tokens
    meta = GradMeta(fp16=False, per_token=True)
    state = types.SimpleNamespace(meta_in={}, tokens={}, output_grads={}, meta_out={})
    for mb, t in enumerate(tokens):
        state.tokens[mb] = t
        meta.before_backward(state, mb, 1.0, is_first=True, is_last=True)
    buffer = _Buffer(sum(own) + output_half)
    meta.divide_by_tokens(buffer, None)  # R
    assert torch.equal(buffer.grad, (sum(own) + output_half) / 16.0)
    assert meta.group_tokens == 0  # the next group starts from zero
