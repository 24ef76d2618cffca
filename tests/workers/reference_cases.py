"""PACI at P>1 against its one-process reference (run under torchrun).

    torchrun --nproc-per-node TPxDPxP tests/workers/reference_cases.py --mode runtime --out DIR CASE...
    torchrun --nproc-per-node TPxDP   tests/workers/reference_cases.py --mode emulator --out DIR CASE...

``runtime``: one process per stage, the real PACI runtime (``PaciRuntime``). ``emulator``: the
same model, optimizer and data with every stage in one process (``PipelineEmulator``); tensor
and data parallelism stay real. Each rank writes DIR/CASE.<mode>.pp<S>tp<T>dp<D>.json with
every micro-batch loss and, per local step, the grad norm, LR and a SHA-256 of the stage's
weights; the pytest side compares the two modes.
"""

import dataclasses
import json
import os
import sys
from typing import Dict, List

import torch

from paci_megatron.adapt import Adaptive, candidates
from paci_megatron.features import Lookahead, StageFeature, WeightPrediction
from paci_megatron.features.weight_prediction import Prediction
from paci_megatron.layer_split import LayerSplit
from paci_megatron.mcore import build
from paci_megatron.mcore.reference import PipelineEmulator, StageParts, weights_sha256
from paci_megatron.tools.backward_audit import audit_backward
from paci_megatron.mcore.runtime import PaciRuntime
from paci_megatron.mcore.checkpoint import persistent_buffers
from paci_megatron.mcore.tied import shared_weight, tied_sha256
from paci_megatron.plan_policy import AdaptivePlan

from case_args import parse_case_args  # same folder: the script's own

MBS = 2
SEED = 1234

# every case: P stages, a, N micro-batches per iteration, calls; model and optimizer options.
# clip 0.3 keeps gradient clipping active on most steps, so the clipping norm matters.
BASE = dict(tp=1, dp=1, a=4, n=4, calls=5, dropout=0.0, bf16=False, recompute=False,
            dist_opt=False, clip=0.3, layers=4, drain_after=None, eval_after=None,
            audit=False, factors=None, tied=False,
            fp16=False, per_token=False, predict=False, overlap=False, grad_overlap=False, kind="paci",
            fp16_scales=(19, 20), warmup=8, param_gather=False, lookahead=0.0,
            optimizer="adam", moe=None, ep=1, split=None, mtp=None)
MOE = dict(num_experts=4, router_topk=2, ffn_hidden_size=64, layer_freq=2, aux_loss_coeff=1e-2,
           shared_expert_intermediate_size=64, token_dispatcher_type="alltoall")
# aux-loss-free balancing: sigmoid scores, the expert bias moved at every local step (a rate
# large enough to change which experts win within a few steps)
MOE_BIAS = dict(MOE, router_score_function="sigmoid", router_enable_expert_bias=True,
                router_bias_update_rate=1e-2)
