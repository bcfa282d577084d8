"""``lm-zoo score`` at the edges: every scoring mode against empty and degenerate input.

Each cell of the matrix (mode x input) is one test. Its expected output is computed independently of the scoring code:
the tiny fit's softmax written out one token at a time (``by_hand``), from the zero state for each line, or carried
from line to line with ``--document``. The definitions the cells hold are docs/evaluation.md's ("At the edges"): an
empty line (or a line of spaces) scores its end-of-sentence token alone, or 0 nats over 0 tokens with ``--no-end``;
an empty file prints nothing; unknown words are each read and scored as ``<unk>`` and counted; a line longer than the
model's window is read whole, its state never cut; a CRLF line end is a line end. An n-best line without an ID is one
error line naming the file and the line.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoints
import cli
from tests.conftest import one_line_error

#: The scoring modes: ``lm-zoo score`` flags. An ``--nbest`` mode reads each input as an n-best list, every line
#: given an ID (``u-N<TAB>line``), so that its hypotheses are the input's lines.
MODES: dict[str, list[str]] = {
    "plain": [],
    "per-token": ["--per-token"],
    "no-end": ["--no-end"],
    "document": ["--document"],
    "document-no-end": ["--document", "--no-end"],
    "nbest": ["--nbest"],
    "nbest-no-end": ["--nbest", "--no-end"],
    "scale-ln": ["--nbest", "--scale", "ln"],
    "scale-kaldi-cost": ["--nbest", "--scale", "kaldi-cost"],
    "scale-kaldi-cost-no-end": ["--nbest", "--scale", "kaldi-cost", "--no-end"],
    "oov-column": ["--nbest", "--oov-column"],
}

#: A line longer than the model's window, in windows (the window is the tiny fit's longer BPTT, training or eval).
LONG_WINDOWS = 4

#: The inputs, as the file's bytes; ``{long}`` becomes a line of ``LONG_WINDOWS`` windows of words and more. The empty
#: lines and the lines of spaces come first and last, so that ``--document`` meets one with nothing read before it.
INPUTS: dict[str, bytes] = {
    "empty-line": b"\nw1 w2\n\n",
    "empty-file": b"",
    "spaces": b"   \nw1 w2\n \t  \n",
    "unknown-words": b"zebra quietly yonder\n",
    "longer-than-window": b"{long}\n",
    "crlf": b"w1 w2\r\n\r\nw3 zebra\r\n",
}


@pytest.fixture(scope="module")
def tiny(tiny_run: Path) -> dict[str, Any]:
    """The tiny fit's checkpoint, its network and tokenizer (for the written-out softmax) and its window."""
    source = tiny_run / "run" / "checkpoints" / "best.ckpt"
    loaded = checkpoints.load(str(source))
    window = max(int(loaded.data["bptt"]), int(loaded.data["eval_bptt"]))
    return {"source": source, "model": loaded.model.eval(), "tokenizer": loaded.tokenizer, "window": window}


@torch.no_grad()
def by_hand(model: torch.nn.Module, ids: list[int], state: Any = None) -> tuple[list[float], Any]:
    """log p(ids[t] | ids[:t]) for t >= 1, one token per forward call, the softmax written out; with a single id
    nothing is read and the state comes back as it was."""
    logprobs = []
    for previous, following in zip(ids, ids[1:], strict=False):
        logits, state = model(torch.tensor([[previous]]), state)  # (1, 1, V)
        row = logits[0, -1].double()
        logprobs.append(float(row[following] - torch.logsumexp(row, 0)))
    return logprobs, state


def input_bytes(name: str, tiny: dict[str, Any]) -> bytes:
    """The input ``name``'s file, its long line built from the model's window."""
    words = " ".join(f"w{i % 40}" for i in range(LONG_WINDOWS * tiny["window"] + 3))
    return INPUTS[name].replace(b"{long}", words.encode())


def as_nbest(data: bytes) -> bytes:
    """``data`` as an n-best list: every line ``u-N<TAB>`` and the line, its line end (``\\n``, ``\\r\\n``) kept."""
    lines = data.split(b"\n")
    last = lines.pop()  # what follows the last line end: b"" when the file ends with one
    entries = [b"u-%d\t%s" % (n, line) for n, line in enumerate(lines, 1)]
    if last:
        return b"\n".join([*entries, b"u-%d\t%s" % (len(entries) + 1, last)])
    return b"".join(entry + b"\n" for entry in entries)


def expected_scores(tiny: dict[str, Any], lines: list[str], flags: list[str]) -> list[list[float]]:
    """Each line's token log-probabilities by :func:`by_hand`: its words (unknown ones as ``<unk>``) and, unless
    ``--no-end``, its end; from the zero state, or with ``--document`` from the state the line before left."""
    model, tokenizer = tiny["model"], tiny["tokenizer"]
    end = [] if "--no-end" in flags else [tokenizer.eos_id]
    scores, state, before = [], None, tokenizer.bos_id
    for line in lines:
        ids = [tokenizer.index.get(word, tokenizer.unk_id) for word in line.split()] + end
        if "--document" in flags:
            logprobs, state = by_hand(model, [before, *ids], state)
            before = ids[-1] if ids else before
        else:
            logprobs, _ = by_hand(model, [tokenizer.bos_id, *ids])
        scores.append(logprobs)
    return scores


