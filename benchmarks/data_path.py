"""Samples/s of two ways to make normalised training batches of the same images, no model:
the project's on-device path (plumbing/training.py's Batches: a TensorDataset normalised once, each
batch gathered by index) and the usual torchvision Dataset + DataLoader + ToTensor/Normalize
pipeline over MNIST-format files.

    OMP_NUM_THREADS=1 python benchmarks/data_path.py --batches 200 --batch-size 64
"""

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.data import synthetic_digits  # noqa: E402
from plumbing.training import Batches  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()
count = args.batches * args.batch_size
images, labels = synthetic_digits(count, seed=0)
mean, std = images.float().div(255).mean().item(), images.float().div(255).std().item()


def timed(batches):
    start = time.perf_counter()
    total = sum(x.shape[0] for x, _ in batches)
    return total / (time.perf_counter() - start)


# The project's path: normalised once, on the device (here the CPU); a shuffled order, a gather per
# batch.
inputs = images * (1 / (255 * std)) + (-mean / std)
dataset = torch.utils.data.TensorDataset(inputs, labels)
order = torch.randperm(count).tolist()
device_loader = timed(Batches(dataset, args.batch_size, torch.device("cpu"), torch.float32)(order))

# The usual path: MNIST files read by torchvision, PIL images, ToTensor + Normalize per sample.
import torchvision  # noqa: E402
from torchvision import transforms  # noqa: E402

with tempfile.TemporaryDirectory() as root:
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", count), ("t10k", 1)):
        header = struct.pack(">BBBBIII", 0, 0, 8, 3, n, 28, 28)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(header + images[:n, 0].numpy().tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">BBBBI", 0, 0, 8, 1, n) + labels[:n].to(torch.uint8).numpy().tobytes()
        )
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))])
    dataset = torchvision.datasets.MNIST(root, train=True, download=False, transform=transform)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=0
    )
    dataloader = timed(iter(loader))

print(
    json.dumps(
        {
            "device_loader_samples_per_second": device_loader,
            "dataloader_samples_per_second": dataloader,
        }
    )
)
