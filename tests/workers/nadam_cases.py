"""--optimizer nadam inside Megatron's wrappers against a plain torch NAdam, and through a
checkpoint (run under torchrun, one pipeline stage, data parallel = the process count).

    torchrun --standalone --nproc-per-node N tests/workers/nadam_cases.py --out DIR CASE...

Each case trains STEPS groups with Megatron's LR scheduler (warm-up, then cosine; weight decay
0 on the biases and norms), its clipping acting on every step, and its step taken in its
parts: after the unscaling and the clipping, a plain ``torch.optim.NAdam`` outside Megatron
gets a copy of every main weight (the distributed optimizer's shards), its gradient and its
group's lr and weight decay, and steps too; every main weight must equal the reference's bit
for bit. Then the run is saved with the project's checkpoint, loaded into a second model and
optimizer built from scratch, and both take MORE groups of the same batches: equal bit for
bit. Writes DIR/CASE.rank<R>.json for tests/test_nadam.py.
"""

import json
import os
import sys

import torch

from paci_megatron.features.base import sub_optimizers
from paci_megatron.mcore import build, checkpoint
from paci_megatron.mcore.nadam import MegatronNAdam

from case_args import parse_case_args  # same folder: the script's own
from prediction_step_cases import A, MBS, SEED, run_group

STEPS, MORE, LR, CLIP, BETAS = 4, 2, 1e-2, 0.05, (0.99, 0.95)
CASES = {"bf16": dict(precision="bf16", dist_opt=False, dp=1),
         "fp16": dict(precision="fp16", dist_opt=False, dp=1),  # dynamic loss scale 2^12
         "dp2_distopt_bf16": dict(precision="bf16", dist_opt=True, dp=2)}


def build_run(cfg):
    spec = build.GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=128, untie_embeddings=True, bf16=cfg["precision"] == "bf16",
                         fp16=cfg["precision"] == "fp16")
    model = build.build_gpt_model(spec, seed=SEED, use_distributed_optimizer=cfg["dist_opt"])
    scaler = dict(initial_loss_scale=2.0 ** 12) if spec.fp16 else {}
    opt = build.build_optimizer(model, lr=LR, weight_decay=0.1, clip_grad=CLIP,
                                adam_beta1=BETAS[0], adam_beta2=BETAS[1], bf16=spec.bf16,
                                fp16=spec.fp16, use_distributed_optimizer=cfg["dist_opt"],
                                optimizer="nadam", **scaler)
    scheduler = build.build_lr_scheduler(opt, lr=LR, min_lr=LR / 10, warmup_steps=2 * A * MBS,
                                         decay_steps=(STEPS + MORE) * A * MBS)
    data = build.mock_data_iterator(spec, MBS, SEED + int(os.environ.get("RANK", "0")))
    return model, opt, scheduler, data


def inner_optimizers(opt):
    return [sub.optimizer for sub in sub_optimizers(opt)]


def reference_for(opt):
    """A plain torch NAdam over copies of the main weights, in Megatron's groups."""
    copies, groups = {}, []
    for inner in inner_optimizers(opt):
        for group in inner.param_groups:
            params = [copies.setdefault(p, p.detach().clone()) for p in group["params"]]
            groups.append({"params": params, "lr": group["lr"],
                           "weight_decay": group["weight_decay"]})
    return torch.optim.NAdam(groups, lr=LR, betas=BETAS, eps=1e-8, momentum_decay=0.004,
                             decoupled_weight_decay=True), copies


def step_beside(opt, reference, copies) -> dict:
    """Megatron's step in its parts, the reference's on the same clipped gradients."""
    assert not opt.prepare_grads()  # no fp16 overflow at this scale
    norm = opt.clip_grad_norm(CLIP)
    groups = [g for inner in inner_optimizers(opt) for g in inner.param_groups]
    for ours, theirs in zip(groups, reference.param_groups):
        theirs["lr"], theirs["weight_decay"] = ours["lr"], ours["weight_decay"]
        for main, copy in zip(ours["params"], theirs["params"]):
            copy.data.copy_(main)
            copy.grad = main.grad.clone()
    decays = sorted({g["weight_decay"] for g in groups})
    assert opt.step_with_ready_grads()
    reference.step()
    diff = max(float((main - copy).abs().max()) for main, copy in copies.items())
    return dict(norm=float(norm), lr=groups[0]["lr"], decays=decays, diff=diff)


def train(model, opt, scheduler, data, steps, on_step=None) -> list:
    rows = []
    for _ in range(steps):
        run_group(model[0], data)
        if on_step is None:
            ok, _norm, _ = opt.step()
            assert ok
        else:
            rows.append(on_step())
        scheduler.step(increment=A * MBS)
        model[0].zero_grad_buffer()
        opt.zero_grad()
    return rows


def weights(model, opt) -> list:
    mains = [p for inner in inner_optimizers(opt) for g in inner.param_groups
             for p in g["params"]]
    return [p.detach().clone() for p in list(model[0].parameters()) + mains]


def run_case(case: str, out: str) -> None:
    cfg = CASES[case]
    model, opt, scheduler, data = build_run(cfg)
    start = weights(model, opt)
    reference, copies = reference_for(opt)
    rows = train(model, opt, scheduler, data, STEPS, lambda: step_beside(opt, reference, copies))
    root = os.path.join(out, f"ckpt_{case}")
    checkpoint.save_checkpoint(root, STEPS, model, opt, scheduler)
    batches = [next(data) for _ in range(MORE * A)]
    model2, opt2, scheduler2, _ = build_run(cfg)
    checkpoint.load_checkpoint(root, model2, opt2, scheduler2)
    train(model, opt, scheduler, iter(batches), MORE)
    train(model2, opt2, scheduler2, iter(batches), MORE)
    whole, resumed = weights(model, opt), weights(model2, opt2)
    rank = torch.distributed.get_rank()
    with open(os.path.join(out, f"{case}.rank{rank}.json"), "w") as f:
        json.dump(dict(case=case, steps=rows,
                       kinds=sorted({type(o).__name__ for o in inner_optimizers(opt2)}),
                       nadam=all(isinstance(o, MegatronNAdam) for o in inner_optimizers(opt2)),
                       resumed_equal=all(torch.equal(a, b) for a, b in zip(whole, resumed)),
                       moved=any(not torch.equal(a, b) for a, b in zip(whole, start))), f)


def main() -> int:
    args = parse_case_args(CASES)
    build.init_distributed(pp=1, seed=SEED, timeout_s=90)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for case in args.cases:
        if CASES[case]["dp"] != world:
            raise SystemExit(f"case {case} needs {CASES[case]['dp']} processes")
        run_case(case, args.out)
    build.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
