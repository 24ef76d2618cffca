"""Stock Megatron-Core schedules on CPU/gloo with the builders of paci_megatron.mcore.build.

    torchrun --standalone --nproc-per-node N tests/workers/stock_smoke.py --case pp2,vpp,...

``--case`` is a comma-separated list of sub-cases run one after the other in the same process
group (the parallel layout is rebuilt for each; importing Megatron costs seconds, so one launch
runs several). Every sub-case trains with the stock ``get_forward_backward_func()`` schedule and
``optimizer.step()`` like Megatron-LM's ``train_step``. The reporting rank (last pipeline stage,
TP rank 0, DP rank 0) prints one line ``RESULT {json}`` per sub-case; checks that need several
ranks (batches read per stage, tied embeddings equal on first and last stage) run here and are
reported in that line.
"""

import argparse
import json
import os
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from paci_megatron.mcore import build  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

SEED = 1234
SPEC = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256)
MICRO_BATCHES = 4
MBS = 2
LR = 3e-3


class CountingIterator:
    """Counts how many batches the forward step pulls."""

    def __init__(self, it):
        self.it, self.count = it, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return next(self.it)


def tied_embedding_diff(model):
    """Max |word embedding (first stage) - output weight (last stage)|; same on every rank."""
    info = build.stage_info()
    first, last = build.unwrap_model(model[0]), build.unwrap_model(model[-1])
    src = parallel_state.get_pipeline_model_parallel_first_rank()
    diff = torch.zeros(1)
    if info["is_first"] and first.pre_process:
        w = first.embedding.word_embeddings.weight.detach().float().clone()
        torch.distributed.broadcast(w, src=src, group=parallel_state.get_embedding_group())
    elif info["is_last"] and last.post_process:
        w = torch.empty_like(last.output_layer.weight, dtype=torch.float)
        torch.distributed.broadcast(w, src=src, group=parallel_state.get_embedding_group())
        diff[0] = (w - last.output_layer.weight.detach().float()).abs().max()
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
    return float(diff)


