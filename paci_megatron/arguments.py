"""Command-line flags with Megatron-LM's names, plus PACI's, and checks that run before any
process group starts (so bad input fails fast with the flag and the fix in the message)."""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from .config import (Layout, PaciConfig, add_paci_arguments, first_stage_shares_weight,
                     rampup_micro_batches, refuse_tied_mtp_checkpoints, resolve)
from .flag import ConfigError, bounded_float, bounded_int, non_negative_float, path, positive, \
    probability
from .layer_split import LayerSplit
from .quiet import exit_after_local_rank0, is_local_rank0

# pretrain_gpt_paci.py's flags whose default differs from Megatron-LM 0.16.1's (same name,
# same meaning), and why; docs/megatron-lm.md lists them, tests/test_megatron_lm.py keeps the
# list true. Add the flag to either command line to match the other.
MEGATRON_LM_DEFAULT_DIFFERENCES = {
    "num_layers": "a tiny model runs with no flag (Megatron-LM requires it)",
    "hidden_size": "the same", "num_attention_heads": "the same", "seq_length": "the same",
    "micro_batch_size": "the same", "train_iters": "the same", "lr": "the same",
    "split": "mock data and a text file train with no flag",
    "hidden_dropout": "0: runs that must match bit for bit need no flag",
    "attention_dropout": "the same",
    "lr_decay_style": "cosine (the convergence studies'); Megatron-LM's is linear, and it "
                      "refuses a checkpoint whose schedule differs from its flags",
    "eval_iters": "short evaluations on CPU", "log_interval": "every iteration is logged",
    "distributed_timeout_minutes": "a stalled stage stops the job sooner",
    "distributed_backend": "nccl with CUDA, else gloo (Megatron-LM: nccl)",
    "pipeline_model_parallel_size": "every rank not used by tensor parallelism is a stage",
    "transformer_impl": "the local layers, the CPU path (Transformer Engine needs CUDA)",
    "make_vocab_size_divisible_by": "1: a tiny vocabulary is not padded to 128 rows",
}


