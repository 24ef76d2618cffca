"""--paci-weight-prediction: which forwards are predicted, the prediction's arithmetic against
the optimizer's own step, the exact restore, and the flag's checks. The runtime against the
emulator, and against plain PACI, is in test_reference.py; memory in test_memory_parity.py."""

import pytest
import torch

from paci_megatron.features import weight_prediction as wp
from paci_megatron.mcore.main_params import main_pairs
from paci_megatron.schedule import Op, plan_stream
from paci_megatron.shape import drift_bound, steps_in_flight


@pytest.mark.parametrize("tied", [False, True])
def test_the_lists_and_the_shape_agree_on_every_forwards_steps_ahead(tied):
    """The runtime reads a forward's steps ahead from the action lists, the emulator counts
    them from P, s and a: the same for every forward of the first calls, and never above the
    drift bound (reached on every stage with P-1-s >= 1)."""
    for P in range(1, 9):
        for a in range(1, 9):
            for N in sorted({a, 2 * a}):
                plan = plan_stream("paci", P, a, N, tied)
                for s in range(P):
                    seen = set()
                    for k in range(5):
                        for act in plan.call(k)[s]:
                            if act.op is Op.FORWARD:
                                ahead = plan.steps_before_backward(k, s, act.mb)
                                assert ahead == steps_in_flight(P, s, a, act.mb)
                                seen.add(ahead)
                    assert max(seen) == drift_bound(P, s, a)


def test_a_flush_plan_predicts_nothing():
    plan = plan_stream("flush", 4, 2, 4)
    assert all(plan.steps_before_backward(1, s, act.mb) == 0 for s in range(4)
               for act in plan.call(1)[s] if act.op is Op.FORWARD)


class _Mixed:
    """Megatron's mixed-precision optimizer as the prediction reads it: bf16 model weights
    (with the DDP's main_grad), fp32 main copies in the inner optimizer's groups."""

    def __init__(self, inner_cls, shapes, **kwargs):
        gen = torch.Generator().manual_seed(0)
        self.float16_groups = [[torch.nn.Parameter(torch.randn(*s, generator=gen).bfloat16())
                                for s in shapes]]
        self.fp32_from_float16_groups = [[p.detach().float() for p in self.float16_groups[0]]]
        self.optimizer = inner_cls(self.fp32_from_float16_groups[0], **kwargs)
        self.gen = gen

    def pairs(self):
        return list(zip(self.float16_groups[0], self.fp32_from_float16_groups[0]))

    def set_grads(self, scale=1.0):
        for model, _main in self.pairs():
            model.main_grad = torch.randn(model.shape, generator=self.gen) * scale

    def step(self):
        """Megatron's step: main grads from the buffers, the inner step, the model cast."""
        for model, main in self.pairs():
            main.grad = model.main_grad.clone()
        self.optimizer.step()
        for model, main in self.pairs():
            model.data.copy_(main)


OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.99))),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
]


@pytest.mark.parametrize("inner_cls,kwargs", OPTIMIZERS)
def test_one_step_predicted_from_the_whole_group_is_the_optimizers_step(inner_cls, kwargs):
    """With the whole group's gradient (factor 1) the prediction is the step the optimizer
    then takes, to fp32 rounding (torch orders its arithmetic differently)."""
    opt = _Mixed(inner_cls, [(64, 32), (32,)], **kwargs)
    for _ in range(3):
        opt.set_grads()
        opt.step()
    opt.set_grads()
    predicted = []
    for pair in main_pairs(opt):
        state = pair.inner.state[pair.main]
        predict = wp._adam_prediction if "exp_avg" in state else wp._sgd_prediction
        predicted.append(predict(pair.inner, pair.group, state,
                                 wp._state_tensors(pair.inner, state, pair.main), pair.main,
                                 pair.grad, 1.0, 1))
    opt.step()
    for value, (_model, main) in zip(predicted, opt.pairs()):
        torch.testing.assert_close(value, main, rtol=1e-6, atol=1e-7)


