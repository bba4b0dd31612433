"""Image data for the three training scripts, kept as tensors on the training device.

A split is held whole as a ``uint8`` tensor (N, C, H, W) on the device, with its labels. A batch is
gathered by index (``split.batch(indices)``) and normalised there: no Dataset, no DataLoader
workers, no per-sample Python or PIL on the hot path. Which indices a rank uses is decided by the
training script with ``torch.utils.data.DistributedSampler``, so the sharding stays visible there.

Datasets: ``mnist``, ``fashion-mnist`` and ``cifar10`` through torchvision (downloaded into
``--data-dir`` by each node's local rank 0 while the node's other ranks wait), and ``synthetic``:
an offline, deterministic, learnable 10-class set of digit glyphs drawn from a small built-in bitmap
font. ``auto`` takes MNIST when it is on disk or can be downloaded, else the synthetic set.
"""

import math
import os
import socket
import struct
import textwrap
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

DATASETS = ("auto", "synthetic", "mnist", "fashion-mnist", "cifar10")
NUM_CLASSES = 10  # every one of them: ten digits, ten garments, ten CIFAR classes
DOWNLOAD_TIMEOUT_SECONDS = 5


class DataError(Exception):
    """A dataset problem the user can fix; the message is one line that says how."""


@dataclass
class Split:
    images: torch.Tensor  # uint8 (N, C, H, W) on the training device
    labels: torch.Tensor  # int64 (N,) on the training device
    scale: torch.Tensor  # (1, C, 1, 1): 1 / (255 * std), in the dtype of the model's inputs
    shift: torch.Tensor  # (1, C, 1, 1): -mean / std

    def __len__(self):
        return self.labels.shape[0]

    def batch(self, indices):
        """Normalised images (in ``scale``'s dtype) and labels for ``indices`` (a tensor on the same device)."""
        return self.images[indices].to(self.scale.dtype) * self.scale + self.shift, self.labels[indices]


@dataclass
class ImageData:
    name: str
    train: Split
    test: Split
    num_classes: int

    @property
    def in_channels(self):
        return self.train.images.shape[1]

    @property
    def image_size(self):
        return self.train.images.shape[2]


