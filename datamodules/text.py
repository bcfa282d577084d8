"""The LightningDataModule for text corpora: word, character, byte or SentencePiece streams for stateful TBPTT."""

from __future__ import annotations

from datamodules.base import StreamDataModule
from datamodules.text_data import TextData


class TextDataModule(TextData, StreamDataModule):
    """:class:`~datamodules.text_data.TextData` as a LightningDataModule: what configs name (``class_path:
    datamodules.TextDataModule``) and LightningCLI builds; its arguments are :class:`TextData`'s."""
