#!/bin/bash
# Convergence study (issue 10): P=4, tinyshakespeare, 1000 updates (warmup 50, cosine to 0.1x),
# a = M = 4 and a = M = 8 at the same 16 sequences per update, 1F1B vs plain PACI (weight 1)
# vs each mitigation, the default (stale-gradient weight 0.2) and the stale-gradient correction
# (K = 4000, with and without warm start), seeds 1234 and 1235.
# Writes OUT/m4/report.md and OUT/m8/report.md.
#
#   bash benchmarks/convergence_study.sh [OUT]      (default OUT=/tmp/study; ~2-3 h on 2 idle cores)
#
# Needs the tokenized corpus (once, ~1 min):
#   python -m paci_megatron.tools.preprocess_data --input ../shared/data/tinyshakespeare.txt \
#       --output-prefix /tmp/cmp_shk/shakespeare --tokenizer-model /tmp/cmp_shk/spm.model --vocab-size 2000
# --reuse keeps runs already finished in OUT with the same flags, so an interrupted study
# resumes, and a new --run adds only its own runs.
set -euo pipefail
OUT=${1:-/tmp/study}
DATA=${DATA:-/tmp/cmp_shk}
COMMON=(--data-path "$DATA/shakespeare_text_document" --tokenizer-type SentencePieceTokenizer
        --tokenizer-model "$DATA/spm.model" --vocab-size 2000 --untie-embeddings-and-output-weights
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
        --global-batch-size 16 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine
        --lr-warmup-iters 50 --train-iters 1000 --eval-interval 50 --eval-iters 8
        --log-interval 10 --split 95,5,0)
PLAIN="--pipeline-schedule paci --paci-stale-grad-weight 1"  # the paper's PACI
W="--pipeline-schedule paci --paci-stale-grad-weight 0.2"     # the default since section 9
K="$PLAIN --paci-stale-grad-correction 4000"                  # the correction, section 11
for MBS in 4 2; do
  M=$((16 / MBS))
  # at M = 8 also the correction and the default trained for as many updates as PACI fits in
  # 1F1B's projected time (throughput 1.375): time-to-accuracy with a schedule of its own length
  LONG=()
  [ "$M" = 8 ] && LONG=(--run paci-k4000-long="$K --train-iters 1375"
                        --run paci-w0.2-long="$W --train-iters 1375")
  python -m paci_megatron.tools.compare --reuse --schedules 1f1b --seeds 1234,1235 \
      --nproc-per-node 4 --out "$OUT/m$M" \
      --run paci-plain="$PLAIN" \
      --run paci-plain-sync50="$PLAIN --paci-sync-iters 50" \
      --run paci-plain-auto="$PLAIN --paci-accumulation-factor auto" \
      --run paci-plain-sync50-auto="$PLAIN --paci-sync-iters 50 --paci-accumulation-factor auto" \
      --run paci-w0.2="$W" \
      --run paci-w0.2-sync50-auto="$W --paci-sync-iters 50 --paci-accumulation-factor auto" \
      --run paci-k4000="$K" \
      --run paci-k4000-sync50="$K --paci-sync-iters 50" \
      "${LONG[@]}" -- "${COMMON[@]}" --micro-batch-size "$MBS"
done
