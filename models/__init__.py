"""The model and the data the three training scripts share: BabyCNN, the datasets and evaluation."""

from models.babycnn import BabyCNN

__all__ = ["BabyCNN"]