class _Parser(argparse.ArgumentParser):
    """A usage error is printed once per node (local rank 0; every rank parses the same flags
    under torchrun), as one line: the usage text would list every flag."""

    def error(self, message: str):
        if is_local_rank0():
            self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        exit_after_local_rank0(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        description="GPT pretraining on Megatron-Core with a selectable pipeline schedule "
                    "(PACI: asynchronous, bubble-free, bounded weight drift).")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=positive("--num-layers"), default=4)
    g.add_argument("--hidden-size", type=positive("--hidden-size"), default=64)
    g.add_argument("--num-attention-heads", type=positive("--num-attention-heads"), default=4)
    g.add_argument("--ffn-hidden-size", type=positive("--ffn-hidden-size"), default=None)
    g.add_argument("--seq-length", type=positive("--seq-length"), default=32)
    g.add_argument("--max-position-embeddings", type=positive("--max-position-embeddings"),
                   default=None)
    g.add_argument("--vocab-size", type=positive("--vocab-size"), default=None,
                   help="mock data: token ids 0..N-1 (default 256); with --tokenizer-model: "
                        "taken from the model")
    g.add_argument("--make-vocab-size-divisible-by",
                   type=positive("--make-vocab-size-divisible-by"), default=1,
                   help="pad the vocabulary to a multiple of this x TP (Megatron-LM's default "
                        "is 128: give it to exchange checkpoints with Megatron-LM exactly)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--hidden-dropout", type=probability("--hidden-dropout"), default=0.0)
    g.add_argument("--attention-dropout", type=probability("--attention-dropout"), default=0.0)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute")
    g.add_argument("--mtp-num-layers", type=positive("--mtp-num-layers"), default=None,
                   help="multi-token prediction: this many MTP layers on the last stage, each "
                        "predicting one token further (needs --position-embedding-type rope "
                        "or none, as in Megatron-LM)")
    g.add_argument("--mtp-loss-scaling-factor",
                   type=non_negative_float("--mtp-loss-scaling-factor"), default=0.1,
                   help="the MTP losses' weight: their mean over the MTP layers times this")
    g = p.add_argument_group("mixture of experts (Megatron-LM's flags)")
    g.add_argument("--num-experts", type=positive("--num-experts"), default=None,
                   help="MoE layers with this many experts (default: a dense GPT)")
    g.add_argument("--moe-router-topk", type=positive("--moe-router-topk"), default=2)
    g.add_argument("--moe-ffn-hidden-size", type=positive("--moe-ffn-hidden-size"), default=None,
                   help="each expert's hidden size (default: --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=positive("--moe-layer-freq"), default=1,
                   help="every N-th layer is MoE, the others dense")
    g.add_argument("--moe-aux-loss-coeff", type=non_negative_float("--moe-aux-loss-coeff"),
                   default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=non_negative_float("--moe-z-loss-coeff"),
                   default=None)
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "none"])
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"],
                   default="softmax")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias moved at every optimizer "
                        "step (needs --moe-router-score-function sigmoid); under PACI at every "
                        "local step by the rate x a / N (as far per sample as 1F1B)")
    g.add_argument("--moe-router-bias-update-rate",
                   type=non_negative_float("--moe-router-bias-update-rate"), default=1e-3,
                   help="the expert bias's move per iteration (Megatron-LM's default 1e-3)")
    g.add_argument("--moe-shared-expert-intermediate-size",
                   type=positive("--moe-shared-expert-intermediate-size"), default=None)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"],
                   default="allgather")
    g.add_argument("--expert-model-parallel-size",
                   type=positive("--expert-model-parallel-size"), default=1,
                   help="the experts of a layer split over this many data-parallel ranks of "
                        "a stage")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=positive("--tensor-model-parallel-size"),
                   default=1)
    g.add_argument("--pipeline-model-parallel-size",
                   type=positive("--pipeline-model-parallel-size"), default=None,
                   help="default: every rank not used by tensor parallelism (data parallel 1)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage",
                   type=positive("--num-layers-per-virtual-pipeline-stage"), default=None)
    g.add_argument("--decoder-first-pipeline-num-layers",
                   type=positive("--decoder-first-pipeline-num-layers"), default=None,
                   help="transformer layers on the first stage (which also holds the "
                        "embedding); the stages between share the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers",
                   type=positive("--decoder-last-pipeline-num-layers"), default=None,
                   help="transformer layers on the last stage (which also holds the output "
                        "layer and the loss)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer of the even split: the first stage "
                        "builds one transformer layer fewer")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the loss as a layer of the even split: the last stage builds "
                        "one transformer layer fewer")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="every stage's layers, e.g. 'Et|tttt|tL': E embedding, t transformer "
                        "layer, L loss, '|' between stages, '(tt|)*3' and 't*3' repeat; one "
                        "stage per pipeline rank")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=bounded_float(
        "--distributed-timeout-minutes", low_open=True), default=5.0,
        help="a stage that stalls this long makes its neighbours (and the job) stop")
    g = p.add_argument_group("batch and optimizer")
    g.add_argument("--micro-batch-size", type=positive("--micro-batch-size"), default=2)
    g.add_argument("--global-batch-size", type=positive("--global-batch-size"), default=None,
                   help="default: 8 micro-batches per data-parallel rank")
    g.add_argument("--train-iters", type=positive("--train-iters"), default=20)
    g.add_argument("--lr", type=non_negative_float("--lr"), default=1e-3)
    g.add_argument("--min-lr", type=non_negative_float("--min-lr"), default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=bounded_int("--lr-warmup-iters", 0), default=0)
    g.add_argument("--weight-decay", type=non_negative_float("--weight-decay"), default=0.01)
    g.add_argument("--adam-beta1", type=probability("--adam-beta1"), default=0.9)
    g.add_argument("--adam-beta2", type=probability("--adam-beta2"), default=0.999)
    g.add_argument("--optimizer", choices=["adam", "nadam"], default="adam",
                   help="adam: Megatron-Core's Adam with decoupled weight decay (AdamW); "
                        "nadam: torch's NAdam inside Megatron's wrappers, the same betas "
                        "(--adam-beta1/2), decoupled weight decay, momentum decay 0.004 "
                        "(not with --paci-lookahead or --paci-weight-prediction, which "
                        "follow Adam's steps)")
    g.add_argument("--clip-grad", type=non_negative_float("--clip-grad"), default=1.0)
    g.add_argument("--rampup-batch-size", nargs=3, type=positive("--rampup-batch-size"),
                   default=None, metavar=("START", "INCR", "SAMPLES"),
                   help="as in Megatron-LM: the global batch size starts at START and grows by "
                        "INCR, evenly over the first SAMPLES samples, up to --global-batch-size "
                        "(PACI drains where the number of micro-batches changes)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over the data-parallel ranks of a stage")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start the data-parallel gradient reduction during the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer and --overlap-grad-reduce: gather the "
                        "updated parameters during the next forward pass")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 weights with dynamic loss scaling; under PACI every stage has its "
                        "own scaler and skips its own overflowing steps")
    g.add_argument("--loss-scale", type=bounded_float("--loss-scale", low_open=True),
                   default=None, help="--fp16: a static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=bounded_float("--initial-loss-scale",
                   low_open=True), default=2.0 ** 32, help="--fp16: the dynamic scale's start")
    g.add_argument("--min-loss-scale", type=bounded_float("--min-loss-scale", low_open=True),
                   default=1.0, help="--fp16: the dynamic scale's floor")
    g.add_argument("--loss-scale-window", type=positive("--loss-scale-window"), default=1000,
                   help="--fp16: steps without overflow before the scale doubles")
    g.add_argument("--hysteresis", type=positive("--hysteresis"), default=2,
                   help="--fp16: overflowing steps in a row before the scale halves")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over the tokens of a batch (a local step's group "
                        "under PACI), not over micro-batches")
    g.add_argument("--seed", type=bounded_int("--seed", 0), default=1234)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="transformer_engine only where Transformer Engine is importable")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=positive("--recompute-num-layers"),
                   default=None)
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic tokens (the default when no --data-path is given)")
    g.add_argument("--data-path", type=path("--data-path"), default=None,
                   help="prefix of a Megatron indexed dataset (PREFIX.bin / PREFIX.idx)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", type=path("--tokenizer-model"), default=None)
    g = p.add_argument_group("evaluation, checkpoints and logging")
    g.add_argument("--eval-interval", type=positive("--eval-interval"), default=None)
    g.add_argument("--eval-iters", type=positive("--eval-iters"), default=2)
    g.add_argument("--save", type=path("--save"), default=None,
                   help="checkpoint directory to write")
    g.add_argument("--load", type=path("--load"), default=None,
                   help="checkpoint directory to resume from (its newest complete checkpoint); "
                        "a missing or empty one starts from scratch, as in Megatron-LM, so "
                        "--save DIR --load DIR works from the first launch and after restarts")
    g.add_argument("--save-interval", type=positive("--save-interval"), default=None)
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="with --use-distributed-optimizer: write its state per parameter, "
                        "gathered on data-parallel rank 0 over gloo (Megatron-LM's flag, with "
                        "its memory-efficient gather), so the checkpoint also loads into another "
                        "P or TP; the default format reshards over data parallelism only")
    g.add_argument("--save-interval-minutes", type=bounded_float(
        "--save-interval-minutes", low_open=True), default=None,
        help="also save when this much wall-clock time has passed since the last save (bounds "
             "the work a crash loses, whatever the iteration time; stages agree on the "
             "iteration at about 10 check points per interval)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="with --load: train with the flags' LR schedule (--lr, --min-lr, "
                        "--lr-warmup-iters, --train-iters, --lr-decay-style, --weight-decay) "
                        "from the checkpoint's position in it, where they differ from the "
                        "checkpoint's (default: such a difference is an error)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="with --load: keep the checkpoint's LR schedule where the flags differ")
    g.add_argument("--exit-interval", type=positive("--exit-interval"), default=None,
                   help="stop (evaluate, save with --save) when the iteration is a multiple "
                        "of this; resume with --load and the same --train-iters")
    g.add_argument("--log-interval", type=positive("--log-interval"), default=1)
    g.add_argument("--tensorboard-dir", type=path("--tensorboard-dir"), default=None)
    g.add_argument("--measure-activation-memory", action="store_true",
                   help="count the bytes autograd keeps for backward (per stage peak in the "
                        "final metrics record)")
    g.add_argument("--measure-memory", action="store_true",
                   help="on CPU, count every live tensor of each stage (weights, gradients, "
                        "optimizer state and temporaries, activations, buffers; slows training) "
                        "for the per-stage peak_memory_mb; on CUDA the allocator's peak is "
                        "always reported")
    g.add_argument("--metrics-file", type=path("--metrics-file"), default=None,
                   help="append one JSON object per logged iteration (and a final one)")
    add_paci_arguments(p, schedule_default="paci")
    return p


def validate(args: argparse.Namespace, world_size: int) -> PaciConfig:
    """Fill derived values into ``args`` and check them; raises ConfigError."""
    tp = args.tensor_model_parallel_size
    if world_size % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} must divide the world size "
                          f"{world_size} (torchrun --nproc-per-node x --nnodes)")
    pp = args.pipeline_model_parallel_size or world_size // tp
    args.pipeline_model_parallel_size = pp
    if world_size % (tp * pp):
        raise ConfigError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size "
                          f"{pp} must divide the world size {world_size}")
    dp = world_size // (tp * pp)
    args.data_parallel_size = dp
    vpp = _validate_layer_split(args, pp)
    args.virtual_pipeline_model_parallel_size = vpp
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} must be divisible by "
                          f"--num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} must be divisible "
                          f"by --tensor-model-parallel-size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    if args.global_batch_size is None:
        args.global_batch_size = 8 * args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                          f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}"
                          f" = {per_step}")
    num_mb = args.global_batch_size // per_step
    args.num_microbatches = num_mb
    ramp = rampup_micro_batches(args.rampup_batch_size, args.global_batch_size, per_step)
    _validate_data_parallel_flags(args)
    _validate_moe(args, dp)
    _validate_mtp(args)
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive; pick one")
    check_loss_scales(args)
    _validate_data_and_outputs(args)
    if args.lr_warmup_iters < 0:
        raise ConfigError(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    return resolve(args, Layout(
        pipeline_size=pp, microbatches=ramp[0] if ramp else num_mb,
        micro_batch_size=args.micro_batch_size, data_parallel_size=dp, virtual=vpp is not None,
        ramp=tuple(ramp), tied=first_stage_shares_weight(
            pp, args.untie_embeddings_and_output_weights, args.mtp_num_layers),
        mtp=pp > 1 and args.mtp_num_layers is not None, fp16=args.fp16))


def layer_split(args) -> LayerSplit:
    """The uneven-stage flags as given (Megatron-LM's names)."""
    return LayerSplit(first=args.decoder_first_pipeline_num_layers,
                      last=args.decoder_last_pipeline_num_layers,
                      embedding=args.account_for_embedding_in_pipeline_split,
                      loss=args.account_for_loss_in_pipeline_split,
                      layout=args.pipeline_model_parallel_layout)


def _validate_layer_split(args, pp: int) -> Optional[int]:
    """Each stage's transformer layers into ``args.layers_per_stage``; returns the virtual
    stages per rank (None without interleaving)."""
    split = layer_split(args)
    counts = split.layers_per_stage(args.num_layers, pp)
    args.layers_per_stage = list(counts)
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is None:
        return None
    if not split.even:
        raise ConfigError(f"{', '.join(split.given())} with "
                          "--num-layers-per-virtual-pipeline-stage: uneven stages with virtual "
                          "stages are not supported here; drop one")
    if counts[0] % per_chunk:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} must divide "
                          f"the {counts[0]} layers of each pipeline stage")
    vpp = counts[0] // per_chunk
    return None if vpp == 1 else vpp


