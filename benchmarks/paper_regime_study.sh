#!/bin/bash
# The paper-regime study (issue 20; pre-registered in benchmarks/studies/12-paper-regime.md): GPT
# 8 x 512 on tinyshakespeare, bf16, AdamW (0.9, 0.95), weight decay 0.1, 2000 updates of
# 8 sequences (a = M = 8, micro-batch 1), 1% warm-up, cosine to 0.1x.
#
#   bash benchmarks/paper_regime_study.sh PHASE [OUT]  (default OUT=benchmarks/results/paper_regime)
#
# The default OUT is in the repository so that finished runs (metrics and flags, a few KB each)
# are committed and a later session's --reuse picks them up: the study grows run by run.
#
# PHASE, in order (each is a compare run with --reuse, so an interrupted phase resumes and
# a finished one costs nothing; about 10 minutes a P=4 run on 2 idle cores):
#   sweep       1F1B at LR 1e-4, 3e-4, 1e-3, seed 1234: is 3e-4 about the best for this model?
#   select      seed 1234, P=4: 1F1B, plain PACI, W=0.2, prediction, the correction K=4000
#   report      p4, p8 and budget below, in that order (seeds 2001, 2002)
#   p4          P=4: 1F1B, interleaved, plain PACI, the candidate (CANDIDATE, the flags the
#               selection chose), plain PACI with a 200-iteration 1F1B cool-down
#   p8          P=8 (8 processes): 1F1B, plain PACI, the candidate
#   budget      P=4, 2750 updates (the throughput ratio x 2000): 1F1B (the control), plain
#               PACI, the candidate
#   aggressive  the earlier study's regime (4 x 64, LR 2e-3, 1000 updates) in bf16, seeds
#               1234 and 1235: 1F1B, plain PACI, W=0.2, prediction
#
# Needs the tokenized corpus (once, ~5 s):
#   python -m paci_megatron.tools.preprocess_data --input ../shared/data/tinyshakespeare.txt \
#       --output-prefix /tmp/cmp_shk/shakespeare --tokenizer-model /tmp/cmp_shk/spm.model --vocab-size 2000
set -euo pipefail
PHASE=${1:?usage: paper_regime_study.sh sweep|select|report|p4|p8|budget|aggressive [OUT]}
OUT=${2:-$(dirname "$0")/results/paper_regime}
DATA=${DATA:-/tmp/cmp_shk}
# report: the selection's winner (section 12: plain PACI with forward weight prediction)
CANDIDATE=${CANDIDATE:-"--paci-weight-prediction"}  # = $PREDICT
source "$(dirname "$0")/paper_regime_flags.sh"  # CORPUS, PAPER, LR, PLAIN, PREDICT
compare() { python -m paci_megatron.tools.compare --reuse "$@"; }

# report_seeds OUT NPROC SCHEDULES [--run ...]: 1F1B (and SCHEDULES), plain PACI, the
# candidate and the given runs on the report seeds, one seed at a time, so a session that
# stops early still leaves whole seeds; the last call only reuses them, for the report over both
report_seeds() {
  local out=$1 nproc=$2 schedules=$3
  shift 3
  [ -n "$CANDIDATE" ] || { echo "report: set CANDIDATE to the selection's flags" >&2; exit 2; }
  for seeds in 2001 2002 2001,2002; do
    compare --schedules "$schedules" --seeds "$seeds" --nproc-per-node "$nproc" --out "$out" \
        --run paci-plain="$PLAIN" --run paci-candidate="--pipeline-schedule paci $CANDIDATE" \
        "$@" -- "${PAPER[@]}" "${LR[@]}" --train-iters 2000
  done
}

case "$PHASE" in
sweep)
  for lr in 1e-4 3e-4 1e-3; do
    min=$(python -c "print(f'{$lr / 10:g}')")
    compare --schedules 1f1b --seeds 1234 --nproc-per-node 4 --out "$OUT/sweep/lr$lr" -- \
        "${PAPER[@]}" --lr "$lr" --min-lr "$min" --train-iters 2000
  done ;;
select)
  mkdir -p "$OUT/select"  # the sweep's LR 3e-4 run is the selection's 1F1B (same flags, seed)
  for f in "$OUT"/sweep/lr3e-4/1f1b.seed1234.*; do cp -n "$f" "$OUT/select/" 2>/dev/null || true; done
  compare --schedules 1f1b --seeds 1234 --nproc-per-node 4 --out "$OUT/select" \
      --run paci-plain="$PLAIN" --run paci-predict="$PREDICT" \
      -- "${PAPER[@]}" "${LR[@]}" --train-iters 2000 ;;
report)  # the three report parts below, in this order
  for part in p4 p8 budget; do bash "$0" "$part" "$OUT"; done ;;
p4) report_seeds "$OUT/p4" 4 1f1b,interleaved ;;
p8)  # interleaved (v=2) needs 16 layers at P=8: the report projects it from 1F1B's curve
  report_seeds "$OUT/p8" 8 1f1b ;;
budget)
  # 2000 x the projected throughput ratio (1.375 at P=4, M=8), cosine over it; 1f1b-long is
  # the control (the longer cosine alone). The full P=4 call, so the report holds every run.
  report_seeds "$OUT/p4" 4 1f1b,interleaved \
      --run 1f1b-long="--pipeline-schedule 1f1b --train-iters 2750" \
      --run paci-plain-long="$PLAIN --train-iters 2750" \
      --run paci-candidate-long="--pipeline-schedule paci $CANDIDATE --train-iters 2750" ;;
aggressive)
  compare --schedules 1f1b --seeds 1234,1235 --nproc-per-node 4 --out "$OUT/aggressive" \
      --run paci-plain="$PLAIN" --run paci-predict="$PREDICT" \
      -- "${CORPUS[@]}" --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
      --seq-length 64 --micro-batch-size 2 --global-batch-size 16 --lr 2e-3 --min-lr 2e-4 \
      --lr-decay-style cosine --lr-warmup-iters 50 --train-iters 1000 --eval-interval 50 \
      --eval-iters 8 --log-interval 10 ;;
*) echo "unknown phase $PHASE: sweep, select, report (p4, p8, budget) or aggressive" >&2; exit 2 ;;
esac
