"""Builders around stock Megatron-Core 0.16.1: GPT model chunks, optimizer, LR scheduler, a
mock data iterator and a Megatron-style forward step (process groups: ``distributed.py``).

Everything here is meant to behave like Megatron-LM's
``training.py`` / ``pretrain_gpt.py`` so that the stock schedules work unchanged on the built
model: ``config.no_sync_func``, ``config.finalize_model_grads_func`` and
``config.grad_scale_func`` are set the way Megatron-LM sets them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial
from typing import Iterator, List, Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from ..layer_split import LayerSplit
from ..restart import padded_vocab_size
from . import nadam
from .data import to_device

# re-exported: a run is built from this one module
from .distributed import (_is_gloo, destroy_distributed, init_distributed, peak_device_memory_mb,
                          peak_rss_mb, set_random_seed, stage_info)

__all__ = [
    "GPTSpec",
    "init_distributed",
    "destroy_distributed",
    "build_gpt_model",
    "build_optimizer",
    "build_lr_scheduler",
    "mock_data_iterator",
    "gpt_forward_step",
    "stage_info",
    "set_random_seed",
    "unwrap_model",
    "stage_layer_numbers",
    "peak_rss_mb",
    "peak_device_memory_mb",
]


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass
class GPTSpec:
    """Size and options of the GPT model (Megatron-LM flag names in the docstrings of builders)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    untie_embeddings: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    bf16: bool = False
    fp16: bool = False  # --fp16: half-precision weights, dynamic loss scaling in the optimizer
    calculate_per_token_loss: bool = False  # loss summed over tokens, grads / tokens at a step
    normalization: str = "LayerNorm"
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    position_embedding_type: str = "learned_absolute"
    transformer_impl: str = "local"
    make_vocab_size_divisible_by: int = 1  # Megatron-LM's flag (its default is 128)
    moe: Optional["MoESpec"] = None  # --num-experts: MoE layers (None: a dense GPT)
    mtp_num_layers: Optional[int] = None  # --mtp-num-layers: MTP layers on the last stage
    mtp_loss_scaling_factor: float = 0.1  # --mtp-loss-scaling-factor (Megatron-LM's default)
    # the uneven-stage flags (--decoder-first-pipeline-num-layers, ..., the layout)
    layer_split: LayerSplit = LayerSplit()


@dataclass(frozen=True)
class MoESpec:
    """Megatron-LM's MoE flags (their names, without --moe-), for the local (torch) layers."""

    num_experts: int
    router_topk: int = 2
    ffn_hidden_size: Optional[int] = None  # --moe-ffn-hidden-size (default: --ffn-hidden-size)
    layer_freq: int = 1  # --moe-layer-freq N: every N-th layer is MoE, the others dense
    aux_loss_coeff: float = 0.0
    z_loss_coeff: Optional[float] = None
    router_load_balancing_type: str = "aux_loss"
    router_score_function: str = "softmax"
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3  # per iteration (PACI: x a / N per local step)
    shared_expert_intermediate_size: Optional[int] = None
    token_dispatcher_type: str = "allgather"

    def config_fields(self) -> dict:
        """The TransformerConfig fields these flags set (local experts: no grouped GEMM)."""
        return dict(
            num_moe_experts=self.num_experts, moe_router_topk=self.router_topk,
            moe_ffn_hidden_size=self.ffn_hidden_size,
            moe_layer_freq=self.layer_freq, moe_aux_loss_coeff=self.aux_loss_coeff,
            moe_z_loss_coeff=self.z_loss_coeff,
            moe_router_load_balancing_type=self.router_load_balancing_type,
            moe_router_score_function=self.router_score_function,
            moe_router_enable_expert_bias=self.router_enable_expert_bias,
            moe_router_bias_update_rate=self.router_bias_update_rate,
            moe_shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            moe_token_dispatcher_type=self.token_dispatcher_type, moe_grouped_gemm=False,
            # Megatron's shared experts take no bias; its MoE GPT recipes train without one
            add_bias_linear=False)


