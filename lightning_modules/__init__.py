"""Lightning wrappers: the LanguageModel, learning-rate schedules, and evaluation."""

from lightning_modules.language_model import LanguageModel
from lightning_modules.schedules import ZarembaDecay

__all__ = ["LanguageModel", "ZarembaDecay"]