CASES: Dict[str, Dict] = {
    "p2_a4": dict(pp=2, dropout=0.1),
    "p2_a2": dict(pp=2, a=2, n=8, calls=4),
    "p2_bf16": dict(pp=2, bf16=True, dropout=0.1),
    "p2_distopt": dict(pp=2, a=2, dist_opt=True),
    "p2_drain_eval": dict(pp=2, a=2, calls=6, drain_after=(2, 4), eval_after=(2, 4)),
    "p4_a4": dict(pp=4, dropout=0.1),
    "p4_a1": dict(pp=4, a=1, calls=4, audit=True),
    "p4_bf16": dict(pp=4, a=2, bf16=True, audit=True),
    "p4_recompute": dict(pp=4, a=2, n=8, calls=3, dropout=0.1, recompute=True),
    "p4_eval_nodrain": dict(pp=4, a=2, calls=4, eval_after=(1, 3)),
    "p4_drain_eval": dict(pp=4, a=4, n=8, calls=4, drain_after=(2,), eval_after=(2,)),
    # depth (issue 51): P = 16, a = 8, the default prediction, bf16 and tied embeddings as
    # deep pipelines run them; drifts 2 (stages 0-6), 1 (7-14), 0; the tied lag ceil(16/8) = 2
    "p16_a8_bf16_predict": dict(pp=16, a=8, n=16, calls=3, layers=16, bf16=True,
                                predict=True, tied=True),
    # --paci-accumulation-factor auto, cycle policy: a of each call (a = N at the start)
    "p4_auto": dict(pp=4, calls=8, factors=(4, 4, 2, 2, 1, 1, 4, 4)),
    "p2_dp2": dict(pp=2, dp=2, dropout=0.1),
    "p2_dp2_distopt": dict(pp=2, dp=2, a=2, dist_opt=True, dropout=0.1),
    "p2_tp2": dict(pp=2, tp=2, dropout=0.1),
    # tied embeddings: lag ceil(P/a) = 2 at P=2, a=1; at P=4, a=2 with a drain (the last
    # stage catches up) and an evaluation without drain (it reads stage 0's current weight)
    "p2_tied": dict(pp=2, a=1, n=4, calls=4, tied=True, dropout=0.1),
    "p4_tied": dict(pp=4, a=2, calls=6, tied=True, drain_after=(3,), eval_after=(2, 4)),
    "p2_tied_bf16": dict(pp=2, a=4, n=4, calls=5, tied=True, bf16=True),
    # the output-layer gradient as the last stage's data-parallel reduction left it, added to
    # stage 0's reduced one: stock's all-reduce. The distributed optimizer (fp32: the shard
    # stepped is a view of the parameter buffer; bf16 with a = 1, lag 2: fp32 master shards),
    # --overlap-grad-reduce (the reduction runs during the closing backward), fp16 (the
    # scalers start a factor 2 apart: the half is rescaled, each stage skips on its own),
    # all of them together, at P=2 and at P=4 with a drain and evaluations without drain
    # (bf16 with --overlap-param-gather too: the weights gathered by the next forward)
    "p2_dp2_tied": dict(pp=2, dp=2, a=2, tied=True, dropout=0.1),
    "p2_dp2_tied_distopt": dict(pp=2, dp=2, a=2, tied=True, dist_opt=True, dropout=0.1),
    "p2_dp2_tied_overlap": dict(pp=2, dp=2, a=2, tied=True, grad_overlap=True, dropout=0.1),
    "p2_dp2_tied_distopt_bf16_overlap": dict(pp=2, dp=2, a=1, n=4, calls=4, tied=True,
                                             dist_opt=True, bf16=True, grad_overlap=True,
                                             dropout=0.1),
    "p2_tied_fp16": dict(pp=2, a=2, calls=6, tied=True, fp16=True),
    "p2_dp2_tied_fp16_distopt_overlap": dict(pp=2, dp=2, a=2, calls=6, tied=True, fp16=True,
                                             dist_opt=True, grad_overlap=True),
    "p4_dp2_tied_distopt_bf16_overlap": dict(pp=4, dp=2, a=2, calls=6, tied=True, dist_opt=True,
                                             bf16=True, grad_overlap=True, param_gather=True,
                                             drain_after=(3,), eval_after=(2, 4)),
    "p4_dp2_tied_fp16_distopt_overlap": dict(pp=4, dp=2, a=2, calls=6, tied=True, fp16=True,
                                             dist_opt=True, grad_overlap=True, drain_after=(3,),
                                             eval_after=(2, 4)),
    # runtime only, against stock: each stage's first step takes the gradient of group 0 at
    # the starting weights under PACI too, so stage 0's first step is stock's (the flush
    # baseline: Megatron's finalize_model_grads with its tied all-reduce) bit for bit; no LR
    # warm-up (the first step moves the weights), no clipping (PACI clips by the stage's
    # norm, stock by all stages'), equal fp16 scales
    **{name + suffix: dict(cfg, pp=2, dp=2, a=2, n=4, calls=1, tied=True, clip=0.0,
                           dropout=0.1, kind=kind, warmup=0)
       for name, cfg in (("p2_dp2_tied_overlap_stock", dict(grad_overlap=True)),
                         ("p2_dp2_tied_distopt_bf16_stock", dict(dist_opt=True, bf16=True,
                                                                 grad_overlap=True)),
                         ("p2_dp2_tied_fp16_distopt_stock", dict(dist_opt=True, fp16=True, grad_overlap=True,
                                                                 fp16_scales=(12, 12))))
       for suffix, kind in (("", "paci"), ("_flush", "flush"))},
    # stage 0's scaler starts at half of stage 1's and both overflow on their own schedule:
    # gradients are rescaled between scales throughout
    "p2_fp16": dict(pp=2, a=2, calls=6, fp16=True),
    "p2_per_token": dict(pp=2, a=2, calls=4, per_token=True, dropout=0.1),
    # --paci-weight-prediction (twins: p4_bf16, p4_tied, p2_fp16): forwards with drift 1 at
    # P=4, a=2 (audited: backwards read the current weights); tied with a drain and evaluations;
    # with data parallelism (each replica folds its own partial gradient); fp16 (the buffers
    # at each stage's loss scale, overflows)
    "p4_bf16_predict": dict(pp=4, a=2, bf16=True, audit=True, predict=True),
    "p4_tied_bf16_predict": dict(pp=4, a=2, calls=6, tied=True, bf16=True, drain_after=(3,),
                                 eval_after=(2, 4), predict=True),
    "p4_tied_bf16": dict(pp=4, a=2, calls=6, tied=True, bf16=True, drain_after=(3,),
                         eval_after=(2, 4)),
    "p2_dp2_tied_bf16_predict": dict(pp=2, dp=2, a=1, n=4, calls=4, tied=True, bf16=True,
                                     dropout=0.1, predict=True),
    "p2_fp16_predict": dict(pp=2, a=2, calls=6, fp16=True, predict=True),
    "p2_tp2_bf16_predict": dict(pp=2, tp=2, a=2, bf16=True, dropout=0.1, predict=True),
    # --paci-weight-prediction-overlap: the runtime moves layer by layer, the emulator the
    # whole stage at once; on a CPU the two are the same numbers
    "p4_bf16_predict_overlap": dict(pp=4, a=2, bf16=True, predict=True, overlap=True),
    # --paci-lookahead: the model weights ahead after each step (a drain and evaluations put
    # the true ones back, the look-ahead returns); with the distributed optimizer: shards
    "p4_tied_bf16_lookahead": dict(pp=4, a=2, calls=6, tied=True, bf16=True, drain_after=(3,),
                                   eval_after=(2, 4), lookahead=1.0),
    "p2_dp2_distopt_bf16_lookahead": dict(pp=2, dp=2, a=2, dist_opt=True, bf16=True,
                                          dropout=0.1, lookahead=2.0),
    # the distributed optimizer: each rank predicts its shard, an all-gather completes it
    "p2_dp2_distopt_bf16": dict(pp=2, dp=2, a=2, dist_opt=True, bf16=True, dropout=0.1),
    # --optimizer nadam (torch's NAdam in Megatron's wrappers) over the distributed optimizer
    "p2_dp2_distopt_bf16_nadam": dict(pp=2, dp=2, a=2, dist_opt=True, bf16=True, dropout=0.1,
                                      optimizer="nadam"),
    "p2_dp2_distopt_bf16_predict": dict(pp=2, dp=2, a=2, dist_opt=True, bf16=True, dropout=0.1,
                                        predict=True),
    # MoE (issue 50): dense and MoE layers, top-2 of 4 experts with the aux loss and a shared
    # expert; the experts split over EP = 2 data-parallel ranks of a stage, both dispatchers
    # (clipping is active: with EP > 1 the expert optimizer's norm spans the EP ranks)
    "p2_moe": dict(pp=2, a=2, dropout=0.1, moe=MOE),
    "p4_moe_bf16_predict": dict(pp=4, a=2, bf16=True, predict=True, moe=MOE),
    "p2_dp2_ep2_moe": dict(pp=2, dp=2, ep=2, a=2, moe=MOE),
    # bf16: the expert optimizer steps fp32 main copies, which lack the weights' allreduce mark
    "p2_dp2_ep2_moe_bf16": dict(pp=2, dp=2, ep=2, a=2, bf16=True, moe=MOE),
    "p2_dp2_ep2_moe_allgather": dict(pp=2, dp=2, ep=2, a=2, dist_opt=True,
                                     moe=dict(MOE, token_dispatcher_type="allgather")),
    # fp16 with the stages' scalers apart: each backward scales the aux loss's gradient at its
    # stage's loss scale then (a local step in between may have changed it), not the forward's
    "p2_fp16_moe": dict(pp=2, a=2, calls=6, fp16=True, moe=MOE),
    # the expert bias at P = 4, and with EP = 2, the distributed optimizer and the prediction
    "p4_moe_bias": dict(pp=4, a=2, n=8, calls=4, bf16=True, moe=MOE_BIAS, drain_after=(2,)),
    "p2_dp2_ep2_moe_bias_distopt": dict(pp=2, dp=2, ep=2, a=2, n=8, calls=4, dist_opt=True,
                                        bf16=True, predict=True, moe=MOE_BIAS),
    # uneven stages (issue 51): the end stages hold fewer transformer layers, by Megatron-LM's
    # first/last flags (1/2/2/1) and by a layout (3/1), tied embeddings beside them
    "p4_uneven": dict(pp=4, a=2, layers=6, dropout=0.1, split=dict(first=1, last=1)),
    "p2_layout_tied": dict(pp=2, a=2, tied=True, split=dict(layout="Ettt|tL")),
    # multi-token prediction (issue 50): its layers on the last stage read a copy of stage 0's
    # word embedding, kept by the tied exchange: untied in bf16 (the copy is the embedding
    # alone), and with the weight prediction (bf16's default); tied at P = 4 with a drain and
    # evaluations without drain (one weight: embedding
    # and output layer); fp16 with the stages' scalers apart (the MTP loss's gradient scaled
    # at the stage's loss scale before each backward)
    "p2_mtp_bf16": dict(pp=2, a=2, bf16=True, dropout=0.1, mtp=1),
    "p2_mtp_bf16_predict": dict(pp=2, a=2, bf16=True, dropout=0.1, mtp=1, predict=True),
    "p4_mtp_tied": dict(pp=4, a=2, calls=6, tied=True, mtp=1, drain_after=(3,),
                        eval_after=(2, 4)),
    "p2_fp16_mtp": dict(pp=2, a=2, calls=6, fp16=True, mtp=1),
}


