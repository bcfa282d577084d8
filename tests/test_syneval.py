"""Targeted syntactic evaluation (evaluation.syneval; Marvin & Linzen 2018): the loader takes only
the published
templates, a model that prefers the grammatical sentences scores 1.0, the counts equal the templates', and the
sentence log-probabilities equal a sum written out token by token."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tarfile

import pytest
import torch

from datamodules.tokenizers import WordTokenizer
from evaluation import syneval
from tests.conftest import DATA_ROOT, needs_data
from zoo import RecurrentLM
from zoo.errors import DataError

SYNEVAL = DATA_ROOT / "syneval"
needs_templates = needs_data("syneval", "templates.tar.xz")

CONDITIONS = {
    "simple_agrmt": [("the author laughs", "the author laugh"), ("the authors laugh", "the authors laughs")],
    "simple_npi": [("no authors have ever been popular", "the authors have ever been popular",
                    "most authors have ever been popular")],
}  # fmt: skip


class Prefers(torch.nn.Module):
    """A stand-in language model that gives every token of the sentences in ``liked`` a higher log-probability:
    what a model that has learnt agreement would do. Syneval scores through ``RecurrentLM.score``, which this class
    borrows over its own ``token_nll``."""

    score = RecurrentLM.score

    def __init__(self, tokenizer: WordTokenizer, liked: set[str]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.liked = {tuple([tokenizer.bos_id, *tokenizer.encode(s)]) for s in liked}

    def token_nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        nll = torch.full(inputs.shape, 2.0)
        for b, row in enumerate(inputs.tolist()):
            if any(tuple(row[: len(s)]) == s for s in self.liked):
                nll[b] = 1.0
        return nll.masked_fill(targets == -100, 0.0), None


def tokenizer_for(conditions: dict) -> WordTokenizer:
    return WordTokenizer.build("\n".join(s for cases in conditions.values() for case in cases for s in case))


def test_a_model_that_prefers_the_grammatical_sentences_scores_one_and_the_reverse_zero():
    tokenizer = tokenizer_for(CONDITIONS)
    grammatical = {case[0] for cases in CONDITIONS.values() for case in cases}
    result = syneval.evaluate_syneval(Prefers(tokenizer, grammatical), tokenizer, CONDITIONS)
    assert result["accuracy"] == 1.0
    assert result["conditions"]["simple_agrmt"]["tuples"] == 2
    npi = result["conditions"]["simple_npi"]["comparisons"]
    assert npi["grammatical > intrusive"]["accuracy"] == npi["grammatical > ungrammatical"]["accuracy"] == 1.0
    assert npi["intrusive > ungrammatical"]["accuracy"] == 0.0  # equal scores: not strictly more probable
    ungrammatical = {case[-1] for cases in CONDITIONS.values() for case in cases}
    reverse = syneval.evaluate_syneval(Prefers(tokenizer, ungrammatical), tokenizer, CONDITIONS)
    assert reverse["conditions"]["simple_agrmt"]["accuracy"] == 0.0
    assert reverse["conditions"]["simple_npi"]["comparisons"]["intrusive > ungrammatical"]["accuracy"] == 0.0


def test_unknown_words_are_counted_and_the_known_only_accuracy_leaves_them_out():
    tokenizer = WordTokenizer.build("the author authors laughs laugh")  # no NPI words, no "no"
    grammatical = {case[0] for cases in CONDITIONS.values() for case in cases}
    result = syneval.evaluate_syneval(Prefers(tokenizer, grammatical), tokenizer, CONDITIONS)
    assert result["conditions"]["simple_agrmt"]["tuples_with_unknown_words"] == 0
    assert result["conditions"]["simple_npi"]["tuples_with_unknown_words"] == 1
    comparison = result["conditions"]["simple_npi"]["comparisons"]["grammatical > ungrammatical"]
    assert comparison["accuracy_without_unknown_words"] is None and comparison["pairs"] == 1


def test_a_pair_that_reads_the_same_after_unknown_words_is_a_tie_whatever_the_batching():
    """Pairs such as "the author zorps" / "the author zorp" read alike when the model knows neither verb form: the
    grammatical one is not more probable, at any batch size (scored once, not twice with float rounding between)."""
    tokenizer = WordTokenizer.build("the author authors laughs laugh\nthe cat sat on the mat")
    torch.manual_seed(0)
    model = RecurrentLM(tokenizer.vocab_size, "lstm", 8, 8, 1).eval()
    alike = {"agreement": [("the author zorps", "the author zorp")] * 3 + [("the author laughs", "the author laugh")]}
    assert tokenizer.encode("the author zorps") == tokenizer.encode("the author zorp")
    for batch_size in (1, 2, 7):
        result = syneval.evaluate_syneval(model, tokenizer, alike, batch_size=batch_size)
        comparison = result["conditions"]["agreement"]["comparisons"]["grammatical > ungrammatical"]
        known_right = comparison["accuracy_without_unknown_words"]  # the one pair without unknown words
        assert comparison["accuracy"] == known_right / 4  # the three alike pairs count as not more probable
        assert result["sentences_scored"] == 3 and result["sentences"] == 4


def test_sentence_log_probability_is_the_sum_written_out():
    tokenizer = tokenizer_for(CONDITIONS)
    torch.manual_seed(0)
    model = RecurrentLM(tokenizer.vocab_size, "lstm", 8, 8, 1).eval()
    sentences = ["the author laughs", "no authors have ever been popular"]
    batched = syneval.sentence_log_probs(model, tokenizer, sentences, batch_size=2)
    for sentence, score in zip(sentences, batched):
        ids = [tokenizer.eos_id, *tokenizer.encode(sentence), tokenizer.eos_id]  # no "." in this vocabulary
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids[:-1]]))
        log_probs = torch.log_softmax(logits[0].double(), -1)
        assert score == pytest.approx(sum(log_probs[t, ids[t + 1]].item() for t in range(len(ids) - 1)), abs=1e-5)


def test_anim_and_inanim_files_are_one_condition():
    assert syneval.condition_of("npi_across_anim") == syneval.condition_of("npi_across_inanim") == "npi_across"
    assert syneval.condition_of("simple_agrmt") == "simple_agrmt"


@needs_templates
@pytest.mark.parametrize(
    ("archive", "tuples"), [("templates.tar.xz", 158_084), ("emnlp2018_templates.tar.xz", 163_124)]
)
def test_the_published_archives_load_with_the_counts_manifest_md_gives(archive, tuples):
    conditions = syneval.read_templates(SYNEVAL / archive)
    assert sum(len(cases) for cases in conditions.values()) == tuples
    assert set(conditions) == set(syneval.CONDITIONS)  # 22 files joined into the 15 conditions
    assert conditions["simple_agrmt"][0] == ("the author laughs", "the author laugh")


@needs_templates
def test_the_original_pickles_in_a_directory_load_and_others_are_refused(tmp_path):
    with tarfile.open(SYNEVAL / "templates.tar.xz") as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("simple_agrmt.pickle"))
        (tmp_path / "simple_agrmt.pickle").write_bytes(archive.extractfile(member).read())
    assert len(syneval.read_templates(tmp_path)["simple_agrmt"]) == 140
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps({"case": [("a", "b")]}))
    with pytest.raises(DataError, match="evil.pickle is not one of Marvin & Linzen's template files"):
        syneval.read_templates(tmp_path)


def test_an_unknown_archive_is_refused_before_anything_is_unpickled(tmp_path):
    archive = tmp_path / "templates.tar.xz"
    payload = tmp_path / "simple_agrmt.pickle"
    payload.write_bytes(pickle.dumps({"case": [("a", "b")]}))
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(payload, arcname="templates/simple_agrmt.pickle")
    with pytest.raises(DataError, match="not one of the template archives lm-zoo knows"):
        syneval.read_templates(archive)


def test_the_unpickler_refuses_any_global():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    with pytest.raises(DataError, match="names posix.system|names os.system"):
        syneval._plain_load(pickle.dumps({"case": [Evil()]}), "evil")


def _exported_word_model(directory):
    """A tiny word model over CONDITIONS' words, exported into ``directory``."""
    from checkpoints import LoadedModel
    from checkpoints.export_write import export_model

    tokenizer = tokenizer_for(CONDITIONS)
    model = RecurrentLM(tokenizer.vocab_size, "lstm", 8, 8, 1).eval()
    return export_model(LoadedModel(model, tokenizer, {"corpus": "somewhere"}), directory, results=[])


