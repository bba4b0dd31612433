"""The bundled data for the four training scripts, images and text: map-style Datasets, held whole
as tensors on the training device.

``load`` returns each split as a ``torch.utils.data.TensorDataset`` of normalised images (N, C, H,
W) and labels, on the device: the scripts gather a batch by index there (no DataLoader workers, no
per-sample Python or PIL on the hot path), as they would pass a Dataset of your own through a
DataLoader. Which indices a rank uses is decided by the training script with
``torch.utils.data.DistributedSampler``, so the sharding stays visible there.

Datasets: ``auto`` (the default, with --model cnn) is the original MNIST files that ship in
models/mnist/, read with no network; ``mnist``, ``fashion-mnist`` and ``cifar10`` are a copy in
--data-dir (the IDX files as they are distributed, gzip-compressed or not, or torchvision's layout),
downloaded by torchvision when missing; ``synthetic`` is a fast, offline, deterministic 10-class set
of digit glyphs drawn from a small built-in bitmap font, for tests. ``find`` looks for the files
(downloading them where allowed) before the process group exists; ``load`` makes every rank agree on
them and reads them.

``shakespeare``: the text in models/tinyshakespeare/, for the GPT (models/gpt.py), as windows of
characters (models/shakespeare.py): --dataset's default with --model gpt or gpt-gpu, the GPT's only
data, in windows of its context.
"""

import argparse
import fcntl
import gzip
import math
import os
import socket
import struct
import textwrap
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from models import shakespeare
from models.errors import DataError

NUM_CLASSES = 10  # every one of them: ten digits, ten garments, ten CIFAR classes
BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mnist")  # --dataset auto
DOWNLOAD_TIMEOUT_SECONDS = 5


def _positive_int(text):  # argparse type, with the scripts' own flags' messages
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


_positive_int.__name__ = "int"  # argparse's "invalid int value: 'abc'"


# --model's GPTs and the characters a window of their text holds: each one's context (nanoGPT's
# block_size), which models.build gives the GPT from the windows.
GPT_CONTEXT = {"gpt": 64, "gpt-gpu": 256}

# The defaults --model sets, each GPT's training recipe (a flag given wins); --model cnn keeps the
# shared parser's. The warmup is the shared rule's: 100 steps, or a fifth of a short run. gpt: a
# validation loss of 1.82 on 2 CPU processes (docs/gpt_time_to_loss.py); gpt-gpu: nanoGPT's
# recipe for its GPU size (config/train_shakespeare_char.py), on one GPU.
RECIPES = {
    "gpt": {"batch_size": 16, "max_steps": 900},
    "gpt-gpu": {
        "batch_size": 64,
        "lr": 1e-3,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "max_steps": 5000,
        "epochs": 100,  # 5,000 steps of 64 windows of 256 characters: 82 passes over the text
    },
}


def add_arguments(parser):
    """The bundled model's and data's flags (a copy with its own leaves them out); returns the
    defaults --model's value sets (``training.parser`` applies them)."""
    add = parser.add_argument
    recipes = "; ".join(
        f"{model}: " + " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in flags.items())
        for model, flags in RECIPES.items()
    )
    add(
        "--model",
        choices=("cnn", *GPT_CONTEXT),
        default="cnn",
        help="cnn: BabyCNN on images; gpt: the character-level GPT on Tiny Shakespeare at "
        "nanoGPT's CPU size (0.80 M parameters), gpt-gpu at its GPU size (10.7 M); each GPT sets "
        f"its recipe's defaults ({recipes})",
    )
    add(
        "--width",
        type=_positive_int,
        default=1,
        help="BabyCNN channel multiplier (parameters grow with its square)",
    )
    add(
        "--dataset",
        choices=("auto", "synthetic", *_TORCHVISION, "shakespeare"),
        help="auto (the default with --model cnn): the MNIST files in models/mnist/, no network; "
        "mnist: a copy in --data-dir; synthetic: for tests; shakespeare (the default with a GPT): "
        "the text in models/tinyshakespeare/",
    )
    add(
        "--data-dir",
        help="where mnist, fashion-mnist and cifar10 are read from and downloaded to (default: "
        "./data); not with --dataset auto",
    )
    add(
        "--no-download",
        action="store_true",
        help="never use the network; use only files already in --data-dir",
    )
    return {"model": RECIPES}


