"""The model and the data the three training scripts share: BabyCNN and the bundled datasets."""

from models.babycnn import BabyCNN

__all__ = ["BabyCNN"]