def config(case: str) -> Dict:
    return {**BASE, **CASES[case]}


def spec_of(cfg: Dict) -> build.GPTSpec:
    return build.GPTSpec(
        num_layers=cfg["layers"], hidden_size=32, num_attention_heads=4, seq_length=16,
        vocab_size=128, untie_embeddings=not cfg["tied"], hidden_dropout=cfg["dropout"],
        attention_dropout=cfg["dropout"], bf16=cfg["bf16"],
        fp16=cfg["fp16"], calculate_per_token_loss=cfg["per_token"],
        recompute_granularity="full" if cfg["recompute"] else None,
        recompute_method="uniform" if cfg["recompute"] else None,
        recompute_num_layers=1 if cfg["recompute"] else None,
        moe=build.MoESpec(**cfg["moe"]) if cfg["moe"] else None,
        # MTP needs rope (Megatron-LM refuses learned positions with it)
        mtp_num_layers=cfg["mtp"], position_embedding_type="rope" if cfg["mtp"]
        else "learned_absolute",
        layer_split=LayerSplit(**cfg["split"]) if cfg["split"] else LayerSplit())


def build_parts(cfg: Dict) -> StageParts:
    """One stage as both modes build it (after Megatron-LM's seeding of this pipeline rank)."""
    spec = spec_of(cfg)
    model = build.build_gpt_model(spec, seed=SEED, use_distributed_optimizer=cfg["dist_opt"],
                                  overlap_grad_reduce=cfg["grad_overlap"],
                                  overlap_param_gather=cfg["param_gather"])
    info = build.stage_info()
    first_scale, other_scale = cfg["fp16_scales"]
    scales = dict(fp16=True, initial_loss_scale=2.0 ** (first_scale if info["is_first"]
                                                        else other_scale),
                  loss_scale_window=2, hysteresis=1) if cfg["fp16"] else {}
    opt = build.build_optimizer(model, lr=2e-3, clip_grad=cfg["clip"], bf16=cfg["bf16"],
                                use_distributed_optimizer=cfg["dist_opt"],
                                optimizer=cfg["optimizer"], **scales)
    sched = build.build_lr_scheduler(opt, lr=2e-3, min_lr=2e-4, warmup_steps=cfg["warmup"],
                                     decay_steps=400, decay_style="cosine")
    reads = info["is_first"] or info["is_last"]
    data = build.mock_data_iterator(spec, MBS, SEED) if reads else None
    if data is not None and cfg["per_token"]:
        data = _masked(data)
    return StageParts(model[0], opt, sched, data)


