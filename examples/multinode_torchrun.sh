#!/usr/bin/env bash
# PACI over two nodes with torchrun: run this script once on EACH node.
#
#   node A (hosts the rendezvous):  bash examples/multinode_torchrun.sh 0 nodeA.example:29500
#   node B:                         bash examples/multinode_torchrun.sh 1 nodeA.example:29500
#
# Any further arguments are passed on to the training script, e.g. --train-iters 1000.
# The two nodes together form one job: with the defaults below (one process per node and
# --pipeline-model-parallel-size 2) pipeline stage 0 runs on one node and stage 1 on the other,
# so the activations and gradients between the stages cross the network.
#
# Environment (all optional):
#   NPROC_PER_NODE   processes per node (default: GPUs on this node, or 1 without GPUs); the
#                    same on every node. World size = 2 x NPROC_PER_NODE; ranks are laid out
#                    tensor-parallel fastest, then data-parallel, then pipeline stage, so with
#                    --pipeline-model-parallel-size 2 each node holds one whole stage.
#   BACKEND          nccl (default with GPUs) or gloo (default without GPUs, works anywhere)
#   NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
#                    the network interface the nodes reach each other on (e.g. eth0, ib0);
#                    set it when a node has several, or when its hostname resolves to
#                    127.0.0.1 (then gloo would listen on loopback only)
#   MEGATRON_LM_PATH a Megatron-LM checkout (tag core_v0.16.1 to core_v0.19.0, of the installed
#                    megatron-core's minor release): run its unchanged
#                    pretrain_gpt.py through paci_megatron.run instead of pretrain_gpt_paci.py
#                    (then give that script's usual flags: data, tokenizer, model size, ...)
set -euo pipefail

NODE_RANK=${1:?usage: $0 NODE_RANK RDZV_HOST:PORT [training flags...]}
RDZV_ENDPOINT=${2:?usage: $0 NODE_RANK RDZV_HOST:PORT [training flags...]}
shift 2

NNODES=2
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L | wc -l)
else
    GPUS=0
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-$(( GPUS > 0 ? GPUS : 1 ))}
BACKEND=${BACKEND:-$([ "$GPUS" -gt 0 ] && echo nccl || echo gloo)}

# MASTER_ADDR / MASTER_PORT are set for the workers by torchrun from the c10d rendezvous;
# export them only when using --rdzv-backend static instead.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# export NCCL_SOCKET_IFNAME=eth0   # or ib0 for InfiniBand; NCCL_IB_DISABLE=1 forces TCP
# export GLOO_SOCKET_IFNAME=eth0
# export NCCL_DEBUG=WARN           # INFO shows which interface and transport NCCL picked

LAUNCH=(
    torchrun
    --nnodes "$NNODES"                  # exactly two agents must join (min:max also works)
    --nproc-per-node "$NPROC_PER_NODE"
    --node-rank "$NODE_RANK"            # used by --rdzv-backend static; c10d assigns ranks
                                        # in the order the agents join
    --rdzv-backend c10d                 # the store lives in the agent on RDZV_ENDPOINT's host
    --rdzv-endpoint "$RDZV_ENDPOINT"    # host:port reachable from every node
    --rdzv-id "${RDZV_ID:-paci-job}"    # the same on every node of one job
    --max-restarts 0                    # a failed stage ends the job (see README: faults)
)

if [ -n "${MEGATRON_LM_PATH:-}" ]; then
    # Megatron-LM's own pretrain_gpt.py, unchanged, with PACI hooked in.
    exec "${LAUNCH[@]}" -m paci_megatron.run "$MEGATRON_LM_PATH/pretrain_gpt.py" \
        --distributed-backend "$BACKEND" \
        --pipeline-model-parallel-size 2 \
        --pipeline-schedule paci \
        "$@"
fi

# This repository's entry point (mock data unless --data-path is given).
exec "${LAUNCH[@]}" "$(dirname "$0")/../pretrain_gpt_paci.py" \
    --distributed-backend "$BACKEND" \
    --pipeline-model-parallel-size 2 \
    --pipeline-schedule paci \
    "$@"
