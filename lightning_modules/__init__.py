"""The LightningModules (LanguageModel, MusicModel), their callbacks, learning-rate schedules and weight averaging.

Scoring a trained network is :mod:`lightning_modules.evaluation`; the architecture search is
:mod:`lightning_modules.search`.
"""

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