def _masked(data):
    """Per-token cases: each row keeps 1..16 of its 16 tokens, differently per micro-batch."""
    for i, item in enumerate(data):
        mask = item["loss_mask"].clone()
        for row in range(mask.shape[0]):
            mask[row, 1 + (i * 2654435761 + row * 40503) % 97 % 16:] = 0.0
        yield {**item, "loss_mask": mask}


def _loss_hex(store) -> List[str]:
    """Every logged value as float hex (per-token: loss sum and tokens per micro-batch)."""
    return [_hex(x) for d in store for x in torch.as_tensor(d["lm loss"]).view(-1).tolist()]


def evaluate(fb, model, spec, data, n, inside=None) -> None:
    """A stock forward-only pass between two training calls (what evaluation does);
    ``inside()`` runs at its first forward."""
    def forward_step(data_iterator, model_chunk):
        if inside is not None and not seen:
            seen.append(inside())
        return build.gpt_forward_step(data_iterator, model_chunk)

    seen = []
    model.eval()
    fb(forward_step_func=forward_step, data_iterator=data, model=[model],
       num_microbatches=n, seq_length=spec.seq_length, micro_batch_size=MBS, forward_only=True)
    model.train()


def _true(features, params=None) -> bool:
    """Every model weight (of ``params``; default all) is its fp32 main copy's cast (no
    look-ahead or prediction on)."""
    for feature in features:
        layout = getattr(feature, "layout", None)
        if layout is not None:
            pieces = layout.stage_pass.pieces if params is None else layout.pieces_of(params)
            return all(p.target.equal(p.main.to(p.target.dtype)) for p in pieces)
    return True