def _check_layer_split(spec: GPTSpec, pp: int, vpp: Optional[int]) -> None:
    """Each stage gets a layer count Megatron-Core accepts (raises ConfigError, a ValueError,
    naming the flag); interleaving takes only an even split."""
    counts = spec.layer_split.layers_per_stage(spec.num_layers, pp)
    if vpp is not None and (not spec.layer_split.even or counts[0] % vpp):
        raise ValueError(
            f"--num-layers ({spec.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp}) x "
            f"--virtual-pipeline-model-parallel-size ({vpp}), with no uneven stages"
        )


def make_transformer_config(spec: GPTSpec) -> TransformerConfig:
    """The TransformerConfig for ``spec`` under the current parallel state."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    _check_layer_split(spec, pp, vpp)
    if spec.bf16 and spec.fp16:
        raise ValueError("GPTSpec: bf16 and fp16 are exclusive")
    dtype = torch.bfloat16 if spec.bf16 else torch.float16 if spec.fp16 else torch.float32
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        hidden_dropout=spec.hidden_dropout,
        attention_dropout=spec.attention_dropout,
        normalization=spec.normalization,
        recompute_granularity=spec.recompute_granularity,
        recompute_method=spec.recompute_method,
        recompute_num_layers=spec.recompute_num_layers,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=spec.bf16,
        fp16=spec.fp16,
        calculate_per_token_loss=spec.calculate_per_token_loss,
        # gloo runs batched p2p as separate ops and mis-pairs them when prev == next rank
        # (interleaved schedule at PP=2): silently wrong gradients. See CPU_NOTES.md.
        batch_p2p_comm=not _is_gloo(),
        # like Megatron-LM's defaults
        deallocate_pipeline_outputs=True,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        mtp_num_layers=spec.mtp_num_layers,
        mtp_loss_scaling_factor=spec.mtp_loss_scaling_factor,
        **(spec.moe.config_fields() if spec.moe is not None else {}),
        **spec.layer_split.config_fields(),
    )


def _layer_spec(spec: GPTSpec, config: TransformerConfig, vp_stage: Optional[int]):
    """The local (non-TE) spec is the CPU path; Transformer Engine only where importable."""
    if spec.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    if spec.moe is not None:  # dense and MoE layers as --moe-layer-freq places them
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=spec.normalization, vp_stage=vp_stage)
    return get_gpt_layer_local_spec(normalization=spec.normalization)


def _mtp_block_spec(spec: GPTSpec, config: TransformerConfig, layer_spec,
                    vp_stage: Optional[int]):
    """The MTP block as Megatron-LM's gpt_builders makes it: its layers take the spec of the
    decoder's last layer (a block spec with no layer on this stage: the plain layer's); None
    without --mtp-num-layers and on every stage but the one that holds the MTP layers."""
    if spec.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if getattr(layer_spec, "layer_specs", None) == []:
        layer_spec = get_gpt_layer_local_spec(normalization=spec.normalization)
    return get_gpt_mtp_block_spec(
        config, layer_spec, use_transformer_engine=spec.transformer_impl == "transformer_engine",
        vp_stage=vp_stage)


def build_gpt_model(
    spec: GPTSpec,
    *,
    ddp: bool = True,
    overlap_grad_reduce: bool = False,
    use_distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
    seed: int = 1234,
    layout_invariant_init: bool = True,
) -> List[torch.nn.Module]:
    """Build this rank's GPT model chunks (one per virtual stage) the way Megatron-LM does.

    Each chunk is a ``GPTModel`` with the local (non-TE) layer spec, wrapped in ``Float16Module``
    for bf16 and in Megatron's ``DistributedDataParallel`` when ``ddp``. With
    ``layout_invariant_init`` every weight is re-drawn from a generator seeded by ``seed`` and
    the parameter's global name (global layer number), so the initial model is the same for any
    TP/PP/VPP layout. Sets ``no_sync_func``/``grad_sync_func`` (overlap only, like Megatron-LM)
    and ``finalize_model_grads_func`` on the shared TransformerConfig. With ``ddp=False`` the
    chunks are bare modules (forward-only use; Megatron's optimizer and finalize need DDP).
    """
    config = make_transformer_config(spec)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    vocab = padded_vocab_size(spec.vocab_size, tp, spec.make_vocab_size_divisible_by)

    chunks: List[torch.nn.Module] = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        layer_spec = _layer_spec(spec, config, stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings or spec.seq_length,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=not spec.untie_embeddings,
            position_embedding_type=spec.position_embedding_type,
            mtp_block_spec=_mtp_block_spec(spec, config, layer_spec, stage),
            vp_stage=stage,
        )
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if layout_invariant_init:
            _layout_invariant_init(model, config, seed)
        chunks.append(model)

    if torch.cuda.is_available():
        for model in chunks:
            model.cuda(torch.cuda.current_device())
    if spec.bf16 or spec.fp16:
        chunks = [Float16Module(config, model) for model in chunks]

    if ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=spec.bf16,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
            overlap_param_gather=overlap_param_gather,
        )
        chunks = [
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=model,
                # like Megatron-LM: only the first chunk's buffers are bucketed
                disable_bucketing=i > 0,
            )
            for i, model in enumerate(chunks)
        ]
        if overlap_grad_reduce:
            no_sync = [c.no_sync for c in chunks]
            grad_sync = [c.start_grad_sync for c in chunks]
            config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
            config.grad_sync_func = grad_sync[0] if len(chunks) == 1 else grad_sync
        # DP all-reduce of the grad buffers, tied-embedding all-reduce between first and last
        # stage, then num_tokens scaling: what keeps tied embeddings equal across stages
        config.finalize_model_grads_func = finalize_model_grads
    return chunks


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers."""
    while isinstance(module, (DistributedDataParallel, Float16Module)):
        module = module.module
    return module


def stage_layer_numbers(model_chunks: List[torch.nn.Module]) -> List[int]:
    """The global numbers (1-based, Megatron's ``layer_number``) of the transformer layers
    this rank's chunks built: what the stage holds, read from the modules."""
    numbers = []
    for chunk in model_chunks:
        decoder = getattr(unwrap_model(chunk), "decoder", None)
        numbers += [layer.layer_number for layer in decoder.layers] if decoder is not None else []
    return numbers


def _stable_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode()) & 0x7FFFFFFF


