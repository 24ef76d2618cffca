"""The local step's finite-gradient check (min and max per gradient buffer): exact for NaN,
+Inf and -Inf anywhere in any buffer, and never fooled by large finite values."""

from types import SimpleNamespace

import pytest
import torch

from paci_megatron.mcore.local_step import grads_are_finite


def _stage(*grads):
    """What grads_are_finite reads of Megatron's DDP: its gradient buffers."""
    return SimpleNamespace(buffers=[SimpleNamespace(grad_data=g) for g in grads])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 500, 999])
def test_any_nonfinite_element_is_caught(dtype, bad, where):
    clean = torch.linspace(-1, 1, 300, dtype=dtype)
    grad = torch.linspace(-2, 2, 1000, dtype=dtype)
    grad[where] = bad
    assert grads_are_finite(_stage(clean, grad), None) is False
    assert grads_are_finite(_stage(grad, clean), None) is False


def test_large_finite_values_and_empty_buffers_pass():
    big = torch.tensor([3e38, -3e38, 0.0, -0.0, 1e-45])
    assert grads_are_finite(_stage(big, torch.empty(0)), None) is True
    assert grads_are_finite(_stage(torch.empty(0)), None) is True


def test_without_buffers_reads_parameter_grads():
    layer = torch.nn.Linear(4, 3)
    layer.weight.grad = torch.zeros(3, 4)
    layer.bias.grad = torch.zeros(3)
    model = SimpleNamespace(parameters=layer.parameters)
    assert grads_are_finite(model, None) is True
    layer.bias.grad[1] = float("-inf")
    assert grads_are_finite(model, None) is False
