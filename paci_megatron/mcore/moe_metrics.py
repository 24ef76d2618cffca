"""One pipeline stage's MoE metrics (auxiliary losses), reported by Megatron's own code.

Megatron reports them once an iteration (``track_moe_metrics`` through megatron-core 0.17,
``MoEMetricsTracker.report`` from 0.18): it all-reduces each metric over the pipeline group and
divides by the whole model's MoE layer count. Under PACI the stages are not in lockstep, so
that all-reduce would hold every stage to the slowest one each iteration. Here the same report
runs with that one all-reduce skipped (the collection's pipeline group is a marker, and an
all-reduce over the marker does nothing: no process group is made, which with NCCL's eager
start-up would be a split every rank must join); the reductions inside the stage (TP, EP, DP)
stay Megatron's. It divides by the stage's own MoE layers: each stage's value is the mean over
its layers, and the iteration log (printed by the last stage) shows the last stage's.

Megatron scales the sums by 1 / micro-batches; under PACI the first call after a start or a
drain also runs the forwards then in flight, so the scale here is 1 / this stage's forwards in
the call (``forwards``, the runtime's count): each value is a mean per forward and per MoE layer.
The stage also keeps each metric's sum over the run, for its end-of-run line, and each
router's tokens per expert over the run (this rank's tokens: the routing before dispatch; a
forward hook adds the routing map's column sums on the device, read once at the end). Under
PACI that count holds the forwards the end-of-run drain drops (at most P - 1 - s micro-batches
of stage s); with full recomputation a recomputed forward counts again.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import types
from typing import Callable, Dict, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter


def moe_layers(model_chunks) -> int:
    """MoE layers on this stage (an MTP layer's MoE layer counts too)."""
    return sum(isinstance(module, MoELayer) for chunk in model_chunks
               for module in chunk.modules())


def track_names(load_balancing_type: str, z_loss_coeff: Optional[float]) -> List[str]:
    """The metrics Megatron-LM's training log asks the tracker for, from the same flags."""
    names = []
    for kind, name in (("aux_loss", "load_balancing_loss"),
                       ("seq_aux_loss", "seq_load_balancing_loss"),
                       ("global_aux_loss", "global_load_balancing_loss")):
        if kind in load_balancing_type:
            names.append(name)
    if z_loss_coeff is not None:
        names.append("z_loss")
    return names


class _ThisStage:
    """The pipeline group of a stage-local report: an all-reduce over it does nothing."""

    def size(self) -> int:
        return 1


THIS_STAGE = _ThisStage()


def stage_collection(pg_collection=None):
    """``pg_collection`` (or the default groups) with the marker as its pipeline group."""
    if pg_collection is None:
        local = types.SimpleNamespace(dp=parallel_state.get_data_parallel_group(
            with_context_parallel=False, partial_data_parallel=False))
    else:
        local = copy.copy(pg_collection)
    local.pp = THIS_STAGE
    return local


@contextlib.contextmanager
def stage_local_all_reduce():
    """While the report runs, an all-reduce over ``THIS_STAGE`` returns at once (a sum over
    one stage); every other all-reduce is torch's."""
    original = torch.distributed.all_reduce

    @functools.wraps(original)
    def all_reduce(tensor, *args, group=None, **kwargs):
        if group is THIS_STAGE:
            return None
        return original(tensor, *args, group=group, **kwargs)

    torch.distributed.all_reduce = all_reduce
    try:
        yield
    finally:
        torch.distributed.all_reduce = original


def megatron_report() -> Callable:
    """The installed megatron-core's once-an-iteration MoE metric report."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # through 0.17
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics
        return track_moe_metrics
    return get_moe_metrics_tracker().report


class StageMoeMetrics:
    """Runs Megatron's report stage-locally (``report``) and keeps the run's sums."""

    def __init__(self, model_chunks, forwards: Optional[Callable[[], int]] = None):
        self.layers = moe_layers(model_chunks)
        self.forwards = forwards  # PACI: the stage's forwards in the last call (None: stock)
        self.sums: Dict[str, torch.Tensor] = {}
        self.reports = 0
        self.tokens: List[torch.Tensor] = []  # per router: tokens routed to each expert
        for module in (m for chunk in model_chunks for m in chunk.modules()):
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._counter(len(self.tokens)))
                self.tokens.append(torch.zeros(module.weight.shape[0], dtype=torch.int64,
                                               device=module.weight.device))

    def _counter(self, index: int) -> Callable:
        def count(module, _inputs, output) -> None:
            if module.training and isinstance(output, tuple) and len(output) > 1:
                self.tokens[index].add_(output[1].sum(dim=0))  # routing map [tokens, experts]
        return count

    def report(self, report: Callable, *args, **kwargs):
        """``report(*args, **kwargs)`` as Megatron-LM's training log calls it, stage-local;
        what it adds to the caller's ``total_loss_dict`` is this stage's mean per MoE layer."""
        if self.layers == 0:  # a stage of dense layers only: nothing recorded, nothing to divide
            return ""
        call = inspect.signature(report).bind(*args, **kwargs)
        theirs = call.arguments.get("total_loss_dict")
        mine: Dict[str, torch.Tensor] = {}
        if self.forwards is not None:
            call.arguments["loss_scale"] = 1.0 / self.forwards()
        call.arguments.update(total_loss_dict=mine, moe_layer_freq=[1] * self.layers,
                              mtp_num_layers=None,
                              pg_collection=stage_collection(call.arguments.get("pg_collection")))
        with stage_local_all_reduce():
            result = report(*call.args, **call.kwargs)
        for name, value in mine.items():
            if theirs is not None:
                theirs[name] = theirs[name] + value if name in theirs else value
            self.sums[name] = self.sums[name] + value.detach() if name in self.sums \
                else value.detach().clone()
        self.reports += 1
        return result

    def take(self, loss_scale: float, iteration: int, names: List[str], num_layers: int
             ) -> Dict[str, torch.Tensor]:
        """pretrain_gpt_paci.py's once-an-iteration report: this iteration's metrics (device
        tensors: read them at the log interval only)."""
        values: Dict[str, torch.Tensor] = {}
        self.report(megatron_report(), loss_scale=loss_scale, iteration=iteration,
                    total_loss_dict=values, force_initialize=True, track_names=names,
                    num_layers=num_layers)
        return values

    def summary(self) -> Dict:
        """The run's mean of each metric and the tokens per expert (host syncs: call it at the
        end)."""
        means = {name: float(total) / max(self.reports, 1) for name, total in self.sums.items()}
        # a host sync, once: after the final drain (training.py, run.report), off the hot path
        tokens = torch.stack(self.tokens).tolist() if self.tokens else []
        return {"moe_layers": self.layers, "iterations": self.reports, "means": means,
                "tokens_per_expert": tokens}


def summary_line(stage: int, row: Optional[Dict]) -> Optional[str]:
    """A stage's end-of-run MoE line (None for a stage without MoE layers)."""
    if not row or not row["moe_layers"]:
        return None
    means = ", ".join(f"{name} {value:.6e}" for name, value in sorted(row["means"].items()))
    return (f"> PACI stage {stage} MoE ({row['moe_layers']} MoE layers, mean over "
            f"{row['iterations']} iterations): {means or 'no metric tracked'}"
            f"{token_balance(stage, row.get('tokens_per_expert') or [])}")


def token_balance(stage: int, tokens: List[List[int]]) -> str:
    """A second line: tokens per expert over the run as shares of the mean, the extremes over
    the stage's routers (empty where nothing was routed)."""
    means = [(layer, sum(layer) / len(layer)) for layer in tokens]
    shares = [count / mean for layer, mean in means if mean for count in layer]
    if not shares:
        return ""
    return (f"\n> PACI stage {stage} MoE tokens per expert (this rank's, over the run): from "
            f"{min(shares):.3f} to {max(shares):.3f} of the mean, {sum(tokens[0])} routed a "
            "router")
