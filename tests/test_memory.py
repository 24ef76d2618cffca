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


def test_weights_moved_after_the_meter_was_made_are_still_not_activations():
    """Weight prediction moves the weights into one flat buffer once the run has started (as
    mcore/main_params does): the meter must not count them as saved activations then."""
    layer = torch.nn.Linear(64, 64, bias=False)
    meter = SavedTensorMeter(layer.parameters())
    step = meter.wrap(lambda x: layer(x))
    x = torch.randn(8, 64, requires_grad=True)
    step(x).sum().backward()
    before = meter.peak  # the input only: the weight is saved by reference
    assert before == x.untyped_storage().nbytes()
    flat = torch.empty(2 * 64 * 64)
    flat[64 * 64:].copy_(layer.weight.detach().reshape(-1))
    layer.weight.data = flat[64 * 64:].view(64, 64)
    meter.peak = 0
    step(x).sum().backward()
    assert meter.peak == before


def test_live_meter_counts_a_known_allocation_once_and_frees_it():
    from paci_megatron.memory import LiveTensorMeter

    meter = LiveTensorMeter().start()
    try:
        base = meter.live
        held = torch.empty(250_000)  # 1 MB, alive across the ops below
        assert meter.live == base + 1_000_000
        views = [held.view(500, 500), held[10:]]  # views add no storage
        assert meter.live == base + 1_000_000
        tmp = torch.ones(1000) * 2  # 4 kB, and the 4 kB of ones() freed right after
        torch.zeros(0)  # any operator looks for freed storages
        assert meter.live == base + 1_000_000 + 4000
        del held, views, tmp
        torch.zeros(0)  # any operator looks for freed storages
        assert meter.live == base
        assert meter.peak >= base + 1_000_000 + 8000  # ones() and its product were both alive
    finally:
        meter.stop()


def test_live_meter_counts_optimizer_state_and_gradients():
    from paci_megatron.memory import LiveTensorMeter

    layer = torch.nn.Linear(64, 64)
    param_bytes = (64 * 64 + 64) * 4
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3, foreach=False)
    meter = LiveTensorMeter().start()
    try:
        before = meter.live  # the weights were found by the start-up scan
        assert before >= param_bytes
        layer(torch.randn(8, 64)).sum().backward()
        torch.zeros(0)
        assert meter.live == before + param_bytes  # the input is gone, the gradients stay
        optimizer.step()
        torch.zeros(0)
        # Adam's two moments per weight, and a 4-byte step count per parameter tensor
        assert meter.live == before + param_bytes + 2 * param_bytes + 2 * 4
        optimizer.zero_grad(set_to_none=True)
        torch.zeros(0)
        assert meter.live == before + 2 * param_bytes + 2 * 4
    finally:
        meter.stop()
