import dataclasses
import functools
import hashlib
import http.server
import io
import os
import shutil
import tarfile
import threading
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from datamodules import corpora
from datamodules.corpora import (
    CORPORA,
    Corpus,
    CorpusSpec,
    RemoteFile,
    Split,
    SplitSource,
    cache_root,
    data_root,
    ensure_files,
    resolve_corpus,
)
from tests.conftest import DATA_ROOT, needs_data
from zoo.errors import DataError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.startswith(".") or p.suffix == ".part")


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LM_ZOO_DATA", raising=False)
    # A proxy configured on the machine must not intercept the loopback server.
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setenv("NO_PROXY", "*")


class Mirror:
    """A real HTTP server on 127.0.0.1 serving a directory and counting requests per path."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.hits: Counter[str] = Counter()
        hits = self.hits

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                hits[self.path] += 1
                super().do_GET()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=str(directory))
        )
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # A short poll interval keeps shutdown() (once per test) from costing half a second.
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join()
            self.running = False


@pytest.fixture
def mirror(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    m = Mirror(served)
    yield m
    m.stop()


TOY = {
    "alpha.txt": b"alpha one\nalpha two\n",
    "beta.txt": b"beta\n",
    "gamma.txt": "gamma \u00e9\n".encode(),
    "delta.txt": b"delta delta\n",
}


def build_toy(mirror: Mirror, **sha_overrides: str) -> CorpusSpec:
    """Serve a plain file, a zip with two members and a tgz with one ("./"-prefixed), and describe them."""
    (mirror.directory / "alpha.txt").write_bytes(TOY["alpha.txt"])
    with zipfile.ZipFile(mirror.directory / "pack.zip", "w") as zf:
        zf.writestr("pack/", b"")
        zf.writestr("pack/beta.txt", TOY["beta.txt"])
        zf.writestr("pack/gamma.txt", TOY["gamma.txt"])
    with tarfile.open(mirror.directory / "bundle.tgz", "w:gz") as tf:
        info = tarfile.TarInfo("./bundle/data/delta.txt")
        info.size = len(TOY["delta.txt"])
        tf.addfile(info, io.BytesIO(TOY["delta.txt"]))

    def digest(name: str) -> str:
        return sha_overrides.get(name, sha(TOY[name]))

    return CorpusSpec(
        name="toy",
        description="a test corpus",
        files=(
            RemoteFile("alpha.txt", f"{mirror.url}/alpha.txt", digest("alpha.txt")),
            RemoteFile("beta.txt", f"{mirror.url}/pack.zip", digest("beta.txt"), "pack/beta.txt"),
            RemoteFile("gamma.txt", f"{mirror.url}/pack.zip", digest("gamma.txt"), "pack/gamma.txt"),
            RemoteFile("delta.txt", f"{mirror.url}/bundle.tgz", digest("delta.txt"), "bundle/data/delta.txt"),
        ),
        splits={"train": SplitSource("alpha.txt"), "valid": SplitSource("beta.txt"), "test": SplitSource("gamma.txt")},
        level="word",
        default_tokenizer="word",
    )


# --------------------------------------------------------------------------------------------------------------------
# Roots and registry


def test_data_root_precedence(tmp_path, monkeypatch):
    assert data_root() == corpora.DEFAULT_DATA_ROOT == Path.home() / ".cache" / "lm-zoo" / "data"
    monkeypatch.setenv("LM_ZOO_DATA", str(tmp_path / "env"))
    assert data_root() == tmp_path / "env"
    assert data_root(tmp_path / "arg") == tmp_path / "arg"
    assert data_root("~/x") == Path.home() / "x"


def test_cache_root(tmp_path, monkeypatch):
    assert cache_root() == tmp_path / "cache"
    monkeypatch.delenv("LM_ZOO_CACHE")
    assert cache_root() == Path.home() / ".cache" / "lm-zoo"


def test_registry():
    assert {"ptb", "ptb-char", "wikitext-2", "wikitext-103", "enwik8", "text8"} <= set(CORPORA)
    for name, spec in CORPORA.items():
        assert spec.name == name and set(spec.splits) == {"train", "valid", "test"}
        assert spec.level in ("word", "char") and spec.default_tokenizer in ("word", "char", "byte")
        assert "\n" not in spec.description
        for rf in spec.files:
            assert rf.sha256 is None or (len(rf.sha256) == 64 and int(rf.sha256, 16) >= 0)
            assert rf.url.startswith(("http://", "https://"))
    assert CORPORA["ptb-char"].directory == CORPORA["ptb"].directory == "ptb"
    assert CORPORA["ptb-char"].spaced_symbols and CORPORA["ptb-char"].level == "char"
    assert CORPORA["ptb"].level == "word" and CORPORA["wikitext-103"].files[0].sha256 is None
    enwik8 = CORPORA["enwik8"].splits
    assert (enwik8["train"].start, enwik8["train"].end, enwik8["valid"].start, enwik8["valid"].end) == (
        0,
        90_000_000,
        90_000_000,
        95_000_000,
    )
    assert enwik8["test"].start == 95_000_000
    assert CORPORA["text8"].splits["valid"] == SplitSource("text8", 90_000_000, 95_000_000)


# --------------------------------------------------------------------------------------------------------------------
# Downloading


def test_ensure_files_downloads_extracts_verifies_and_downloads_once(tmp_path, mirror, capsys):
    spec = build_toy(mirror)
    root = tmp_path / "data"
    directory = ensure_files(spec, root)
    assert directory == root / "toy"
    for name, data in TOY.items():
        assert (directory / name).read_bytes() == data
    assert mirror.hits == {"/alpha.txt": 1, "/pack.zip": 1, "/bundle.tgz": 1}, "each URL fetched once"
    assert leftovers(root) == []
    err = capsys.readouterr().err
    assert f"lm-zoo: downloading {mirror.url}/alpha.txt -> {directory / 'alpha.txt'}" in err
    assert f"lm-zoo: downloading {mirror.url}/pack.zip" in err

    assert ensure_files(spec, root) == directory
    assert sum(mirror.hits.values()) == 3, "present files are not downloaded again"

    corpus = Corpus("toy", {s: Split(directory / src.file) for s, src in spec.splits.items()}, "word", "word")
    assert corpus.read_text("test") == "gamma \u00e9\n"


def test_only_missing_files_are_downloaded(tmp_path, mirror):
    spec = build_toy(mirror)
    directory = ensure_files(spec, tmp_path / "data")
    (directory / "delta.txt").unlink()
    mirror.hits.clear()
    ensure_files(spec, tmp_path / "data")
    assert mirror.hits == {"/bundle.tgz": 1}
    assert (directory / "delta.txt").read_bytes() == TOY["delta.txt"]


@pytest.mark.parametrize("name", ["alpha.txt", "gamma.txt"])
def test_wrong_sha256_of_download_leaves_nothing_behind(tmp_path, mirror, name):
    spec = build_toy(mirror, **{name: "0" * 64})
    root = tmp_path / "data"
    with pytest.raises(DataError) as err:
        ensure_files(spec, root)
    message = str(err.value)
    assert "\n" not in message
    assert name in message and "0" * 64 in message and sha(TOY[name]) in message
    assert not (root / "toy" / name).exists()
    assert leftovers(root) == []


def test_unreachable_server_names_missing_files_and_where_to_put_them(tmp_path, mirror):
    spec = build_toy(mirror)
    root = tmp_path / "data"
    mirror.stop()
    with pytest.raises(DataError) as err:
        ensure_files(spec, root)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("corpus 'toy' is missing alpha.txt, beta.txt, gamma.txt, delta.txt in ")
    assert str(root / "toy") in message and "could not download them (" in message
    assert f"{mirror.url}/alpha.txt" in message and f"{mirror.url}/pack.zip" in message
    assert "put the files there" in message and "LM_ZOO_DATA" in message
    assert leftovers(root) == []


def test_http_error_is_reported(tmp_path, mirror):
    spec = build_toy(mirror)
    (mirror.directory / "pack.zip").unlink()
    with pytest.raises(DataError, match=r"missing beta\.txt, gamma\.txt, delta\.txt in .*HTTP 404") as err:
        ensure_files(spec, tmp_path / "data")
    assert "\n" not in str(err.value)
    assert (tmp_path / "data" / "toy" / "alpha.txt").is_file(), "what could be fetched is kept"


def test_download_false_names_missing_files(tmp_path, mirror):
    spec = build_toy(mirror)
    with pytest.raises(DataError) as err:
        ensure_files(spec, tmp_path / "data", download=False)
    message = str(err.value)
    assert "\n" not in message
    assert "missing alpha.txt, beta.txt, gamma.txt, delta.txt" in message and "downloading is off" in message
    assert "put the files there" in message and f"{mirror.url}/bundle.tgz" in message
    assert sum(mirror.hits.values()) == 0
    assert not (tmp_path / "data").exists()


def test_missing_and_unsafe_archive_members(tmp_path, mirror):
    with tarfile.open(mirror.directory / "evil.tgz", "w:gz") as tf:
        for name in ("../evil.txt", "/abs/evil.txt"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tf.addfile(info, io.BytesIO(b"evil"))
    spec = CorpusSpec(
        "evil",
        "unsafe members",
        (RemoteFile("evil.txt", f"{mirror.url}/evil.tgz", None, "evil.txt"),),
        {s: SplitSource("evil.txt") for s in ("train", "valid", "test")},
        "word",
        "word",
    )
    with pytest.raises(DataError, match=r"has no member evil\.txt") as err:
        ensure_files(spec, tmp_path / "data" / "deep")
    assert "\n" not in str(err.value)
    assert not list(tmp_path.rglob("evil.txt"))


def test_present_files_are_hashed_once(tmp_path, mirror, monkeypatch):
    spec = build_toy(mirror)
    directory = tmp_path / "data" / "toy"
    directory.mkdir(parents=True)
    for name, data in TOY.items():
        (directory / name).write_bytes(data)
    hashed = []
    real = corpora.sha256_file
    monkeypatch.setattr(corpora, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))

    ensure_files(spec, tmp_path / "data", download=False)
    assert sorted(hashed) == sorted(TOY)
    ensure_files(spec, tmp_path / "data", download=False)
    assert len(hashed) == 4, "the verdict is remembered"
    assert list((tmp_path / "cache" / "verified").iterdir()), "markers live in the cache"
    assert leftovers(tmp_path / "data") == [] and sorted(p.name for p in directory.iterdir()) == sorted(TOY)

    st = (directory / "beta.txt").stat()
    os.utime(directory / "beta.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    ensure_files(spec, tmp_path / "data", download=False)
    assert hashed[4:] == ["beta.txt"], "a touched file is hashed again"


def test_present_file_with_wrong_sha256(tmp_path, mirror):
    spec = build_toy(mirror)
    directory = ensure_files(spec, tmp_path / "data")
    (directory / "beta.txt").write_bytes(b"tampered\n")
    with pytest.raises(DataError) as err:
        ensure_files(spec, tmp_path / "data")
    message = str(err.value)
    assert "\n" not in message
    assert str(directory / "beta.txt") in message and sha(b"tampered\n") in message and sha(TOY["beta.txt"]) in message
    assert "delete it" in message
    (directory / "beta.txt").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        ensure_files(spec, tmp_path / "data")


def test_unwritable_cache_only_costs_rehashing(tmp_path, mirror, monkeypatch):
    spec = build_toy(mirror)
    directory = ensure_files(spec, tmp_path / "data")
    (tmp_path / "blocker").write_text("a file where the cache directory should be")
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "blocker"))
    assert ensure_files(spec, tmp_path / "data") == directory


# --------------------------------------------------------------------------------------------------------------------
# The real PTB files, served from a loopback mirror


@needs_data("ptb")
def test_real_ptb_spec_against_loopback_mirror(tmp_path, mirror, monkeypatch):
    for name in ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"):
        shutil.copyfile(DATA_ROOT / "ptb" / name, mirror.directory / name)
    real = CORPORA["ptb"]
    spec = dataclasses.replace(
        real, files=tuple(dataclasses.replace(rf, url=f"{mirror.url}/{rf.name}") for rf in real.files)
    )
    assert [rf.sha256 for rf in spec.files] == [rf.sha256 for rf in real.files]
    monkeypatch.setitem(CORPORA, "ptb", spec)
    corpus = resolve_corpus("ptb", root=tmp_path / "data")
    assert corpus.read_text("valid").count("\n") == 3370
    assert corpus.level == "word" and corpus.default_tokenizer == "word" and not corpus.spaced_symbols
    assert corpus.splits["train"].path == tmp_path / "data" / "ptb" / "ptb.train.txt"
    assert corpus.fingerprint("test") == CORPORA["ptb"].files[2].sha256 == real.files[2].sha256

    # A mirror serving different bytes is caught by the real checksum.
    (tmp_path / "data" / "ptb" / "ptb.valid.txt").unlink()
    (mirror.directory / "ptb.valid.txt").write_bytes((DATA_ROOT / "ptb" / "ptb.valid.txt").read_bytes()[:-1])
    with pytest.raises(DataError, match="ptb.valid.txt .* has sha256"):
        resolve_corpus("ptb", root=tmp_path / "data")
    assert not (tmp_path / "data" / "ptb" / "ptb.valid.txt").exists()


@needs_data("ptb")
def test_real_ptb_char_spec_from_a_dot_slash_tgz(tmp_path, mirror, monkeypatch):
    # Mikolov's simple-examples.tgz names its members "./simple-examples/data/...".
    with tarfile.open(mirror.directory / "simple-examples.tgz", "w:gz", compresslevel=1) as tf:
        for split in ("train", "valid", "test"):
            tf.add(DATA_ROOT / "ptb" / f"ptb.char.{split}.txt", f"./simple-examples/data/ptb.char.{split}.txt")
        tf.add(DATA_ROOT / "ptb" / "ptb.valid.txt", "./simple-examples/data/ptb.valid.txt")
    real = CORPORA["ptb-char"]
    spec = dataclasses.replace(
        real, files=tuple(dataclasses.replace(rf, url=f"{mirror.url}/simple-examples.tgz") for rf in real.files)
    )
    monkeypatch.setitem(CORPORA, "ptb-char", spec)
    corpus = resolve_corpus("ptb-char", root=tmp_path / "data")
    assert mirror.hits == {"/simple-examples.tgz": 1}
    assert corpus.splits["valid"].path == tmp_path / "data" / "ptb" / "ptb.char.valid.txt"
    assert corpus.spaced_symbols and corpus.level == "char"
    assert corpus.read_text("valid").count("\n") == 3370


# --------------------------------------------------------------------------------------------------------------------
# User corpora and reading


def write_dir(directory: Path, files: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


@pytest.mark.parametrize(
    "names",
    [
        ("train.txt", "valid.txt", "test.txt"),
        ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
        ("train", "validation", "test"),
        ("ptb.train.txt", "ptb.val.txt", "ptb.test.txt"),
    ],
)
def test_user_directory_corpus(tmp_path, names):
    directory = write_dir(tmp_path / "mine", {n: f"{n} text\n".encode() for n in names} | {"README.md": b"x"})
    corpus = resolve_corpus(str(directory))
    assert corpus.level == "word" and corpus.default_tokenizer == "word"
    assert [corpus.splits[s].path.name for s in ("train", "valid", "test")] == list(names)
    assert corpus.read_text("valid") == f"{names[1]} text\n"


def test_user_directory_prefers_plain_names_and_rejects_ambiguity(tmp_path):
    directory = write_dir(tmp_path / "d", {n: b"x\n" for n in ("train.txt", "a.train.txt", "valid.txt", "test.txt")})
    assert resolve_corpus(str(directory)).splits["train"].path.name == "train.txt"
    directory = write_dir(tmp_path / "e", {n: b"x\n" for n in ("a.train.txt", "b.train.txt", "valid", "test")})
    with pytest.raises(DataError, match="several train files"):
        resolve_corpus(str(directory))


def test_user_directory_missing_split(tmp_path):
    directory = write_dir(tmp_path / "d", {"train.txt": b"a\n", "test.txt": b"b\n"})
    with pytest.raises(DataError) as err:
        resolve_corpus(str(directory))
    message = str(err.value)
    assert "\n" not in message
    assert "no valid file" in message and "found: test.txt, train.txt" in message and "valid.txt" in message


def test_unknown_corpus(tmp_path):
    with pytest.raises(DataError) as err:
        resolve_corpus("xyz")
    message = str(err.value)
    assert message.startswith("unknown corpus 'xyz': use one of ptb, ptb-char, wikitext-2")
    assert "directory holding train/valid/test" in message and "\n" not in message
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(DataError, match="not a directory"):
        resolve_corpus(str(tmp_path / "f.txt"))


def test_empty_split(tmp_path):
    directory = write_dir(tmp_path / "d", {"train.txt": b"a\n", "valid.txt": b"", "test.txt": b"b\n"})
    corpus = resolve_corpus(str(directory))
    with pytest.raises(DataError, match=r"split 'valid' .* is empty: .*valid\.txt") as err:
        corpus.read_bytes("valid")
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="is empty"):
        corpus.fingerprint("valid")
    with pytest.raises(DataError, match="no split 'dev'"):
        corpus.read_bytes("dev")


def test_non_utf8_reports_byte_offset(tmp_path):
    directory = write_dir(tmp_path / "d", {"train.txt": b"caf\xe9 ok\n", "valid.txt": b"a\n", "test.txt": b"b\n"})
    corpus = resolve_corpus(str(directory))
    assert corpus.read_bytes("train") == b"caf\xe9 ok\n"
    with pytest.raises(DataError) as err:
        corpus.read_text("train")
    message = str(err.value)
    assert "\n" not in message
    assert "train.txt" in message and "byte offset 3" in message and "tokenizer: byte" in message
    assert "iconv" in message
    # Offsets are of the file, not of the split.
    ranged = Corpus("r", {"train": Split(directory / "train.txt", 1, 6)}, "char", "char")
    with pytest.raises(DataError, match="byte offset 3"):
        ranged.read_text("train")


def test_a_byte_order_mark_is_not_text(tmp_path):
    bom = "\ufeff".encode()
    directory = write_dir(tmp_path / "d", {"train.txt": bom + b"the cat\n", "valid.txt": b"a\n", "test.txt": b"b\n"})
    corpus = resolve_corpus(str(directory))
    assert corpus.read_text("train") == "the cat\n"
    from datamodules.tokenizers import build_tokenizer

    assert build_tokenizer("word", corpus.read_text("train")).symbols[2:] == ["the", "cat"]
    # Only at the start of a file: a split that starts later keeps the character (a zero-width no-break space).
    (directory / "later.txt").write_bytes(b"a\n" + bom + b"b\n")
    ranged = Corpus("r", {"train": Split(directory / "later.txt", 2, None)}, "char", "char")
    assert ranged.read_text("train") == "\ufeffb\n"


def test_byte_ranges(tmp_path):
    path = tmp_path / "one"
    path.write_bytes(b"0123456789")
    corpus = Corpus(
        "cut",
        {"train": Split(path, 0, 6), "valid": Split(path, 6, 8), "test": Split(path, 8)},
        "char",
        "byte",
    )
    assert [corpus.read_bytes(s) for s in ("train", "valid", "test")] == [b"012345", b"67", b"89"]
    past = Corpus("cut", {"train": Split(path, 20, 30)}, "char", "byte")
    with pytest.raises(DataError, match=r"no bytes in \[20, 30\).*truncated"):
        past.read_bytes("train")


def test_fingerprint_is_the_sha256_of_the_split_and_follows_edits(tmp_path):
    path = tmp_path / "one"
    path.write_bytes(b"0123456789")
    corpus = Corpus("cut", {"train": Split(path, 2, 5), "valid": Split(path)}, "char", "byte")
    assert corpus.fingerprint("train") == sha(b"234") == corpus.fingerprint("train")
    assert corpus.fingerprint("valid") == sha(b"0123456789")
    again = Corpus("cut", {"train": Split(path, 2, 5)}, "char", "byte")
    assert again.fingerprint("train") == corpus.fingerprint("train")
    path.write_bytes(b"01xyz56789!")
    assert corpus.fingerprint("train") == sha(b"xyz")


# --------------------------------------------------------------------------------------------------------------------
# The real corpora in shared/data (read-only: nothing may be written there)


@needs_data("ptb")
@needs_data("wikitext-2")
def test_real_corpora_offline(monkeypatch):
    before = sorted(str(p) for p in DATA_ROOT.rglob("*"))
    hashed = []
    real = corpora.sha256_file
    monkeypatch.setattr(corpora, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))

    ptb = resolve_corpus("ptb", root=DATA_ROOT, download=False)
    assert ptb.read_text("valid").count("\n") == 3370
    assert ptb.splits["train"].path == DATA_ROOT / "ptb" / "ptb.train.txt"
    ptb_char = resolve_corpus("ptb-char", root=DATA_ROOT, download=False)
    assert ptb_char.splits["test"].path == DATA_ROOT / "ptb" / "ptb.char.test.txt" and ptb_char.spaced_symbols
    wikitext = resolve_corpus("wikitext-2", root=DATA_ROOT, download=False)
    assert wikitext.read_text("test").count("\n") == 4358
    assert len(hashed) == 9, "every file checked against its sha256"

    monkeypatch.setenv("LM_ZOO_DATA", str(DATA_ROOT))
    for name in ("ptb", "ptb-char", "wikitext-2"):
        resolve_corpus(name, download=False)
    assert len(hashed) == 9, "verified once, remembered in LM_ZOO_CACHE"
    assert sorted(str(p) for p in DATA_ROOT.rglob("*")) == before
