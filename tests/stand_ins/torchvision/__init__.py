"""torchvision's dataset download, as far as tests/test_hardening.py needs it: no network, and a
witness.

``datasets.FashionMNIST(root, train=True, download=True)`` writes Fashion-MNIST-format IDX files
(synthetic digits) into root/FashionMNIST/raw/ after a pause, as a slow download would; it refuses
to run inside a process group (a download there would count against the collectives' timeout) and
appends one line per download to root/downloads.log, so the test can count them.
"""

import os
import struct
import time

import torch.distributed as dist


def _write_idx(path, tensor):
    header = struct.pack(">BBBB", 0, 0, 0x08, tensor.dim()) + struct.pack(
        f">{tensor.dim()}I", *tensor.shape
    )
    with open(path, "wb") as file:
        file.write(header + tensor.contiguous().numpy().tobytes())


class datasets:  # noqa: N801 - the module's name in torchvision
    class FashionMNIST:
        def __init__(self, root, train=True, download=False):
            if dist.is_available() and dist.is_initialized():
                raise RuntimeError(
                    "a download inside a process group: the collectives' timeout runs meanwhile"
                )
            from models.data import synthetic_digits

            time.sleep(2)  # a slow download: the other ranks must wait for it without a collective
            raw = os.path.join(root, "FashionMNIST", "raw")
            os.makedirs(raw, exist_ok=True)
            for prefix, count, seed in (("train", 256, 20), ("t10k", 64, 21)):
                images, labels = synthetic_digits(count, seed=seed)
                _write_idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), images[:, 0])
                _write_idx(
                    os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels.to(images.dtype)
                )
            with open(os.path.join(root, "downloads.log"), "a") as log:
                log.write(f"{os.getpid()}\n")
