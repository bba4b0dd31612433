"""The four collectives on small tensors, and all-reduce done as a reduce-scatter, then an
all-gather.

Run:  torchrun --standalone --nproc-per-node=2 docs/snippets/allreduce_is_rs_ag.py   (any number of
processes)

Rank r starts with 2·W numbers, 10·r + 0, 10·r + 1, ...: whole numbers in float64, so every sum is
exact and the two ways to all-reduce can be compared bit for bit. Rank 0 prints, for each rank, its
input and what each collective left it, one JSON line.
"""

import json

import torch
import torch.distributed as dist

# torch 2.14 names the single-tensor forms reduce_scatter_single and all_gather_single (the old
# names still work, with a warning); torch 2.9 has only reduce_scatter_tensor and
# all_gather_into_tensor.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(2 * world_size, dtype=torch.float64) + 10 * rank

    broadcast = mine.clone()
    dist.broadcast(broadcast, src=0)  # every rank: rank 0's tensor

    all_reduced = mine.clone()
    dist.all_reduce(all_reduced)  # every rank: the sum over the ranks, all of it

    shard = torch.empty(2, dtype=torch.float64)
    reduce_scatter(shard, mine)  # rank r: the sum over the ranks of the r-th of W slices only
    gathered = torch.empty(2 * world_size, dtype=torch.float64)
    all_gather(gathered, shard)  # every rank: the W summed slices, in rank order

    assert torch.equal(gathered, all_reduced), (gathered, all_reduced)

    results = {
        "input": mine,
        "broadcast": broadcast,
        "all_reduce": all_reduced,
        "reduce_scatter": shard,
        "reduce_scatter_then_all_gather": gathered,
    }
    everyone = [None] * world_size
    dist.all_gather_object(
        everyone, {"rank": rank, **{k: v.long().tolist() for k, v in results.items()}}
    )  # to print
    if rank == 0:
        print(json.dumps(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
