"""The One Billion Word benchmark (Chelba et al. 2013) as a LightningDataModule, batched as in Léonard 2016.

The benchmark's own files are read where its archive unpacks them::

    <data_root>/gbw/training-monolingual.tokenized.shuffled/news.en-000NN-of-00100          (99 training shards)
    <data_root>/gbw/heldout-monolingual.tokenized.shuffled/news.en.heldout-000NN-of-00050   (50 held-out shards)

Each split is a list of glob patterns relative to the corpus directory, so any selection of shards (and a flat
directory such as ``gbw-sample``) works. The default test set is held-out shard 0, the benchmark's test set; the
default validation set is held-out shard 1.

Vocabulary (Chelba et al. 2013, the preprocessing Léonard's ``dl.loadGBW`` uses): the words seen at least
``min_count = 3`` times in the training files, plus ``<S>``, ``</S>`` and ``<UNK>``; on the full training set that is
the paper's 793,471 ids. (The paper's ``--cutoff 10`` is its gradient-norm clip, not a vocabulary cutoff.) The
unigram counts stay with the vocabulary (``tokenizer.counts``), for NCE's noise distribution.

Built for the 800M-word training set: counting and encoding stream the files in blocks of whole lines, encode with no
Python loop per token, and write flat int32 ids plus int64 sentence offsets to disk once, under
``$LM_ZOO_CACHE/gbw`` keyed by the files' sha256 and the vocabulary; later runs memory-map them. Batches come from
:class:`datamodules.multisequence.MultiSequenceWindows`.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from datamodules.corpora import SPLITS, _remember_sha256, _remembered_sha256, cache_root, data_root, sha256_file
from datamodules.data_modules import StreamDataModule
from datamodules.multisequence import MultiSequenceWindows
from datamodules.progress import Progress
from datamodules.stream_data import atomic_write, cache_key, check_sizes
from datamodules.tokenizers import SentenceTokenizer, TextUnits, Tokenizer
from zoo.errors import DataError

GBW_URL = "http://www.statmt.org/lm-benchmark/1-billion-word-language-modeling-benchmark-r13output.tar.gz"
GBW_SHA256 = "01ba60381110baf7f189dfd2b8374de371e8c9a340835793f190bdae9e90a34e"  # of the archive (HF lm1b's record)
TRAIN_DIR = "training-monolingual.tokenized.shuffled"
HELDOUT_DIR = "heldout-monolingual.tokenized.shuffled"
DEFAULT_FILES = {
    "train": f"{TRAIN_DIR}/news.en-000??-of-00100",
    "valid": f"{HELDOUT_DIR}/news.en.heldout-00001-of-00050",
    "test": f"{HELDOUT_DIR}/news.en.heldout-00000-of-00050",
}
BLOCK_BYTES = 1 << 22  # lines are read and encoded 4 MiB at a time
PARALLEL_BYTES = 64 << 20  # from this size on, files are counted and encoded by one process per core
CACHE_FORMAT = 1  # part of every cache key: a changed encoding never reuses old files


# --------------------------------------------------------------------------------------------------------- files
def corpus_directory(corpus: str, root: str | Path | None = None) -> Path:
    """``<data_root>/<corpus>`` when that is a directory, else ``corpus`` as a path if it is one, else the former."""
    under_root = data_root(root) / corpus
    if under_root.is_dir():
        return under_root
    as_path = Path(corpus).expanduser()
    return as_path if as_path.is_dir() else under_root


def _missing_error(directory: Path, split: str, patterns: list[str]) -> DataError:
    return DataError(
        f"no GBW {split} file matches {' '.join(patterns)} in {directory}: download {GBW_URL} (1.8 GB, not fetched "
        f"automatically), unpack it and put its {TRAIN_DIR}/ and {HELDOUT_DIR}/ directories in {directory}, or point "
        "data.corpus (or LM_ZOO_DATA) at the directory that holds them"
    )


def match_files(directory: Path, patterns: str | list[str], split: str) -> list[Path]:
    """The files of one split: every pattern's matches in sorted order, each file once.

    Raises:
        DataError: a pattern matches no file (one line saying where to put the benchmark).
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns:
        raise DataError(f"no files given for the GBW {split} split: set data.{split}_files to glob patterns")
    files: dict[Path, None] = {}
    for pattern in patterns:
        found = sorted(Path(p) for p in glob.glob(str(directory / pattern)) if Path(p).is_file())
        if not found:
            raise _missing_error(directory, split, patterns)
        files.update(dict.fromkeys(found))
    return list(files)


