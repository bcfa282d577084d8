"""Corpora, tokenizers and stream batching, as LightningDataModules.

The data modules are imported when first named (``datamodules.TextDataModule``, as a config's ``class_path`` names
them), not with the package: a tokenizer (``datamodules.tokenizers``), which loading a model for inference needs, then
costs no Lightning import.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_HOMES = {
    "FrameBatch": "datamodules.music",
    "GBWDataModule": "datamodules.gbw",
    "LMBatch": "datamodules.windows",
    "MultiSequenceWindows": "datamodules.multisequence",
    "MusicDataModule": "datamodules.music",
    "ReverseCopyDataModule": "datamodules.reverse_copy",
    "StreamData": "datamodules.stream_data",
    "StreamWindows": "datamodules.windows",
    "TextData": "datamodules.text_data",
    "TextDataModule": "datamodules.data_modules",
    "Tokenizer": "datamodules.tokenizers",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'datamodules' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
