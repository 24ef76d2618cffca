"""The weight prediction with a whole group's gradient against Megatron's real optimizer step
(run under torchrun, one pipeline stage, data parallel = the process count).

    torchrun --standalone --nproc-per-node N tests/workers/prediction_step_cases.py --out DIR CASE...

Each case trains a few steps (so the optimizer has state), runs one more group of
micro-batches and its data-parallel reduction, writes the prediction one step ahead into fp32
buffers in place of the model weights, then takes Megatron's own step and compares: every
element of every main copy, the clip coefficient Megatron applied, and what the prediction
costs in host syncs. Writes DIR/CASE.rank<R>.json for tests/test_prediction_step.py.
"""

import contextlib
import json
import os
import sys

import torch
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config, get_model_type

from paci_megatron.features.moves import grad_factor, predict_ahead
from paci_megatron.mcore import build, compat, main_params
from paci_megatron.mcore.admission import stage_grad_stats_group

from case_args import parse_case_args  # same folder: the script's own

MBS, A, SEED = 2, 4, 1234
# clip 0.05 is far below these models' gradient norms: clipping acts on every step
BASE = dict(precision="bf16", optimizer="adam", decoupled=True, momentum=0.9, dist_opt=False,
            clip=0.05, lr=1e-2, dp=1)
CASES = {
    "bf16_adamw": dict(),
    "fp16_adamw": dict(precision="fp16"),  # the buffers at a dynamic loss scale of 2^12
    "bf16_adam_l2": dict(decoupled=False),  # L2 decay: folded into the gradient and moments
    "fp16_adam_l2": dict(precision="fp16", decoupled=False),
    "bf16_sgd_momentum": dict(optimizer="sgd", lr=0.05),
    "bf16_sgd": dict(optimizer="sgd", momentum=0.0, lr=0.05),
    "bf16_noclip": dict(clip=0.0),
    "dp2_bf16_adamw": dict(dp=2),
    "dp2_distopt_bf16_adamw": dict(dp=2, dist_opt=True),
    "dp2_distopt_fp16_adam_l2": dict(dp=2, dist_opt=True, precision="fp16", decoupled=False),
    "dp2_fp16_sgd_momentum": dict(dp=2, precision="fp16", optimizer="sgd", lr=0.05),
}


def build_case(cfg):
    build.init_distributed(pp=1, seed=SEED, timeout_s=90)
    spec = build.GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=128, untie_embeddings=True, bf16=cfg["precision"] == "bf16",
                         fp16=cfg["precision"] == "fp16")
    model = build.build_gpt_model(spec, seed=SEED, use_distributed_optimizer=cfg["dist_opt"])
    scaler = dict(initial_loss_scale=2.0 ** 12, loss_scale_window=1000) \
        if cfg["precision"] == "fp16" else {}
    opt = build.build_optimizer(model, lr=cfg["lr"], weight_decay=0.1, clip_grad=cfg["clip"],
                                bf16=spec.bf16, fp16=spec.fp16,
                                use_distributed_optimizer=cfg["dist_opt"],
                                optimizer=cfg["optimizer"], sgd_momentum=cfg["momentum"],
                                decoupled_weight_decay=cfg["decoupled"], **scaler)
    data = build.mock_data_iterator(spec, MBS, SEED + int(os.environ.get("RANK", "0")))
    return model[0], opt, data


def run_group(model, data) -> None:
    """A micro-batches, forward and backward (the data-parallel reduction on the last), then
    the gradients' finalisation: the buffer is the group's whole gradient."""
    config, model_type = get_model_config(model), get_model_type(model)
    for i in range(A):
        sync = contextlib.nullcontext() if i == A - 1 else model.no_sync()
        with sync:
            output, _ = mcore_schedules.forward_step(
                build.gpt_forward_step, data, model, A, None, [], config, cp_group_size=1,
                is_first_microbatch=i == 0, current_microbatch=i, is_last_stage=True)
            compat.backward_step(None, output, None, model_type, config)
    finalize_model_grads([model], None)