def file_fingerprint(path: Path) -> str:
    """The file's sha256, hashed once per (path, size, mtime) and remembered under the cache root."""
    st = path.stat()
    digest = _remembered_sha256(path, st)
    if digest is None:
        digest = sha256_file(path)
        _remember_sha256(path, digest)
    return digest


def read_blocks(path: Path) -> Iterator[tuple[bytes, int]]:
    """Complete lines of ``path``, about :data:`BLOCK_BYTES` at a time, checked to be UTF-8.

    Yields:
        ``(block, characters)``: whole lines (what follows the last newline of the file counts as a line) and how
        many characters they decode to.

    Raises:
        DataError: the file cannot be read, is empty, or is not UTF-8 (naming the byte offset).
    """
    offset, carry = 0, b""
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(BLOCK_BYTES)
                data = carry + chunk
                if not chunk:
                    block, carry = data, b""
                else:
                    cut = data.rfind(b"\n") + 1
                    block, carry = data[:cut], data[cut:]
                if block:
                    try:
                        characters = len(block.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        raise DataError(
                            f"{path} is not valid UTF-8 at byte offset {offset + e.start}; the benchmark's files are "
                            "UTF-8: replace it with the original shard"
                        ) from None
                    yield block, characters
                    offset += len(block)
                if not chunk:
                    break
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    if offset == 0:
        raise DataError(f"{path} is empty: replace it with the original shard, or leave it out of the file patterns")


def _block_sentences(block: bytes) -> int:
    return sum(map(bool, map(bytes.strip, block.split(b"\n"))))


def _no_sentence(path: Path) -> DataError:
    return DataError(f"{path} holds no sentence (only blank lines): use the original shard")


def _count_file(path: Path) -> tuple[Counter[bytes], int]:
    counter: Counter[bytes] = Counter()
    sentences = 0
    for block, _ in read_blocks(path):
        counter.update(block.split())  # C speed: bytes.split and Counter's own counting loop
        sentences += _block_sentences(block)
    if sentences == 0:
        raise _no_sentence(path)
    return counter, sentences


def _pool_size(paths: list[Path], workers: int | None) -> int:
    """Processes for per-file work: ``workers``, or (``None``) one per core for corpora of 64 MB and more."""
    if workers is None:
        big = sum(p.stat().st_size for p in paths) >= PARALLEL_BYTES
        workers = (os.cpu_count() or 1) if big else 1
    if workers > 1 and "fork" not in multiprocessing.get_all_start_methods():
        return 1  # spawned workers would re-import torch and Lightning each: not worth it
    return max(1, min(workers, len(paths)))


def count_words(paths: list[Path], workers: int | None = None) -> tuple[Counter[str], int]:
    """Word counts and the number of sentences (non-blank lines) of ``paths``, streaming.

    Words are counted as bytes at C speed and decoded once at the end. With several workers, each counts whole files
    in a forked process (pure Python and bytes: nothing of torch runs there) and the parent adds the counts up.
    """
    total: Counter[bytes] = Counter()
    sentences = 0
    processes = _pool_size(paths, workers)

    if processes == 1:
        for counter, n in Progress(map(_count_file, paths), "counting words", "files", len(paths)):
            total.update(counter)
            sentences += n
    else:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            for counter, n in Progress(pool.imap(_count_file, paths), "counting words", "files", len(paths)):
                total.update(counter)
                sentences += n
    return Counter({word.decode("utf-8"): n for word, n in total.items()}), sentences


@dataclass(frozen=True)
class EncodedSplit:
    """A split as flat arrays.

    Attributes:
        ids: ``(tokens,)`` int32, every sentence as ``<S> w1 ... wn </S>``, memory-mapped.
        offsets: ``(sentences + 1,)`` int64 sentence boundaries in ``ids``.
        units: predicted tokens (words + one ``</S>`` per sentence), characters and words of the text.
    """

    ids: np.ndarray
    offsets: np.ndarray
    units: TextUnits

    @property
    def num_sentences(self) -> int:
        return len(self.offsets) - 1


_ENCODER: SentenceTokenizer | None = None  # the tokenizer forked encoding workers inherit (never pickled)


def _encode_file(path: Path, out: BinaryIO, tokenizer: SentenceTokenizer) -> tuple[np.ndarray, int]:
    """Append the ids of ``path`` to ``out``; return its sentence lengths and characters."""
    lengths: list[np.ndarray] = []
    characters = 0
    for block, block_chars in read_blocks(path):
        ids, block_lengths = tokenizer.encode_block(block)
        ids.tofile(out)
        lengths.append(block_lengths)
        characters += block_chars
    if not lengths or sum(map(len, lengths)) == 0:
        raise _no_sentence(path)
    return np.concatenate(lengths), characters


def _encode_part(job: tuple[Path, Path]) -> tuple[np.ndarray, int]:
    path, part = job
    assert _ENCODER is not None
    with open(part, "wb") as out:
        return _encode_file(path, out, _ENCODER)


def encode_files(paths: list[Path], tokenizer: SentenceTokenizer, directory: Path, workers: int | None = None) -> None:
    """Write ``ids.bin`` (int32), ``offsets.bin`` (int64) and ``meta.json`` of ``paths`` into ``directory``, streaming.

    With several workers, forked processes encode whole files into parts that are then joined in file order.
    """
    global _ENCODER

    processes = _pool_size(paths, workers)
    with open(directory / "ids.bin", "wb") as out:
        if processes == 1:
            results = [_encode_file(path, out, tokenizer) for path in Progress(paths, "encoding", "files")]
        else:
            parts = [directory / f"part-{i:05d}.bin" for i in range(len(paths))]
            _ENCODER = tokenizer
            try:
                with multiprocessing.get_context("fork").Pool(processes) as pool:
                    encoded = pool.imap(_encode_part, list(zip(paths, parts)))  # in file order
                    results = list(Progress(encoded, "encoding", "files", len(paths)))
            finally:
                _ENCODER = None
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
                part.unlink()
    lengths = np.concatenate([lengths for lengths, _ in results])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    offsets.tofile(directory / "offsets.bin")
    tokens, sentences = int(offsets[-1]), len(lengths)
    predicted = tokens - sentences  # every id but the <S> of each sentence
    meta = {"tokens": tokens, "sentences": sentences, "chars": sum(c for _, c in results), "predicted": predicted}
    (directory / "meta.json").write_text(json.dumps(meta))


def load_encoded(directory: Path) -> EncodedSplit | None:
    """The arrays written by :func:`encode_files`, or ``None`` if they are not (all) there."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        ids = np.memmap(directory / "ids.bin", dtype=np.int32, mode="r", shape=(meta["tokens"],))
        offsets = np.fromfile(directory / "offsets.bin", dtype=np.int64)
    except (OSError, ValueError, KeyError):
        return None
    if len(offsets) != meta["sentences"] + 1 or offsets[-1] != meta["tokens"]:
        return None
    units = TextUnits(tokens=meta["predicted"], chars=meta["chars"], words=meta["predicted"])
    return EncodedSplit(ids, offsets, units)


def _install_directory(fill: Callable[[Path], None], target: Path) -> None:
    """Fill a temp directory beside ``target``, then rename it into place (atomic: a killed run leaves no half)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        fill(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "meta.json").exists():  # another process finished first: keep its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- the module
class GBWDataModule(StreamDataModule):
    """Google's One Billion Word benchmark: independent sentences in multi-sequence batches with state resets.

    Args:
        corpus: the directory holding the benchmark: a name under the data root (``gbw``, ``gbw-sample``) or a path.
        train_files: glob pattern(s), relative to ``corpus``, of the training files (the vocabulary comes from them).
        valid_files: pattern(s) of the validation files.
        test_files: pattern(s) of the test files.
        min_count: words seen fewer times in the training files become ``<UNK>`` (3: the benchmark's 793,471 ids).
        batch_size: training columns per device (the paper: 128).
        bptt: training window length (the paper's ``seqlen``: 50).
        eval_batch_size: validation/test columns. With a reset at every sentence, perplexity does not depend on it.
        eval_bptt: validation/test window length; ``None`` uses ``bptt``.
        seed: seed of the per-epoch sentence order.
        data_root: where corpora live; ``None`` uses ``$LM_ZOO_DATA`` or ``~/.cache/lm-zoo/data``.
        workers: processes that count and encode the files, one file each at a time (``None``: one per core once the
            files reach 64 MB; the result is the same).
        windows_per_step: consecutive training windows a step trains on, one update each (as
            :class:`~datamodules.text_data.TextData`'s).
    """

    def __init__(
        self,
        corpus: str = "gbw",
        train_files: str | list[str] = DEFAULT_FILES["train"],
        valid_files: str | list[str] = DEFAULT_FILES["valid"],
        test_files: str | list[str] = DEFAULT_FILES["test"],
        min_count: int = 3,
        batch_size: int = 128,
        bptt: int = 50,
        eval_batch_size: int = 64,
        eval_bptt: int | None = None,
        seed: int = 0,
        data_root: str | None = None,
        workers: int | None = None,
        windows_per_step: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_sizes(batch_size=batch_size, bptt=bptt, eval_batch_size=eval_batch_size, eval_bptt=eval_bptt)
        if min_count < 1:
            raise DataError(f"min_count must be at least 1, got {min_count}")
        self.corpus_name = corpus
        self.patterns = {"train": train_files, "valid": valid_files, "test": test_files}
        self.min_count = min_count
        self.batch_size = batch_size
        self.bptt = bptt
        self.eval_batch_size = eval_batch_size
        self.eval_bptt = eval_bptt or bptt
        self.seed = seed
        self.data_root = data_root
        self.workers = workers
        self.windows_per_step = windows_per_step
        self.level = "word"
        self._tokenizer: SentenceTokenizer | None = None
        self._tokenizer_key: str | None = None
        self._files: dict[str, list[Path]] = {}
        self._encoded: dict[str, EncodedSplit] = {}

    # ----------------------------------------------------------------------------------------- files, vocabulary
    @property
    def directory(self) -> Path:
        return corpus_directory(self.corpus_name, self.data_root)

    def files(self, split: str) -> list[Path]:
        """The files of ``split`` (``train``, ``valid`` or ``test``)."""
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}: use train, valid or test")
        if split not in self._files:
            self._files[split] = match_files(self.directory, self.patterns[split], split)
        return self._files[split]

    def _fingerprints(self, split: str) -> list[tuple[str, str]]:
        return [(path.name, file_fingerprint(path)) for path in self.files(split)]

    @property
    def tokenizer(self) -> SentenceTokenizer:
        """The vocabulary of the training files (cached), or the one restored with :meth:`load_state_dict`."""
        if self._tokenizer is None:
            self._tokenizer = self._build_or_load_vocabulary()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of ids (linked to the model's ``vocab_size`` by the CLI)."""
        return self.tokenizer.vocab_size

    def _build_or_load_vocabulary(self) -> SentenceTokenizer:
        key = cache_key("gbw-vocabulary", CACHE_FORMAT, self.min_count, self._fingerprints("train"))
        path = cache_root() / "gbw" / f"vocabulary-{key}.json"
        if path.exists():
            return SentenceTokenizer.from_state_dict(json.loads(path.read_text(encoding="utf-8")))  # type: ignore
        files = self.files("train")
        print(f"lm-zoo: counting the words of {len(files)} GBW training file(s) in {self.directory}", file=sys.stderr)
        counts, sentences = count_words(files, self.workers)
        tokenizer = SentenceTokenizer.from_counts(counts, sentences, self.min_count)
        atomic_write(path, lambda f: f.write(json.dumps(tokenizer.state_dict()).encode()))
        return tokenizer

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Encode the splits with ``tokenizer``'s vocabulary (a checkpoint's or a loaded model's own)."""
        if not isinstance(tokenizer, SentenceTokenizer):
            raise DataError(f"a GBW model needs a sentence tokenizer, the checkpoint has a {tokenizer.kind!r} one")
        self._tokenizer, self._tokenizer_key = tokenizer, None
        self._encoded.clear()

    # ------------------------------------------------------------------------------------------------ the splits
    def encoded(self, split: str) -> EncodedSplit:
        """``split`` as flat id and offset arrays (encoded once, then memory-mapped from the cache)."""
        if split not in self._encoded:
            if self._tokenizer_key is None:
                self._tokenizer_key = cache_key(self.tokenizer.state_dict())
            key = cache_key("gbw-encoded", CACHE_FORMAT, self._fingerprints(split), self._tokenizer_key)
            directory = cache_root() / "gbw" / f"encoded-{key}"
            encoded = load_encoded(directory)
            if encoded is None:
                files, tokenizer = self.files(split), self.tokenizer
                _install_directory(lambda tmp: encode_files(files, tokenizer, tmp, self.workers), directory)
                encoded = load_encoded(directory)
                if encoded is None:
                    raise DataError(f"the encoded {split} split in {directory} cannot be read back; delete it")
            self._encoded[split] = encoded
        return self._encoded[split]

    def units(self, split: str) -> TextUnits:
        """Predicted tokens (words + ``</S>``), characters and words of ``split``."""
        return self.encoded(split).units

    def stream(self, split: str, batch_size: int | None = None, bptt: int | None = None) -> MultiSequenceWindows:
        """The windows of ``split`` for this rank: shuffled sentences for training, the file order otherwise."""
        encoded = self.encoded(split)
        return MultiSequenceWindows(
            encoded.ids, encoded.offsets, pad_id=self.tokenizer.eos_id, **self._window_settings(split, batch_size, bptt)
        )
