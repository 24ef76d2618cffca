"""Where Megatron-Core's mixed-precision optimizers keep a stage's fp32 main copies, and how a
model weight is made again from them (``features/weight_prediction.py`` moves the weights and
puts them back through these).

Float16OptimizerWithFloat16Params pairs each bf16/fp16 model weight with a whole fp32 main
copy. The distributed optimizer keeps only this data-parallel rank's shard of each main copy;
the model weights live in flat buffers that the optimizer step writes shard by shard and an
all-gather over the stage's data-parallel group completes (stage-local).
"""

from __future__ import annotations

from typing import List

from ..features.base import sub_optimizers
from ..features.weight_prediction import MainPair


def main_pairs(optimizer) -> List[MainPair]:
    """Every weight with an fp32 main copy (or this rank's shard of one): where its model
    values live, the main copy, the matching slice of its gradient buffer."""
    pairs: List[MainPair] = []
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            pairs += _shard_pairs(opt, inner, group_of)
            continue
        for models, mains in zip(getattr(opt, "float16_groups", []),
                                 getattr(opt, "fp32_from_float16_groups", [])):
            for model, main in zip(models, mains):
                pairs.append(MainPair(inner, group_of[id(main)], model.data, main,
                                      getattr(model, "main_grad", None),
                                      bool(getattr(model, "sequence_parallel", False))))
    return pairs


def _shard_pairs(opt, inner, group_of) -> List[MainPair]:
    """The distributed optimizer: this rank's shard of each weight, in the param buffer (as
    Megatron-Core's _copy_main_params_to_model_params writes it) and in the gradient."""
    pairs = []
    for mains, models in zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups):
        for main, model in zip(mains, models):
            ranges = opt._get_model_param_range_map(model)
            world, own = ranges["gbuf_world_in_bucket"], ranges["param"]
            buffer_index, _dtype, bucket = opt.model_param_gbuf_map[model]
            flat = opt.buffers[buffer_index].buckets[bucket].param_data.view(-1)
            grad = getattr(model, "main_grad", None)
            pairs.append(MainPair(
                inner, group_of[id(main)], flat[world.start:world.end], main,
                None if grad is None else grad.view(-1)[own.start:own.end],
                bool(getattr(model, "sequence_parallel", False))))
    return pairs


def gather_weights(optimizer) -> None:
    """The distributed optimizer: bring every rank's shard into the stage's weights (the
    all-gather its step runs); nothing to do otherwise."""
    for opt in sub_optimizers(optimizer):
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            for chunk in opt.model_chunks:
                chunk.start_param_sync(force_sync=True)
