"""BabyCNN: a small image classifier built as an ordered stack of blocks.

The model is a plain ``nn.Module``. Its body is ``self.blocks``, an ``nn.Sequential`` of four
blocks of roughly equal compute, so the same model can be

* replicated whole (DDP),
* sharded block by block (FSDP2 calls ``fully_shard`` on each block, then on the root),
* cut into pipeline stages (``train_pippy.py`` groups contiguous blocks of about equal FLOPs).

Initialisation is deterministic *per output row*: every row of every parameter draws from its own
generator, seeded from ``torch.initial_seed()``, the parameter's name and the row's global index.
So a rank that holds only some rows (an FSDP shard) or only some blocks (a pipeline stage) could
initialise exactly its part of a ``meta``-built model, and still get the very values the whole
model gets on one process with the same seed. (The scripts build the model whole, which is right
for any model's init; ``docs/fsdp.md`` says when meta is needed.) (DTensor's own random ops cannot
do this on the CPU: they reproduce a full tensor only on CUDA-like devices.)
"""

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ConvBlock(nn.Module):
    """Two 3x3 convolutions with ReLU, optionally followed by a 2x2 max-pool."""

    def __init__(self, in_channels, out_channels, pool, device=None, dtype=None):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, device=device, dtype=dtype)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, device=device, dtype=dtype)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.pool(x)


class Head(nn.Module):
    """A last 3x3 convolution, then a linear classifier over the flattened feature map."""

    def __init__(self, channels, feature_size, num_classes, device=None, dtype=None):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, device=device, dtype=dtype)
        self.fc = nn.Linear(
            channels * feature_size * feature_size, num_classes, device=device, dtype=dtype
        )

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.fc(x.flatten(1))


class BabyCNN(nn.Module):
    """conv block -> conv block -> conv block -> head, with ``8 * width`` base channels.

    For a 28x28 input and width 1 that is about 43k parameters and 2.3 M multiply-accumulates per
    sample forward, split 0.51 / 0.68 / 0.68 / 0.47 M across the four blocks. Width multiplies the
    channels, so parameters and compute grow with its square.
    """

    def __init__(
        self, in_channels=1, num_classes=10, image_size=28, width=1, device=None, dtype=None
    ):
        super().__init__()
        if width < 1 or image_size < 4:
            raise ValueError(
                f"BabyCNN needs width >= 1 and image_size >= 4, got {width} and {image_size}"
            )
        c = 8 * width
        feature_size = image_size // 4  # two 2x2 pools
        self.blocks = nn.Sequential(
            ConvBlock(in_channels, c, pool=True, device=device, dtype=dtype),
            ConvBlock(c, 2 * c, pool=True, device=device, dtype=dtype),
            ConvBlock(2 * c, 4 * c, pool=False, device=device, dtype=dtype),
            Head(4 * c, feature_size, num_classes, device=device, dtype=dtype),
        )
        if not next(self.parameters()).is_meta:  # meta: the caller's, after to_empty
            self.reset_parameters()

    def forward(self, x):
        return self.blocks(x)

    @torch.no_grad()
    def reset_parameters(self):
        """Initialise every parameter (or only the local shard of a DTensor parameter)."""
        for index, block in enumerate(self.blocks):
            init_block(block, index)


def _local_rows(param):
    """The tensor this rank holds for ``param``, the global index of its first row, and which part
    of each row it holds (a DTensor's chunk: FSDP's rows, TP's rows or columns)."""
    if not isinstance(param, DTensor):
        return param, 0, ()
    (chunk,) = param.__create_chunk_list__()  # its offsets and sizes in the whole
    columns = tuple(slice(o, o + n) for o, n in zip(chunk.offsets[1:], chunk.sizes[1:]))
    return param.to_local(), chunk.offsets[0], columns


@torch.no_grad()
def init_block(block, block_index):
    """He-uniform for convolutions (they feed a ReLU), LeCun-uniform for the classifier, zero
    biases.

    Values are drawn in float32 whatever the parameter's dtype, so a float64 model starts from
    exactly the float32 model's weights."""
    base_seed = torch.initial_seed()
    for name, param in block.named_parameters():
        local, first_row, columns = _local_rows(param)
        if local.is_meta:  # another pipeline stage's block: nothing held here to fill
            continue
        if name.endswith("bias"):
            local.zero_()
            continue
        fan_in = math.prod(param.shape[1:])
        gain = 1.0 if name.startswith("fc") else 2.0
        bound = math.sqrt(3.0 * gain / fan_in)
        values = torch.empty(local.shape[0], *param.shape[1:], dtype=torch.float32)  # whole rows
        for row in range(local.shape[0]):
            key = f"{base_seed}/blocks.{block_index}.{name}/{first_row + row}".encode()
            row_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
            values[row].uniform_(-bound, bound, generator=torch.Generator().manual_seed(row_seed))
        local.copy_(values[(slice(None), *columns)])
