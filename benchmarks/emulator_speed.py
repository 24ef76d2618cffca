"""Which runs a long PACI study faster on this machine: the multi-process runtime (one process
a stage) or the one-process emulator (every stage in one process, ``mcore/reference.py``)?
Both run the same action lists and give the same numbers (tests/test_reference.py).

    torchrun --nproc-per-node 4 benchmarks/emulator_speed.py --mode runtime
    torchrun --nproc-per-node 1 benchmarks/emulator_speed.py --mode emulator [--threads 2]

Prints seconds per training call (N = 8 micro-batches) after two untimed calls, for the
paper-regime study's model (GPT 8 x 512, sequence 64, micro-batch 1, bf16, P = 4, a = 8).
``--stages P --layers L --hidden H --micro-batches N`` time another shape, e.g. study 15's
(``--mode emulator --stages 16 --layers 32 --hidden 128 --heads 4 --vocab 2000
--micro-batches 16``), a = N.
"""

import argparse
import time

import torch

from paci_megatron.mcore import build
from paci_megatron.mcore.reference import PipelineEmulator, StageParts
from paci_megatron.mcore.runtime import PaciRuntime

P, N, MBS, SEED = 4, 8, 1, 1234
SPEC = build.GPTSpec(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=64,
                     vocab_size=2048, untie_embeddings=True, bf16=True)


def set_shape(args) -> None:
    """The module's shape from the flags (the defaults are the paper-regime study's)."""
    global P, N, SPEC
    P, N = args.stages, args.micro_batches
    SPEC = build.GPTSpec(num_layers=args.layers, hidden_size=args.hidden,
                         num_attention_heads=args.heads, seq_length=64,
                         vocab_size=args.vocab, untie_embeddings=True, bf16=True)


def parts() -> StageParts:
    model = build.build_gpt_model(SPEC, seed=SEED)
    opt = build.build_optimizer(model, lr=3e-4, bf16=True)
    info = build.stage_info()
    data = build.mock_data_iterator(SPEC, MBS, SEED) if info["is_first"] or info["is_last"] \
        else None
    return StageParts(model[0], opt, None, data)


def timed(call, calls: int) -> float:
    for _ in range(2):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("runtime", "emulator"), required=True)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (emulator)")
    parser.add_argument("--stages", type=int, default=P)
    parser.add_argument("--micro-batches", type=int, default=N)
    parser.add_argument("--layers", type=int, default=SPEC.num_layers)
    parser.add_argument("--hidden", type=int, default=SPEC.hidden_size)
    parser.add_argument("--heads", type=int, default=SPEC.num_attention_heads)
    parser.add_argument("--vocab", type=int, default=SPEC.vocab_size)
    args = parser.parse_args()
    set_shape(args)
    torch.set_num_threads(args.threads)
    if args.mode == "runtime":
        build.init_distributed(pp=P, seed=SEED, timeout_s=600)
        stage = parts()
        rt = PaciRuntime(kind="paci", accumulation=N)
        rt.bind(stage.optimizer, None)
        seconds = timed(lambda: rt.forward_backward(
            forward_step_func=build.gpt_forward_step, data_iterator=stage.data,
            model=[stage.model], num_microbatches=N, seq_length=SPEC.seq_length,
            micro_batch_size=MBS), args.calls)
        if rt.stage == 0:
            print(f"runtime, {P} processes: {seconds:.3f} s per call")
        rt.drain()
    else:
        build.init_distributed(pp=1, seed=SEED, timeout_s=600)
        emu = PipelineEmulator(num_stages=P, accumulation=N, micro_batch_size=MBS,
                               seq_length=SPEC.seq_length, build_stage=lambda s: parts(),
                               seed=SEED)
        seconds = timed(lambda: emu.train_call(N), args.calls)
        print(f"emulator, 1 process, {args.threads} thread(s): {seconds:.3f} s per call")


if __name__ == "__main__":
    main()