def find(name, data_dir, download=True, model=None):
    """This process's view of the files of dataset ``name``, to hand to ``load``: whether they are
    there (downloaded first, when missing and allowed), or what is wrong with them. Call it before
    the process group exists: a download may outlast any collective's timeout. The processes sharing
    a ``data_dir`` take turns (a file lock), so one downloads and the others then find the files.
    ``model`` (--model's): ``name`` None is its own data (auto for cnn, shakespeare for a GPT),
    and another model's is refused; a GPT's sets the windows' length, its context."""
    gpt = model in GPT_CONTEXT
    if name is None:
        name = "shakespeare" if gpt else "auto"
    elif model is not None and (name == "shakespeare") != gpt:  # no such pairing
        wanted = "--dataset shakespeare (its default)" if gpt else "an image dataset"
        raise DataError(f"--model {model} trains on {wanted}, not --dataset {name}")
    # auto never reads --data-dir: say so, rather than train on other data than asked
    if name == "auto" and data_dir is not None:
        raise DataError(
            f"--data-dir {data_dir} is not read with --dataset auto, which trains on the MNIST "
            "files in "
            f"{BUNDLED}: add --dataset mnist to train on the MNIST files in {data_dir}"
        )
    if name == "shakespeare":  # the text in models/tinyshakespeare/: checked here, never downloaded
        return _find_text(data_dir, GPT_CONTEXT[model if gpt else "gpt"])
    data_dir = BUNDLED if name == "auto" else data_dir or "./data"  # auto: the shipped copy
    found = {
        "name": name,
        "data_dir": os.path.abspath(data_dir),
        "missing": None,
        "broken": None,
        "node": f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})",
    }
    if name == "synthetic":
        return found
    wanted = "mnist" if name == "auto" else name
    folder = data_dir if wanted == "cifar10" else os.path.dirname(_idx_paths(wanted, data_dir)[0])
    # unreadable is not "missing": the fix is another
    if os.path.isdir(folder) and not os.access(folder, os.R_OK | os.X_OK):
        found["broken"] = (
            f"{os.path.abspath(folder)} cannot be read by this user (permission denied): let it "
            "read it"
        )
        return found
    found["missing"] = None if _on_disk(wanted, data_dir) else "--no-download forbids fetching it"
    if found["missing"] and download and name != "auto":
        try:
            os.makedirs(data_dir, exist_ok=True)
            with open(os.path.join(data_dir, ".download-lock"), "w") as lock:
                # released when the file closes, also when this process dies
                fcntl.flock(lock, fcntl.LOCK_EX)
                found["missing"] = _download(wanted, data_dir)  # None if another got there first
        except OSError as error:
            found["missing"] = f"{data_dir} cannot be written ({error.strerror or error})"
    if found["missing"] is None:
        try:  # every check the read makes, so that a broken file is found before the ranks agree
            found["splits"] = [_read(wanted, data_dir, train) for train in (True, False)]
            (train_images, _), (test_images, _) = found["splits"]
            if train_images.shape[1:] != test_images.shape[1:]:
                raise DataError(
                    f"{wanted} in {found['data_dir']} has training images of shape "
                    f"{tuple(train_images.shape[1:])} but test images of "
                    f"{tuple(test_images.shape[1:])}"
                )
        except DataError as error:
            found["broken"], found["splits"] = str(error), None
    return found


