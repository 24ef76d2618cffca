"""What one predicted forward's weight prediction costs (move + restore), before and after the
fused pass, beside a forward of the same stage and the memory floor.

    python benchmarks/prediction_pass.py [--threads 2] [--before 051acee] [--repeats 10]

One process, one real Megatron-Core stage, bf16, AdamW with state and a gradient in its
buffer, for two shapes: the paper-regime study's stage (a middle stage of GPT 8 x 512 at
P = 4: 2 layers, 64-token micro-batches) and one GPT-2-medium layer (hidden 1024, micro-batch
4 x 1024). Per shape and pass: move + restore in ms (best of ``--repeats``) and in forwards
of the same stage; bytes it must move (24 a parameter: main copy, two moments and gradient
read, weight written; then main read and weight written) against what a plain copy of 24
bytes a parameter takes here; and, counted with a dispatch mode, the operators launched
(views excluded), compiled kernels called and host syncs (a scalar read back) per predicted
forward. ``before``: the pass as it was at that commit, loaded from git (not kept in the
tree). On a GPU (never required) the times are CUDA events.
"""

import argparse
import os
import subprocess
import sys
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from paci_megatron.features import prediction_pass as pp  # noqa: E402
from paci_megatron.features.moves import grad_factor, predict_ahead  # noqa: E402
from paci_megatron.mcore import build, main_params  # noqa: E402
from paci_megatron.mcore.reference import as_pipeline_stage  # noqa: E402

SHAPES = {
    "study stage (2 x 512, 1 x 64 tokens)": dict(layers=8, stages=4, stage=1, hidden=512,
                                                  heads=8, seq=64, mbs=1),
    "GPT-2 medium layer (1024, 4 x 1024 tokens)": dict(layers=2, stages=2, stage=1,
                                                       hidden=1024, heads=16, seq=1024, mbs=4),
}
SYNCS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.ops += not func.is_view
        self.syncs += str(func) in SYNCS
        return func(*args, **(kwargs or {}))


def load_before(commit: str):
    """The pass at ``commit``: its weight_prediction and main_params modules, from git."""
    def source(path):
        return subprocess.run(["git", "-C", REPO, "show", f"{commit}:{path}"], check=True,
                              capture_output=True, text=True).stdout

    modules = {}
    for name, path in (("weight_prediction", "paci_megatron/features/weight_prediction.py"),
                       ("main_params", "paci_megatron/mcore/main_params.py")):
        package = "paci_megatron.features" if name == "weight_prediction" else "paci_megatron.mcore"
        module = types.ModuleType(f"{package}._before_{name}")
        module.__package__ = package
        text = source(path).replace("from ..features.weight_prediction import MainPair",
                                    "MainPair = _BEFORE.MainPair")
        module._BEFORE = modules.get("weight_prediction")
        sys.modules[module.__name__] = module  # dataclasses look their module up
        exec(compile(text, f"{commit}:{path}", "exec"), module.__dict__)
        modules[name] = module
    return modules["weight_prediction"], modules["main_params"]


def build_stage(shape):
    spec = build.GPTSpec(num_layers=shape["layers"], hidden_size=shape["hidden"],
                         num_attention_heads=shape["heads"], seq_length=shape["seq"],
                         vocab_size=2048, untie_embeddings=True, bf16=True)
    with as_pipeline_stage(shape["stage"], shape["stages"]):
        model = build.build_gpt_model(spec, seed=1234)[0]
        opt = build.build_optimizer([model], lr=3e-4, bf16=True, adam_beta2=0.95, weight_decay=0.1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    hidden = torch.randn(shape["seq"], shape["mbs"], shape["hidden"], dtype=torch.bfloat16,
                         device=device)

    def forward():
        with as_pipeline_stage(shape["stage"], shape["stages"]):
            build.unwrap_model(model).set_input_tensor(hidden)
            return model(None, None, None)

    for _ in range(2):  # state in the optimizer, a gradient in the buffer
        out = forward()
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    out = forward()
    out.float().square().mean().backward()
    return model, opt, forward


def timer(cuda: bool):
    if not cuda:
        return time.perf_counter
    def now():
        torch.cuda.synchronize()
        return time.perf_counter()
    return now


def best_ms(fn, repeats: int, now) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        times.append(now() - start)
    return 1e3 * min(times)


def counted(fn):
    calls = pp.fused_calls()
    with Count() as count:
        fn()
    return count.ops, pp.fused_calls() - calls, count.syncs


def measure(name, shape, before, repeats: int, now) -> list:
    model, opt, forward = build_stage(shape)
    params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        forward_ms = best_ms(forward, repeats, now)
    passes = {}
    if before is not None:
        old_wp, old_mp = before
        pairs = old_mp.main_pairs(opt)

        def old():
            old_wp.move_to_prediction(pairs, 1, 1.0)
            old_wp.restore_weights(pairs)
        passes["before"] = old
    layout = main_params.StageLayout(model, opt)
    for kernel in ("plain", "fused"):
        def new(kernel=kernel):
            layout.stage_pass.kernel = kernel
            predict_ahead(layout, 1, grad_factor(8, 3), lambda group, n: n * group["lr"])
            layout.stage_pass.restore()
        if kernel == "fused" and pp.kernel_choice(layout.stage_pass.device.type) != "fused":
            continue
        passes[kernel] = new
    floor_src = torch.empty(params * 3, dtype=torch.float32, device=layout.stage_pass.device)
    floor_dst = torch.empty_like(floor_src)
    floor_ms = best_ms(lambda: floor_dst.copy_(floor_src), repeats, now)
    rows = []
    for label, fn in passes.items():
        ms = best_ms(fn, repeats, now)
        ops, compiled, syncs = counted(fn)
        rows.append(f"| {name} | {label} | {ms:.2f} | {ms / forward_ms:.2f} | "
                    f"{ms / floor_ms:.1f} | {ops} | {compiled} | {syncs} |")
    rows.append(f"| {name} | forward of the stage ({params / 1e6:.1f} M parameters) | "
                f"{forward_ms:.2f} | 1 | | | | |")
    rows.append(f"| {name} | copy of 24 bytes a parameter (the floor) | {floor_ms:.2f} | "
                f"{floor_ms / forward_ms:.2f} | 1.0 | | | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--before", default="051acee",
                        help="commit whose pass to time beside today's ('' to skip)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_PORT", "29517")
    build.init_distributed(pp=1, seed=1234)
    cuda = torch.cuda.is_available()
    before = load_before(args.before) if args.before else None
    print(f"device: {'cuda' if cuda else 'cpu'}, threads {args.threads}, torch "
          f"{torch.__version__}; best of {args.repeats}")
    print("| stage | pass | move + restore ms | forwards | x floor | operators | compiled "
          "kernels | host syncs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, shape in SHAPES.items():
        for row in measure(name, shape, before, args.repeats, timer(cuda)):
            print(row, flush=True)
    build.destroy_distributed()


if __name__ == "__main__":
    main()
