"""What bare_loop.py and ddp_sync.py share: batches made before the clock starts, and the training
scripts' own optimizer, so both time the scripts' step and nothing of the data path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.data import synthetic_digits  # noqa: E402
from plumbing import training  # noqa: E402


def batches(steps, batch_size, seed):
    """``steps`` batches of synthetic digits, normalised once, up front."""
    images, labels = synthetic_digits(steps * batch_size, seed=seed)
    images = (images.float() / 255 - 0.13) / 0.3
    return list(zip(images.split(batch_size), labels.split(batch_size)))


def optimizer(parameters):
    """The scripts' optimizer (AdamW, fused) from their own function, with their default flags, at
    the peak lr (the scripts set the lr in their loop, step by step: a step at another lr costs the
    same)."""
    args = training.parser("benchmark").parse_args([])
    optimizer = training.make_optimizer(args, parameters)
    peak_lr, _ = training.peak_and_warmup(args, args.base_batch_size, total_steps=1)
    training.set_lr(optimizer, peak_lr)
    return optimizer
