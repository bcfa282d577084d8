"""Corpora, tokenizers and stream batching, as LightningDataModules."""

from datamodules.gbw import GBWDataModule
from datamodules.multisequence import MultiSequenceWindows
from datamodules.music import FrameBatch, MusicDataModule
from datamodules.reverse_copy import ReverseCopyDataModule
from datamodules.streams import LMBatch, StreamWindows
from datamodules.text import TextDataModule
from datamodules.tokenizers import Tokenizer

__all__ = [
    "FrameBatch",
    "GBWDataModule",
    "LMBatch",
    "MultiSequenceWindows",
    "MusicDataModule",
    "ReverseCopyDataModule",
    "StreamWindows",
    "TextDataModule",
    "Tokenizer",
]
