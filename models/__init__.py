"""What the three training scripts share and do not teach: the model and the data."""

from models.babycnn import BabyCNN

__all__ = ["BabyCNN"]
