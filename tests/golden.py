"""Golden outputs: every loss and every stage's weights of fixed runs, recorded before a
change that must not alter numbers and checked after it.

    python tests/golden.py record DIR [CONFIG...]   # before the change
    python tests/golden.py check DIR [CONFIG...]    # after it: exit 1 on any difference

Each config is one ``pretrain_gpt_paci.py`` job (or two, for a resume) on CPU/gloo covering
one feature or a combination; ``mlm_*`` configs run Megatron-LM's own ``pretrain_gpt.py``
through ``paci_megatron.run`` and need ``MEGATRON_LM_PATH``. What is compared: the run's
summary (every training loss, the validation loss, every stage's weights SHA-256 and tied
copy digest, the drift tables) and every metrics record but its timings; for ``mlm_*`` the
printed iteration and drift lines. A script, not a test: the digests depend on this machine's
CPU kernels, so they hold on one machine, before and after.
"""

import json
import os
import re
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from launch import (REPO, launch, paci_summary, read_metrics, run_torchrun,  # noqa: E402
                    torchrun_cmd)

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--vocab-size", "128",
        "--train-iters", "6", "--lr", "2e-3", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--distributed-backend", "gloo", "--eval-interval", "3", "--eval-iters", "1"]
UNTIED = ["--untie-embeddings-and-output-weights"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]

# name -> (processes, flags); every run is PACI unless it says otherwise
CONFIGS: Dict[str, tuple] = {
    "p2_default": (2, ["--global-batch-size", "8"] + DROPOUT),
    "p4_plain_untied": (4, UNTIED + ["--global-batch-size", "16", "--paci-accumulation-factor",
                                     "2", "--paci-drain-before-eval"] + DROPOUT),
    "p4_bf16_tied": (4, ["--bf16", "--global-batch-size", "8", "--paci-accumulation-factor", "2"]),
    "p2_fp16": (2, UNTIED + ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window",
                             "2", "--global-batch-size", "8", "--paci-accumulation-factor", "2"]),
    "p2_dp2_distopt_overlap": (4, UNTIED + [
        "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather", "--global-batch-size", "16",
        "--paci-accumulation-factor", "2"] + DROPOUT),
    "p2_tp2": (4, ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"] + DROPOUT),
    "p4_auto": (4, UNTIED + ["--global-batch-size", "8", "--train-iters", "8",
                             "--paci-accumulation-factor", "auto", "--paci-adapt-interval", "2",
                             "--paci-adapt-policy", "cycle"]),
    "p2_a1": (2, UNTIED + ["--global-batch-size", "8", "--paci-accumulation-factor", "1"]
              + DROPOUT),
    "p2_rampup": (2, UNTIED + ["--global-batch-size", "8", "--rampup-batch-size", "4", "4",
                               "16"]),
    "p2_1f1b": (2, ["--pipeline-schedule", "1f1b", "--global-batch-size", "8"] + DROPOUT),
    "p2_interleaved": (2, UNTIED + ["--pipeline-schedule", "interleaved",
                                    "--num-layers-per-virtual-pipeline-stage", "1",
                                    "--global-batch-size", "8"]),
    "p2_per_token_untied": (2, UNTIED + ["--calculate-per-token-loss", "--global-batch-size",
                                         "8", "--paci-accumulation-factor", "2"]),
    "p2_per_token_tied": (2, ["--calculate-per-token-loss", "--global-batch-size", "8",
                              "--paci-accumulation-factor", "1"]),
    "p4_recompute_a1": (4, UNTIED + ["--global-batch-size", "8", "--paci-accumulation-factor",
                                     "1", "--recompute-granularity", "full",
                                     "--recompute-method", "uniform"] + DROPOUT),
    # train to 3 with a checkpoint, then resume to 6 (two launches; the second is compared)
    "p2_resume": (2, ["--global-batch-size", "8", "--paci-accumulation-factor", "2"] + DROPOUT),
}
MLM_FLAGS = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "4", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
    "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "paci"]
