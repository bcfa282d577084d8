"""Text corpora read as word, character, byte or SentencePiece streams for stateful TBPTT, without Lightning
(:class:`datamodules.data_modules.TextDataModule` is the same with LightningDataModule, for training)."""

from __future__ import annotations

import inspect
import json
from typing import Any

import numpy as np

from datamodules.corpora import Corpus, cache_root, resolve_corpus
from datamodules.kinds import per_character
from datamodules.stream_data import StreamData, atomic_write, cache_key, check_sizes
from datamodules.tokenizers import TextUnits, Tokenizer, build_tokenizer
from datamodules.windows import StreamWindows


class TextData(StreamData):
    """A corpus cut into contiguous streams for truncated BPTT.

    The vocabulary is built from the training split when the module is created (LightningCLI links ``vocab_size`` to
    the model before training starts), and cached with the tokenized splits under ``$LM_ZOO_CACHE`` (default
    ``~/.cache/lm-zoo``) keyed by the files' sha256, so the second run of a recipe starts in seconds.

    Args:
        corpus: a registered corpus (``ptb``, ``ptb-char``, ``wikitext-2``, ``wikitext-103``, ``enwik8``, ``text8``,
            ``synthetic-xml``, ``synthetic-arithmetic``) or a directory with train/valid/test text files.
        tokenizer: ``word``, ``char``, ``byte`` or ``sentencepiece``; ``None`` takes the corpus's usual one.
        tokenizer_options: e.g. ``{"min_count": 2}`` (word/char) or ``{"vocab_size": 8000}`` (sentencepiece).
        batch_size: training streams (columns) per device.
        bptt: training window length.
        eval_batch_size: validation/test streams; perplexity depends on it (each stream starts without context).
        eval_bptt: validation/test window length; ``None`` uses ``bptt``.
        variable_bptt: AWD-LSTM's random training window lengths around ``bptt``.
        bptt_multiple: with ``variable_bptt``, each length rounded to a multiple of this and the epoch's last window
            padded to one (:class:`~datamodules.windows.StreamWindows`): a few shapes, each replayed from a captured
            step on a GPU. ``None``: the lengths as drawn.
        data_root: where corpora live; ``None`` uses ``$LM_ZOO_DATA`` or ``~/.cache/lm-zoo/data``.
        download: fetch a missing registered corpus from its canonical URL.
        corpus_options: options of generated corpora (``seed``, ``train_chars``, ... for the synthetic tasks).
        seed: seed of the variable BPTT lengths.
        windows_per_step: consecutive training windows each Lightning step trains on, one optimizer update each
            (:func:`~datamodules.stream_data.group_windows`): Lightning's per-step cost is paid once for them. Its
            step counters (``max_steps``, ``val_check_interval``, ``log_every_n_steps``, a schedule's ``step``
            interval) then count steps of this many windows.
    """

    def __init__(
        self,
        corpus: str = "ptb",
        tokenizer: str | None = None,
        tokenizer_options: dict[str, Any] | None = None,
        batch_size: int = 20,
        bptt: int = 35,
        eval_batch_size: int = 10,
        eval_bptt: int | None = None,
        variable_bptt: bool = False,
        bptt_multiple: int | None = None,
        data_root: str | None = None,
        download: bool = True,
        corpus_options: dict[str, Any] | None = None,
        seed: int = 0,
        windows_per_step: int = 1,
    ) -> None:
        super().__init__()
        self._save_settings(inspect.currentframe())
        check_sizes(batch_size=batch_size, bptt=bptt, eval_batch_size=eval_batch_size, eval_bptt=eval_bptt)
        self.corpus_name = corpus
        self.tokenizer_kind = tokenizer
        self.tokenizer_options = dict(tokenizer_options or {})
        self.batch_size = batch_size
        self.bptt = bptt
        self.eval_batch_size = eval_batch_size
        self.eval_bptt = eval_bptt or bptt
        self.variable_bptt = variable_bptt
        self.bptt_multiple = bptt_multiple
        self.data_root = data_root
        self.download = download
        self.corpus_options = corpus_options
        self.seed = seed
        self.windows_per_step = windows_per_step
        self._corpus: Corpus | None = None
        self._tokenizer: Tokenizer | None = None
        self._ids: dict[str, np.ndarray] = {}
        self._units: dict[str, TextUnits] = {}

    # ----------------------------------------------------------------------------------------------- corpus, vocab
    @property
    def corpus(self) -> Corpus:
        """The resolved corpus (downloaded on first use if it is registered and missing)."""
        if self._corpus is None:
            self._corpus = resolve_corpus(
                self.corpus_name, root=self.data_root, download=self.download, options=self.corpus_options
            )
        return self._corpus

    @property
    def level(self) -> str:
        """``word`` (report perplexity) or ``char`` (report bits per character)."""
        return "char" if per_character(self._kind(), self.corpus.level) else self.corpus.level

    def _kind(self) -> str:
        return self.tokenizer_kind or self.corpus.default_tokenizer

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, built from the training split (or restored from a checkpoint with ``load_state_dict``)."""
        if self._tokenizer is None:
            self._tokenizer = self._build_or_load_tokenizer()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids (linked to the model's ``vocab_size`` by the CLI)."""
        return self.tokenizer.vocab_size

    def _build_or_load_tokenizer(self) -> Tokenizer:
        corpus, kind = self.corpus, self._kind()
        key = cache_key("tokenizer", kind, self.tokenizer_options, corpus.spaced_symbols, corpus.fingerprint("train"))
        path = cache_root() / "tokenizers" / f"{key}.json"
        if path.exists():
            return Tokenizer.from_state_dict(json.loads(path.read_text()))
        train_text = "" if kind == "byte" else corpus.read_text("train")
        tokenizer = build_tokenizer(kind, train_text, corpus.spaced_symbols, self.tokenizer_options)
        atomic_write(path, lambda f: f.write(json.dumps(tokenizer.state_dict()).encode()))
        return tokenizer

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Encode the splits with ``tokenizer`` (a checkpoint's or a loaded model's own): they are encoded again."""
        self._tokenizer = tokenizer
        self._ids.clear()
        self._units.clear()

    # ------------------------------------------------------------------------------------------------- the splits
    def encoded(self, split: str) -> np.ndarray:
        """The id stream of ``split`` (cached on disk by corpus checksum and tokenizer)."""
        if split not in self._ids:
            self._ids[split], self._units[split] = self._encode(split)
        return self._ids[split]

    def units(self, split: str) -> TextUnits:
        """Tokens, characters and words of ``split`` (what metrics are normalised by)."""
        self.encoded(split)
        return self._units[split]

    def _encode(self, split: str) -> tuple[np.ndarray, TextUnits]:
        tokenizer, corpus = self.tokenizer, self.corpus
        key = cache_key("encoded", tokenizer.state_dict(), corpus.fingerprint(split))
        directory = cache_root() / "encoded"
        ids_path, units_path = directory / f"{key}.npy", directory / f"{key}.json"
        if ids_path.exists() and units_path.exists():
            return np.load(ids_path, mmap_mode="r"), TextUnits(**json.loads(units_path.read_text()))
        if tokenizer.kind == "byte":  # bytes need not be UTF-8 (enwik8 is, but raw byte corpora may not be)
            data = corpus.read_bytes(split)
            ids = tokenizer.encode_bytes(data)  # type: ignore[attr-defined]
            units = tokenizer.count_units(data.decode("utf-8", errors="replace"), len(ids))
        else:
            text = corpus.read_text(split)
            ids = tokenizer.encode_text(text)
            units = tokenizer.count_units(text, len(ids))
        atomic_write(ids_path, lambda f: np.save(f, ids))
        atomic_write(units_path, lambda f: f.write(json.dumps(units.__dict__).encode()))
        return ids, units

    def stream(self, split: str, batch_size: int | None = None, bptt: int | None = None) -> StreamWindows:
        """The windows of ``split`` for this rank (evaluation sizes unless it is the training split)."""
        rank, world = self._rank_world()
        training = split == "train"
        return StreamWindows(
            self.encoded(split),
            batch_size=batch_size or (self.batch_size if training else self.eval_batch_size),
            bptt=bptt or (self.bptt if training else self.eval_bptt),
            start_id=self.tokenizer.eos_id,
            rank=rank,
            world_size=world,
            variable_bptt=self.variable_bptt and training,
            seed=self.seed,
            epoch=self._training_epoch(split),
            bptt_multiple=self.bptt_multiple,
        )
