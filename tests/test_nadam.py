"""--optimizer nadam: ``MegatronNAdam`` is torch's NAdam bit for bit, whatever Megatron does to
its state between steps (the unit part here; inside Megatron's wrappers and through a resume
of the entry point: tests/workers/nadam_cases.py, tests/test_training.py)."""

import copy
import math

import pytest
import torch

from paci_megatron.mcore.nadam import MOMENTUM_DECAY, MegatronNAdam, mu_product_at

SIZES = (7, 5, 3)
HYPER = dict(lr=3e-3, betas=(0.99, 0.95), eps=1e-8, weight_decay=0.1, momentum_decay=0.004,
             decoupled_weight_decay=True)


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _groups(params):
    # the last group decays nothing, as Megatron's biases and norms
    return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]


def _grads(step, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _run(opt, params, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("beta1", [0.9, 0.99])
def test_mu_product_is_torchs_own_bit_for_bit_and_the_closed_form(beta1):
    params = _params()
    reference = torch.optim.NAdam(params, **{**HYPER, "betas": (beta1, 0.95)})
    _run(reference, params, 150)
    halfway = reference.state[params[0]]["mu_product"].clone()
    _run(reference, params, 150, first=150)
    kept = reference.state[params[0]]["mu_product"]
    for step, expected in ((300, kept), (150, halfway), (300, kept)):  # asked in any order
        assert torch.equal(torch.tensor(mu_product_at(step, beta1)), expected), step
    closed = math.prod(beta1 * (1 - 0.5 * 0.96 ** (t * MOMENTUM_DECAY)) for t in range(1, 301))
    assert float(kept) == pytest.approx(closed, rel=1e-5)  # float32 products of 300 terms
    assert mu_product_at(0, beta1) == 1.0


def test_it_steps_as_torchs_nadam_and_keeps_adams_state_between_steps():
    ours_params, torch_params = _params(), _params()
    ours = MegatronNAdam(_groups(ours_params), **HYPER)
    reference = torch.optim.NAdam(_groups(torch_params), **HYPER)
    for step in range(20):
        for p, q, g in zip(ours_params, torch_params, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
        assert all(torch.equal(p, q) for p, q in zip(ours_params, torch_params)), step
        assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in ours.state.values())
    assert [g["step"] for g in ours.param_groups] == [20.0, 20.0]
    # not Adam under another name: AdamW from the same start lands elsewhere
    adam_params = _params()
    adam = torch.optim.AdamW(_groups(adam_params), lr=3e-3, betas=(0.99, 0.95),
                             weight_decay=0.1)
    after = _run(adam, adam_params, 20)
    assert max(float((a - p).abs().max()) for a, p in zip(after, ours_params)) > 1e-3


def _shared_step(state):
    step = torch.tensor(float(next(iter(state["state"].values()))["step"]))
    for s in state["state"].values():
        s["step"] = step  # Megatron's load without Apex/TE: one tensor for every parameter


def _no_param_steps(state):
    for s in state["state"].values():
        s.pop("step")  # Apex/TE's layout: the step per group only


def _no_group_step(state):
    for g in state["param_groups"]:
        g.pop("step")  # a checkpoint of torch's Adam: the step per parameter only


def _placeholder_first(state):
    return "placeholder"


@pytest.mark.parametrize("change", [None, _shared_step, _no_param_steps, _no_group_step,
                                    _placeholder_first])
def test_a_resume_from_its_state_dict_continues_bit_for_bit(change):
    """Saved after 12 steps, loaded into a fresh optimizer (with the step kept as Megatron
    may keep it, or after Megatron's placeholder step): 8 more steps equal 20 uninterrupted
    steps of torch's NAdam."""
    whole_params = _params()
    whole = torch.optim.NAdam(_groups(whole_params), **HYPER)
    expected = _run(whole, whole_params, 20)

    params = _params()
    first = MegatronNAdam(_groups(params), **HYPER)
    _run(first, params, 12)
    saved = copy.deepcopy(first.state_dict())
    assert all("mu_product" not in s for s in saved["state"].values())
    resumed_params = [p.detach().clone() for p in params]
    resumed = MegatronNAdam(_groups(resumed_params), **HYPER)
    if change is _placeholder_first:
        for p in resumed_params:
            p.grad = torch.zeros_like(p)
        resumed.step()  # Megatron's _init_optimizer_states_with_dummy_values
        for p, kept in zip(resumed_params, params):
            p.data.copy_(kept)  # the load writes the weights back
    elif change is not None:
        change(saved)
    resumed.load_state_dict(saved)
    assert torch.equal(torch.cat(_run(resumed, resumed_params, 8, first=12)),
                       torch.cat(expected))


WORKER = "tests/workers/nadam_cases.py"


@pytest.fixture(scope="module")
def megatron_rows(tmp_path_factory):
    from launch import worker_rows

    return worker_rows(WORKER, tmp_path_factory.mktemp("nadam"),
                       [(1, ["bf16", "fp16"]), (2, ["dp2_distopt_bf16"])])


@pytest.mark.dist
@pytest.mark.parametrize("case,ranks", [("bf16", 1), ("fp16", 1), ("dp2_distopt_bf16", 2)])
def test_inside_megatrons_wrappers_it_is_torchs_nadam_and_resumes_bit_for_bit(case, ranks,
                                                                               megatron_rows):
    rows = megatron_rows[case]
    assert len(rows) == ranks
    for row in rows:
        assert row["nadam"] and row["kinds"] == ["MegatronNAdam"]
        for step in row["steps"]:
            assert step["diff"] == 0.0  # every main weight (or shard), bit for bit
            assert step["norm"] > 3 * 0.05  # the clipping acted
            assert step["decays"] == [0.0, 0.1]  # Megatron's no-decay group reached NAdam
        lrs = [step["lr"] for step in row["steps"]]
        assert lrs[0] < lrs[1] and len(set(lrs)) == len(lrs)  # warm-up, then the decay
        assert row["moved"] and row["resumed_equal"]
