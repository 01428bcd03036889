"""The name ``libs/models/shard.py`` still imports the shipped model's weights file by: the shipped
model is ``libs/models/shipped.py``. Remove this module once the torch shard imports from there."""

from libs.models.shipped import WEIGHTS

__all__ = ["WEIGHTS"]
