"""Every command that takes a model against every kind of model lm-zoo ships: each cell works, or refuses in one line
that names the model's kind and what would serve (a music model given to syneval ended in an AttributeError).

The rows are shipped models (``pretrained/``, loaded from the bundled export: no network): word, character and
sentence-level text, piano-roll music, the XML character model, an NCE head, an ON-LSTM (the one model ``parse``
serves) and int8. An int8 model is no stored kind: nothing writes one (an export holds float32 or float16 weights);
``evaluate``, ``generate`` and ``score --quantize int8`` make it in memory, so its row is ptb-lstm-small under
``--quantize int8``, and the commands without the flag refuse it. ``publish`` and ``download`` talk to a Hub on
loopback (``tests/hub_server.py``). The cells run on tiny inputs: 20 tokens, one sample, a two-line file, one tuple
per syneval condition, one sentence to parse, an export without evaluation. docs/evaluation.md tabulates the matrix.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import checkpoints
import cli
from checkpoints import registry
from checkpoints.export_read import CONFIG_NAME
from commands import COMMANDS
from commands.common import QUANTIZING
from datamodules.kinds import MUSIC, PARSE, SCORE, SYNEVAL, WORDS_ONLY
from tests.conftest import DATA_ROOT
from tests.hub_server import FakeHub

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_test_token"


@dataclass(frozen=True)
class Row:
    """A kind of model: a shipped model that is one, the flags that make it one, the corpus folder its evaluation
    reads (``None``: generated), and the words a refusal names its kind by."""

    source: str
    corpus: str | None
    called: str
    flags: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return "music" if self.corpus == "music" else "text"


ROWS = {
    "word": Row("ptb-lstm-small", "ptb", "a word-level text model"),
    "char": Row("ptb-char-lstm", "ptb", "a character-level text model"),
    "sentence": Row("gbw-sample-lstm-softmax", "gbw-sample", "a sentence-level text model"),  # <S> ... </S>
    "music": Row("nottingham-gru", "music", "a music model (piano rolls)"),
    "xml": Row("synthetic-xml-lstm", None, "a character-level text model"),
    "nce": Row("gbw-sample-lstm-nce", "gbw-sample", "a sentence-level text model"),
    "on-lstm": Row("ptb-on-lstm", "ptb", "a word-level text model"),
    "int8": Row("ptb-lstm-small", "ptb", "int8", ("--quantize", "int8")),
}

# What serves, as the refusals say it.
WORD_MODEL = "give a word-level model such as ptb-lstm-small"
WORD_TEXT_MODEL = "give a word-level text model such as ptb-lstm-small"
ON_LSTM = "give a word-level ON-LSTM text model such as ptb-on-lstm"
INT8 = "by lm-zoo evaluate, generate or score --quantize int8 --device cpu"
# The cells that refuse, with the line's fragment saying what would serve; every other cell works.
REFUSED = {
    ("score", "music"): "give a text model such as ptb-lstm-small",
    ("syneval", "music"): WORD_TEXT_MODEL,
    ("syneval", "char"): WORD_MODEL,
    ("syneval", "xml"): WORD_MODEL,
    **{("parse", kind): ON_LSTM for kind in ROWS if kind != "on-lstm"},
    **{(command, "int8"): INT8 for command in ("syneval", "parse", "export", "publish", "download")},
}


# ------------------------------------------------------------------------------------------------ the commands
@dataclass(frozen=True)
class Cell:
    """A command run on one row: its arguments, and the checks of what a working cell printed."""

    argv: Callable[[Row, Path, FakeHub], list[str]]
    check: Callable[[str, Row, Path, FakeHub], None]
    data: Callable[[Row], str | None] = lambda row: None  # the corpus folder the command reads, if any


def _loads_as(directory: Path, row: Row) -> None:
    """``directory`` holds an export of ``row``'s model: its head, and its kind once loaded."""
    shipped = json.loads((ROOT / "pretrained" / row.source / CONFIG_NAME).read_text())
    assert json.loads((directory / CONFIG_NAME).read_text())["head"] == shipped["head"]
    assert checkpoints.load(directory).kind.name == row.kind


