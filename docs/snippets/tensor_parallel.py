"""Tensor parallelism on a two-layer MLP: the first layer split by columns, the second by rows.

Run:  torchrun --standalone --nproc-per-node=2 docs/snippets/tensor_parallel.py   (W must divide 16)

Every rank builds the same MLP (seeded), keeps an unsplit copy, and splits the original with
parallelize_module: fc1 with ColwiseParallel (rank r keeps 1/W of its output features: rows of its
weight and bias), fc2 with RowwiseParallel (rank r keeps the matching 1/W of its input features:
columns of its weight; the bias stays whole). Each rank computes its slice of the hidden layer
without talking to the others; fc2's partial outputs are then summed by one all-reduce. Backward
needs one more, for the gradient of the input. Rank 0 prints, as one JSON line, the collectives
CommDebugMode counted in forward and in backward, each rank's parameter count, and how far the
split model's output and gradients are from the unsplit copy's, in float64.
"""

import copy
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self, features=8, hidden=16):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden, dtype=torch.float64)
        self.fc2 = nn.Linear(hidden, features, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def counts(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = MLP()
    whole = copy.deepcopy(model)  # the one-process reference
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    x = torch.randn(
        4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )  # the same on every rank
    x_split, x_whole = (
        x.clone().requires_grad_(),
        x.clone().requires_grad_(),
    )  # as if a layer before made it
    with CommDebugMode() as forward:
        out = model(x_split)
    with CommDebugMode() as backward:
        out.sum().backward()
    reference = whole(x_whole)
    reference.sum().backward()

    # Each rank's gradients are DTensor shards: its rows of fc1's, its columns of fc2's weight.
    rows = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
    gradient_gap = max(
        (model.fc1.weight.grad.to_local() - whole.fc1.weight.grad[rows]).abs().max().item(),
        (model.fc2.weight.grad.to_local() - whole.fc2.weight.grad[:, rows]).abs().max().item(),
        (x_split.grad - x_whole.grad).abs().max().item(),
    )
    # Without fc2's all-reduce: what rank r's own slice of the hidden layer gives alone, a partial
    # sum.
    hidden = torch.relu(x @ model.fc1.weight.to_local().T + model.fc1.bias.to_local())
    partial = hidden @ model.fc2.weight.to_local().T + model.fc2.bias.to_local()
    mine = {
        "rank": rank,
        "parameters": sum(p.to_local().numel() for p in model.parameters()),
        "output_gap": (out - reference).abs().max().item(),
        "gradient_gap": gradient_gap,
        "partial_sum_gap": (partial - reference).abs().max().item(),
    }
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print(
            json.dumps(
                {
                    "world_size": world_size,
                    "parameters_unsplit": sum(p.numel() for p in whole.parameters()),
                    "forward": counts(forward),
                    "backward": counts(backward),
                    "ranks": everyone,
                }
            ),
            flush=True,
        )
    # torch 2.14's DTensor keeps the mesh in caches for good, and the mesh keeps its groups: let go
    # of them, or gloo's threads outlive destroy_process_group, and one still letting go of the last
    # collective's tensors at interpreter shutdown aborts the process ("terminate called without an
    # active exception"). Private; torch 2.9 has none.
    getattr(mesh, "_pg_registry", {}).clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
