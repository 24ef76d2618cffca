"""The saved-tensor meter counts what autograd keeps for backward, and frees it with the graph."""

import torch

from paci_megatron.memory import SavedTensorMeter


def test_meter_tracks_in_flight_activations():
    layer = torch.nn.Linear(64, 64)
    meter = SavedTensorMeter(layer.parameters())
    step = meter.wrap(lambda x: torch.relu(layer(x)))
    outs = [step(torch.randn(8, 64)) for _ in range(3)]  # three micro-batches in flight
    per_mb = meter.live / 3
    assert per_mb > 0 and meter.peak == meter.live
    outs[0].sum().backward()
    del outs[0]
    assert meter.live == 2 * per_mb
    for out in outs:
        out.sum().backward()
    del outs, out
    assert meter.live == 0 and meter.peak == 3 * per_mb
    assert not meter.refs
