"""Corpora, tokenizers and stream batching, as LightningDataModules."""

from datamodules.streams import LMBatch, StreamWindows
from datamodules.text import TextDataModule
from datamodules.tokenizers import Tokenizer

__all__ = ["LMBatch", "StreamWindows", "TextDataModule", "Tokenizer"]