def load(found, device, dtype=torch.float32, workers=0, log=print, block_size=None):
    """Collective (every rank must call it): every rank sees every rank's ``find`` (an all_gather),
    so all of them train on the same dataset, ``auto`` included, or all stop with one line naming
    the node that lacks the files. Returns its name and the training and test splits as
    TensorDatasets of ``dtype`` images on ``device`` (in CPU memory for ``workers``: a DataLoader's
    worker processes cannot read CUDA tensors). ``log`` speaks for rank 0."""
    # shakespeare: windows of block_size characters (default: find's, the GPT's context) and
    # their targets, as int64 ids
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, {k: v for k, v in found.items() if k != "splits"})
    resolved = _agree(found["name"], answers, log)
    if resolved == "shakespeare":  # windows of characters, ids on the device
        device = torch.device("cpu") if workers else device
        block_size = block_size or found["block_size"]
        return resolved, *shakespeare.datasets(found["splits"], device, block_size)
    if resolved == "synthetic":
        (train_x, train_y), (test_x, test_y) = (
            synthetic_digits(60_000, seed=0),
            synthetic_digits(10_000, seed=1),
        )
    else:
        (train_x, train_y), (test_x, test_y) = found["splits"]
    device = torch.device("cpu") if workers else device
    train_x, test_x = train_x.to(device), test_x.to(device)
    scale, shift = normalisation(train_x, dtype)
    splits = [
        TensorDataset(x * scale + shift, y.to(device))
        for x, y in ((train_x, train_y), (test_x, test_y))
    ]
    return resolved, *splits


def normalisation(images, dtype):
    """(scale, shift) in ``dtype`` that bring uint8 ``images`` (N, C, H, W) to mean 0 and std 1 per
    channel, from their own statistics, computed where they are. In float64 for a float64 model:
    summed in float32, they round by the device's order, and a GPU's run parted from the CPU's
    by 4e-8 (float32 and bf16 models: float32, as they always were)."""
    precise = torch.promote_types(dtype, torch.float32)
    pixels = images.to(precise).div_(255).transpose(0, 1).flatten(1)
    mean, std = pixels.mean(dim=1), pixels.std(dim=1)
    scale = (1 / (255 * std)).view(1, -1, 1, 1).to(dtype)
    shift = (-mean / std).view(1, -1, 1, 1).to(dtype)
    return scale, shift


def _find_text(data_dir, block_size):
    """``find`` for Tiny Shakespeare: the text read and checked now, its vocabulary and splits, and
    the windows' length."""
    if data_dir is not None:  # never read: say so, rather than train on other text than asked
        raise DataError(
            f"--data-dir {data_dir} is not read with --dataset shakespeare, which "
            f"trains on the text in {shakespeare.FOLDER}: leave --data-dir out"
        )
    found = {
        "name": "shakespeare",
        "data_dir": shakespeare.FOLDER,
        "missing": None,
        "broken": None,
        "node": f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})",
        "block_size": block_size,
    }
    try:
        found["splits"] = shakespeare.split(shakespeare.read())
    except DataError as error:  # every rank hears it through load's agreement, naming the node
        found["broken"], found["splits"] = str(error), None
    return found


_TORCHVISION = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10"}
_IDX = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_FILES = {
    "mnist": f"MNIST/raw/ ({', '.join(_IDX)})",
    "fashion-mnist": f"FashionMNIST/raw/ ({', '.join(_IDX)})",
    "cifar10": "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta)",
}


def _agree(name, answers, log):
    """The dataset every rank uses, from every rank's answer; a DataError when a node lacks the
    files."""
    if name == "synthetic":
        return "synthetic"
    # one answer per node and directory
    nodes = list({answer["node"]: answer for answer in answers}.values())
    several = len({answer["node"] for answer in answers}) > 1
    broken = [node for node in nodes if node["broken"]]
    if broken:  # files that are there but wrong are an error: never silently replaced
        raise DataError(broken[0]["broken"] + (f" (on {broken[0]['node']})" if several else ""))
    wanted = "mnist" if name == "auto" else name
    lacking = [node for node in nodes if node["missing"]]
    if not lacking:
        return wanted
    first = lacking[0]
    where = f"{first['data_dir']} on {first['node']}" if several else first["data_dir"]
    others = f" (and on {len(lacking) - 1} more node(s))" if len(lacking) > 1 else ""
    if name == "auto":  # the repository's own copy is gone
        raise DataError(
            f"the MNIST files that ship with this project are not in {where}{others}: restore them "
            "(git checkout models/mnist), or pick --dataset mnist --data-dir DIR with your own copy"
        )
    files = os.path.join(first["data_dir"], _FILES[wanted])
    shared = " on every node (or on storage all nodes share)" if several else ""
    raise DataError(
        f"{wanted} is not in {where}{others} and {first['missing']}: put the files in "
        f"{files}{shared}, "
        "or pick --dataset synthetic"
    )


