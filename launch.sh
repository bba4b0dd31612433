#!/usr/bin/env bash
# torchrun launcher shared by run_ddp.sh, run_fsdp.sh and run_pippy.sh: `bash launch.sh SCRIPT [flags]`.
#
# One node (the default):  NPROC_PER_NODE=4 bash run_ddp.sh --epochs 3
# Several nodes: on each node, with the same MASTER_ADDR (node 0's address) and MASTER_PORT:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_ddp.sh    # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_ddp.sh    # on node 1
#
# NPROC_PER_NODE  processes on this node (default: the GPUs torch sees, which honours
#                 CUDA_VISIBLE_DEVICES; 2 without GPUs)
# NNODES          number of nodes (default 1: torchrun --standalone)
# NODE_RANK       this node's index, 0..NNODES-1; node 0 hosts the rendezvous (default 0)
# MASTER_ADDR     node 0's address (required with NNODES > 1); MASTER_PORT its port (default 29500)
# RDZV_ID         the job's name in the rendezvous, the same on every node (default babycnn)
# MAX_RESTARTS    times torchrun restarts all workers after one fails (default 0 on one node, 3 on
#                 several); with --checkpoint-dir the restarted workers resume from the last checkpoint
# OMP_NUM_THREADS CPU threads per process (default: this machine's cores / NPROC_PER_NODE, at least 1)
set -euo pipefail

script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$1"
shift

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    # A default of 127.0.0.1 would have every node wait for itself until the rendezvous times out.
    echo "error: NNODES=$NNODES needs MASTER_ADDR, node 0's address, the same on every node" \
        "(e.g. MASTER_ADDR=node0 MASTER_PORT=29500)" >&2
    exit 2
fi
if [ -z "${NPROC_PER_NODE:-}" ]; then
    # Count the GPUs torch will see: nvidia-smi lists every GPU, also those CUDA_VISIBLE_DEVICES hides.
    gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    if [ "$gpus" -gt 0 ]; then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
if [ "$NNODES" -eq 1 ]; then MAX_RESTARTS=${MAX_RESTARTS:-0}; else MAX_RESTARTS=${MAX_RESTARTS:-3}; fi

# NCCL: a collective stuck on a dead or hung peer becomes an error (and a flight-recorder dump of the
# last collectives on each rank) instead of a silent hang; torchrun then restarts or ends the job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
# A fresh store for each restart: with torchrun's shared store, restarted workers can read the dead
# ones' addresses and fail to connect (pytorch issue 135712; seen here with gloo on torch 2.14).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

# torchrun would set 1 thread per process with a warning; use the cores this node really has instead.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    threads=$(( $(nproc) / NPROC_PER_NODE ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

if [ "$NNODES" -eq 1 ]; then
    # --standalone: a private rendezvous on a free local port, no address to agree on.
    exec torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" "$script" "$@"
fi
# c10d rendezvous: every node meets at MASTER_ADDR:MASTER_PORT; node 0 hosts its store.
is_host=$([ "$NODE_RANK" -eq 0 ] && echo 1 || echo 0)
exec torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="$MAX_RESTARTS" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${RDZV_ID:-babycnn}" \
    --rdzv-conf="is_host=$is_host" "$script" "$@"
