"""The models and the data the training scripts share: BabyCNN, the GPT and the bundled datasets."""

from models.babycnn import BabyCNN
from models.gpt import GPT

__all__ = ["GPT", "BabyCNN"]
