"""BackwardAudit on plain torch modules: it tells a backward that read the current weights
from one that read a copy derived from them at forward time."""

import torch

from paci_megatron.autograd_versions import keep_version_counters
from paci_megatron.tools.backward_audit import BackwardAudit


class ZeroCenteredLayerNorm(torch.nn.Module):
    """LayerNorm with zero-centred gamma as Apex's FusedLayerNorm computes it
    (``--apply-layernorm-1p``): ``weight + 1`` is derived in the forward and saved by autograd."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(width))
        self.bias = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight + 1, self.bias)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                               ZeroCenteredLayerNorm(8), torch.nn.Linear(8, 3))


def _forward(model, audit, mb):
    audit.forward_phase(mb)
    loss = model(torch.randn(4, 8, requires_grad=True)).pow(2).sum()
    audit.idle()
    return loss


def _backward(audit, loss, mb):
    audit.backward_phase(mb)
    loss.backward()
    audit.idle()
    return {v.module: v for v in audit.verify(mb)}


def test_without_a_step_every_module_matches_both_weight_versions():
    model = _model()
    audit = BackwardAudit(model)
    verdicts = _backward(audit, _forward(model, audit, 0), 0)
    assert sorted(verdicts) == ["0", "1", "2", "3"]
    for v in verdicts.values():
        assert not v.weights_changed and v.matches_current and v.matches_forward_time


def test_a_step_between_forward_and_backward_exposes_a_derived_weight_copy():
    model = _model()
    audit = BackwardAudit(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = _forward(model, audit, 0)
    _backward(audit, _forward(model, audit, 1), 1)  # gives every weight a gradient
    with keep_version_counters(list(model.parameters())):
        optimizer.step()  # in place, between micro-batch 0's forward and its backward
    optimizer.zero_grad()
    verdicts = _backward(audit, loss, 0)
    for name in ("0", "1", "3"):  # Linear, LayerNorm, Linear read the weights at backward
        v = verdicts[name]
        assert v.weights_changed and v.matches_current and not v.matches_forward_time
        assert v.max_abs_error == 0.0
    zero_centred = verdicts["2"]  # weight + 1 was saved at forward: the old values
    assert zero_centred.weights_changed
    assert not zero_centred.matches_current and zero_centred.matches_forward_time
    assert zero_centred.max_abs_error > 1e-3
