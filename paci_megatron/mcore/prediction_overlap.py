"""--paci-weight-prediction-overlap: move the weights layer by layer, beside the forward.

A predicted forward needs each layer's weights moved before that layer runs and put back
after it, not the whole stage's before the forward starts. So the stage's transformer layers
get a forward pre-hook and a forward hook:

* before the forward, the stage's scalars (clipping norm, finite flag) are computed once and
  the weights outside the layers (the embedding) and the first layer's are moved (exposed);
* layer l's pre-hook waits for layer l's move, then starts layer l+1's on a side stream, so
  it runs while layer l computes;
* layer l's forward hook puts layer l back on the side stream once layer l's kernels are
  queued (an event orders the two streams: the restore waits for the forward, never the host);
* after the forward the compute stream waits for the side stream, and the weights outside
  the layers are put back (exposed).

Only the first move and the last restore are exposed. On a CPU there is no side stream: the
same hooks run the same moves in place, one after another (what the tests check: the forward
and the weights after it equal the whole-stage move's, bit for bit). The hooks act only while
a predicted forward runs, so an activation recompute in the backward (which re-runs the
layers' forwards) or a CUDA-graph capture sees none of them.

Not with the distributed optimizer: its weights are completed by an all-gather per bucket,
and a bucket spans layers (it would need buckets split per layer); there the whole stage
moves before the forward, as without this flag.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .admission import unwrap


def transformer_layers(model) -> List[torch.nn.Module]:
    """The stage's transformer layers in forward order (Megatron's TransformerBlock)."""
    decoder = getattr(unwrap(model), "decoder", None)
    return list(getattr(decoder, "layers", []) or [])


class LayerwiseMove:
    """The hooks and streams of one stage (see the module docstring)."""

    def __init__(self, layout, model):
        self.layout = layout
        self.layers = transformer_layers(model)
        in_layers = {id(p) for layer in self.layers for p in layer.parameters()}
        self.outside = layout.pieces_of([p for p in model.parameters() if id(p) not in in_layers])
        self.units = [layout.pieces_of(list(layer.parameters())) for layer in self.layers]
        self.active = False
        self.coef, self.fold = None, False
        cuda = layout.stage_pass.device.type == "cuda"
        self.side = torch.cuda.Stream() if cuda else None
        self.moved: List[Optional[object]] = [None] * len(self.layers)  # CUDA events
        self.handles = []
        for index, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(self._before_layer(index)))
            self.handles.append(layer.register_forward_hook(self._after_layer(index)))

    @staticmethod
    def supported(layout, model) -> str:
        """'' where the layer-by-layer move can run, else why not."""
        if layout.sharded:
            return ("the distributed optimizer completes the weights with an all-gather per "
                    "bucket, and buckets span layers")
        if not transformer_layers(model):
            return "the stage has no transformer layers to hook"
        return ""

    def piece_sets(self) -> list:
        """What it moves besides the whole stage (each compiled at start-up: Pass.settle)."""
        return [self.outside, *self.units]

    # the feature's two calls ----------------------------------------------------------------
    def start(self, coef, fold: bool) -> None:
        """Before the forward: the weights outside the layers and the first layer's."""
        if self._capturing():
            self.active = False
            self.layout.stage_pass.move_pieces(self.layout.stage_pass.pieces, coef, fold)
            return
        self.coef, self.fold, self.active = coef, fold, True
        sp = self.layout.stage_pass
        sp.move_pieces(self.outside, coef, fold)
        if self.units:
            sp.move_pieces(self.units[0], coef, fold)
        if self.side is not None:
            coef.record_stream(self.side)

    def finish(self) -> None:
        """After the forward: every layer is back; then the weights outside them."""
        sp = self.layout.stage_pass
        if not self.active:  # moved whole (a capture, or no hook ran)
            sp.restore()
            return
        self.active = False
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        sp.restore(self.outside)

    # the hooks ------------------------------------------------------------------------------
    def _before_layer(self, index: int):
        def hook(_module, _args):
            if not self.active:
                return
            nxt = index + 1
            if self.side is None:  # CPU: in place, one after another
                if nxt < len(self.units):
                    self.layout.stage_pass.move_pieces(self.units[nxt], self.coef, self.fold)
                return
            if self.moved[index] is not None:
                torch.cuda.current_stream().wait_event(self.moved[index])
            if nxt < len(self.units):
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    self.layout.stage_pass.move_pieces(self.units[nxt], self.coef, self.fold)
                    self.moved[nxt] = torch.cuda.Event()
                    self.moved[nxt].record(self.side)
        return hook

    def _after_layer(self, index: int):
        def hook(_module, _args, _output):
            if not self.active:
                return
            sp = self.layout.stage_pass
            if self.side is None:
                sp.restore(self.units[index])
                return
            self.side.wait_stream(torch.cuda.current_stream())  # layer index's kernels first
            with torch.cuda.stream(self.side):
                sp.restore(self.units[index])
        return hook

    @staticmethod
    def _capturing() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