def _layout_invariant_init(model: GPTModel, config: TransformerConfig, seed: int) -> None:
    """Re-draw every matrix weight from a generator keyed by (seed, global parameter name).

    The full (TP-unsharded) tensor is drawn and this rank's TP shard is kept, so the weights do
    not depend on the TP/PP/VPP layout. Vectors (norms, biases) keep Megatron's constant init.
    """
    layer_numbers = {}
    if getattr(model, "decoder", None) is not None:
        for i, layer in enumerate(model.decoder.layers):
            layer_numbers[str(i)] = layer.layer_number - 1  # global, 0-based
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # a name question, not "does stage 0 share a weight with the last" (tied.shares_first_and_
    # last): a tied output layer draws the embedding's values; MTP's copy of the embedding on
    # the last stage has the embedding's own name, so it draws them too
    tied = model.share_embeddings_and_output_weights

    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(layer_numbers[parts[2]])
        global_name = ".".join(parts)
        if global_name == "output_layer.weight" and tied:
            global_name = "embedding.word_embeddings.weight"

        if global_name.startswith("embedding."):
            init = config.embedding_init_method
        elif global_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            init = config.output_layer_init_method
        else:
            init = config.init_method

        shape = list(param.shape)
        tensor_parallel_param = getattr(param, "tensor_model_parallel", False) and tp > 1
        if tensor_parallel_param:
            shape[param.partition_dim] *= tp
        full = torch.empty(shape, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_stable_seed(seed, global_name))
            init(full)
        if tensor_parallel_param:
            stride = getattr(param, "partition_stride", 1)
            piece = param.shape[param.partition_dim] // stride
            pieces = torch.split(full, piece, dim=param.partition_dim)
            full = torch.cat(pieces[tp_rank::tp], dim=param.partition_dim)
        with torch.no_grad():
            param.data.copy_(full)


