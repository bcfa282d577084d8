"""Corpora, tokenizers and stream batching, as LightningDataModules.

The data modules are imported when first named (``datamodules.TextDataModule``, as a config's ``class_path`` names
them), not with the package: a tokenizer (``datamodules.tokenizers``), which loading a model for inference needs, then
costs no Lightning import.
"""

from __future__ import annotations

from zoo.lazy import lazy_names

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

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