def _on_disk(name, data_dir):
    if name == "cifar10":
        import torchvision  # imported only here: it costs seconds (it loads torch._dynamo)

        try:
            torchvision.datasets.CIFAR10(data_dir, train=True, download=False)
            return True
        except RuntimeError:
            return False
    return all(
        os.path.isfile(path) or os.path.isfile(path + ".gz") for path in _idx_paths(name, data_dir)
    )


def _idx_paths(name, data_dir):
    """The four IDX files of ``name`` (``mnist`` or ``fashion-mnist``), each also read as FILE.gz:
    torchvision's layout DIR/MNIST/raw/, or the files alone in DIR (as they are distributed, and as
    models/mnist/ holds them)."""
    raw = os.path.join(data_dir, _TORCHVISION[name], "raw")
    folder = raw if os.path.isdir(raw) else data_dir
    return [os.path.join(folder, file) for file in _IDX]


def _download(name, data_dir):
    """None when the files are on disk, or downloaded now; else why they are not."""
    if _on_disk(name, data_dir):
        return None
    import torchvision

    previous_timeout = socket.getdefaulttimeout()
    # an unreachable mirror fails in seconds, not minutes
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_SECONDS)
    try:
        getattr(torchvision.datasets, _TORCHVISION[name])(data_dir, train=True, download=True)
        return None
    except Exception as error:  # torchvision raises RuntimeError or URLError, by the dataset
        # torchvision's message spans lines
        reason = " ".join(str(error).split()) or type(error).__name__
        return f"the download failed ({textwrap.shorten(reason, 160, placeholder=' ...')})"
    finally:
        socket.setdefaulttimeout(previous_timeout)


def _read(name, data_dir, train):
    """(images uint8 (N, C, H, W), labels int64 (N,)) of one split, checked; a DataError names a bad
    file."""
    if name == "cifar10":
        import torchvision

        dataset = torchvision.datasets.CIFAR10(data_dir, train=train, download=False)
        images = torch.as_tensor(dataset.data).permute(0, 3, 1, 2)  # (N, H, W, C) as a numpy array
        return images.contiguous(), torch.as_tensor(dataset.targets, dtype=torch.int64)
    # MNIST and Fashion-MNIST: read the IDX files directly (a header, then raw bytes), checking what
    # torchvision's reader does not: counts that match, labels in range, files of the right length.
    images_path, labels_path = _idx_paths(name, data_dir)[0 if train else 2 : 2 if train else 4]
    images, labels = _read_idx(images_path, 3), _read_idx(labels_path, 1).long()
    if len(images) == 0:
        raise DataError(f"{images_path} holds no images")
    if len(labels) != len(images):
        raise DataError(
            f"{labels_path} holds {len(labels)} labels for the {len(images)} images in "
            f"{images_path}; "
            "the two files must match"
        )
    if min(images.shape[1:]) < 4:
        raise DataError(
            f"{images_path} holds {tuple(images.shape[1:])} images; BabyCNN needs at least 4x4"
        )
    wrong = ((labels < 0) | (labels >= NUM_CLASSES)).nonzero()
    if len(wrong):
        index = int(wrong[0])
        raise DataError(
            f"{labels_path} has label {int(labels[index])} at index {index}; "
            f"{name} labels are 0 to {NUM_CLASSES - 1}"
        )
    return images.unsqueeze(1), labels


