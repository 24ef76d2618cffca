#!/bin/bash
# The clock study (issue 31; pre-registered in benchmarks/studies/14-clock-study.md): which
# PACI method reaches 1F1B's loss first with its own cost, in the paper's regime (GPT 8 x 512,
# bf16, AdamW (0.9, 0.95), wd 0.1, LR 3e-4, 1% warm-up, cosine to 0.1x, 2000 updates, a = M = 8).
#
#   bash benchmarks/clock_study.sh PHASE [OUT]   (default OUT=benchmarks/results/clock)
#
# PHASE, in order (each a compare run with --reuse: an interrupted phase resumes, a finished
# one costs nothing; a P=4 run took 10-16 minutes on 2 idle cores when study 12 ran, 37-55
# minutes on the machines of 2026-12-02/03):
#   select   seed 1234, P=4: the look-ahead at C = 0.5, 1 and 2 (1F1B's and plain PACI's finals on
#            this seed are study 12's; the rule compares the look-ahead's three runs only)
#   p4       seeds 3001 and 3002, P=4: 1F1B, interleaved, the look-ahead at the selected C
#            (C=2, the selection's), prediction per forward, plain PACI, prediction once a group
#   p8       the same at P=8 (8 processes; interleaved projected from 1F1B's curve)
#   nadam-select   seed 1234, P=4: plain PACI with --optimizer nadam at beta1 0.95 and 0.99
#   nadam-p4 / nadam-p8   seeds 3001 and 3002: 1F1B with NAdam (the arm's own baseline) and
#            plain PACI with NAdam, at beta1 B1 (0.95, nadam-select's choice)
#
# Needs the tokenized corpus (once, ~5 s; benchmarks/paper_regime_study.sh says how).
set -euo pipefail
PHASE=${1:?usage: clock_study.sh select|p4|p8 [OUT]}
OUT=${2:-$(dirname "$0")/results/clock}
DATA=${DATA:-/tmp/cmp_shk}
C=${C:-2}  # the look-ahead strength the selection chose (study 14)
B1=${B1:-0.95}  # NAdam's beta1, which its selection chose (study 14)
source "$(dirname "$0")/paper_regime_flags.sh"  # CORPUS, PAPER, LR, PLAIN, PREDICT
PAPER+=("${LR[@]}" --train-iters 2000)
AHEAD=$PLAIN  # the look-ahead adds --paci-lookahead C to plain PACI
TIMEOUT=${TIMEOUT:-14400}  # seconds a run may take: a P=8 run on a slow machine passes 1 h
compare() { python -m paci_megatron.tools.compare --reuse --timeout "$TIMEOUT" "$@"; }

report() {  # OUT NPROC SCHEDULES: one seed at a time, then both (reused) for the report
  local out=$1 nproc=$2 schedules=$3
  for seeds in 3001 3002 3001,3002; do
    compare --schedules "$schedules" --seeds "$seeds" --nproc-per-node "$nproc" --out "$out" \
        --run paci-lookahead="$AHEAD --paci-lookahead $C" --run paci-predict="$PREDICT" \
        --run paci-plain="$PLAIN" -- "${PAPER[@]}"
  done
}

nadam_report() {  # OUT NPROC: the NAdam arm, its own 1F1B the baseline
  local out=$1 nproc=$2
  for seeds in 3001 3002 3001,3002; do
    compare --schedules 1f1b --seeds "$seeds" --nproc-per-node "$nproc" --out "$out" \
        --run paci-nadam="$PLAIN" -- "${PAPER[@]}" --optimizer nadam --adam-beta1 "$B1"
  done
}

case "$PHASE" in
select)
  compare --seeds 1234 --nproc-per-node 4 --out "$OUT/select" \
      --run paci-lookahead1="$AHEAD --paci-lookahead 1" \
      --run paci-lookahead0.5="$AHEAD --paci-lookahead 0.5" \
      --run paci-lookahead2="$AHEAD --paci-lookahead 2" -- "${PAPER[@]}" ;;
p4) report "$OUT/p4" 4 1f1b,interleaved ;;
p8) report "$OUT/p8" 8 1f1b ;;
nadam-select)
  compare --seeds 1234 --nproc-per-node 4 --out "$OUT/nadam-select" \
      --run paci-nadam0.95="$PLAIN --optimizer nadam --adam-beta1 0.95" \
      --run paci-nadam0.99="$PLAIN --optimizer nadam --adam-beta1 0.99" -- "${PAPER[@]}" ;;
nadam-p4) nadam_report "$OUT/p4-nadam" 4 ;;
nadam-p8) nadam_report "$OUT/p8-nadam" 8 ;;
*) echo "unknown phase $PHASE: select, p4, p8, nadam-select, nadam-p4 or nadam-p8" >&2
   exit 2 ;;
esac