def test_d_steps_ahead_is_d_times_one_step_and_without_gradient_uses_the_moments():
    opt = _Mixed(torch.optim.AdamW, [(40, 8)], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    opt.set_grads()
    opt.step()
    (model, main), = opt.pairs()
    state = opt.optimizer.state[main]
    (pair,), inner = main_pairs(opt), opt.optimizer
    group = pair.group
    one, two = (wp._adam_prediction(inner, group, state, wp._state_tensors(inner, state, main),
                                    main, None, 0.0, d) for d in (1, 2))
    torch.testing.assert_close(two - main, 2 * (one - main), rtol=0, atol=3e-7)  # fp32 ulps of main
    m, v, t = state["exp_avg"], state["exp_avg_sq"], float(state["step"]) + 1
    expected = main - 1e-3 * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.95 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(one, expected, rtol=1e-6, atol=3e-7)


def test_the_move_and_the_restore_are_in_place_chunked_and_exact(monkeypatch):
    """The model weights take the prediction (cast to bf16) and get back their main copy's
    cast bit for bit; a weight with no optimizer state yet stays; chunking changes nothing."""
    opt = _Mixed(torch.optim.AdamW, [(300, 7), (5,)], lr=1e-2, betas=(0.9, 0.95))
    opt.set_grads()
    opt.step()
    fresh = torch.nn.Parameter(torch.ones(3).bfloat16())  # joins after the first step
    opt.float16_groups[0].append(fresh)
    opt.fp32_from_float16_groups[0].append(fresh.detach().float())
    opt.optimizer.param_groups[0]["params"].append(opt.fp32_from_float16_groups[0][-1])
    opt.set_grads()
    before = [m.detach().clone() for m in opt.float16_groups[0]]
    storages = [m.data_ptr() for m in opt.float16_groups[0]]
    wp.move_to_prediction(main_pairs(opt), 2, 0.5)
    whole = [m.detach().clone() for m in opt.float16_groups[0]]
    assert not torch.equal(whole[0], before[0]) and torch.equal(whole[2], before[2])
    assert [m.data_ptr() for m in opt.float16_groups[0]] == storages
    wp.restore_weights(main_pairs(opt))
    assert all(torch.equal(m, b) for m, b in zip(opt.float16_groups[0], before))
    monkeypatch.setattr(wp, "MIN_CHUNK", 64)  # 300 x 7 in 33 pieces
    wp.move_to_prediction(main_pairs(opt), 2, 0.5)
    assert all(torch.equal(m, w) for m, w in zip(opt.float16_groups[0], whole))
    wp.restore_weights(main_pairs(opt))
    assert all(torch.equal(m, b) for m, b in zip(opt.float16_groups[0], before))


def test_an_overflowed_fp16_buffer_predicts_from_the_moments_alone():
    opt = _Mixed(torch.optim.AdamW, [(8, 8)], lr=1e-3)
    opt.set_grads()
    opt.step()
    (model, _main), = opt.pairs()
    wp.move_to_prediction(main_pairs(opt), 1, None)
    from_moments = model.detach().clone()
    wp.restore_weights(main_pairs(opt))
    model.main_grad[0, 0] = float("inf")
    wp.move_to_prediction(main_pairs(opt), 1, 1.0)
    assert torch.equal(model, from_moments)


def test_an_optimizer_it_cannot_predict_or_restore_from_is_refused():
    from paci_megatron.flag import ConfigError

    class Plain:  # fp32: the optimizer steps the model weights themselves
        def __init__(self, inner):
            self.optimizer = inner

    param = torch.nn.Parameter(torch.ones(2))
    def check(opt):
        wp.check_optimizer(opt, main_pairs(opt))

    with pytest.raises(ConfigError, match="--bf16 or --fp16"):
        check(Plain(torch.optim.AdamW([param])))
    check(_Mixed(torch.optim.AdamW, [(2,)]))
    with pytest.raises(ConfigError, match="AMSGrad"):
        check(_Mixed(torch.optim.AdamW, [(2,)], amsgrad=True))
    with pytest.raises(ConfigError, match="neither"):
        check(_Mixed(torch.optim.Adagrad, [(2,)]))


@pytest.mark.parametrize("extra,message", [
    ([], "needs --bf16 or --fp16"),
    (["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
     "--overlap-param-gather"),
    (["--bf16", "--paci-accumulation-factor", "auto"], "--paci-accumulation-factor auto"),
])
def test_the_flag_is_refused_where_it_cannot_run_before_any_process_group(extra, message, capsys):
    from launch import megatron_lm_args
    from paci_megatron import run as paci_run
    from paci_megatron.arguments import parse_and_validate

    argv = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights",
            "--paci-weight-prediction", *extra]
    with pytest.raises(SystemExit):
        parse_and_validate(argv, world_size=2)
    assert message in capsys.readouterr().err
    mlm = dict(paci_weight_prediction=True, bf16="--bf16" in extra,
               use_distributed_optimizer="--use-distributed-optimizer" in extra,
               overlap_grad_reduce="--overlap-grad-reduce" in extra,
               overlap_param_gather="--overlap-param-gather" in extra)
    if "auto" in extra:
        mlm["paci_accumulation_factor"] = "auto"
    with pytest.raises(ValueError, match=message.replace("-", r"\-")):
        paci_run.validate_flags(megatron_lm_args(**mlm))


def _resolved(*argv):
    from paci_megatron.arguments import parse_and_validate

    _args, opts = parse_and_validate(["--pipeline-model-parallel-size", "2",
                                      "--untie-embeddings-and-output-weights", *argv],
                                     world_size=2)
    return opts


def test_the_flag_reaches_the_runtime_as_given_or_by_default_and_never_under_1f1b(capsys):
    from paci_megatron.features import build_features

    def features(*argv):
        return [type(f).__name__ for f in build_features(_resolved("--bf16", *argv))]

    assert ("WeightPrediction" in features()) == wp.DEFAULT_PREDICTION
    assert "WeightPrediction" in features("--paci-weight-prediction")
    assert "WeightPrediction" not in features("--no-paci-weight-prediction")  # the paper's
    assert features("--pipeline-schedule", "1f1b", "--no-paci-weight-prediction") == []
    with pytest.raises(SystemExit):
        features("--pipeline-schedule", "1f1b", "--paci-weight-prediction")
    assert "only applies" in capsys.readouterr().err


@pytest.mark.parametrize("extra,why", [
    ([], "needs --bf16 or --fp16"),
    (["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
     "--overlap-param-gather"),
    (["--fp16", "--paci-accumulation-factor", "auto"], "--paci-accumulation-factor auto"),
])
def test_the_default_stays_off_where_the_run_cannot_predict_and_says_why(extra, why):
    opts = _resolved(*extra)
    assert not opts.weight_prediction
    assert (why in opts.prediction_off) == wp.DEFAULT_PREDICTION
    line = wp.default_off_line(opts.prediction_off)
    assert line.startswith("> PACI: weight prediction (on by default) is off") and why in line


def test_the_default_is_on_in_bf16_and_fp16_and_under_the_drop_in():
    from launch import megatron_lm_args
    from paci_megatron import run as paci_run

    for precision in ("--bf16", "--fp16"):
        opts = _resolved(precision)
        assert (opts.weight_prediction, opts.prediction_off) == (wp.DEFAULT_PREDICTION, "")
    resolved = paci_run.validate_flags(megatron_lm_args(bf16=True))
    assert resolved.weight_prediction == wp.DEFAULT_PREDICTION
    other = paci_run.validate_flags(megatron_lm_args(bf16=True, optimizer="muon"))
    assert not other.weight_prediction
    assert ("--optimizer muon" in other.prediction_off) == wp.DEFAULT_PREDICTION


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_the_partial_gradient_is_the_groups_mean_so_far_as_the_step_will_weigh_it(
        weight, monkeypatch):
    """With --paci-stale-grad-weight the buffer is rescaled as the drift falls; the factor the
    prediction reads it with still gives the weighted mean gradient of the backwards so far
    (the plain mean at W = 1). The buffer holds each gradient / a at the loss scale, as
    Megatron's does."""
    from paci_megatron.executor import DriftStats
    from paci_megatron.features import StageContext, StaleGradWeights, WeightPrediction
    a, scale, drifts = 4, 8.0, [2, 1, 1]
    features = [StaleGradWeights(weight), WeightPrediction()]
    ctx = StageContext(stage=0, num_stages=4, drift=DriftStats(0, 2, version=2),
                       features=features, accumulation=a, planned_drift=lambda mb: 1,
                       loss_scale=lambda: scale)
    grads = [torch.full((3,), float(10 ** i), dtype=torch.float64) for i in range(len(drifts))]
    buffer = torch.zeros(3, dtype=torch.float64)
    for mb, (drift, grad) in enumerate(zip(drifts, grads)):
        ctx.drift.fwd_version[mb] = ctx.drift.version - drift  # as the executor records it
        ctx.drift.on_backward(mb)
        for feature in features:
            buffer *= feature.backward_factor(ctx, drift)
        buffer += grad * scale / a
    seen = []
    monkeypatch.setattr(wp, "move_to_prediction", lambda pairs, steps, f: seen.append(f))
    features[1].before_forward(ctx, 3)
    features[1].after_forward(ctx, 3)
    weights = [weight ** d for d in drifts]
    mean = sum(w * g for w, g in zip(weights, grads)) / sum(weights)
    torch.testing.assert_close(buffer * seen[0], mean, rtol=1e-12, atol=0)


def test_the_feature_times_the_move_and_restore_apart_from_the_forward(monkeypatch):
    """What the end-of-run report reads: move + restore per predicted forward, and the
    forward itself between them (a forward that predicts nothing is not timed)."""
    import time

    from paci_megatron.executor import DriftStats
    from paci_megatron.features import StageContext, WeightPrediction
    feature = WeightPrediction()
    ahead = {0: 1, 1: 0}
    ctx = StageContext(stage=0, num_stages=2, drift=DriftStats(0, 1), features=[feature],
                       planned_drift=ahead.get)
    monkeypatch.setattr(wp, "move_to_prediction", lambda *a: time.sleep(0.03))
    monkeypatch.setattr(wp, "restore_weights", lambda *a: time.sleep(0.02))
    assert "predict_ms" not in feature.summary()
    for mb in (0, 1):
        feature.before_forward(ctx, mb)
        time.sleep(0.002)  # the forward
        feature.after_forward(ctx, mb)
    row = feature.summary()
    assert row["predicted_forwards"] == {1: 1}
    assert row["predict_ms"] >= 50.0
    assert 2.0 <= row["forward_ms"] < 30.0  # the move is not the forward's


def _row(stage, steps, backwards, predicted=0, predict_ms=None, forward_ms=None):
    row = {"stage": stage, "steps": steps, "histogram": {0: backwards},
           "predicted_forwards": {1: predicted} if predicted else {}}
    if predict_ms is not None:
        row.update(predict_ms=predict_ms, forward_ms=forward_ms)
    return row


@pytest.mark.parametrize("predict_ms,with_it", [(0.0, 1.375), (30.0, 1.0), (40.0, 41.25 / 45)])
def test_the_report_projects_what_prediction_leaves_of_pacis_gain(predict_ms, with_it):
    """P = 4, a = 8 (2 steps of 16 micro-batches), forward 10 ms, backward 20: stage 0
    predicts 3 forwards in 8, so per micro-batch it spends 30 + 3/8 p ms against 1F1B's
    11/8 x 30. At p = 3 forwards PACI's gain is gone exactly; above, 1F1B is faster."""
    rows = [_row(0, 2, 16, 6, predict_ms, 10.0), _row(1, 2, 16, 4, predict_ms, 10.0),
            _row(2, 2, 16, 2, predict_ms, 10.0), _row(3, 2, 16)]
    assert wp.projected_throughput(rows) == (pytest.approx(with_it, rel=1e-12), 1.375)
    lines = wp.cost_lines(rows)
    assert len(lines) == 4 and lines[0].startswith("> stage 0: weight prediction on 6 forwards")
    slower = "slower than 1F1B on this machine" in lines[-1]
    assert slower == (with_it < 1.0)
    assert f"{with_it:.2f}x 1F1B's (plain PACI 1.38x" in lines[-1]


def test_the_report_says_nothing_of_prediction_when_none_ran():
    assert wp.cost_lines([_row(0, 2, 16), _row(1, 2, 16)]) == []