# --------------------------------------------------------------------------------------------
# Optimizer and LR schedule
# --------------------------------------------------------------------------------------------


def build_optimizer(
    model_chunks: List[torch.nn.Module],
    *,
    lr: float = 1e-3,
    min_lr: float = 0.0,
    weight_decay: float = 0.01,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    clip_grad: float = 1.0,
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    fp16: bool = False,
    loss_scale: Optional[float] = None,
    initial_loss_scale: float = 2.0**32,
    min_loss_scale: float = 1.0,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    optimizer: str = "adam",
    sgd_momentum: float = 0.9,
    decoupled_weight_decay: bool = True,
):
    """Megatron's Adam (AdamW, or L2 Adam without ``decoupled_weight_decay``) or SGD via
    ``get_megatron_optimizer``, or ``optimizer="nadam"``: Megatron's Adam with torch's NAdam
    inside (``nadam.py``); also sets ``config.grad_scale_func``.
    With ``fp16`` the optimizer keeps fp32 main weights and a loss scaler: static with
    ``loss_scale``, else dynamic (Megatron-LM's --initial-loss-scale, --min-loss-scale,
    --loss-scale-window, --hysteresis)."""
    model_config = get_model_config(model_chunks[0])
    for name, value in (("bf16", bf16), ("fp16", fp16)):
        if getattr(model_config, name) != value:
            raise ValueError(f"build_optimizer({name}={value}) does not match the model "
                             f"(GPTSpec.{name}={getattr(model_config, name)})")
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    if ddp_config is not None and ddp_config.use_distributed_optimizer != use_distributed_optimizer:
        raise ValueError(
            "use_distributed_optimizer must match the one given to build_gpt_model "
            f"({ddp_config.use_distributed_optimizer})"
        )
    opt_config = OptimizerConfig(
        optimizer="adam" if optimizer == "nadam" else optimizer,
        sgd_momentum=sgd_momentum,
        decoupled_weight_decay=decoupled_weight_decay,
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        clip_grad=clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        loss_scale=loss_scale,
        initial_loss_scale=initial_loss_scale,
        min_loss_scale=min_loss_scale,
        loss_scale_window=loss_scale_window,
        hysteresis=hysteresis,
    )
    built = get_megatron_optimizer(opt_config, model_chunks)
    if optimizer == "nadam":
        nadam.use_nadam(built, decoupled_weight_decay=decoupled_weight_decay)
    get_model_config(model_chunks[0]).grad_scale_func = built.scale_loss
    return built


def build_lr_scheduler(
    optimizer,
    *,
    lr: float,
    min_lr: float = 0.0,
    warmup_steps: int = 0,
    decay_steps: int = 1,
    decay_style: str = "cosine",
    override: bool = False,
    use_checkpoint: bool = False,
) -> OptimizerParamScheduler:
    """Megatron's ``OptimizerParamScheduler``: linear warmup to ``lr`` then ``decay_style``.
    On load, ``override`` keeps these settings, ``use_checkpoint`` takes the checkpoint's, and
    neither asserts they are equal (Megatron-LM's --override-opt_param-scheduler /
    --use-checkpoint-opt_param-scheduler; ``lr_resume`` explains a mismatch first)."""
    wd = optimizer.config.weight_decay if hasattr(optimizer, "config") else 0.0
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=decay_style,
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
        override_opt_param_scheduler=override,
        use_checkpoint_opt_param_scheduler=use_checkpoint,
    )