MLM_CONFIGS = {
    "mlm_untied": ["--untie-embeddings-and-output-weights", "--paci-accumulation-factor", "2"],
    "mlm_tied": ["--paci-accumulation-factor", "1"],
}
TIMINGS = {"wall_s", "elapsed_ms", "tokens_per_sec", "peak_memory_mb", "peak_rss_mb",
           "peak_activation_mb", "memory", "forward_ms", "predict_ms", "lookahead_ms",
           "method_forward_ms", "stage_forward_ms"}
MLM_LINE = re.compile(r"(iteration\s+\d+/\s*\d+ \|.*?lm loss: \S+ \|.*?grad norm: \S+ \|)"
                      r"|(> PACI stage \d+: .*)|(> PACI tied embedding: .*)")


def _without_timings(obj):
    if isinstance(obj, dict):
        return {k: _without_timings(v) for k, v in obj.items() if k not in TIMINGS}
    if isinstance(obj, list):
        return [_without_timings(v) for v in obj]
    return obj


def _train(nproc: int, flags: List[str], work: str) -> dict:
    metrics = os.path.join(work, "metrics.jsonl")
    _rc, out, _err = run_torchrun("pretrain_gpt_paci.py", [*BASE, *flags, "--metrics-file",
                                                           metrics], nproc=nproc, timeout=600)
    return {"summary": _without_timings(paci_summary(out)),
            "metrics": _without_timings(read_metrics(metrics))}


def run_config(name: str) -> dict:
    with tempfile.TemporaryDirectory() as work:
        if name in MLM_CONFIGS:
            return _run_megatron_lm(MLM_CONFIGS[name], work)
        nproc, flags = CONFIGS[name]
        if name == "p2_resume":
            ckpt = os.path.join(work, "ckpt")
            _train(nproc, flags + ["--save", ckpt, "--exit-interval", "3"], work)
            os.remove(os.path.join(work, "metrics.jsonl"))
            return _train(nproc, flags + ["--load", ckpt], work)
        return _train(nproc, flags, work)


def _run_megatron_lm(flags: List[str], work: str) -> dict:
    # the first entry of the list tests/test_megatron_lm.py takes, without a SITE
    root = os.environ.get("MEGATRON_LM_PATH", "").split(os.pathsep)[0].partition("@")[0]
    if not root:
        raise SystemExit("mlm_* configs need MEGATRON_LM_PATH (a Megatron-LM checkout of the "
                         "installed megatron-core's minor release)")
    cmd = torchrun_cmd("paci_megatron.run", [os.path.join(root, "pretrain_gpt.py"), *MLM_FLAGS,
                                             *flags], nproc=2, module=True)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = launch(cmd, cwd=work, env=env, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    lines = [m.group(0) for m in MLM_LINE.finditer(out.stdout)]
    # the elapsed time and throughput vary from run to run
    return {"lines": [re.sub(r"elapsed time per iteration \(ms\): [\d.]+ \|", "", line)
                      for line in lines]}


def _diff(a, b, path="") -> List[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append(f"{path}/{key}: only in {'before' if key in a else 'after'}")
            else:
                out += _diff(a[key], b[key], f"{path}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:300]]


def main(argv: List[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    mode, folder, names = argv[0], argv[1], argv[2:]
    if not names:
        names = list(CONFIGS) + (list(MLM_CONFIGS) if os.environ.get("MEGATRON_LM_PATH") else [])
    os.makedirs(folder, exist_ok=True)
    failed = []
    for name in names:
        result = run_config(name)
        path = os.path.join(folder, f"{name}.json")
        if mode == "record":
            with open(path, "w") as f:
                json.dump(result, f, indent=1, sort_keys=True)
            print(f"recorded {name}", flush=True)
            continue
        with open(path) as f:
            before = json.load(f)
        diffs = _diff(before, result)
        print(f"{name}: {'same' if not diffs else f'{len(diffs)} differences'}", flush=True)
        for line in diffs[:10]:
            print("   ", line)
        if diffs:
            failed.append(name)
    if failed:
        print(f"CHANGED: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
