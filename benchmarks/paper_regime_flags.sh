# The paper regime's training flags, sourced by paper_regime_study.sh and clock_study.sh
# (their runs are reused by flags: keep the spelling and order). Needs DATA set.
CORPUS=(--data-path "$DATA/shakespeare_text_document" --tokenizer-type SentencePieceTokenizer
        --tokenizer-model "$DATA/spm.model" --vocab-size 2000 --split 95,5,0
        --untie-embeddings-and-output-weights --bf16)
PAPER=("${CORPUS[@]}" --num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 64
       --hidden-dropout 0.1 --attention-dropout 0.1
       --micro-batch-size 1 --global-batch-size 8 --adam-beta1 0.9
       --adam-beta2 0.95 --weight-decay 0.1 --lr-decay-style cosine --lr-warmup-iters 20
       --eval-interval 50 --eval-iters 16 --log-interval 50)
LR=(--lr 3e-4 --min-lr 3e-05)  # spelled as the sweep spells it, so its 1F1B run is reused
# the paper's PACI, and the prediction spelled out (0.1.x spelled --paci-stale-grad-weight 1 in
# both too; 0.2.0 removed that flag, so a 0.1.x run is not reused by these flags)
PLAIN="--pipeline-schedule paci --no-paci-weight-prediction"
PREDICT="--pipeline-schedule paci --paci-weight-prediction"