@pytest.mark.parametrize("input_name", INPUTS)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_scores_every_edge_input(
    tiny: dict[str, Any], mode: str, input_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = MODES[mode]
    data = input_bytes(input_name, tiny)
    file = tmp_path / ("input.nbest" if "--nbest" in flags else "input.txt")
    file.write_bytes(as_nbest(data) if "--nbest" in flags else data)
    lines = [line.removesuffix("\r") for line in data.decode().split("\n")]
    lines = lines[:-1] if data.endswith(b"\n") or not data else lines
    expected = expected_scores(tiny, lines, flags)
    capsys.readouterr()

    code = cli.main(["score", str(tiny["source"]), str(file), "--device", "cpu", *flags])

    out, err = capsys.readouterr()
    assert code == 0, err
    printed = out.split("\n")[:-1] if out else []
    assert len(printed) == len(lines), out
    if input_name == "longer-than-window":
        assert len(expected[0]) > LONG_WINDOWS * tiny["window"]  # the line is read whole, through every window
    tokenizer = tiny["tokenizer"]
    for number, (line, logprobs, text) in enumerate(zip(lines, expected, printed, strict=True), 1):
        logprob, unknown = sum(logprobs), sum(word not in tokenizer.index for word in line.split())
        if input_name == "unknown-words":
            assert unknown == len(line.split())
        if "--nbest" not in flags:
            score = json.loads(text)
            assert score["text"] == line and score["tokens"] == len(logprobs) and score["oov"] == unknown
            assert score["logprob"] == pytest.approx(logprob, abs=1e-5)
            assert score["log10prob"] == pytest.approx(logprob / math.log(10), abs=1e-5)
            ppl = math.exp(-logprob / len(logprobs)) if logprobs else None
            assert score["ppl"] == (pytest.approx(ppl, rel=1e-5) if logprobs else None)
            if "--per-token" in flags:
                assert score["token_logprobs"] == pytest.approx(logprobs, abs=1e-5)
            continue
        scale = flags[flags.index("--scale") + 1] if "--scale" in flags else "log10"
        value = {"log10": logprob / math.log(10), "ln": logprob, "kaldi-cost": -logprob}[scale]
        key, column, *rest = text.split("\t")
        assert key == f"u-{number}"
        assert float(column) == pytest.approx(value, abs=1e-5)
        assert not column.startswith("-0.000000") or value < -5e-7  # no signed zero for a score of nothing
        if "--oov-column" in flags:
            assert rest.pop(0) == str(unknown)
        assert "\t".join(rest) == line  # the hypothesis printed back as it was read


@pytest.mark.parametrize("blank", ["empty-line", "spaces"])
@pytest.mark.parametrize("mode", [mode for mode, flags in MODES.items() if "--nbest" in flags])
def test_an_nbest_line_without_an_id_is_one_error_line_naming_it(
    tiny: dict[str, Any], mode: str, blank: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In an n-best list the ID is part of the line: a blank line has none, so it cannot be put back with a score in
    its place; an empty hypothesis is its ID alone (``u-2<TAB>``, or ``u-2``)."""
    file = tmp_path / "hyps.nbest"
    file.write_text("u-1\tw1 w2\n" + ("\n" if blank == "empty-line" else "   \n") + "u-2\tw3\n")
    capsys.readouterr()
    code = cli.main(["score", str(tiny["source"]), str(file), "--device", "cpu", *MODES[mode]])
    one_line_error(capsys, code, f"{file} line 2: no hypothesis ID", "an empty hypothesis is its ID alone")


def test_an_empty_line_with_no_end_leaves_a_document_as_it_was(
    tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--document --no-end``: an empty line reads nothing, so the lines after it score as if it were not there."""
    scores = {}
    for name, text in (("with", "w1 w2\n\n  \nw3 w4\n"), ("without", "w1 w2\nw3 w4\n")):
        (tmp_path / name).write_text(text)
        capsys.readouterr()
        assert cli.main(["score", str(tiny["source"]), str(tmp_path / name), "--document", "--no-end"]) == 0
        scores[name] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["tokens"] for s in scores["with"]] == [2, 0, 0, 2]
    assert scores["with"][3]["logprob"] == pytest.approx(scores["without"][1]["logprob"], abs=1e-6)


def test_a_bad_line_on_standard_input_is_named_so(
    tiny: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """FILE ``-``: the error line says standard input, not ``-``."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"u-1\tw1 w2\n\nu-2\tw3\n")))
    code = cli.main(["score", str(tiny["source"]), "-", "--nbest", "--device", "cpu"])
    one_line_error(capsys, code, "standard input line 2: no hypothesis ID")