MOE_FLAGS = ("moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
             "moe_ffn_hidden_size", "moe_z_loss_coeff")


def _validate_moe(args, dp: int) -> None:
    """Megatron-LM's MoE rules."""
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        given = [f"--{name.replace('_', '-')}" for name in MOE_FLAGS if getattr(args, name)]
        given += ["--expert-model-parallel-size"] if ep > 1 else []
        if given:
            raise ConfigError(f"{', '.join(given)} need MoE layers: add --num-experts N")
        return
    if dp % ep or args.num_experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} must divide the data-parallel size "
                          f"{dp} and --num-experts {args.num_experts}")
    if args.moe_router_topk > args.num_experts:
        raise ConfigError(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts "
                          f"{args.num_experts}")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                          "sigmoid (as in Megatron-LM)")


def _validate_mtp(args) -> None:
    """Megatron-LM's MTP rules, and the layouts this entry point builds MTP with."""
    if args.mtp_num_layers is None:
        return
    if args.position_embedding_type not in ("rope", "none"):
        raise ConfigError(f"--mtp-num-layers needs --position-embedding-type rope or none (as "
                          f"in Megatron-LM), not {args.position_embedding_type}")
    refuse_tied_mtp_checkpoints(args.pipeline_model_parallel_size,
                                args.untie_embeddings_and_output_weights, args.mtp_num_layers,
                                args.save)
    if args.pipeline_model_parallel_layout is not None:
        raise ConfigError("--mtp-num-layers with --pipeline-model-parallel-layout is not "
                          "supported by pretrain_gpt_paci.py (the MTP layers go on the last "
                          "stage); split with --decoder-first/last-pipeline-num-layers instead")


