"""Lightning wrappers: the LanguageModel, learning-rate schedules, weight averaging, and evaluation."""

from lightning_modules.averaging import WeightAveragingOnPlateau
from lightning_modules.language_model import LanguageModel
from lightning_modules.music import MusicModel
from lightning_modules.schedules import CosineDecay, DecayOnPlateau, HalveOnPlateau, LinearDecay, ZarembaDecay

__all__ = [
    "CosineDecay",
    "DecayOnPlateau",
    "HalveOnPlateau",
    "LanguageModel",
    "LinearDecay",
    "MusicModel",
    "WeightAveragingOnPlateau",
    "ZarembaDecay",
]
