"""--paci-stale-grad-correction K: the coefficient, the in-step correction, the flags.

That the multi-process runtime applies exactly g -= K x mean drift x lr x exp_avg is
checked bit for bit against the emulator's own spelling of it (tests/test_reference.py, the
``*_correct`` cases); here the pieces are checked alone.
"""

import pytest
import torch

from paci_megatron.executor import DriftStats
from paci_megatron.features.stale_correction import StaleGradCorrection
from paci_megatron.features.stale_weights import StaleGradWeights


def _unweighted(drifts):
    stats = DriftStats(stage=0, bound=None)
    for mb, d in enumerate(drifts):
        stats.version = d  # forward at version 0, backward d steps later
        stats.fwd_version[mb] = 0
        stats.on_backward(mb)
    return stats


def _weighted(weight, drifts):
    weights = StaleGradWeights(weight)
    for d in drifts:
        weights.before_backward(d)
    return weights


def test_the_coefficient_is_the_strength_times_the_weighted_mean_drift():
    corr = StaleGradCorrection(4.0)
    assert corr.coefficient(_unweighted((1, 1, 1, 0)).group_mean_drift) == 4.0 * 0.75
    # weights 0.25, 0.5, 1, 1: (0.5 + 0.5) / 2.75
    assert corr.coefficient(_weighted(0.5, (2, 1, 0, 0)).mean_drift) == pytest.approx(
        4.0 * 1.0 / 2.75, rel=1e-15)


def test_a_group_without_drift_is_not_corrected_and_the_step_resets_it():
    corr = StaleGradCorrection(8.0)
    assert corr.coefficient(_unweighted(()).group_mean_drift) == 0.0  # no backward yet
    assert corr.coefficient(_unweighted((0, 0, 0)).group_mean_drift) == 0.0
    assert corr.coefficient(_unweighted((1,)).group_mean_drift) == 8.0
    weights = _weighted(0.5, (1,))
    assert corr.coefficient(weights.mean_drift) == 8.0
    weights.finish()
    assert corr.coefficient(weights.mean_drift) == 8.0  # the step still reads it
    weights.reset()
    assert corr.coefficient(weights.mean_drift) == 0.0  # the group was reset
    stats = _unweighted((1,))
    stats.on_step()
    assert corr.coefficient(stats.group_mean_drift) == 0.0


@pytest.mark.parametrize("strength", [-1.0, float("nan"), float("inf")])
def test_bad_strengths_are_refused(strength):
    with pytest.raises(ValueError, match="--paci-stale-grad-correction"):
        StaleGradCorrection(strength)


class _Wrapper:
    """What Megatron's optimizer does around its inner one: prepare, clip, inner step."""

    def __init__(self, inner, skip=False):
        self.optimizer, self.skip = inner, skip

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self):
        if self.skip:  # an fp16 overflow: no inner step
            return False, None, None
        self.optimizer.step()
        return True, None, None


def _adam(param, lr):
    opt = torch.optim.AdamW([param], lr=lr, weight_decay=0.0)
    param.grad = torch.tensor([0.5, -1.0, 2.0])
    opt.step()  # now it has a first moment
    return opt


def test_the_inner_step_sees_the_gradient_minus_the_scaled_momentum():
    from paci_megatron.features.stale_correction import momentum_corrected

    p, q, r = (torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0])) for _ in range(3))
    opt_p, opt_q, opt_r = _adam(p, 1e-3), _adam(q, 1e-3), _adam(r, 1e-3)
    moment = opt_p.state[p]["exp_avg"].clone()
    grad = torch.tensor([0.25, 0.75, -0.5])
    p.grad = grad.clone()
    with momentum_corrected(_Wrapper(opt_p), 3000.0):
        _Wrapper(opt_p).step()
    q.grad = grad - 3000.0 * 1e-3 * moment  # by hand: K x lr x m
    opt_q.step()
    assert torch.equal(p, q)
    assert "step" not in opt_p.__dict__  # the optimizer's own step is back
    r.grad = grad.clone()
    opt_r.step()
    assert not torch.equal(p, r)  # uncorrected, the step differs


def test_a_skipped_step_and_a_zero_coefficient_leave_the_gradient_alone():
    from paci_megatron.features.stale_correction import momentum_corrected

    p = torch.nn.Parameter(torch.ones(3))
    opt = _adam(p, 1e-3)
    p.grad = torch.full((3,), 0.5)
    with momentum_corrected(_Wrapper(opt, skip=True), 3000.0):
        _Wrapper(opt, skip=True).step()
    with momentum_corrected(_Wrapper(opt), 0.0):
        assert "step" not in opt.__dict__  # nothing wrapped
    assert torch.equal(p.grad, torch.full((3,), 0.5))