def load(name, data_dir, device, local_rank, dtype=torch.float32, download=True, log=print):
    """Load ``name`` onto ``device`` on every rank, as ``dtype`` batches. ``log`` is called on rank 0 only.

    Nodes need not share a filesystem: each node's local rank 0 checks (and, if allowed, downloads)
    the files in its own ``data_dir`` while the node's other ranks wait. Then every rank sees every
    node's answer (an all-gather), so all of them train on the same dataset, ``auto`` included, or
    all of them stop together with one line that names the node lacking the files.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    # Rank 0's node goes first: where the nodes share storage, the others then find the files and
    # download nothing, so no two processes ever write the same files.
    mine, splits = _check_node(name, data_dir, download) if rank == 0 else (None, None)
    answers = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        if local_rank == 0 and rank != 0:
            mine, splits = _check_node(name, data_dir, download)
        answers = [None] * dist.get_world_size()
        dist.all_gather_object(answers, mine)  # also a barrier: nobody reads before its node has the files
    nodes = [answer for answer in answers if answer is not None]
    resolved = _agree(name, nodes, log)
    if resolved == "synthetic":
        (train_x, train_y), (test_x, test_y) = synthetic_digits(60_000, seed=0), synthetic_digits(10_000, seed=1)
    else:
        # A node's local rank 0 has read the files already, to check them; the other ranks read them now.
        (train_x, train_y), (test_x, test_y) = splits or [_read(resolved, data_dir, train) for train in (True, False)]
    # Normalise with the training split's own statistics, computed once on the device.
    train_x, test_x = train_x.to(device), test_x.to(device)
    pixels = train_x.float().div_(255).transpose(0, 1).flatten(1)
    mean, std = pixels.mean(dim=1), pixels.std(dim=1)
    scale = (1 / (255 * std)).view(1, -1, 1, 1).to(dtype)
    shift = (-mean / std).view(1, -1, 1, 1).to(dtype)
    return ImageData(
        resolved,
        Split(train_x, train_y.to(device), scale, shift),
        Split(test_x, test_y.to(device), scale, shift),
        NUM_CLASSES,
    )


_TORCHVISION = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10"}
_IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_FILES = {
    "mnist": f"MNIST/raw/ ({', '.join(_IDX)})",
    "fashion-mnist": f"FashionMNIST/raw/ ({', '.join(_IDX)})",
    "cifar10": "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta)",
}


def _check_node(name, data_dir, download):
    """On each node's local rank 0: (this node's name and why its files are missing or broken, None
    if fine; the (train, test) splits it read to check them, or None)."""
    node = f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"
    answer = {"node": node, "data_dir": os.path.abspath(data_dir), "missing": None, "broken": None}
    if name != "synthetic":
        wanted = "mnist" if name == "auto" else name
        answer["missing"] = _ensure_files(wanted, data_dir, download)
        if answer["missing"] is None:
            try:  # every check the ranks' own reads will make, once, here
                splits = [_read(wanted, data_dir, train) for train in (True, False)]
                (train_images, _), (test_images, _) = splits
                if train_images.shape[1:] != test_images.shape[1:]:
                    raise DataError(f"{wanted} in {answer['data_dir']} has training images of shape "
                                    f"{tuple(train_images.shape[1:])} but test images of "
                                    f"{tuple(test_images.shape[1:])}")
                return answer, splits
            except DataError as error:
                answer["broken"] = str(error)
    return answer, None


def _agree(name, nodes, log):
    """The dataset every rank uses, from every node's answer; a DataError when a node lacks the files."""
    if name == "synthetic":
        return "synthetic"
    several = len(nodes) > 1
    broken = [node for node in nodes if node["broken"]]
    if broken:  # files that are there but wrong are an error, also for auto: never a silent fallback
        raise DataError(broken[0]["broken"] + (f" (on {broken[0]['node']})" if several else ""))
    wanted = "mnist" if name == "auto" else name
    lacking = [node for node in nodes if node["missing"]]
    if not lacking:
        return wanted
    first = lacking[0]
    where = f"{first['data_dir']} on {first['node']}" if several else first["data_dir"]
    others = f" (and on {len(lacking) - 1} more node(s))" if len(lacking) > 1 else ""
    if name == "auto":
        log(f"dataset: MNIST is not in {where}{others} and {first['missing']}; "
            f"using the built-in synthetic digits{' on every node' if several else ''} instead")
        return "synthetic"
    files = os.path.join(first["data_dir"], _FILES[wanted])
    shared = " on every node (or on storage all nodes share)" if several else ""
    raise DataError(f"{wanted} is not in {where}{others} and {first['missing']}: put the files in {files}{shared}, "
                    "or pick --dataset synthetic")


def _on_disk(name, data_dir):
    if name == "cifar10":
        import torchvision  # imported only here: it costs seconds (it loads torch._dynamo)

        try:
            torchvision.datasets.CIFAR10(data_dir, train=True, download=False)
            return True
        except RuntimeError:
            return False
    raw = os.path.join(data_dir, _TORCHVISION[name], "raw")
    return all(os.path.isfile(os.path.join(raw, file)) for file in _IDX)


def _ensure_files(name, data_dir, download):
    """None when the files are on disk (downloading them if allowed), else why they are not."""
    if _on_disk(name, data_dir):
        return None
    if not download:
        return "--no-download forbids fetching it"
    import torchvision

    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_SECONDS)  # an unreachable mirror fails in seconds, not minutes
    try:
        getattr(torchvision.datasets, _TORCHVISION[name])(data_dir, train=True, download=True)
        return None
    except Exception as error:  # torchvision raises RuntimeError or URLError, depending on the dataset
        reason = " ".join(str(error).split()) or type(error).__name__  # torchvision's message spans lines
        return f"the download failed ({textwrap.shorten(reason, 160, placeholder=' ...')})"
    finally:
        socket.setdefaulttimeout(previous_timeout)