def _evaluated(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    result = json.loads(out)
    assert result["source"] == row.source and result["max_tokens"] == 20
    figure = "nll_per_step" if row.kind == "music" else "ppl"
    assert math.isfinite(result[figure]) and result[figure] > 0
    assert result.get("quantize") == ("int8" if row.flags else None)


def _generated(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    samples = json.loads(out)["samples"]
    assert len(samples) == 1
    if row.kind == "music":
        assert Path(samples[0]["midi"]).is_file() and samples[0]["frames"] == 4
    else:
        assert isinstance(samples[0], str)


def _scored(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    scores = [json.loads(line) for line in out.splitlines()]
    assert [s["text"] for s in scores] == TWO_LINES
    assert all(s["logprob"] < 0 and math.isfinite(s["logprob"]) for s in scores)


def _synevaluated(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    conditions = json.loads(out)["conditions"]
    assert len(conditions) == 15 and all(c["tuples"] == 1 for c in conditions.values())


def _parsed(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    result = json.loads(out)
    assert result["words"] == SENTENCE.split() and result["tree"]


def _exported(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    _loads_as(Path(json.loads(out)["out"]), row)


def _published(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    repo_id = f"kinds/{row.source}"
    assert out.splitlines()[0].endswith(repo_id)
    files = hub.repos[repo_id].commits[hub.repos[repo_id].branches["main"]]
    assert files[CONFIG_NAME] == (tmp / "export" / CONFIG_NAME).read_bytes()


def _downloaded(out: str, row: Row, tmp: Path, hub: FakeHub) -> None:
    _loads_as(Path(json.loads(out)["path"]), row)


TWO_LINES = ["the cat sat on the mat", "the dogs bark"]
SENTENCE = "the cat sat on the mat"
EVALUATE = ["--split", "test", "--max-tokens", "20", "--batch-size", "1", "--device", "cpu", "--json"]


def _evaluate_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    return ["evaluate", row.source, *EVALUATE, "--bptt", "10"]


def _generate_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    music = ["--out", str(tmp / "samples"), "--frames", "4"] if row.kind == "music" else []  # MIDI files
    return ["generate", row.source, "--num-samples", "1", "--max-tokens", "5", "--seed", "0", "--json", *music]


def _score_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    return ["score", row.source, str(tmp / "two.txt")]


def _syneval_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    return ["syneval", row.source, "--max-tuples", "1", "--json"]


def _parse_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    return ["parse", row.source, "--text", SENTENCE, "--json"]


def _export_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    return ["export", row.source, "--out", str(tmp / "out"), "--splits", "--json"]  # --splits with none: no evaluation


def _publish_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    shutil.copytree(ROOT / "pretrained" / row.source, tmp / "export")  # publishing re-renders its card
    return ["publish", str(tmp / "export"), "--repo-id", f"kinds/{row.source}"]


def _download_argv(row: Row, tmp: Path, hub: FakeHub) -> list[str]:
    repo_id = f"shipped/{row.source}"
    if repo_id not in hub.repos:
        hub.add_repo(repo_id, {p.name: p.read_bytes() for p in (ROOT / "pretrained" / row.source).iterdir()})
    return ["download", repo_id, "--json"]


COMMAND_CELLS = {
    "evaluate": Cell(_evaluate_argv, _evaluated, lambda row: row.corpus),
    "generate": Cell(_generate_argv, _generated),
    "score": Cell(_score_argv, _scored),
    "syneval": Cell(_syneval_argv, _synevaluated, lambda row: "syneval"),
    "parse": Cell(_parse_argv, _parsed),
    "export": Cell(_export_argv, _exported),
    "publish": Cell(_publish_argv, _published),
    "download": Cell(_download_argv, _downloaded),
}
# Where a command runs the model: the CPU (a GPU machine would otherwise take it).
ON_CPU = {"generate", "score", "syneval", "parse", "export"}  # evaluate: in EVALUATE
# The other subcommands take no SOURCE: a listing, the drivers of many fits, and LightningCLI's, which take a recipe
# and a .ckpt of lm-zoo fit (--ckpt_path), never an export.
NO_SOURCE = {"models", "recipes", "tune", "search"}
CELLS = [(command, kind) for command in COMMAND_CELLS for kind in ROWS]


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        yield server


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus cache for the module: each corpus is encoded (the XML one generated) once."""
    return tmp_path_factory.mktemp("kinds-cache")


@pytest.fixture(autouse=True)
def environment(hub: FakeHub, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test Hub, a fresh Hugging Face cache, the module's corpus cache, and the two-line file to score."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "two.txt").write_text("\n".join(TWO_LINES) + "\n")


def _needs(folder: str | None) -> None:
    if folder is not None and not (DATA_ROOT / folder).exists():
        pytest.skip(f"no {DATA_ROOT / folder}: set LM_ZOO_DATA to the corpora's root")


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(code: int, err: str, *fragments: str) -> str:
    """The cell stopped with exit status 2 and one ``lm-zoo: error:`` line, nothing else on stderr, holding
    ``fragments``."""
    assert code == 2, err
    assert "Traceback" not in err and "usage:" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lm-zoo: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _refused(code: int, err: str, row: Row, *fragments: str) -> str:
    """:func:`_one_line`, naming the model's kind and ``fragments`` (what would serve)."""
    return _one_line(code, err, row.called, *fragments)


# ---------------------------------------------------------------------------------------------------- the matrix
def test_the_matrix_has_every_command_that_takes_a_model() -> None:
    lightning = {name for name, command in COMMANDS.items() if command.lightning}
    assert set(COMMANDS) == set(COMMAND_CELLS) | NO_SOURCE | lightning
    assert set(QUANTIZING) < set(COMMAND_CELLS)


@pytest.mark.parametrize(("command", "kind"), CELLS, ids=[f"{command}-{kind}" for command, kind in CELLS])
def test_a_command_serves_a_kind_or_says_in_one_line_what_would(
    command: str, kind: str, tmp_path: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    row, cell = ROWS[kind], COMMAND_CELLS[command]
    _needs(cell.data(row))
    device = ["--device", "cpu"] if command in ON_CPU else []
    code, out, err = _run(capsys, [*cell.argv(row, tmp_path, hub), *device, *row.flags])
    if (command, kind) in REFUSED:
        line = _refused(code, err, row, REFUSED[command, kind])
        assert row.flags or row.source in line  # the model by its name; an int8 one by its flag
    else:
        assert code == 0, err
        cell.check(out, row, tmp_path, hub)


def test_every_model_a_refusal_names_is_registered_and_served() -> None:
    """A refusal's "such as NAME" is a shipped model, and the matrix holds NAME serving that command."""
    lines = [(what, MUSIC.refusals[what]) for what in (SCORE, SYNEVAL, PARSE)]
    lines += [(what, WORDS_ONLY[what]) for what in (SYNEVAL, PARSE)] + [(PARSE, ON_LSTM)]
    names = registry.load_registry(registry.DEFAULT_PATH)
    for command, line in lines:
        for name in re.findall(r"such as ([\w-]+)", line):
            assert name in names, line
            served = [kind for kind, row in ROWS.items() if row.source == name and not row.flags]
            assert served and all((command, kind) not in REFUSED for kind in served), (command, name)


# ------------------------------------------------------------------------------------- evaluate's procedures, int8
PROCEDURES = {
    "temperature": ["--temperature", "1.2"],
    "long-context": ["--long-context"],
    "mc-dropout": ["--mc-samples", "2"],
    "dynamic": ["--dynamic", "--dyn-stat-batches", "1", "--dyn-stat-batch-size", "2", "--dyn-max-time-steps", "5"],
}
PROCEDURE_CELLS = [(procedure, kind) for procedure in PROCEDURES for kind in ROWS]


@pytest.mark.parametrize(
    ("procedure", "kind"), PROCEDURE_CELLS, ids=[f"{procedure}-{kind}" for procedure, kind in PROCEDURE_CELLS]
)
def test_evaluate_procedures_of_every_kind(procedure: str, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Text models are scored by every procedure (ptb-on-lstm's recipe draws its training windows' lengths, which
    --dynamic's gradient statistics on train read at one length); a music model as it is; int8 weights stay fixed."""
    row = ROWS[kind]
    _needs(row.corpus)
    window = [] if procedure == "dynamic" else ["--bptt", "10"]  # --dynamic's segment is --dyn-max-time-steps
    code, out, err = _run(capsys, ["evaluate", row.source, *EVALUATE, *window, *PROCEDURES[procedure], *row.flags])
    if kind == "music":
        _refused(code, err, row, "apply to text models; drop them")
    elif kind == "int8" and procedure in ("mc-dropout", "dynamic"):
        _refused(code, err, row, "--quantize int8 scores with fixed int8 weights", "drop one of them")
    else:
        assert code == 0, err
        result = json.loads(out)
        assert math.isfinite(result["ppl"]) and result["max_tokens"] == 20
        assert result["method"] == (procedure if procedure in ("mc-dropout", "dynamic") else "deterministic")


@pytest.mark.parametrize("kind", [kind for kind in ROWS if kind != "int8"])
def test_int8_of_every_kind(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--quantize int8 on each kind: a music model has no int8 copy, an ON-LSTM's cells none (its output layer
    alone can be: int8-head)."""
    row = ROWS[kind]
    _needs(row.corpus)
    code, out, err = _run(capsys, ["evaluate", row.source, *EVALUATE, "--bptt", "10", "--quantize", "int8"])
    if kind == "music":
        _refused(code, err, row, "nottingham-gru", "drop --quantize")
    elif kind == "on-lstm":
        _one_line(code, err, "this model has ONLSTMLayer: use --quantize int8-head")
    else:
        assert code == 0, err
        assert json.loads(out)["quantize"] == "int8"
