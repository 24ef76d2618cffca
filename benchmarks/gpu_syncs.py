"""Host syncs on a GPU, where they cost (part of the prepared GPU check, benchmarks/gpu_check.sh).

    python benchmarks/gpu_syncs.py prediction
    torchrun --nproc-per-node 1 benchmarks/gpu_syncs.py steady <pretrain_gpt_paci.py flags>

``prediction``: the weight prediction's move and restore on the paper-regime study's stage,
fused and plain, under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing CUDA
call raises. Prints one line per kernel.

``steady``: pretrain_gpt_paci.py with ``torch.cuda.set_sync_debug_mode("warn")`` over the
training steps of the steady-state iterations (2 to the second-to-last); every warning is a
synchronizing call. Prints ``SYNCS {json}``: the count per iteration and the first callers.
Run it for ``--pipeline-schedule paci`` and ``1f1b`` on the same flags: PACI's count must not
exceed stock's.
"""

import json
import os
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def prediction() -> int:
    import torch

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import prediction_pass as bench
    from paci_megatron.features.moves import grad_factor, predict_ahead
    from paci_megatron.mcore import build, main_params

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_PORT", "29531")):
        os.environ.setdefault(key, value)
    build.init_distributed(pp=1, seed=1234)
    model, opt, _forward = bench.build_stage(bench.SHAPES["study stage (2 x 512, 1 x 64 tokens)"])
    layout = main_params.StageLayout(model, opt)
    failed = 0
    for kernel in ("fused", "plain"):
        layout.stage_pass.kernel = kernel

        def move():
            predict_ahead(layout, 1, grad_factor(8, 3), lambda group, n: n * group["lr"],
                          main_params.loss_scale_tensor(opt))
            layout.stage_pass.restore()

        move()  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                move()
            print(f"prediction {kernel}: no synchronizing call in 5 moves and restores")
        except RuntimeError as exc:
            failed += 1
            print(f"prediction {kernel}: SYNC: {exc}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    build.destroy_distributed()
    return 1 if failed else 0


def steady(argv) -> int:
    import torch
    from paci_megatron import training

    calls, iterations = [], [0]
    original = training.train_step

    def train_step(job):
        if not 2 <= job.iteration < job.args.train_iters - 1:
            return original(job)
        iterations[0] += 1
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = original(job)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                calls.append(f"{os.path.basename(w.filename)}:{w.lineno}")
        return result

    training.train_step = train_step
    finish = training.finish

    def report(job):
        print("SYNCS " + json.dumps({"rank": int(os.environ.get("RANK", "0")),
                                     "iterations": iterations[0],
                                     "per_iteration": len(calls) / max(1, iterations[0]),
                                     "callers": sorted(set(calls))[:12]}), flush=True)
        return finish(job)

    training.finish = report
    return training.main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["prediction"]:
        sys.exit(prediction())
    if sys.argv[1:2] == ["steady"]:
        sys.exit(steady(sys.argv[2:]))
    sys.exit(__doc__)