def _read(name, data_dir, train):
    """(images uint8 (N, C, H, W), labels int64 (N,)) of one split, checked; a DataError names a bad file."""
    if name == "cifar10":
        import torchvision

        dataset = torchvision.datasets.CIFAR10(data_dir, train=train, download=False)
        images = torch.as_tensor(dataset.data).permute(0, 3, 1, 2)  # (N, H, W, C) as a numpy array
        return images.contiguous(), torch.as_tensor(dataset.targets, dtype=torch.int64)
    # MNIST and Fashion-MNIST: read the IDX files directly (a header, then raw bytes), checking what
    # torchvision's reader does not: counts that match, labels in range, files of the right length.
    raw = os.path.join(data_dir, _TORCHVISION[name], "raw")
    prefix = "train" if train else "t10k"
    images_path = os.path.join(raw, f"{prefix}-images-idx3-ubyte")
    labels_path = os.path.join(raw, f"{prefix}-labels-idx1-ubyte")
    images, labels = _read_idx(images_path, 3), _read_idx(labels_path, 1).long()
    if len(images) == 0:
        raise DataError(f"{images_path} holds no images")
    if len(labels) != len(images):
        raise DataError(f"{labels_path} holds {len(labels)} labels for the {len(images)} images in {images_path}; "
                        "the two files must match")
    if min(images.shape[1:]) < 4:
        raise DataError(f"{images_path} holds {tuple(images.shape[1:])} images; BabyCNN needs at least 4x4")
    wrong = ((labels < 0) | (labels >= NUM_CLASSES)).nonzero()
    if len(wrong):
        index = int(wrong[0])
        raise DataError(f"{labels_path} has label {int(labels[index])} at index {index}; "
                        f"{name} labels are 0 to {NUM_CLASSES - 1}")
    return images.unsqueeze(1), labels


