"""``lm-zoo score`` and ``score_sentences``: a sentence's log-probability is the softmax's, written out here one token
at a time; padding in a batch changes no score; a running document carries its state; n-best lists keep their
form."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import cli
from checkpoints.export_read import LoadedModel
from checkpoints.export_write import export_model
from datamodules.tokenizers import build_tokenizer
from evaluation.sentences import score_sentences
from tests.conftest import one_line_error
from zoo import RecurrentLM

TEXT = "the cat sat on the mat\nthe dog sat\na cat saw the dog on the mat\n"
SENTENCES = ["the cat sat", "a dog saw the cat on the mat", "the mat"]


@pytest.fixture(scope="module")
def lm() -> tuple[RecurrentLM, object]:
    tokenizer = build_tokenizer("word", TEXT)
    torch.manual_seed(0)
    model = RecurrentLM(tokenizer.vocab_size, "lstm", embedding_size=8, hidden_size=8, num_layers=2).eval()
    return model, tokenizer


@torch.no_grad()
def by_hand(model: RecurrentLM, ids: list[int], state=None) -> tuple[list[float], object]:
    """log p(ids[t] | ids[:t]) for t >= 1, one token per forward call, the softmax written out."""
    logprobs = []
    for previous, following in zip(ids, ids[1:]):
        logits, state = model(torch.tensor([[previous]]), state)  # (1, 1, V)
        row = logits[0, -1].double()
        logprobs.append(float(row[following] - torch.logsumexp(row, 0)))
    return logprobs, state


def test_a_sentence_scores_its_words_and_its_end_as_the_softmax_gives_them(lm) -> None:
    model, tokenizer = lm
    for score, text in zip(score_sentences(model, tokenizer, SENTENCES, per_token=True), SENTENCES, strict=True):
        ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
        expected, _ = by_hand(model, ids)
        assert score.token_logprobs == pytest.approx(expected, abs=1e-5)
        assert score.logprob == pytest.approx(sum(expected), abs=1e-5)
        assert score.log10prob == pytest.approx(score.logprob / math.log(10))
        assert score.tokens == len(text.split()) + 1 and score.oov == 0
    words_only = score_sentences(model, tokenizer, SENTENCES[:1], end=())[0]
    assert words_only.tokens == 3
    assert words_only.logprob == pytest.approx(
        sum(by_hand(model, [tokenizer.bos_id, *tokenizer.encode("the cat sat")])[0]), abs=1e-5
    )


def test_padding_in_a_batch_changes_no_score(lm) -> None:
    model, tokenizer = lm
    alone = score_sentences(model, tokenizer, ["the mat"], per_token=True)[0]
    longer = ["a dog saw the cat on the mat on the mat", "the cat sat on the mat", "the mat", "the dog"]
    batched = score_sentences(model, tokenizer, longer, batch_size=4, per_token=True)
    assert batched[2].text == "the mat"  # the order of the input
    assert batched[2].token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-6)
    one_by_one = score_sentences(model, tokenizer, longer, batch_size=1)
    assert [s.logprob for s in batched] == pytest.approx([s.logprob for s in one_by_one], abs=1e-5)


def test_a_document_reads_each_line_in_the_context_of_those_before(lm) -> None:
    model, tokenizer = lm
    scores = score_sentences(model, tokenizer, SENTENCES, document=True)
    stream = [tokenizer.bos_id]
    for text in SENTENCES:
        stream += [*tokenizer.encode(text), tokenizer.eos_id]
    expected, _ = by_hand(model, stream)  # the whole text as one stream
    bounds = [0]
    for text in SENTENCES:
        bounds.append(bounds[-1] + len(text.split()) + 1)
    for score, start, end in zip(scores, bounds, bounds[1:], strict=False):
        assert score.logprob == pytest.approx(sum(expected[start:end]), abs=1e-5)
    alone = score_sentences(model, tokenizer, SENTENCES)
    assert scores[0].logprob == pytest.approx(alone[0].logprob, abs=1e-6)  # nothing before the first line
    assert scores[1].logprob != pytest.approx(alone[1].logprob, abs=1e-6)  # the context changes the second


def test_unknown_words_are_counted_and_scored_as_unk(lm) -> None:
    model, tokenizer = lm
    score = score_sentences(model, tokenizer, ["the zebra sat quietly"])[0]
    assert score.oov == 2 and score.tokens == 5
    unk = score_sentences(model, tokenizer, ["the <unk> sat <unk>"])[0]
    assert score.logprob == pytest.approx(unk.logprob, abs=1e-6)


@pytest.fixture(scope="module")
def exported(lm, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tokenizer = lm
    out = tmp_path_factory.mktemp("score") / "export"
    export_model(LoadedModel(model, tokenizer, {"corpus": "somewhere"}), out, results=[])
    return out


def test_the_command_prints_one_json_line_per_sentence(lm, exported: Path, tmp_path: Path, capsys) -> None:
    model, tokenizer = lm
    file = tmp_path / "sentences.txt"
    file.write_text("\n".join(SENTENCES) + "\n")
    capsys.readouterr()
    assert cli.main(["score", str(exported), str(file), "--device", "cpu", "--per-token"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = score_sentences(model, tokenizer, SENTENCES, per_token=True)
    assert [p["text"] for p in printed] == SENTENCES
    assert [p["logprob"] for p in printed] == pytest.approx([s.logprob for s in expected], abs=1e-6)
    assert set(printed[0]) == {"text", "logprob", "log10prob", "tokens", "oov", "ppl", "token_logprobs"}
    assert printed[0]["ppl"] == pytest.approx(math.exp(-printed[0]["logprob"] / printed[0]["tokens"]))
    (tmp_path / "empty.txt").write_text("")
    assert cli.main(["score", str(exported), str(tmp_path / "empty.txt")]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # torch.ao's torchao notice
@pytest.mark.parametrize("mode", ["int8", "int8-head"])
def test_the_command_scores_with_a_quantized_copy(lm, exported: Path, tmp_path: Path, capsys, mode: str) -> None:
    """``--quantize``: each mode's scores are what the same quantized copy scores from Python, close to the float's."""
    from zoo.quantization import quantize_int8

    model, tokenizer = lm
    file = tmp_path / "sentences.txt"
    file.write_text("\n".join(SENTENCES) + "\n")
    capsys.readouterr()
    assert cli.main(["score", str(exported), str(file), "--device", "cpu", "--quantize", mode]) == 0
    printed = [json.loads(line)["logprob"] for line in capsys.readouterr().out.splitlines()]
    quantized = quantize_int8(model, recurrent=mode == "int8")
    assert printed == pytest.approx([s.logprob for s in score_sentences(quantized, tokenizer, SENTENCES)], abs=1e-5)
    floats = [s.logprob for s in score_sentences(model, tokenizer, SENTENCES)]
    assert printed != pytest.approx(floats, abs=1e-6) and printed == pytest.approx(floats, rel=0.05)


def test_an_nbest_list_comes_back_byte_for_byte_with_a_score_column(lm, exported: Path, tmp_path: Path, capsys) -> None:
    model, tokenizer = lm
    tabbed = tmp_path / "nbest.tsv"
    tabbed.write_bytes("utt1-1\tthe cat sat\nutt1-2\tthe  mat \r\nutt2-1\t\nutt3-1\tthe zebra\u2028sat\n".encode())
    kaldi = tmp_path / "nbest.txt"
    kaldi.write_text("utt1-1 the cat sat\nutt1-2  the mat\nutt2-1\n")
    scored = score_sentences(model, tokenizer, ["the cat sat", "the mat", "", "the zebra sat"])
    log10 = [s.log10prob for s in scored]
    capsys.readouterr()
    assert cli.main(["score", str(exported), str(tabbed), "--nbest"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[:-1] == [
        f"utt1-1\t{log10[0]:.6f}\tthe cat sat",
        f"utt1-2\t{log10[1]:.6f}\tthe  mat ",  # its spacing kept; scored as "the mat"
        f"utt2-1\t{log10[2]:.6f}\t",  # an empty hypothesis: p(<eos>) alone
        f"utt3-1\t{log10[3]:.6f}\tthe zebra\u2028sat",  # a line separator inside a line is no line end
    ]
    # Without the score column, the output is the input, line for line (a CRLF line end aside).
    assert ["\t".join(line.split("\t")[:1] + line.split("\t")[2:]) for line in out.split("\n")[:-1]] == [
        line.removesuffix("\r") for line in tabbed.read_bytes().decode().split("\n")[:-1]
    ]
    assert cli.main(["score", str(exported), str(kaldi), "--nbest"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"utt1-1 {log10[0]:.6f} the cat sat",
        f"utt1-2 {log10[1]:.6f}  the mat",
        f"utt2-1 {log10[2]:.6f}",
    ]


def test_the_nbest_column_in_each_toolkits_convention_with_the_unknown_words(
    lm, exported: Path, tmp_path: Path, capsys
) -> None:
    """``--scale``: log10 p (SRILM), ln p, and Kaldi's cost -ln p, the same score; ``--oov-column`` counts each
    hypothesis's words outside the vocabulary, which are scored as <unk>."""
    model, tokenizer = lm
    nbest = tmp_path / "nbest.txt"
    nbest.write_text("u-1 the cat sat\nu-2 the zebra sat quietly\n")
    scored = score_sentences(model, tokenizer, ["the cat sat", "the zebra sat quietly"])
    columns = {}
    for scale in ("log10", "ln", "kaldi-cost"):
        capsys.readouterr()
        assert cli.main(["score", str(exported), str(nbest), "--nbest", "--scale", scale, "--oov-column"]) == 0
        columns[scale] = [line.split(" ") for line in capsys.readouterr().out.splitlines()]
    assert [float(row[1]) for row in columns["ln"]] == pytest.approx([s.logprob for s in scored], abs=1e-6)
    assert [float(row[1]) for row in columns["kaldi-cost"]] == pytest.approx([-s.logprob for s in scored], abs=1e-6)
    assert [float(row[1]) for row in columns["log10"]] == pytest.approx(
        [s.logprob / math.log(10) for s in scored], abs=1e-6
    )
    assert [row[2] for row in columns["ln"]] == ["0", "2"]  # zebra, quietly
    assert [" ".join(row[3:]) for row in columns["ln"]] == ["the cat sat", "the zebra sat quietly"]
    one_line_error(capsys, cli.main(["score", str(exported), str(nbest), "--scale", "ln"]), "--nbest column")