def _validate_data_parallel_flags(args) -> None:
    """Megatron-LM's own rules for the overlap flags."""
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                          "--overlap-grad-reduce (as in Megatron-LM); add them or drop it")


def check_loss_scales(args) -> None:
    """Megatron-LM's own rule for the fp16 scales (PACI's are in config.py)."""
    if args.fp16 and (args.min_loss_scale or 0) > (args.initial_loss_scale or 0) \
            and args.loss_scale is None:
        raise ConfigError(f"--min-loss-scale {args.min_loss_scale:g} is above "
                          f"--initial-loss-scale {args.initial_loss_scale:g}")


def _validate_data_and_outputs(args) -> None:
    if args.tokenizer_model is not None and not os.path.isfile(args.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: no such file; run "
                          "python -m paci_megatron.tools.preprocess_data first")
    if args.data_path is not None and args.mock_data:
        raise ConfigError("--mock-data and --data-path are exclusive; drop one")
    if args.data_path is not None:
        if args.tokenizer_type is None:
            args.tokenizer_type = "SentencePieceTokenizer"
        if args.tokenizer_type == "SentencePieceTokenizer":
            if not args.tokenizer_model:
                raise ConfigError("--data-path with SentencePieceTokenizer needs "
                                  "--tokenizer-model (the .model file preprocess_data wrote)")
            if not os.path.isfile(args.tokenizer_model):
                raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: no such file; "
                                  "run python -m paci_megatron.tools.preprocess_data first")
        for ext in (".bin", ".idx"):
            if not os.path.isfile(args.data_path + ext):
                raise ConfigError(f"--data-path {args.data_path}: {args.data_path + ext} does "
                                  "not exist (give the prefix without .bin/.idx)")
    try:
        weights = [float(x) for x in args.split.split(",")]
    except ValueError:
        raise ConfigError(f"--split {args.split!r} must be comma-separated numbers, e.g. 969,30,1")
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {args.split!r} needs three non-negative weights, e.g. 969,30,1")
    if args.eval_interval is not None and weights[1] == 0 and args.data_path is not None:
        raise ConfigError("--eval-interval needs a validation share in --split (the 2nd weight)")
    for flag, value in (("--save-interval", args.save_interval),
                        ("--save-interval-minutes", args.save_interval_minutes)):
        if value is not None and not args.save:
            raise ConfigError(f"{flag} needs --save DIR")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and "
                          "--use-checkpoint-opt_param-scheduler are exclusive; pick one")
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ConfigError("--transformer-impl transformer_engine: Transformer Engine is not "
                              "importable here; use --transformer-impl local") from None
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method "
                          "{uniform,block} (and --recompute-num-layers)")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ConfigError("--recompute-method needs --recompute-granularity full")
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1


def parse_and_validate(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        opts = validate(args, world)
    except ConfigError as exc:
        parser.error(str(exc))
    return args, opts