def _read_idx(path, dimensions):
    """An IDX file of uint8 data: bytes 0, 0, 0x08, the number of dimensions, each dimension as a
    big-endian 32-bit integer, then the data."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise DataError(f"{path} cannot be read ({error.strerror or error})") from None
    header = 4 + 4 * dimensions
    if len(data) < header or data[:4] != bytes((0, 0, 0x08, dimensions)):
        raise DataError(f"{path} is not an IDX file of {dimensions}-D uint8 data "
                        f"(it starts with {data[:4].hex() or 'nothing'}, not 0000080{dimensions})")
    shape = struct.unpack(f">{dimensions}I", data[4:header])
    expected = header + math.prod(shape)
    if len(data) != expected:
        state = "is truncated" if len(data) < expected else "is longer than its header says"
        raise DataError(f"{path} {state}: shape {shape} needs {expected:,} bytes, the file has {len(data):,}")
    if expected == header:  # no items at all: frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).view(shape)


# ---------------------------------------------------------------------------------------------
# The synthetic set: digit glyphs from a 5x7 bitmap font, each drawn with a random affine
# transform (rotation, scale, shear, shift), stroke width and noise. Deterministic for a seed.
# ---------------------------------------------------------------------------------------------

_FONT = {
    0: (" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "),
    1: ("  #  ", " ##  ", "# #  ", "  #  ", "  #  ", "  #  ", "#####"),
    2: (" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"),
    3: ("#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "),
    4: ("   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "),
    5: ("#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "),
    6: ("  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "),
    7: ("#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "),
    8: (" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "),
    9: (" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "),
}


def _glyph_templates(upscale=4):
    """(10, 1, 7*upscale, 5*upscale) soft glyphs: the bitmap enlarged, then blurred by shifted sums
    (not a convolution, so the result is bit-identical whatever the thread count)."""
    bitmaps = torch.tensor([[[c == "#" for c in row] for row in _FONT[d]] for d in range(10)], dtype=torch.float64)
    big = bitmaps.repeat_interleave(upscale, 1).repeat_interleave(upscale, 2)
    padded = F.pad(big, (3, 3, 3, 3))
    h, w = big.shape[1:]
    weights = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0], dtype=torch.float64) / 16  # binomial blur
    blurred = sum(weights[i] * padded[:, i : i + h + 2, :] for i in range(5))
    blurred = sum(weights[i] * blurred[:, :, i : i + w + 2] for i in range(5))
    return blurred.unsqueeze(1).float()


def synthetic_digits(count, seed, image_size=28):
    """``count`` images (uint8, (count, 1, image_size, image_size)) and labels of the synthetic set."""
    generator = torch.Generator().manual_seed(seed)
    templates = _glyph_templates()
    _, _, th, tw = templates.shape
    labels = torch.randint(0, 10, (count,), generator=generator)

    def uniform(low, high):
        return torch.rand(count, generator=generator, dtype=torch.float64) * (high - low) + low

    angle = uniform(-0.30, 0.30)  # radians, about +-17 degrees
    scale = uniform(0.80, 1.15)
    shear = uniform(-0.25, 0.25)
    shift_x, shift_y = uniform(-0.18, 0.18), uniform(-0.15, 0.15)
    threshold = uniform(0.15, 0.55)  # lower threshold = thicker stroke
    noise_level = uniform(0.02, 0.20)

    # The glyph fills about 20x14 pixels of a 28x28 frame, as MNIST digits fill a 20x20 box.
    glyph_h, glyph_w = 20 / image_size, 20 / image_size * tw / th
    cos, sin = torch.cos(angle), torch.sin(angle)
    # Output -> template coordinates: undo shift, rotate back, unscale, unshear, fit to the glyph box.
    theta = torch.zeros(count, 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = (cos + shear * sin) / (scale * glyph_w)
    theta[:, 0, 1] = (sin - shear * cos) / (scale * glyph_w)
    theta[:, 1, 0] = -sin / (scale * glyph_h)
    theta[:, 1, 1] = cos / (scale * glyph_h)
    theta[:, 0, 2] = -(theta[:, 0, 0] * shift_x + theta[:, 0, 1] * shift_y)
    theta[:, 1, 2] = -(theta[:, 1, 0] * shift_x + theta[:, 1, 1] * shift_y)

    # Pixel centres in [-1, 1] (as affine_grid with align_corners=False makes them, but as one matmul).
    centres = (torch.arange(image_size, dtype=torch.float32) * 2 + 1) / image_size - 1
    ys, xs = torch.meshgrid(centres, centres, indexing="ij")
    pixels = torch.stack([xs.flatten(), ys.flatten(), torch.ones(image_size * image_size)], dim=1)

    images = torch.empty(count, 1, image_size, image_size, dtype=torch.uint8)
    chunk = 8192
    for start in range(0, count, chunk):
        part = slice(start, min(start + chunk, count))
        n = part.stop - part.start
        grid = (pixels @ theta[part].float().transpose(1, 2)).view(n, image_size, image_size, 2)
        ink = F.grid_sample(templates[labels[part]], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        t = threshold[part].float().view(-1, 1, 1, 1)
        ink = ((ink - t) / (1 - t)).clamp(0, 1)
        ink = ink * (2 - ink)  # brighten the stroke's soft edge
        noise = torch.randn(n, 1, image_size, image_size, generator=generator)
        noise *= noise_level[part].float().view(-1, 1, 1, 1)
        images[part] = ((ink + noise).clamp(0, 1) * 255).round().to(torch.uint8)
    return images, labels


# ---------------------------------------------------------------------------------------------
# Evaluation over the whole test split, sharded across ranks.
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(forward, split, rank, world_size, batch_size=512, pipeline=False):
    """Test loss and accuracy of ``forward`` (images -> logits) over all of ``split``.

    ``rank`` and ``world_size`` count data-parallel replicas: each takes a contiguous slice of the
    test set (no sample twice, none left out) and the sums are all-reduced over every process.
    Every replica runs the same number of batches, even when its slice is one sample shorter,
    because a sharded model (FSDP) needs every rank in each forward's all-gather.

    With ``pipeline=True``, ``forward(images, labels)`` runs a pipeline schedule: every batch has
    the same shape (short ones are padded, the padding not counted), the labels go to the last
    stage, and ranks without the last stage return None and add nothing.
    """
    shard = torch.arange(len(split), device=split.labels.device).tensor_split(world_size)[rank]
    num_batches = math.ceil(math.ceil(len(split) / world_size) / batch_size)
    totals = torch.zeros(3, dtype=torch.float64, device=split.labels.device)  # loss sum, correct, count
    for i in range(num_batches):
        indices = shard[i * batch_size : (i + 1) * batch_size]
        real = indices.numel()
        if pipeline:
            indices = torch.cat([indices, indices.new_zeros(batch_size - real)])
        images, labels = split.batch(indices)
        logits = forward(images, labels) if pipeline else forward(images)
        if logits is None:
            continue
        logits, labels = logits[:real].float(), labels[:real]
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += real
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count
