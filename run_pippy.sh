#!/usr/bin/env bash
# Pipeline parallelism (torch.distributed.pipelining) under torchrun; flags go to train_pippy.py.
# Variables: see launch.sh.
#   bash run_pippy.sh                                          # this node, all GPUs (2 processes on a CPU)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_pippy.sh  # node 0 of 2 (NODE_RANK=1 on the other)
exec bash "$(dirname "${BASH_SOURCE[0]}")/launch.sh" train_pippy.py "$@"
