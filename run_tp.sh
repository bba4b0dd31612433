#!/usr/bin/env bash
# Tensor parallelism within groups of --tp ranks, FSDP2 across them, under torchrun; flags go to train_tp.py.
# Variables: see launch.sh.
#   bash run_tp.sh                                          # this node, all GPUs (2 processes on a CPU): tp 2
#   NPROC_PER_NODE=4 bash run_tp.sh --tp 2                  # 4 processes: 2 groups of 2
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_tp.sh   # node 0 of 2 (NODE_RANK=1 on the other)
exec bash "$(dirname "${BASH_SOURCE[0]}")/launch.sh" train_tp.py "$@"