class BatchRamp:
    """--rampup-batch-size through Megatron-Core's own calculator (the class, not its
    process-wide global): the number of micro-batches per iteration after a number of samples."""

    def __init__(self, rampup, global_batch_size: int, micro_batch_size: int,
                 data_parallel_size: int, rank: int = 0):
        from megatron.core.num_microbatches_calculator import (
            RampupBatchsizeNumMicroBatchesCalculator,
        )

        start, incr, samples = rampup
        self.samples_per_microbatch = micro_batch_size * data_parallel_size
        self.calculator = RampupBatchsizeNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size,
            decrease_batch_size_if_needed=False, rank=rank,
            start_global_batch_size=start, batch_size_increment=incr, ramup_samples=samples)

    def micro_batches(self, consumed_samples: int) -> int:
        self.calculator.update(consumed_samples, consistency_check=True)
        return self.calculator.get()

    def per_iteration(self, iterations: int) -> List[int]:
        """The micro-batches of each of the first ``iterations`` iterations."""
        counts, consumed = [], 0
        for _ in range(iterations):
            counts.append(self.micro_batches(consumed))
            consumed += counts[-1] * self.samples_per_microbatch
        return counts


# --------------------------------------------------------------------------------------------
# Data and forward step
# --------------------------------------------------------------------------------------------


def mock_data_iterator(spec: GPTSpec, micro_batch_size: int, seed: int = 1234) -> Iterator[dict]:
    """Infinite, deterministic, learnable token stream (pure torch, CPU tensors).

    Each sequence starts at a random token and follows a fixed random permutation of the
    vocabulary (``next = perm[cur]``), so a model can learn it. The permutation depends on
    ``seed`` only; the start tokens on ``seed`` and the data-parallel rank, so all ranks of a DP
    replica (TP and PP ranks) see the same batches and different replicas different ones.
    """
    dp_rank = 0
    if parallel_state.model_parallel_is_initialized():
        dp_rank = parallel_state.get_data_parallel_rank()
    vocab, seq = spec.vocab_size, spec.seq_length
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(_stable_seed(seed, f"data/dp{dp_rank}"))
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(micro_batch_size, -1)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    while True:
        rows = torch.empty(micro_batch_size, seq + 1, dtype=torch.long)
        rows[:, 0] = torch.randint(0, vocab, (micro_batch_size,), generator=gen)
        for t in range(seq):
            rows[:, t + 1] = perm[rows[:, t]]
        yield {
            "tokens": to_device(rows[:, :-1].contiguous(), device),
            "labels": to_device(rows[:, 1:].contiguous(), device),
            "loss_mask": torch.ones(micro_batch_size, seq, dtype=torch.float, device=device),
            "attention_mask": None,
            "position_ids": to_device(position_ids.contiguous(), device),
        }


def _lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch; the logged value is averaged over DP replicas."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    reported = loss.detach().clone()
    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(reported, group=parallel_state.get_data_parallel_group())
        reported /= parallel_state.get_data_parallel_world_size()
    return loss, {"lm loss": reported}


def _lm_loss_per_token(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """--calculate-per-token-loss, as Megatron-LM's pretrain_gpt.py: the summed token loss
    and the token count (the schedule divides the gradients by the batch's count); the logged
    value is ``[loss sum, tokens]``, summed over DP replicas (``training._mean_loss`` divides)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    reported = torch.cat([loss.detach().clone().view(1), num_tokens.float().view(1)])
    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    return loss, num_tokens, {"lm loss": reported}


def gpt_forward_step(data_iterator, model):
    """Megatron-style ``forward_step_func``: returns ``(output, partial(loss_fn, loss_mask))``.

    Reads exactly one batch per call on the first and last pipeline stages (all their virtual
    chunks, like Megatron-LM's ``get_batch``) and none on middle stages.
    """
    reads = parallel_state.is_pipeline_first_stage(ignore_virtual=True) or (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    )
    if reads:
        batch = next(data_iterator)
        tokens, labels = batch["tokens"], batch["labels"]
        loss_mask, position_ids = batch["loss_mask"], batch["position_ids"]
        attention_mask = batch.get("attention_mask")
    else:
        tokens = labels = loss_mask = position_ids = attention_mask = None
    # the loss mask reaches the model as in Megatron-LM's pretrain_gpt.py: MTP's losses use it
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    per_token = get_model_config(model).calculate_per_token_loss
    return output, partial(_lm_loss_per_token if per_token else _lm_loss, loss_mask)
