#!/usr/bin/env bash
# torchrun launcher shared by run_ddp.sh, run_fsdp.sh and run_pippy.sh: `bash launch.sh SCRIPT [flags]`.
#
# One node (the default):  NPROC_PER_NODE=4 bash run_ddp.sh --epochs 3
# Several nodes: on each node, with the same MASTER_ADDR (node 0's address) and MASTER_PORT:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_ddp.sh    # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_ddp.sh    # on node 1
#
# NPROC_PER_NODE  processes on this node (default: the number of GPUs, or 2 without GPUs)
# NNODES          number of nodes (default 1: torchrun --standalone)
# NODE_RANK       this node's index, 0..NNODES-1; node 0 hosts the rendezvous (default 0)
# MASTER_ADDR     node 0's address (default 127.0.0.1); MASTER_PORT its port (default 29500)
# RDZV_ID         the job's name in the rendezvous, the same on every node (default babycnn)
# OMP_NUM_THREADS CPU threads per process (default: this machine's cores / NPROC_PER_NODE, at least 1)
set -euo pipefail

script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$1"
shift

if [ -z "${NPROC_PER_NODE:-}" ]; then
    gpus=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
    fi
    if [ "$gpus" -gt 0 ]; then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

# torchrun would set 1 thread per process with a warning; use the cores this node really has instead.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    threads=$(( $(nproc) / NPROC_PER_NODE ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

if [ "$NNODES" -eq 1 ]; then
    # --standalone: a private rendezvous on a free local port, no address to agree on.
    exec torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" "$script" "$@"
fi
# c10d rendezvous: every node meets at MASTER_ADDR:MASTER_PORT; node 0 hosts its store.
is_host=$([ "$NODE_RANK" -eq 0 ] && echo 1 || echo 0)
exec torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${RDZV_ID:-babycnn}" \
    --rdzv-conf="is_host=$is_host" "$script" "$@"
