"""Tiny Shakespeare, the text that ships in models/tinyshakespeare/: read offline, checked, split
and served as windows of characters to the character-level GPT (models/gpt.py).

``read`` returns the text, refusing any file that is not byte-identical to the original (a
one-line DataError). ``split`` makes nanoGPT's character vocabulary (the sorted set of the text's
characters: 65) and splits the ids as nanoGPT does: the first 90 % of the characters to train on,
the rest to validate. ``CharWindows`` serves a split as a map-style Dataset of (input ids, target
ids) windows, held whole on the training device, so the scripts' DistributedSampler deals it and
plumbing.training.Batches gathers a batch of windows by index there. ``models/data.py`` calls these
for ``find("shakespeare", None)`` and ``load(..., block_size=...)``.
"""

import gzip
import hashlib
import os
import zlib

import torch
from torch.utils.data import TensorDataset

from models.errors import DataError

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tinyshakespeare")
SIZE, SHA256 = 1_115_394, "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TRAIN_FRACTION = 0.9  # nanoGPT's split: 1,003,854 characters to train on, 111,540 to validate
BLOCK_SIZE = 64  # the default context, nanoGPT's CPU recipe's
RESTORE = "restore it (git checkout models/tinyshakespeare)"


def read(folder=FOLDER):
    """The text of ``folder``/input.txt.gz, byte-identical to the original, or a DataError."""
    path = os.path.join(folder, "input.txt.gz")
    try:
        with gzip.open(path, "rb") as file:
            raw = file.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:  # before OSError: BadGzipFile is one
        raise DataError(f"{path} is a damaged gzip archive ({error}): {RESTORE}") from None
    except FileNotFoundError:
        raise DataError(f"{path} is missing: {RESTORE}") from None
    except OSError as error:
        raise DataError(f"{path} cannot be read ({error.strerror or error})") from None
    digest = hashlib.sha256(raw).hexdigest()
    if (len(raw), digest) != (SIZE, SHA256):  # an edited or cut copy would train another model
        raise DataError(
            f"{path} is not the original Tiny Shakespeare: {len(raw):,} bytes of "
            f"SHA-256 {digest[:16]}..., not {SIZE:,} of {SHA256[:16]}...: {RESTORE}"
        )
    return raw.decode("ascii")  # the original is ASCII: one byte, one character


def split(text):
    """(vocabulary, training ids, validation ids): the vocabulary is the sorted set of the text's
    characters (a string, the id of a character its index), the ids int64 tensors on the CPU."""
    chars = "".join(sorted(set(text)))
    lookup = torch.zeros(128, dtype=torch.int64)  # ASCII code -> id: one gather, 1.1 M characters
    lookup[torch.tensor([ord(c) for c in chars])] = torch.arange(len(chars))
    ids = lookup[torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()]
    cut = int(len(ids) * TRAIN_FRACTION)
    return chars, ids[:cut], ids[cut:]


class CharWindows(TensorDataset):
    """Sample ``i``: the ``block_size`` characters from ``i * stride`` as input ids, and the
    character after each as its target (the window shifted by one): int64 tensors of block_size.

    The stride defaults to ``block_size``: the windows tile the split, so an epoch is one pass over
    the text, in which every character (but the first, and a tail shorter than a window) is a
    target exactly once, and --epochs means what it says. Every position instead (stride 1, as
    nanoGPT's random windows) would make an epoch 64 passes. On the validation split, tiling scores
    each character once, deterministically, where nanoGPT estimates from random windows. Each
    target is predicted from 1 to block_size characters, as in nanoGPT's windows.

    A TensorDataset whose one tensor is the whole split: on the training device,
    plumbing.training.Batches gathers a batch of windows by index there (one indexing op, no
    DataLoader); on the CPU, a DataLoader's workers (--workers) read one window at a time. An index:
    an int or a tensor."""

    def __init__(self, ids, block_size, vocabulary, stride=None):
        if len(ids) <= block_size:
            raise DataError(f"a split of {len(ids):,} characters has no window of {block_size + 1}")
        self.tensors = (ids,)  # not TensorDataset's __init__, which wants a sample a row
        self.block_size, self.stride = block_size, stride or block_size
        self.vocabulary, self.vocab_size = vocabulary, len(vocabulary)
        self.offsets = torch.arange(block_size + 1, device=ids.device)

    def __len__(self):
        return (len(self.tensors[0]) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index):
        if isinstance(index, int):  # a DataLoader's, or a loop's: out of range ends iteration
            if not -len(self) <= index < len(self):
                raise IndexError(f"window {index} of {len(self)}")
            index %= len(self)
        starts = torch.as_tensor(index, device=self.offsets.device) * self.stride
        windows = self.tensors[0][starts.unsqueeze(-1) + self.offsets]
        # Contiguous: a pipeline stage's send refuses views; a batch of ids costs nothing to copy.
        return windows[..., :-1].contiguous(), windows[..., 1:].contiguous()

    def decode(self, ids):  # ids (any iterable of ints) -> text
        return "".join(self.vocabulary[int(i)] for i in ids)


def datasets(splits, device, block_size=BLOCK_SIZE, stride=None):
    """The training and validation splits of ``split``'s result, as CharWindows on ``device``."""
    vocabulary, *ids = splits
    return [CharWindows(split.to(device), block_size, vocabulary, stride) for split in ids]