def count_host_syncs(fn):
    """Calls of the ops that make a GPU host wait (a scalar read back): counted by a dispatch
    mode while ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncs = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.syncs, self.ops = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.syncs += str(func) in syncs
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn()
    return counter.syncs, counter.ops


def run_case(case: str, out: str) -> None:
    cfg = {**BASE, **CASES[case]}
    model, opt, data = build_case(cfg)
    for _ in range(3):
        run_group(model, data)
        ok, _norm, _ = opt.step()
        assert ok
        model.zero_grad_buffer()
        opt.zero_grad()
    layout = main_params.StageLayout(model, opt)
    sp = layout.stage_pass
    run_group(model, data)
    # the prediction into fp32 buffers in place of the model weights
    targets = [p.target for p in sp.pieces]
    for piece in sp.pieces:
        piece.target = torch.zeros_like(piece.main)
    def predict():
        predict_ahead(layout, 1, grad_factor(A, A), lambda group, n: n * group["lr"],
                      main_params.loss_scale_tensor(opt),
                      lambda t: main_params.reduce_over(t, stage_grad_stats_group(opt)))

    sp.kernel = "plain"
    before = [p.main.clone() for p in sp.pieces]
    syncs, ops = count_host_syncs(predict)
    predicted = [p.target.clone() for p in sp.pieces]
    for piece, target in zip(sp.pieces, targets):
        piece.target = target
    ok, norm, _ = opt.step()  # Megatron's own, on the same buffers
    assert ok
    after = [p.main.clone() for p in sp.pieces]
    diff = max(float((p - a).abs().max()) for p, a in zip(predicted, after))
    scale = max(float(a.abs().max()) for a in after)
    step = max(float((a - b).abs().max()) for a, b in zip(after, before))
    moved = max(float((p - b).abs().max()) for p, b in zip(predicted, before))
    rank = torch.distributed.get_rank()
    with open(os.path.join(out, f"{case}.rank{rank}.json"), "w") as f:
        json.dump(dict(case=case, config=cfg, max_diff=diff, max_weight=scale, moved=moved,
                       step=step,
                       grad_norm=float(norm), clip=cfg["clip"], host_syncs=syncs, ops=ops,
                       pieces=len(sp.pieces), klasses=len(sp.klasses),
                       minors=sum(len(p.minors) for p in sp.pieces)), f)


def run_layerwise(out: str) -> None:
    """--paci-weight-prediction-overlap on CPU: the layer-by-layer move gives the forward the
    whole-stage move gives, bit for bit, and leaves the weights as they were; a forward
    outside a predicted one sees no hook."""
    from paci_megatron.mcore.prediction_overlap import LayerwiseMove

    cfg = {**BASE, "clip": 1.0}
    model, opt, data = build_case(cfg)
    for _ in range(2):
        run_group(model, data)
        opt.step()
        model.zero_grad_buffer()
        opt.zero_grad()
    layout = main_params.StageLayout(model, opt)
    config = get_model_config(model)
    batch = next(data)
    run_group(model, data)  # a gradient in the buffer to fold

    def forward():
        with torch.no_grad():
            output, _ = mcore_schedules.forward_step(
                build.gpt_forward_step, iter([batch]), model, A, None, [], config,
                cp_group_size=1, is_first_microbatch=True, current_microbatch=0,
                is_last_stage=True)
        return output.clone()

    def predicted(mover):
        predict_ahead(layout, 2, grad_factor(A, 3), lambda group, n: n * group["lr"],
                      None, None, mover)
        return forward()

    plain = forward()
    before = [p.detach().clone() for p in model.parameters()]
    whole = predicted(None)
    layout.stage_pass.restore()
    mover = LayerwiseMove(layout, model)
    layered = predicted(mover)
    mover.finish()
    after = [p.detach() for p in model.parameters()]
    rank = torch.distributed.get_rank()
    with open(os.path.join(out, f"layerwise.rank{rank}.json"), "w") as f:
        json.dump(dict(case="layerwise", layers=len(mover.layers), units=len(mover.units),
                       outside=len(mover.outside), equal=torch.equal(whole, layered),
                       moved=not torch.equal(whole, plain),
                       restored=all(torch.equal(a, b) for a, b in zip(before, after)),
                       plain_again=torch.equal(forward(), plain)), f)


def main() -> int:
    args = parse_case_args(list(CASES) + ["layerwise"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for case in args.cases:
        if case == "layerwise":
            run_layerwise(args.out)
            continue
        if CASES[case].get("dp", 1) != world:
            raise SystemExit(f"case {case} needs {CASES[case].get('dp', 1)} processes")
        run_case(case, args.out)
    build.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