def _untied(model, stage, cfg) -> list:
    """The weights an evaluation runs as the stage's own: all but the last stage's tied
    copy (or MTP's copy of the embedding), which an evaluation without drain swaps for stage
    0's current weight (tied.py)."""
    params = list(model.parameters())
    if (cfg["tied"] or cfg["mtp"]) and cfg["pp"] > 1 and stage == cfg["pp"] - 1:
        params = [p for p in params if not getattr(p, "shared_embedding", False)]
    return params


def run_runtime(case: str, out_dir: str) -> None:
    cfg = config(case)
    info = build.init_distributed(tp=cfg["tp"], pp=cfg["pp"], ep=cfg["ep"], seed=SEED,
                                  timeout_s=120)
    parts = build_parts(cfg)
    adaptive = Adaptive(cfg["pp"], cfg["n"], candidates(cfg["pp"], cfg["n"], None), interval=1,
                        tolerance=0.0, policy="cycle") if cfg["factors"] else None
    features = ([WeightPrediction(cfg["overlap"])] if cfg["predict"] else []) \
        + ([Lookahead(cfg["lookahead"])] if cfg["lookahead"] else [])
    rt = PaciRuntime(kind=cfg["kind"], accumulation=cfg["a"], features=features,
                     policy=AdaptivePlan(cfg["pp"], adaptive) if adaptive else None)
    rt.bind(parts.optimizer, parts.lr_scheduler, lr_increment=cfg["a"] * MBS * info["dp_size"])
    initial = weights_sha256([parts.model])
    steps: List[Dict] = []

    restores: List[bool] = []
    evaluated: List[bool] = []  # per evaluation: true weights inside, the weights back after
    # the tied exchange's buffers, most at once: the last stage's gradients in flight and
    # weights received (installed or not), stage 0's weights in flight
    buffers = dict(grads=0, weights=0)
    moves: List[Dict] = []  # per predicted forward: did the weights move, from what
    true_after_step: List[bool] = []  # the weights are the main copies' cast after each step

    class Recorder(StageFeature):
        """Every step's record with the weights after it (a feature's after_step hook), and
        after every forward whether each weight is its main copy's cast (the restore)."""

        def after_step(self, ctx, record) -> None:
            tied = rt.tied
            if tied is not None:
                held = (len(tied.inbox) + len(tied.spare)) if not tied.is_owner \
                    else int(tied.weight_send is not None)
                buffers.update(grads=max(buffers["grads"], len(tied.grad_sends)),
                               weights=max(buffers["weights"], held))
            steps.append(dict(mb=record.mb, ok=record.update_successful,
                              grad_norm=_hex(record.grad_norm), lr=_hex(record.lr),
                              weights=weights_sha256([parts.model])))
            if cfg["predict"]:  # after the prediction's own hook: the weights are true again
                pieces = features[-1].layout.stage_pass.pieces
                true_after_step.append(all(p.target.equal(p.main.to(p.target.dtype))
                                           for p in pieces))

        def before_forward(self, ctx, mb) -> None:  # after the prediction's own hook
            ahead = ctx.planned_drift(mb)
            if cfg["predict"] and ahead:
                layout = features[-1].layout
                pieces = layout.stage_pass.pieces
                moves.append(dict(moved=any(not p.target.equal(p.main.to(p.target.dtype))
                                            for p in pieces),
                                  backwards=ctx.drift.group_backwards, steps=ctx.drift.version,
                                  updates=layout.step_count(layout.stage_pass.klasses[0].inner),
                                  lr_sum=ctx.lr_sum(layout.stage_pass.klasses[0].group, ahead),
                                  ahead=ahead))

        def after_forward(self, ctx, mb) -> None:
            if cfg["predict"]:
                pieces = features[-1].layout.stage_pass.pieces
                restores.append(all(p.target.equal(p.main.to(p.target.dtype)) for p in pieces))

    rt.user_features.append(Recorder())  # after the tied feature's: the weights installed
    losses: List[str] = []
    eval_data = build.mock_data_iterator(spec_of(cfg), MBS, SEED + 1) \
        if info["is_first"] or info["is_last"] else None
    for call in range(cfg["calls"]):
        store = rt.forward_backward(
            forward_step_func=build.gpt_forward_step, data_iterator=parts.data, model=[parts.model],
            num_microbatches=cfg["n"], seq_length=16, micro_batch_size=MBS, forward_only=False)
        losses += _loss_hex(store)
        if cfg["drain_after"] and call + 1 in cfg["drain_after"]:
            rt.drain()
        if cfg["eval_after"] and call + 1 in cfg["eval_after"]:
            before = weights_sha256([parts.model])
            evaluate(rt.forward_backward, parts.model, spec_of(cfg), eval_data, cfg["n"],
                     lambda: evaluated.append(_true(features, _untied(parts.model, info["pp_rank"], cfg))))
            evaluated.append(weights_sha256([parts.model]) == before)
    if adaptive is not None:
        assert tuple(adaptive.factors) == tuple(cfg["factors"]), adaptive.factors
    rt.drain()  # as at the end of training: the last stage's tied copy catches up
    _write(out_dir, case, "runtime", info, dict(
        losses=losses, steps=steps, max_drift=rt.drift.max,
        tied_after_drain=tied_sha256(parts.model, parts.optimizer),
        histogram={str(k): v for k, v in sorted(rt.drift.histogram.items())},
        tied_histogram={str(k): v for k, v in sorted(rt.tied_histogram.items())},
        tied_buffers=buffers, initial_weights=initial,
        predicted={str(k): v for k, v in sorted(features[-1].predicted.items())}
        if cfg["predict"] else {}, restores=restores, moves=moves,
        true_after_step=true_after_step, evaluated=evaluated,
        expert_bias=[t.tolist() for name, t in persistent_buffers(parts.model)
                     if name.endswith("expert_bias")],
        layers=build.stage_layer_numbers([parts.model]), holds=_holds(parts.model)))