def _read_idx(path, dimensions):
    """An IDX file of uint8 data: bytes 0, 0, 0x08, the number of dimensions, each dimension as a
    big-endian 32-bit integer, then the data."""
    path = path if os.path.isfile(path) or not os.path.isfile(path + ".gz") else path + ".gz"
    try:
        with open(path, "rb") as file:
            data = file.read()
        if data[:2] == b"\x1f\x8b":  # gzip's magic number: the files as they are distributed
            data = gzip.decompress(data)
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:  # before OSError: BadGzipFile is one
        raise DataError(f"{path} is a damaged gzip archive ({error}): download it again") from None
    except OSError as error:
        raise DataError(f"{path} cannot be read ({error.strerror or error})") from None
    header = 4 + 4 * dimensions
    if len(data) < header or data[:4] != bytes((0, 0, 0x08, dimensions)):
        raise DataError(
            f"{path} is not an IDX file of {dimensions}-D uint8 data "
            f"(it starts with {data[:4].hex() or 'nothing'}, not 0000080{dimensions})"
        )
    shape = struct.unpack(f">{dimensions}I", data[4:header])
    expected = header + math.prod(shape)
    if len(data) != expected:
        state = "is truncated" if len(data) < expected else "is longer than its header says"
        raise DataError(
            f"{path} {state}: shape {shape} needs {expected:,} bytes, the file has {len(data):,}"
        )
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
    bitmaps = torch.tensor(
        [[[c == "#" for c in row] for row in _FONT[d]] for d in range(10)], dtype=torch.float64
    )
    big = bitmaps.repeat_interleave(upscale, 1).repeat_interleave(upscale, 2)
    padded = F.pad(big, (3, 3, 3, 3))
    h, w = big.shape[1:]
    weights = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0], dtype=torch.float64) / 16  # binomial blur
    blurred = sum(weights[i] * padded[:, i : i + h + 2, :] for i in range(5))
    blurred = sum(weights[i] * blurred[:, :, i : i + w + 2] for i in range(5))
    return blurred.unsqueeze(1).float()


def synthetic_digits(count, seed, image_size=28):
    """``count`` images (uint8, (count, 1, image_size, image_size)) and labels of the synthetic
    set."""
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
    # Output -> template coordinates: undo shift, rotate back, unscale, unshear, fit to the glyph
    # box.
    theta = torch.zeros(count, 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = (cos + shear * sin) / (scale * glyph_w)
    theta[:, 0, 1] = (sin - shear * cos) / (scale * glyph_w)
    theta[:, 1, 0] = -sin / (scale * glyph_h)
    theta[:, 1, 1] = cos / (scale * glyph_h)
    theta[:, 0, 2] = -(theta[:, 0, 0] * shift_x + theta[:, 0, 1] * shift_y)
    theta[:, 1, 2] = -(theta[:, 1, 0] * shift_x + theta[:, 1, 1] * shift_y)

    # Pixel centres in [-1, 1] (as affine_grid with align_corners=False makes them, but as one
    # matmul).
    centres = (torch.arange(image_size, dtype=torch.float32) * 2 + 1) / image_size - 1
    ys, xs = torch.meshgrid(centres, centres, indexing="ij")
    pixels = torch.stack([xs.flatten(), ys.flatten(), torch.ones(image_size * image_size)], dim=1)

    images = torch.empty(count, 1, image_size, image_size, dtype=torch.uint8)
    chunk = 8192
    for start in range(0, count, chunk):
        part = slice(start, min(start + chunk, count))
        n = part.stop - part.start
        grid = (pixels @ theta[part].float().transpose(1, 2)).view(n, image_size, image_size, 2)
        ink = F.grid_sample(
            templates[labels[part]],
            grid,
            mode="bilinear",
            padding_mode="zeros",
            align_corners=False,
        )
        t = threshold[part].float().view(-1, 1, 1, 1)
        ink = ((ink - t) / (1 - t)).clamp(0, 1)
        ink = ink * (2 - ink)  # brighten the stroke's soft edge
        noise = torch.randn(n, 1, image_size, image_size, generator=generator)
        noise *= noise_level[part].float().view(-1, 1, 1, 1)
        images[part] = ((ink + noise).clamp(0, 1) * 255).round().to(torch.uint8)
    return images, labels