def train(name, *, tp=1, pp=1, vpp=None, ep=1, iters=10, bf16=False, untie=False,
          overlap=False, distopt=False, dropout=0.0, recompute=False, **spec_overrides):
    """Build and train ``iters`` stock iterations; the result dict on the reporting rank."""
    build.init_distributed(tp=tp, pp=pp, vpp=vpp, ep=ep, seed=SEED)
    kw = dict(SPEC, **spec_overrides)
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    spec = build.GPTSpec(bf16=bf16, untie_embeddings=untie, hidden_dropout=dropout,
                         attention_dropout=dropout, **kw)
    model = build.build_gpt_model(spec, overlap_grad_reduce=overlap,
                                  use_distributed_optimizer=distopt, seed=SEED)
    optimizer = build.build_optimizer(model, lr=LR, bf16=bf16, use_distributed_optimizer=distopt)
    scheduler = build.build_lr_scheduler(optimizer, lr=LR, min_lr=LR / 10, warmup_steps=0,
                                         decay_steps=1000)
    data = [CountingIterator(build.mock_data_iterator(spec, MBS, seed=SEED)) for _ in model]
    fwd_bwd = get_forward_backward_func()
    losses, grad_norms, times = [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = fwd_bwd(forward_step_func=build.gpt_forward_step,
                      data_iterator=data if len(model) > 1 else data[0],
                      model=model if len(model) > 1 else model[0],
                      num_microbatches=MICRO_BATCHES, seq_length=spec.seq_length,
                      micro_batch_size=MBS, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok, "optimizer step skipped"
        scheduler.step(increment=1)
        times.append(time.perf_counter() - t0)
        if out:  # last stage only
            losses.append(sum(float(d["lm loss"]) for d in out) / len(out))
        grad_norms.append(grad_norm)

    # evaluation: the same schedule with forward_only=True
    out = fwd_bwd(forward_step_func=build.gpt_forward_step,
                  data_iterator=data if len(model) > 1 else data[0],
                  model=model if len(model) > 1 else model[0],
                  num_microbatches=MICRO_BATCHES, seq_length=spec.seq_length,
                  micro_batch_size=MBS, forward_only=True)
    eval_loss = sum(float(d["lm loss"]) for d in out) / len(out) if out else None

    info = build.stage_info()
    reads = [d.count for d in data]
    if info["is_first"] or info["is_last"]:
        assert reads == [(iters + 1) * MICRO_BATCHES] * len(model), (name, info, reads)
    else:
        assert reads == [0] * len(model), (name, info, reads)
    tied = None if (untie or pp == 1) else tied_embedding_diff(model)
    steady = times[2:] or times
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    if not (info["is_last"] and info["tp_rank"] == 0 and info["dp_rank"] == 0):
        return None
    return dict(case=name, tp=tp, pp=pp, vpp=vpp, dp=info["dp_size"], bf16=bf16,
                losses=losses, eval_loss=eval_loss, grad_norms=grad_norms, tied_diff=tied,
                reads=reads,
                ms_per_iter=round(1000 * sum(steady) / len(steady), 1))


def dropout_case():
    """Dropout is reproducible for a seed and full activation recompute replays its RNG:
    same loss and grad norm twice, and with recompute; the whole world is one pipeline."""
    pp = int(os.environ.get("WORLD_SIZE", "1"))
    a = train("dropout_a", pp=pp, iters=1, dropout=0.2)
    b = train("dropout_b", pp=pp, iters=1, dropout=0.2)
    rc = train("dropout_recompute", pp=pp, iters=1, dropout=0.2, recompute=True)
    off = train("dropout_off", pp=pp, iters=1, dropout=0.0)
    if a is None:
        return None
    return dict(case="dropout", pp=pp,
                losses=[r["losses"][0] for r in (a, b, rc, off)],
                grad_norms=[r["grad_norms"][0] for r in (a, b, rc, off)])


CASES = {
    # name: (world size, runner)
    "pp1": (1, lambda: train("pp1", pp=1)),
    "pp1_rope_rmsnorm": (1, lambda: train("pp1_rope_rmsnorm", pp=1, untie=True,
                                          position_embedding_type="rope",
                                          normalization="RMSNorm", ffn_hidden_size=96)),
    "pp2": (2, lambda: train("pp2", pp=2)),
    "vpp": (2, lambda: train("vpp", pp=2, vpp=2)),
    "bf16": (2, lambda: train("bf16", pp=2, bf16=True)),
    "pp2_untied_overlap": (2, lambda: train("pp2_untied_overlap", pp=2, untie=True,
                                            overlap=True)),
    "dropout": (None, dropout_case),
    "pp4": (4, lambda: train("pp4", pp=4)),
    "tp2pp2": (4, lambda: train("tp2pp2", tp=2, pp=2)),
    "dp2pp2": (4, lambda: train("dp2pp2", pp=2, overlap=True, distopt=True)),
    "dp2pp2_bf16": (4, lambda: train("dp2pp2_bf16", pp=2, overlap=True, distopt=True,
                                     bf16=True)),
    # MoE (the moe_cuda patch): dense and MoE layers, shared experts, expert bias; P=1, P=2,
    # and EP=2 inside each of 2 stages with either dispatcher
    "moe_pp1": (1, lambda: train("moe_pp1", pp=1, untie=True, moe=moe_spec("alltoall"))),
    "moe_pp2": (2, lambda: train("moe_pp2", pp=2, untie=True, moe=moe_spec("alltoall"))),
    "moe_ep2pp2_alltoall": (4, lambda: train("moe_ep2pp2_alltoall", pp=2, ep=2, untie=True,
                                             distopt=True, moe=moe_spec("alltoall"))),
    "moe_ep2pp2_allgather": (4, lambda: train("moe_ep2pp2_allgather", pp=2, ep=2, untie=True,
                                              distopt=True, moe=moe_spec("allgather"))),
}


def moe_spec(dispatcher):
    return build.MoESpec(num_experts=4, router_topk=2, ffn_hidden_size=64, layer_freq=2,
                         aux_loss_coeff=1e-2, shared_expert_intermediate_size=64,
                         router_enable_expert_bias=True, router_score_function="sigmoid",
                         token_dispatcher_type=dispatcher)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, help="comma-separated: " + ",".join(CASES))
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    names = [c for c in args.case.split(",") if c]
    for name in names:
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; known: {', '.join(CASES)}")
        need = CASES[name][0]
        if need is not None and need != world:
            raise SystemExit(f"case {name} needs --nproc-per-node {need}, got {world}")
    try:
        for name in names:
            result = CASES[name][1]()
            if result is not None:
                print("RESULT " + json.dumps(result), flush=True)
    finally:
        build.destroy_distributed()


if __name__ == "__main__":
    main()