def test_scores_come_out_of_a_pipe_as_each_batch_is_scored(exported: Path, tmp_path: Path) -> None:
    """The first batch's lines are printed while standard input is still open: ``score`` can sit in a pipe."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "cli", "score", str(exported), "-", "--nbest", "--batch-size", "2"]
    process = subprocess.Popen(
        [*command, "--device", "cpu"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    watchdog = threading.Timer(300, process.kill)  # a process that never answers fails the test, not the suite
    watchdog.start()
    try:
        process.stdin.write("a-1\tthe cat sat\na-2\tthe mat\n")  # type: ignore[union-attr]
        process.stdin.flush()  # type: ignore[union-attr]
        first = [process.stdout.readline(), process.stdout.readline()]  # type: ignore[union-attr]
        assert [line.split("\t")[0] for line in first] == ["a-1", "a-2"], first
        assert process.poll() is None  # still reading
        process.stdin.write("b-1\tthe dog\n")  # type: ignore[union-attr]
        rest, _ = process.communicate(timeout=300)
    finally:
        watchdog.cancel()
    assert process.returncode == 0 and rest.split("\t")[0] == "b-1"


def test_bad_input_is_one_line(exported: Path, tmp_path: Path, capsys) -> None:
    one_line_error(capsys, cli.main(["score", str(exported), str(tmp_path / "none.txt")]), "none.txt: no such file")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    one_line_error(capsys, cli.main(["score", str(exported), str(binary)]), "binary.txt line 1: not UTF-8 text")
    nbest = tmp_path / "nbest.txt"
    nbest.write_text("a-1\tthe cat\n\tthe mat\n")
    one_line_error(capsys, cli.main(["score", str(exported), str(nbest), "--nbest"]), "line 2: no hypothesis ID")
    one_line_error(capsys, cli.main(["score", str(exported), str(nbest), "--nbest", "--document"]), "drop --document")
    one_line_error(capsys, cli.main(["score", str(exported), str(nbest), "--batch-size", "0"]), "--batch-size")