def _holds(model) -> Dict:
    """What the stage built of the embedding and MTP: its MTP layers, and whether the
    weight it shares with the other end (tied.shared_weight) is a word embedding."""
    inner = build.unwrap_model(model)
    shared = shared_weight(model)
    embedding = getattr(inner, "embedding", None)
    return dict(mtp_layers=len(inner.mtp.layers) if getattr(inner, "mtp", None) else 0,
                shares_embedding=shared is not None and embedding is not None
                and shared is embedding.word_embeddings.weight,
                shares=shared is not None)


def run_emulator(case: str, out_dir: str) -> None:
    cfg = config(case)
    info = build.init_distributed(tp=cfg["tp"], pp=1, ep=cfg["ep"], seed=SEED, timeout_s=120)
    # each method's emulated step, as Method.emulated makes it from the method's settings
    prediction = WeightPrediction.emulated(Prediction(cfg["overlap"])) if cfg["predict"] else None
    methods = ([prediction] if prediction else []) \
        + ([Lookahead.emulated(cfg["lookahead"])] if cfg["lookahead"] else [])
    emu = PipelineEmulator(num_stages=cfg["pp"], accumulation=cfg["a"], micro_batch_size=MBS,
                           seq_length=16, build_stage=lambda s: build_parts(cfg), seed=SEED,
                           methods=methods)
    audits = {s: audit_backward(emu, s) for s in range(cfg["pp"])} if cfg["audit"] else {}
    losses: List[str] = []
    for call in range(cfg["calls"]):
        if cfg["factors"]:
            emu.set_accumulation(cfg["factors"][call])
        losses += _loss_hex(emu.train_call(cfg["n"]))
        if cfg["drain_after"] and call + 1 in cfg["drain_after"]:
            emu.drain()
    for s, stage in enumerate(emu.stages):
        steps = [dict(mb=r.mb, ok=r.ok, grad_norm=_hex(r.grad_norm), lr=_hex(r.lr),
                      weights=r.weights) for r in stage.steps]
        _write(out_dir, case, "emulator", dict(info, pp_rank=s), dict(
            losses=losses if s == cfg["pp"] - 1 else [], steps=steps,
            max_drift=max(stage.drift, default=0),
            histogram={str(k): v for k, v in sorted(stage.drift.items())},
            predicted={str(k): v for k, v in sorted(prediction.predicted[s].items())}
            if prediction else {},
            audit=[dataclasses.asdict(v) for v in audits.get(s, [])],
            tied_histogram={str(k): v for k, v in sorted(emu.tied.histogram.items())}
            if emu.tied is not None and s == cfg["pp"] - 1 else {},
            layers=build.stage_layer_numbers([stage.parts.model])))


def _hex(value):
    return None if value is None else float(value).hex()


def _write(out_dir: str, case: str, mode: str, info: Dict, result: Dict) -> None:
    name = f"{case}.{mode}.pp{info['pp_rank']}tp{info['tp_rank']}dp{info['dp_rank']}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(result, case=case, mode=mode, config=config(case)), f)


def main() -> int:
    args = parse_case_args(CASES, lambda parser: parser.add_argument(
        "--mode", choices=("runtime", "emulator"), required=True))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run = run_runtime if args.mode == "runtime" else run_emulator
    for case in args.cases:
        cfg = config(case)
        need = cfg["tp"] * cfg["dp"] * (cfg["pp"] if args.mode == "runtime" else 1)
        if need != world:
            raise SystemExit(f"case {case} needs {need} processes in {args.mode} mode, got {world}")
        run(case, args.out)
    build.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