def test_sgd_corrects_with_its_momentum_buffer_and_without_momentum_not_at_all():
    from paci_megatron.features.stale_correction import subtract_momentum

    p, plain = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    no_momentum = torch.optim.SGD([plain], lr=0.1)
    for param, opt in ((p, sgd), (plain, no_momentum)):
        param.grad = torch.tensor([0.5, -1.0, 2.0])
        opt.step()
    buffer = sgd.state[p]["momentum_buffer"].clone()
    p.grad, plain.grad = torch.full((3,), 0.25), torch.full((3,), 0.25)
    subtract_momentum(sgd, 20.0)
    subtract_momentum(no_momentum, 20.0)
    assert torch.equal(p.grad, torch.full((3,), 0.25) - 20.0 * 0.1 * buffer)
    assert torch.equal(plain.grad, torch.full((3,), 0.25))  # no momentum, nothing to subtract


class _ScaledStateAdam(torch.optim.AdamW):
    """Like TE's FusedAdam with a low-precision exp_avg: the state is stored scaled and in
    another dtype; get_unscaled_state gives it back in the gradient's units."""

    scale = 4.0

    def step(self, closure=None):
        super().step(closure)
        for state in self.state.values():
            state["exp_avg"] = (state["exp_avg"] * self.scale).to(torch.bfloat16)

    def get_unscaled_state(self, param, name):
        return self.state[param][name].float() / self.scale


def test_a_first_moment_stored_scaled_is_read_unscaled():
    from paci_megatron.features.stale_correction import first_moment

    p = torch.nn.Parameter(torch.ones(3))
    opt = _ScaledStateAdam([p], lr=1e-3)
    assert first_moment(opt, p) is None  # before the first step
    p.grad = torch.tensor([0.5, -1.0, 2.0])
    opt.step()
    m = first_moment(opt, p)
    assert m.dtype == torch.float32
    assert torch.equal(m, opt.state[p]["exp_avg"].float() / 4.0)
    assert torch.allclose(m, 0.1 * torch.tensor([0.5, -1.0, 2.0]), rtol=1e-2)


@pytest.mark.parametrize("argv,message", [
    (["--paci-stale-grad-correction", "-1"], "--paci-stale-grad-correction"),
    (["--pipeline-schedule", "1f1b", "--paci-stale-grad-correction", "2"], "only applies"),
])
def test_bad_strengths_are_refused_by_both_entry_points(argv, message, capsys):
    from test_stale_weights import assert_refused_by_both_entry_points

    assert_refused_by_both_entry_points(argv, message, capsys)


def test_the_flag_reaches_the_runtime_and_other_schedules_never_correct():
    from paci_megatron.arguments import parse_and_validate
    from paci_megatron.features.stale_correction import DEFAULT_STRENGTH

    def strength(*argv):
        _args, opts = parse_and_validate(["--pipeline-model-parallel-size", "2",
                                          "--untie-embeddings-and-output-weights", *argv],
                                         world_size=2)
        return opts.stale_grad_correction

    assert strength() == DEFAULT_STRENGTH
    assert strength("--paci-stale-grad-correction", "0") == 0.0  # the paper's plain PACI
    assert strength("--paci-stale-grad-correction", "6") == 6.0
    assert strength("--pipeline-schedule", "1f1b") == 0.0


def test_an_optimizer_without_a_first_moment_is_refused():
    """The correction reads the optimizer's first moment; SGD without momentum keeps none, so
    the flag would do nothing: refused before any process group by the drop-in's validator
    (Megatron-LM's --optimizer sgd --sgd-momentum 0), and by the runtime once the optimizer
    exists (any entry point, any optimizer)."""
    from launch import megatron_lm_args
    from paci_megatron import run as paci_run
    from paci_megatron.features.stale_correction import refuse_without_first_moment
    from paci_megatron.flag import ConfigError

    with pytest.raises(ValueError, match="--sgd-momentum 0 has none"):
        paci_run.validate_flags(megatron_lm_args(optimizer="sgd", sgd_momentum=0.0,
                                                 paci_stale_grad_correction=2.0))
    paci_run.validate_flags(megatron_lm_args(optimizer="sgd", sgd_momentum=0.9,
                                             paci_stale_grad_correction=2.0))
    param = torch.nn.Parameter(torch.ones(2))
    for inner in (torch.optim.AdamW([param]), torch.optim.SGD([param], lr=0.1, momentum=0.9)):
        refuse_without_first_moment(_Wrapper(inner))
    with pytest.raises(ConfigError, match="SGD as configured keeps none"):
        refuse_without_first_moment(_Wrapper(torch.optim.SGD([param], lr=0.1)))