SYNEVAL_CLI = [sys.executable, "-m", "cli", "syneval"]


@pytest.mark.slow
def test_cli_refuses_a_file_that_is_not_a_template(tmp_path):
    exported = _exported_word_model(tmp_path / "word")
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "x.pickle").write_bytes(b"")
    args = [*SYNEVAL_CLI, str(exported), "--templates", str(templates)]
    refused = subprocess.run(args, capture_output=True, text=True)
    assert refused.returncode == 2 and "x.pickle is not one of Marvin & Linzen's template files" in refused.stderr


@pytest.mark.slow
@needs_templates
def test_cli_scores_a_word_model_and_refuses_a_character_model(tmp_path):
    from checkpoints import LoadedModel
    from checkpoints.export_write import export_model
    from datamodules.tokenizers import CharTokenizer

    exported = _exported_word_model(tmp_path / "word")
    archive = str(SYNEVAL / "templates.tar.xz")
    done = subprocess.run(
        [*SYNEVAL_CLI, str(exported), "--templates", archive, "--max-tuples", "3", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout)
    assert all(c["tuples"] == 3 for c in result["conditions"].values()) and len(result["conditions"]) == 15
    chars = CharTokenizer.build("the author laughs")
    char_model = RecurrentLM(chars.vocab_size, "lstm", 8, 8, 1).eval()
    char_dir = export_model(LoadedModel(char_model, chars, {"corpus": "somewhere"}), tmp_path / "char", results=[])
    refused = subprocess.run([*SYNEVAL_CLI, str(char_dir), "--templates", archive], capture_output=True, text=True)
    assert refused.returncode == 2 and "reads char tokens: give a word-level model" in refused.stderr
