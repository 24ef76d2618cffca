"""--paci-weight-prediction: which forwards are predicted, the prediction's arithmetic against
the optimizer's own step, the exact restore, and the flag's checks. The runtime against the
emulator, and against plain PACI, is in test_reference.py; memory in test_memory_parity.py."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paci_megatron.features import lookahead as la
from paci_megatron.features import prediction_pass as pp
from paci_megatron.features import weight_prediction as wp
from paci_megatron.throughput import projected_throughput
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


def _flat_optimizer(inner_cls, sizes, steps=2, **kwargs):
    """A torch optimizer over fp32 main weights laid out flat as ``StageLayout`` lays them:
    two param groups (the second without weight decay, as Megatron's biases and norms), a
    bf16 target and a gradient buffer of the same layout. Returns (optimizer, params, flat
    buffers) after ``steps`` steps on random gradients."""
    gen = torch.Generator().manual_seed(0)
    total = sum(sizes)
    main = torch.randn(total, generator=gen)
    grad = torch.zeros(total)
    params, offsets, start = [], [], 0
    for size in sizes:
        p = main[start:start + size]
        p.grad = grad[start:start + size]
        params.append(p)
        offsets.append((start, start + size))
        start += size
    decay = kwargs.pop("weight_decay", 0.0)
    groups = [dict(params=params[:-1], weight_decay=decay), dict(params=params[-1:], weight_decay=0.0)]
    opt = inner_cls(groups, **kwargs)
    for _ in range(steps):
        grad.copy_(torch.randn(total, generator=gen) * 0.1)
        opt.step()
    return opt, params, offsets, dict(main=main, grad=grad, gen=gen)


def _pass(opt, params, offsets, flat, kind, clip=0.0, decoupled=True, pieces=1):
    """The prediction's pass over the flat layout (cut into ``pieces`` pieces); the state
    tensors are re-homed into flat buffers as the layout does."""
    from paci_megatron.mcore.main_params import STATE_NAMES, _cut

    total = flat["main"].numel()
    names = STATE_NAMES[kind]
    state = tuple(torch.zeros(total) for _ in names)
    for p, (lo, hi) in zip(params, offsets):
        for name, buf in zip(names, state):
            buf[lo:hi].copy_(opt.state[p][name])
            opt.state[p][name] = buf[lo:hi]
    klasses = [pp.Klass(kind, g, opt, True, decoupled, clip) for g in opt.param_groups]
    runs = [(lo, hi, 0 if i < len(params) - 1 else 1) for i, (lo, hi) in enumerate(offsets)]
    target = flat["main"].bfloat16()
    bounds = [round(k * total / pieces) for k in range(pieces + 1)]
    cut = []
    for lo, hi in zip(bounds, bounds[1:]):
        inside = [(max(a, lo) - lo, min(b, hi) - lo, k) for a, b, k in runs if a < hi and b > lo]
        cut += _cut(inside, target[lo:hi], flat["main"][lo:hi], tuple(s[lo:hi] for s in state),
                    flat["grad"][lo:hi]).pieces
    return pp.Pass(kind, cut, klasses), target


def _predicted(stage_pass, opt, steps, factor, lr_sum=None, kernel="plain", scale=None):
    """The prediction written into fp32 buffers in place of the bf16 targets."""
    lr_sum = lr_sum or (lambda group, n: n * group["lr"])
    layout = SimpleNamespace(stage_pass=stage_pass, step_count=lambda inner: _steps(opt))
    targets = [p.target for p in stage_pass.pieces]
    for piece in stage_pass.pieces:
        piece.target = torch.zeros_like(piece.main)
    stage_pass.kernel = kernel
    moved = wp.predict_ahead(layout, steps, factor, lr_sum, scale)
    out = torch.cat([p.target for p in stage_pass.pieces])
    for piece, target in zip(stage_pass.pieces, targets):
        piece.target = target
    return out if moved else None


def _steps(opt):
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


OPTIMIZERS = [
    ("adam", True, torch.optim.AdamW, dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)),
    ("adam", False, torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1)),
    ("sgd_momentum", True, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("sgd_momentum", True, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True,
                                                 weight_decay=0.01)),
    ("sgd", True, torch.optim.SGD, dict(lr=0.05, momentum=0.0, weight_decay=0.01)),
]
SIZES = [3000, 700, 40, 5]  # the last param in the group without weight decay


@pytest.mark.parametrize("kind,decoupled,inner_cls,kwargs", OPTIMIZERS)
@pytest.mark.parametrize("clip", [0.0, 0.3, 0.1])
def test_one_step_predicted_from_the_whole_gradient_is_the_optimizers_clipped_step(
        kind, decoupled, inner_cls, kwargs, clip):
    """With the whole group's gradient (at a loss scale of 8, four backwards of four) the
    prediction is the step torch then takes after clipping the gradient as Megatron does
    (torch's clip_grad_norm_ is the independent reference: max / (norm + 1e-6)), to fp32
    rounding, for AdamW, L2 Adam, SGD with and without momentum, over two param groups, three
    pieces and a minor index list."""
    opt, params, offsets, flat = _flat_optimizer(inner_cls, SIZES, **kwargs)
    stage_pass, _target = _pass(opt, params, offsets, flat, kind, clip, decoupled, pieces=3)
    assert sum(len(p.minors) for p in stage_pass.pieces) >= 1
    mean = torch.randn(flat["main"].numel(), generator=flat["gen"]) * 0.5
    flat["grad"].copy_(mean * 8.0)  # the buffer: gradient / a per backward, at scale 8
    predicted = _predicted(stage_pass, opt, 1, wp.grad_factor(4, 4), scale=torch.tensor(8.0))
    flat["grad"].copy_(mean)
    norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip else mean.norm()
    if clip:
        assert norm > clip  # clipping acted
    before = flat["main"].clone()
    opt.step()
    torch.testing.assert_close(predicted, flat["main"], rtol=2e-6, atol=1e-7)
    assert (predicted - before).abs().max() > 100 * (predicted - flat["main"]).abs().max()


def test_d_steps_ahead_extrapolate_the_next_step_at_the_next_d_learning_rates():
    opt, params, offsets, flat = _flat_optimizer(
        torch.optim.AdamW, SIZES, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    stage_pass, _ = _pass(opt, params, offsets, flat, "adam")
    flat["grad"].copy_(torch.randn(flat["main"].numel(), generator=flat["gen"]))
    lrs = {1: 1e-3, 2: 1e-3 + 7e-4, 3: 1e-3 + 7e-4 + 5e-4}  # a decaying schedule
    main = flat["main"].clone()
    one = _predicted(stage_pass, opt, 1, 1.0)
    three = _predicted(stage_pass, opt, 3, 1.0,
                       lambda group, n: lrs[n] if group["weight_decay"] else n * 1e-3)
    decayed = slice(0, sum(SIZES[:-1]))
    # with weight decay: main (1 - wd sum lr) - (sum lr / lr) x (the one step's update)
    update = (main * (1 - 1e-3 * 0.1) - one) / 1e-3
    expected = main * (1 - lrs[3] * 0.1) - lrs[3] * update
    torch.testing.assert_close(three[decayed], expected[decayed], rtol=0, atol=2e-6)
    rest = slice(sum(SIZES[:-1]), None)  # no decay, a constant LR: three times the step
    torch.testing.assert_close(three[rest] - main[rest], 3 * (one[rest] - main[rest]),
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize("steps", [1, 2])
def test_a_gradient_that_will_skip_the_step_predicts_one_step_fewer_everywhere(steps):
    """An Inf in one piece's gradient makes the step skip (fp16's found-inf, bf16's check):
    every piece then predicts d - 1 steps from the moments alone (d = 1: no move at all),
    decided once for the stage, without a host sync."""
    opt, params, offsets, flat = _flat_optimizer(
        torch.optim.AdamW, SIZES, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    stage_pass, _ = _pass(opt, params, offsets, flat, "adam", clip=0.5, pieces=3)
    flat["grad"].copy_(torch.randn(flat["main"].numel(), generator=flat["gen"]))
    flat["grad"][-2] = float("inf")  # in the last piece, in the no-decay group
    skipped = _predicted(stage_pass, opt, steps, 1.0)
    fewer = _predicted(stage_pass, opt, steps - 1, None) if steps > 1 else flat["main"]
    torch.testing.assert_close(skipped, fewer, rtol=0, atol=0)
    flat["grad"][-2] = 0.0
    assert not torch.equal(_predicted(stage_pass, opt, steps, 1.0), skipped)


def test_without_a_gradient_adam_moves_on_its_moments_and_sgd_does_not_move():
    opt, params, offsets, flat = _flat_optimizer(
        torch.optim.AdamW, SIZES, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    stage_pass, _ = _pass(opt, params, offsets, flat, "adam")
    one = _predicted(stage_pass, opt, 1, None)
    state = [opt.state[p] for p in params]
    m = torch.cat([s["exp_avg"] for s in state])
    v = torch.cat([s["exp_avg_sq"] for s in state])
    t = _steps(opt) + 1
    expected = flat["main"] - 1e-3 * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.95 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(one, expected, rtol=1e-6, atol=3e-7)
    opt, params, offsets, flat = _flat_optimizer(torch.optim.SGD, SIZES, lr=0.1, momentum=0.0)
    stage_pass, _ = _pass(opt, params, offsets, flat, "sgd")
    assert _predicted(stage_pass, opt, 1, None) is None  # nothing to go on: nothing moves


@pytest.mark.parametrize("kind,decoupled,inner_cls,kwargs", OPTIMIZERS[:3] + OPTIMIZERS[4:])
@pytest.mark.parametrize("fold", [True, False])
def test_the_fused_kernel_equals_the_plain_pass_to_bf16_rounding(kind, decoupled, inner_cls,
                                                                kwargs, fold):
    if pp.kernel_choice("cpu") != "fused":
        pytest.skip("torch.compile does not run here")
    if kind == "sgd" and not fold:
        return
    opt, params, offsets, flat = _flat_optimizer(inner_cls, SIZES * 30, **kwargs)
    stage_pass, target = _pass(opt, params, offsets, flat, kind, 0.3, decoupled, pieces=2)
    flat["grad"].copy_(torch.randn(flat["main"].numel(), generator=flat["gen"]))
    factor = 0.5 if fold else None
    layout = SimpleNamespace(stage_pass=stage_pass, step_count=lambda inner: _steps(opt))
    results = {}
    for kernel in ("plain", "fused"):
        stage_pass.kernel = kernel
        wp.predict_ahead(layout, 2, factor, lambda group, n: n * group["lr"])
        results[kernel] = target.clone()
        stage_pass.restore()
    plain, fused = (results[k].float() for k in ("plain", "fused"))
    assert not torch.equal(plain, flat["main"].bfloat16().float())  # it moved
    ulp = torch.finfo(torch.bfloat16).eps * plain.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((fused - plain).abs() <= ulp).all()
    assert (fused != plain).float().mean() < 0.01


@pytest.mark.parametrize("kernel", ["plain", "fused"])
def test_the_restore_is_megatrons_cast_bit_for_bit_and_in_place(kernel):
    if kernel == "fused" and pp.kernel_choice("cpu") != "fused":
        pytest.skip("torch.compile does not run here")
    opt, params, offsets, flat = _flat_optimizer(
        torch.optim.AdamW, SIZES, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    stage_pass, target = _pass(opt, params, offsets, flat, "adam", pieces=2)
    flat["grad"].copy_(torch.randn(flat["main"].numel(), generator=flat["gen"]))
    stage_pass.kernel = kernel
    before, pointer = target.clone(), target.data_ptr()
    layout = SimpleNamespace(stage_pass=stage_pass, step_count=lambda inner: _steps(opt))
    wp.predict_ahead(layout, 1, 1.0, lambda group, n: n * group["lr"])
    assert (target != before).float().mean() > 0.5 and target.data_ptr() == pointer
    stage_pass.restore()
    assert torch.equal(target, flat["main"].to(torch.bfloat16)) and torch.equal(target, before)


class _Failing:
    """A fused kernel set whose ``fails`` calls raise (a compile error) and whose others run
    the plain formulas; counts the calls."""

    name = "fused"

    def __init__(self, *fails):
        self.fails, self.calls, self.tried = set(fails), 0, []

    def __getattr__(self, name):
        plain = getattr(pp._EAGER, name)

        def call(*args, **_kwargs):
            self.tried.append(name)
            if name in self.fails:
                raise RuntimeError(f"InductorError: {name} does not compile here")
            self.calls += 1
            return plain(*args)

        return call


def _adam_pass(pieces=2):
    opt, params, offsets, flat = _flat_optimizer(
        torch.optim.AdamW, SIZES, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    stage_pass, target = _pass(opt, params, offsets, flat, "adam", clip=0.3, pieces=pieces)
    flat["grad"].copy_(torch.randn(flat["main"].numel(), generator=flat["gen"]))
    layout = SimpleNamespace(stage_pass=stage_pass, step_count=lambda inner: 3)
    return stage_pass, target, layout, flat


@pytest.mark.parametrize("fails", ["sumsq", "coefficients", "piece", "minor"])
def test_a_fused_kernel_that_fails_never_repeats_the_norms_all_reduce(fails, monkeypatch):
    """The clipping norm's reduction over the stage's grad-stats group is the move's one
    collective. A fused kernel that fails on one rank runs the plain formulas for its call,
    on that rank, without running the reduction again (another rank, whose kernel worked,
    posts it once: a second one would hang the job); the weights are the plain pass's."""
    stage_pass, target, layout, _flat = _adam_pass()
    stage_pass.kernel = "plain"
    wp.predict_ahead(layout, 2, 0.5, lambda group, n: n * group["lr"], None, lambda t: None)
    plain = target.clone()
    stage_pass.restore()
    monkeypatch.setattr(pp, "_FUSED", _Failing(fails))
    stage_pass.kernel = "fused"
    reductions = []
    with pytest.warns(UserWarning) as warned:
        wp.predict_ahead(layout, 2, 0.5, lambda group, n: n * group["lr"], None,
                         lambda sumsq: reductions.append(float(sumsq)))
    assert len(reductions) == 1
    assert torch.equal(target, plain)
    assert f"fused {fails} failed" in str(warned[0].message)
    assert stage_pass.kernel == "plain" and stage_pass.fallbacks == 1  # not settled: plain on


@pytest.mark.parametrize("local_ok,others_ok", [(True, True), (True, False), (False, True)])
def test_the_kernel_is_settled_once_at_start_up_and_alike_on_the_stages_ranks(
        local_ok, others_ok, monkeypatch):
    """``settle``: every variant compiled and run on the stage's own pieces (a move of step 0
    and the restore: the weights come back bit for bit), then one agreement (the runtime's
    all-reduce MIN over the stage): fused only where every rank compiled, else plain on all,
    saying why. Later calls never settle again nor agree again."""
    stage_pass, target, layout, flat = _adam_pass()
    before = target.clone()
    layer = [stage_pass.sliced(0, 100, 900)]  # a layer-by-layer move's slice
    monkeypatch.setattr(pp, "_FUSED", _Failing() if local_ok else _Failing("minor"))
    stage_pass.kernel = "fused"
    agreed = []

    def agree(ok):  # the all-reduce MIN of the stage's flags
        agreed.append(ok)
        return ok and others_ok

    why = stage_pass.settle([layer], (True, False), torch.tensor([0.25]), agree)
    assert agreed == [local_ok] and stage_pass.settled
    assert torch.equal(target, before)
    if local_ok:  # every variant ran: both folds, the stage's pieces and the layer's
        assert set(pp._FUSED.tried) == {"sumsq", "coefficients", "piece", "minor"}
        assert pp._FUSED.tried.count("coefficients") == 2
    assert stage_pass.kernel == ("fused" if local_ok and others_ok else "plain")
    expected = "" if local_ok and others_ok else \
        "another rank of the stage" if local_ok else "on this rank (RuntimeError: InductorError"
    assert (expected in why) if expected else why == ""
    assert stage_pass.settle([layer], (True,), None, agree) == "" and len(agreed) == 1


def test_after_start_up_nothing_compiles_and_an_unmet_variant_runs_plain(monkeypatch):
    """A real torch.compile (Dynamo, with the cheap aot_eager backend): after ``settle`` the
    moves compile nothing (every timed move is the steady state); a variant start-up did not
    meet (here a loss scale where it settled without one) is not compiled then but runs the
    plain formulas for that call, and the move equals the plain pass's."""
    from torch._dynamo.utils import counters

    stage_pass, target, layout, _flat = _adam_pass()
    results = {}
    for kernel in ("plain", "fused"):
        stage_pass.kernel = kernel
        for factor, scale in ((0.5, None), (None, None), (0.5, torch.tensor([4.0]))):
            wp.predict_ahead(layout, 2, factor, lambda group, n: n * group["lr"], scale,
                             lambda t: None)
            results[kernel, factor, scale is None] = target.float()
            stage_pass.restore()
        if kernel == "plain":
            monkeypatch.setattr(pp, "_FUSED", pp._Fused(backend="aot_eager"))
            stage_pass.kernel = "fused"
            torch._dynamo.reset()
            assert stage_pass.settle((), (True, False), None) == ""
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 3 and stage_pass.kernel == "fused"
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after start-up
    assert stage_pass.fallbacks >= 1  # the loss scale's variant ran plain
    for key, plain in results.items():
        if key[0] == "plain":
            fused = results["fused", *key[1:]]
            ulp = torch.finfo(torch.bfloat16).eps * plain.abs().clamp_min(1e-30)
            assert ((fused - plain).abs() <= ulp).all(), key


def test_the_layer_by_layer_move_survives_a_failing_kernel(monkeypatch):
    """--paci-weight-prediction-overlap calls the same pass from its hooks: a fused kernel
    that fails there runs plain for that call; the forward goes on, each layer runs on its
    predicted slice and everything is put back."""
    from paci_megatron.mcore.prediction_overlap import LayerwiseMove

    stage_pass, target, layout, _flat = _adam_pass(pieces=1)
    total = target.numel()
    stage_pass.kernel = "plain"
    wp.predict_ahead(layout, 1, 0.5, lambda group, n: n * group["lr"], None, lambda t: None)
    predicted = target.clone()
    stage_pass.restore()
    before = target.clone()
    model = torch.nn.Module()
    model.embed = torch.nn.Linear(2, 4)
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    spans = {id(p): (0, 200) for p in model.embed.parameters()}
    for index, layer in enumerate(model.decoder.layers):
        spans.update({id(p): (200 + index * 1000, 1200 + index * 1000) for p in layer.parameters()})
    seen = []
    for index, layer in enumerate(model.decoder.layers):
        lo, hi = 200 + index * 1000, 1200 + index * 1000
        layer.register_forward_pre_hook(
            lambda _m, _a, lo=lo, hi=hi: seen.append(torch.equal(target[lo:hi], predicted[lo:hi])))
    layout.sharded = False
    layout.pieces_of = lambda params: [stage_pass.sliced(0, *spans[id(p)]) for p in params[:1]]
    mover = LayerwiseMove(layout, model)
    assert total > 2200
    monkeypatch.setattr(pp, "_FUSED", _Failing("piece"))
    stage_pass.kernel, stage_pass.settled = "fused", True  # settled fused; a variant fails
    host = pp.scalars_to_device([pp.host_coefficients(k, (1e-2, 0.0), 3, 0.5)
                                 for k in stage_pass.klasses], "cpu")
    with pytest.warns(UserWarning, match="fused piece failed"):
        mover.start(stage_pass.coefficients(host, None, True, lambda t: None), True)
    model.decoder.layers[1](model.decoder.layers[0](model.embed(torch.ones(1, 2))))
    mover.finish()
    assert seen == [True, True]  # each layer ran on its predicted weights
    assert torch.equal(target, before) and stage_pass.kernel == "fused"
    assert stage_pass.fallbacks == 3  # the outside piece and each layer's, one move each
    assert len(mover.piece_sets()) == 3  # what start-up compiles for it: all of it


class _Count(TorchDispatchMode):
    """Operators dispatched that launch work (views launch none), and those that make a GPU
    host wait (a scalar read back)."""

    SYNCS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default"}

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        self.syncs += str(func) in self.SYNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernel", ["plain", "fused"])
def test_a_predicted_forward_has_no_host_sync_and_a_few_operators(kernel):
    """Counted by a dispatch mode on CPU over a move and a restore, gradient folded, clipped,
    at a loss scale: no scalar is read back. The fused pass is one compiled kernel for the
    scalars, one per piece and minor list, the loss scale's inverse and one multi-tensor copy
    (the compiled code itself never dispatches); the plain one about 16 operators for the
    scalars and 25 per piece and minor list."""
    if kernel == "fused" and pp.kernel_choice("cpu") != "fused":
        pytest.skip("torch.compile does not run here")
    opt, params, offsets, flat = _flat_optimizer(
        torch.optim.AdamW, SIZES, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    stage_pass, _ = _pass(opt, params, offsets, flat, "adam", clip=0.3, pieces=2)
    flat["grad"].copy_(torch.randn(flat["main"].numel(), generator=flat["gen"]))
    stage_pass.kernel = kernel
    layout = SimpleNamespace(stage_pass=stage_pass, step_count=lambda inner: 3)
    calls = pp.fused_calls()
    with _Count() as counter:
        wp.predict_ahead(layout, 1, 0.25, lambda group, n: n * group["lr"], torch.tensor(4.0))
        stage_pass.restore()
    lists = len(stage_pass.pieces) + sum(len(p.minors) for p in stage_pass.pieces)
    assert counter.syncs == 0
    if kernel == "fused":
        assert pp.fused_calls() - calls == 1 + lists
        assert counter.ops == 2
    else:
        assert pp.fused_calls() == calls
        assert counter.ops <= 16 + 25 * lists


def test_the_fused_kernel_allocates_no_full_size_temporary(tmp_path):
    """Peak resident memory around a fused move of 2 x 2^24 elements: a full-size fp32
    temporary would add 128 MB; the kernel writes in place (checked in a fresh process)."""
    if pp.kernel_choice("cpu") != "fused":
        pytest.skip("torch.compile does not run here")
    code = (
        "import resource, torch\n"
        "from paci_megatron.features import prediction_pass as pp\n"
        "n = 1 << 25\n"
        "main = torch.randn(n); m = torch.randn(n) * 1e-3; v = torch.rand(n) * 1e-6\n"
        "g = torch.randn(n); t = torch.zeros(n, dtype=torch.bfloat16)\n"
        "k = pp.Klass('adam', dict(betas=(0.9, 0.95), eps=1e-8, lr=1e-3, weight_decay=0.1), None)\n"
        "p = pp.Pass('adam', [pp.Piece(t, main, (m, v), g, 0)], [k], kernel='fused')\n"
        "rows = [pp.host_coefficients(k, (1e-3, 0.0), 3)]\n"
        "pp.predict(p, [pp.host_coefficients(k, (1e-3, 0.0), 3)], 0.5)  # compile\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "pp.predict(p, rows, 0.5); p.restore()\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print('GROWTH_KB', after - before)\n")
    from launch import run_python

    out = run_python(code, timeout=300, check=True).stdout
    growth_kb = int(out.split("GROWTH_KB")[1])
    assert growth_kb < 16 * 1024, growth_kb  # 2^25 fp32 elements are 128 MB


@pytest.mark.parametrize("extra,message", [
    ([], "needs --bf16 or --fp16"),
    (["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
     "--overlap-param-gather"),
    (["--bf16", "--paci-accumulation-factor", "auto"], "--paci-accumulation-factor auto"),
    (["--bf16", "--optimizer", "nadam"], "not --optimizer nadam"),
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
    if "nadam" in extra:
        mlm["optimizer"] = "nadam"
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
    (["--bf16", "--optimizer", "nadam"], "not --optimizer nadam"),
])
def test_the_default_stays_off_where_the_run_cannot_predict_and_says_why(extra, why):
    opts = _resolved(*extra)
    assert not opts.method("weight_prediction")
    assert (why in " ".join(opts.notes)) == wp.DEFAULT_PREDICTION
    line = opts.notes[0]
    assert line.startswith("> PACI: weight prediction (on by default) is off") and why in line


def test_the_default_is_on_in_bf16_and_fp16_and_under_the_drop_in():
    from launch import megatron_lm_args
    from paci_megatron import run as paci_run

    for precision in ("--bf16", "--fp16"):
        opts = _resolved(precision)
        assert (bool(opts.method("weight_prediction")), opts.notes) == (wp.DEFAULT_PREDICTION, ())
    resolved = paci_run.validate_flags(megatron_lm_args(bf16=True))
    assert bool(resolved.method("weight_prediction")) == wp.DEFAULT_PREDICTION
    other = paci_run.validate_flags(megatron_lm_args(bf16=True, optimizer="muon"))
    assert not other.method("weight_prediction")
    assert ("--optimizer muon" in " ".join(other.notes)) == wp.DEFAULT_PREDICTION


def _feature_ctx(feature, ahead, backwards=0, scale=None, per_token=False):
    from paci_megatron.executor import DriftStats
    from paci_megatron.features import StageContext

    drift = DriftStats(0, 2, version=2)
    drift.group_backwards = backwards
    restored = []
    feature.layout = SimpleNamespace(stage_pass=SimpleNamespace(restore=lambda: restored.append(1)),
                                     on_step=lambda ok: None)
    ctx = StageContext(stage=0, num_stages=4, drift=drift, features=[feature], accumulation=4,
                       planned_drift=ahead.get, per_token=per_token,
                       loss_scale_tensor=lambda: None if scale is None else torch.tensor(scale))
    return ctx, restored


@pytest.mark.parametrize("backwards,scale,per_token,expected", [
    (3, 8.0, False, 4 / 3), (1, None, False, 4.0), (0, 8.0, False, None),
    (2, 8.0, True, None)])
def test_the_feature_folds_the_groups_mean_gradient_so_far_unscaled(
        backwards, scale, per_token, expected, monkeypatch):
    """The buffer after k of a group's a backwards holds sum(g_i) / a at the loss scale S: the
    factor a / k and the scale (on the device) make it the mean so far, unscaled. Before the
    group's first backward, and for per-token loss (token sums until R), nothing is folded."""
    feature = wp.WeightPrediction()
    ctx, restored = _feature_ctx(feature, {5: 2}, backwards, scale, per_token)
    seen = []
    monkeypatch.setattr(wp, "predict_ahead", lambda layout, steps, f, lr_sum, loss_scale, r, m:
                        seen.append((steps, f, loss_scale)) or True)
    feature.before_forward(ctx, 5)
    feature.after_forward(ctx, 5)
    (steps, factor, loss_scale), = seen
    assert steps == 2 and restored == [1] and feature.predicted == {2: 1}
    assert factor == expected
    assert (loss_scale is None) == (scale is None) and (scale is None or float(loss_scale) == scale)


def test_a_forward_with_nothing_to_predict_from_is_neither_counted_nor_restored(monkeypatch):
    feature = wp.WeightPrediction()
    ctx, restored = _feature_ctx(feature, {0: 1})
    monkeypatch.setattr(wp, "predict_ahead", lambda *a: False)  # SGD, no gradient yet
    feature.before_forward(ctx, 0)
    feature.after_forward(ctx, 0)
    assert feature.predicted == {} and restored == [] and not ctx.weights_moved


def test_the_feature_compiles_at_start_up_and_times_every_move_after_it(monkeypatch):
    """What the end-of-run report reads: move + restore per predicted forward, and the
    forward itself between them (a forward that predicts nothing is not timed). The stream's
    start settles the pass's kernel (``Pass.settle``: every variant compiled, with the folds
    and the loss scale the moves use) before any span, so every move counts, the first too."""
    import time

    feature = wp.WeightPrediction()
    ctx, _restored = _feature_ctx(feature, {0: 1, 1: 0, 2: 1}, scale=8.0)
    layout = feature.layout
    layout.stage_pass.device = torch.device("cpu")
    settled = []
    ctx.flat_state = lambda: layout
    ctx.settle_pass = lambda sets, folds, inv: settled.append((list(sets), folds,
                                                                      float(inv)))
    feature.on_start(ctx)
    assert settled == [([], (True, False), 0.125)]
    layout.stage_pass.restore = lambda: time.sleep(0.02)
    layout.stage_pass.kernel = "plain"
    moves = iter([0.2, 0.02])  # both timed: nothing compiles after on_start
    monkeypatch.setattr(wp, "predict_ahead", lambda *a: time.sleep(next(moves)) or True)
    assert "predict_ms" not in feature.summary()
    for mb in (0, 1, 2):
        feature.before_forward(ctx, mb)
        time.sleep(0.002)  # the forward
        feature.after_forward(ctx, mb)
    row = feature.summary()
    assert row["predicted_forwards"] == {1: 2}
    assert 120.0 <= row["predict_ms"] < 600.0  # (220 + 40) / 2: the first move counts
    assert 2.0 <= row["forward_ms"] < 30.0  # the move is not the forward's


def test_per_token_loss_and_the_lookahead_settle_only_the_variants_they_run():
    from paci_megatron.features.lookahead import Lookahead

    feature = wp.WeightPrediction()
    ctx, _restored = _feature_ctx(feature, {}, per_token=True)
    feature.layout.stage_pass.device = torch.device("cpu")
    layout, settled = feature.layout, []
    ctx.flat_state = lambda: layout
    ctx.settle_pass = lambda *a: settled.append(a)
    feature.on_start(ctx)  # per-token loss: the gradient is a token sum until R, never folded
    assert settled == [((), (False,), None)]
    ctx.stage = ctx.num_stages - 1  # the last stage: nothing to look ahead to, kernel settled
    Lookahead(1.0).on_start(ctx)
    assert settled[-1] == ((), (False,), None) and len(settled) == 2


def test_the_cost_lines_say_no_compilation_was_timed():
    rows = [_row(0, 2, 16, 6, 3.0, 10.0), _row(1, 2, 16)]
    assert wp.cost_lines(rows)[-1].endswith(
        "every move timed, none compiling: the kernels were compiled at start-up")
    rows = [{**_row(s, 2, 16), "forward_ms": 10.0, "lookahead_ms": 1.0} for s in range(2)]
    assert la.cost_lines(rows)[-1].endswith(
        "every pass timed, none compiling: the kernels were compiled at start-up")


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
    assert projected_throughput(rows, predict_ms / 10.0) == \
        (pytest.approx(with_it, rel=1e-12), 1.375)
    lines = wp.cost_lines(rows)
    assert len(lines) == 4 and lines[0].startswith("> stage 0: weight prediction on 6 forwards")
    slower = "slower than 1F1B on this machine" in lines[-1]
    assert slower == (with_it < 1.0)
    assert f"{with_it:.2f}x 1F1B's (plain PACI 1.38x" in lines[-1]


def test_the_report_says_nothing_of_prediction_when_none_ran():
    assert wp.cost_lines([_row(0, 2, 16), _row(1, 2, 16)]) == []


@pytest.mark.parametrize("pass_ms,with_it", [(0.0, 1.375), (8.0, 41.25 / 31), (90.0, 1.0)])
def test_the_report_projects_what_the_lookahead_leaves_of_pacis_gain(pass_ms, with_it):
    """P = 4, a = 8 (2 steps of 16 micro-batches), forward 10 ms, backward 20: a stage that
    looks ahead spends 30 + 2/16 L ms a micro-batch (one pass of L ms a step) against 1F1B's
    11/8 x 30 = 41.25; the last stage times its forwards but has nothing to look ahead to."""
    rows = [{**_row(s, 2, 16), "forward_ms": 10.0} for s in range(4)]
    for row in rows[:3]:
        row["lookahead_ms"] = pass_ms
    lines = la.cost_lines(rows)
    assert len(lines) == 4
    assert lines[0] == (f"> stage 0: look-ahead pass {pass_ms:.2f} ms a step against 10.00 ms "
                        f"a forward ({pass_ms / 10:.2f} forwards a step)")
    assert lines[-1].startswith(f"> PACI: the look-ahead's cost leaves a projected throughput "
                                f"of {with_it:.2f}x 1F1B's (plain PACI 1.38x")
    assert projected_throughput(rows, per_step=pass_ms / 10.0) == \
        (pytest.approx(with_it, rel=1e-12), 1.375)
    assert la.cost_lines([_row(0, 2, 16), _row(1, 2, 16)]) == []


@pytest.mark.parametrize("P,stage,a,strength,steps", [(4, 0, 8, 1.0, 3 / 8), (4, 1, 2, 2.0, 2.0),
                                                      (8, 0, 8, 1.0, 7 / 8), (4, 3, 1, 1.0, 0.0)])
def test_the_lookahead_runs_c_times_the_mean_drift_ahead_on_the_moments(P, stage, a, strength,
                                                                        steps):
    """--paci-lookahead C after a step: the weights C x (P-1-s)/a steps ahead on the
    moments (no gradient), by hand: main (1 - c lr wd) - c lr m^ / (sqrt(v^) + eps) with the
    next step's bias corrections, c a fraction of a step where the drift is."""
    from paci_megatron.features.lookahead import Lookahead

    ctx = SimpleNamespace(num_stages=P, stage=stage, accumulation=a)
    assert Lookahead(strength).steps_ahead(ctx) == steps
    if not steps:
        return  # the last stage: nothing to look ahead for (the feature moves nothing)
    opt, params, offsets, flat = _flat_optimizer(
        torch.optim.AdamW, SIZES, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    stage_pass, _ = _pass(opt, params, offsets, flat, "adam")
    ahead = _predicted(stage_pass, opt, steps, None)
    state = [opt.state[p] for p in params]
    m = torch.cat([s["exp_avg"] for s in state])
    v = torch.cat([s["exp_avg_sq"] for s in state])
    t = _steps(opt) + 1
    decay = torch.cat([torch.full((n,), 0.1 if i < len(SIZES) - 1 else 0.0)
                       for i, n in enumerate(SIZES)])
    lr = steps * 1e-3
    expected = flat["main"] * (1 - lr * decay) \
        - lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.95 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(ahead, expected, rtol=1e-6, atol=3e-7)


def test_the_lookahead_is_refused_with_nadam_before_any_process_group(capsys):
    """The look-ahead follows Adam's update; NAdam's is another one, so the pair is refused
    (naming both flags and the fix) where the flags are read, not at the first step."""
    from paci_megatron.arguments import parse_and_validate

    assert _resolved("--bf16", "--optimizer", "nadam", "--no-paci-weight-prediction")
    with pytest.raises(SystemExit):
        parse_and_validate(["--pipeline-model-parallel-size", "2", "--bf16",
                            "--untie-embeddings-and-output-weights", "--optimizer", "nadam",
                            "--paci-lookahead", "1"], world_size=2)
    err = capsys.readouterr().err
    assert "--paci-lookahead 1 follows Adam's and SGD's steps, not --optimizer nadam" in err
    assert "use --optimizer adam or drop --paci-lookahead" in err
