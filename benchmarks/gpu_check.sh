#!/usr/bin/env bash
# The one prepared GPU check: everything a lent GPU should run, in one call of under 8 minutes,
# its figures written to $OUT (read ../shared/GPU_NOTES.md first).
#
#   here, once:       bash benchmarks/gpu_check.sh prepare   # megatron-core's wheel into .whl/
#   on the device:    bash benchmarks/gpu_check.sh run       # device tool: carry [".whl"]
#
# What it runs (each step under its own timeout; a failed step does not stop the others):
#   1. the prediction benchmark's GPU table (CUDA events), benchmarks/prediction_pass.py;
#   2. the prediction's move and restore under torch.cuda.set_sync_debug_mode("error");
#   3. host syncs over the steady state at P=1 on NCCL, paci against 1f1b (sync debug "warn");
#   4. tests/test_cuda.py: P=1 on NCCL, P=2 and P=4 on one GPU through the host-staged harness,
#      with weight prediction on (bf16).
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-run}" in
prepare)
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl "megatron-core==0.16.1"
    ls .whl
    ;;
run)
    OUT=${OUT:-/tmp/gpu_check}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megatron_core-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    [ -e paci_megatron/patches ] || cp -r patches paci_megatron/patches  # as setup.py maps it
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
    python3 -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$OUT/gpu.txt"
    step() {  # name, seconds, command...
        local name=$1 seconds=$2; shift 2
        local start=$SECONDS
        timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
        echo "$name: rc $? in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    }
    step prediction_pass 150 python3 benchmarks/prediction_pass.py --threads 8 --before "" --repeats 20
    step prediction_syncs 90 python3 benchmarks/gpu_syncs.py prediction
    FLAGS="--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
           --micro-batch-size 4 --global-batch-size 32 --vocab-size 8192 --bf16
           --train-iters 6 --log-interval 100"
    for schedule in paci 1f1b; do
        # shellcheck disable=SC2086
        step "steady_syncs_$schedule" 90 torchrun --standalone --nproc-per-node 1 \
            benchmarks/gpu_syncs.py steady $FLAGS --pipeline-schedule "$schedule"
    done
    step test_cuda 240 python3 -m pytest -q -x tests/test_cuda.py
    grep -h "^SYNCS\|^|\|^prediction" "$OUT"/*.txt > "$OUT/figures.txt" 2>/dev/null
    cat "$OUT/summary.txt"
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
