"""A DataLoader with a DistributedSampler: for data that is not a tensor on the device (files,
records, objects).

Run:  torchrun --standalone --nproc-per-node=2 docs/snippets/dataloader.py

The training scripts keep a small dataset whole on the device and index it; most data is read and
decoded sample by sample instead. Here each rank's DataLoader runs worker processes that build the
samples of the rank's share, and the loop moves each batch to the device. Rank 0 prints the sample
indices every rank loaded in each epoch, one JSON line per epoch.
"""

import json
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Records(Dataset):
    """Stands for your data: __getitem__ builds one sample on the CPU (read a file, decode,
    augment)."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        image = torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(index))
        return index, image, index % 10  # the index too, to show which samples each rank loaded


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = Records(1001)
    # Every rank gets len(dataset) // world_size samples of each epoch's shuffled order, none of
    # them another rank's. drop_last=True leaves the last len(dataset) % world_size out; with False,
    # the sampler pads the shards to the same length by repeating samples from the start of the
    # order.
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=32,
        sampler=sampler,  # the sampler shuffles: no shuffle=True here
        num_workers=2,  # processes per rank building batches while the rank trains
        pin_memory=device.type == "cuda",  # page-locked batches: the copy below is asynchronous
        persistent_workers=True,  # keep the workers from one epoch to the next
    )
    for epoch in range(2):
        # A new shuffle each epoch, the same on every rank; without it every epoch repeats.
        sampler.set_epoch(epoch)
        loaded = []
        for indices, images, labels in loader:
            images, labels = (
                images.to(device, non_blocking=True),
                labels.to(device, non_blocking=True),
            )
            loaded += indices.tolist()
            # forward, backward and step of the DDP model here, as in train_ddp.py
        ranks = [None] * world_size
        dist.all_gather_object(ranks, loaded)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "indices": ranks}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
