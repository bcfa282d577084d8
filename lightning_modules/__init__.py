"""The LightningModules (LanguageModel, MusicModel), their callbacks, learning-rate schedules and weight averaging.

Scoring a trained network is the package :mod:`evaluation`; the architecture search is :mod:`search`.

The names below are handed out on first use (PEP 562), as ``zoo`` and ``datamodules`` do theirs: importing one module
of the package (what ``lm-zoo tune`` or ``search`` needs) then costs no Lightning import it does not need.
"""

from __future__ import annotations

from zoo.lazy import lazy_names

_HOMES = {
    "WeightAveragingOnPlateau": "lightning_modules.averaging",
    "LanguageModel": "lightning_modules.language_model",
    "MusicModel": "lightning_modules.music",
    "CosineDecay": "lightning_modules.schedules",
    "DecayOnPlateau": "lightning_modules.schedules",
    "HalveOnPlateau": "lightning_modules.schedules",
    "LinearDecay": "lightning_modules.schedules",
    "ZarembaDecay": "lightning_modules.schedules",
}
__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
