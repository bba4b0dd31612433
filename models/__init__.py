"""The models and the data the training scripts share: BabyCNN, the GPT and the bundled datasets.

``build`` makes the model --model names for the data that ``data.load`` returned, in one call: the
line that a copy of a script with a model of its own replaces.
"""

from models import data
from models.babycnn import BabyCNN
from models.gpt import GPT, SIZES, sample

__all__ = ["GPT", "BabyCNN", "build", "sample"]


def build(args, train_set, device=None, dtype=None):
    """--model's model, whole, from the current seed: BabyCNN for one sample's (C, H, W), or a GPT
    of ``gpt.SIZES`` (gpt: nanoGPT's CPU size, gpt-gpu: its GPU size) for the text's vocabulary,
    its context the windows' length."""
    if args.model in SIZES:
        context = train_set.block_size
        return GPT(train_set.vocab_size, context, **SIZES[args.model], device=device, dtype=dtype)
    channels, size = train_set[0][0].shape[:2]  # of one sample (C, H, W)
    return BabyCNN(channels, data.NUM_CLASSES, size, args.width, device=device, dtype=dtype)
