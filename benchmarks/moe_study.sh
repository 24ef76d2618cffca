#!/bin/bash
# Item 7 of issue 50 (benchmarks/studies/16-moe-study.md): a small MoE GPT on tinyshakespeare
# at P = 4 under stock 1F1B and PACI's default, at equal samples, seeds 5001 and 5002.
#
#   bash benchmarks/moe_study.sh [OUT]   (default OUT=benchmarks/results/moe)
#   ITERS=600 WARMUP=40 EVAL_INTERVAL=50 SEEDS=5011,5012 bash benchmarks/moe_study.sh \
#       benchmarks/results/moe600       (the pre-registered longer run)
#
# Finished runs in OUT are read back (--reuse): on a machine that has them only the costs are
# timed again (about 10 s). Needs the tokenized corpus in DATA (default /tmp/cmp_shk):
#   python -m paci_megatron.tools.preprocess_data --input ../shared/data/tinyshakespeare.txt \
#       --output-prefix /tmp/cmp_shk/shakespeare --tokenizer-model /tmp/cmp_shk/spm.model --vocab-size 2000
set -euo pipefail
OUT=${1:-$(dirname "$0")/results/moe}
DATA=${DATA:-/tmp/cmp_shk}
ITERS=${ITERS:-150} WARMUP=${WARMUP:-10} EVAL_INTERVAL=${EVAL_INTERVAL:-25}
SEEDS=${SEEDS:-5001,5002}
MOE_STUDY=(--data-path "$DATA/shakespeare_text_document" --tokenizer-type SentencePieceTokenizer
  --tokenizer-model "$DATA/spm.model" --vocab-size 2000 --split 95,5,0
  --untie-embeddings-and-output-weights --bf16
  --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 64
  --moe-shared-expert-intermediate-size 64
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-aux-loss-coeff 0.001
  --moe-token-dispatcher-type alltoall
  --micro-batch-size 1 --global-batch-size 8 --adam-beta1 0.9 --adam-beta2 0.95
  --weight-decay 0.1 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --eval-interval "$EVAL_INTERVAL" --eval-iters 8 --log-interval 25 --pipeline-model-parallel-size 4)
python -m paci_megatron.tools.compare --reuse --schedules 1f1b,paci --seeds "$SEEDS" \
    --nproc-per-node 4 --project-costs measured --timeout 3600 --out "$OUT" -- \
    "${MOE_STUDY[@]}" --train-iters "$ITERS"
