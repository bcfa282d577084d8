"""Google Billion Word: MultiSequence batches, the vocabulary, the real sample, error lines, resets in every cell of the
zoo, sentence sampling and checkpoints of GBW models."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import cli
import zoo
from datamodules import GBWDataModule, MultiSequenceWindows
from datamodules.gbw import (
    DEFAULT_FILES,
    HELDOUT_DIR,
    TRAIN_DIR,
    count_words,
    encode_files,
    load_encoded,
    match_files,
)
from datamodules.multisequence import epoch_layout
from datamodules.tokenizers import SentenceTokenizer, build_tokenizer
from datamodules.windows import IGNORE_INDEX
from lightning_modules import LanguageModel
from tests.conftest import DATA_ROOT, needs_data, one_line_error

SAMPLE = DATA_ROOT / "gbw-sample"
PAD = -1  # a padding input no sentence holds, so padding is told apart from a real </S>
FIRST_ID = 10


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))


def write_gbw_corpus(root: Path, seed: int = 0, sentences: int = 80, word_types: int = 40) -> Path:
    """A tiny corpus in the benchmark's layout: two training shards and held-out shards 0 and 1, Zipf-like words."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(word_types)]

    def shard(path: Path, lines: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(
            " ".join(rng.choices([f"w{k}" for k in range(word_types)], weights, k=rng.randint(1, 12))) + " .\n"
            for _ in range(lines)
        )
        path.write_text(text)

    for n in (1, 2):
        shard(root / TRAIN_DIR / f"news.en-{n:05d}-of-00100", sentences)
    for n in (0, 1):
        shard(root / HELDOUT_DIR / f"news.en.heldout-{n:05d}-of-00050", sentences // 4)
    return root


# ------------------------------------------------------------------------------------------ MultiSequence batches
def synthetic_sentences(seed: int = 0, count: int = 23) -> tuple[np.ndarray, np.ndarray]:
    """Sentences of 2..9 ids whose ids are all different (each id is its own position + FIRST_ID)."""
    lengths = np.random.default_rng(seed).integers(2, 10, size=count)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.arange(offsets[-1], dtype=np.int32) + FIRST_ID, offsets


def read_columns(windows: list, ids: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    """Check one epoch of one rank's windows column by column; return the sentences of each column, in order.

    Checks: padding only at a column's end (input PAD, target -100, no reset); the rest splits at the resets into
    whole sentences; every target is the next input of the same sentence, and the last one of a sentence is -100.
    """
    starts = {int(ids[o]): i for i, o in enumerate(offsets[:-1])}
    inputs = torch.cat([w.inputs for w in windows], dim=1)  # (B, total steps)
    targets = torch.cat([w.targets for w in windows], dim=1)
    reset = torch.cat([w.reset for w in windows], dim=1)
    columns = []
    for row in range(inputs.size(0)):
        x, y, r = inputs[row].tolist(), targets[row].tolist(), reset[row].tolist()
        real = x.index(PAD) if PAD in x else len(x)
        if real < len(x):
            assert set(x[real:]) == {PAD}, "padding only at the end of a column"
            assert set(y[real:]) == {IGNORE_INDEX} and not any(r[real:])
        sentences: list[int] = []
        for t in range(real):
            if r[t]:
                assert x[t] in starts, f"reset at step {t} where no sentence starts"
                sentences.append(starts[x[t]])
                position = offsets[sentences[-1]]
            else:
                assert t > 0 and sentences, "a column starts with a reset"
            assert x[t] == ids[position], "inputs are the sentence's ids in order"
            last = position + 1 == offsets[sentences[-1] + 1]
            assert y[t] == (IGNORE_INDEX if last else ids[position + 1]), "no target crosses into another sentence"
            position += 1
            if last and t + 1 < real:
                assert r[t + 1], "the next sentence starts with a reset"
        if sentences:
            assert position == offsets[sentences[-1] + 1], "a column never ends inside a sentence"
        columns.append(sentences)
    return columns


def epoch_of(stream: MultiSequenceWindows) -> list:
    return list(stream)


@pytest.mark.parametrize(("batch_size", "world_size", "bptt"), [(2, 1, 5), (2, 3, 4), (4, 2, 3), (3, 3, 50)])
def test_every_sentence_once_per_epoch_whole_and_reset(batch_size: int, world_size: int, bptt: int) -> None:
    ids, offsets = synthetic_sentences()  # (3, 3): more columns than sentences fit into some of them
    for epoch in (0, 1):
        seen: list[int] = []
        window_counts = set()
        for rank in range(world_size):
            stream = MultiSequenceWindows(
                ids, offsets, batch_size, bptt, PAD, shuffle=True, seed=5, rank=rank, world_size=world_size
            )
            stream.epoch = epoch
            windows = epoch_of(stream)
            columns = read_columns(windows, ids, offsets)
            seen += [s for column in columns for s in column]
            window_counts.add(len(windows))
            assert all(w.inputs.shape == (batch_size, w.inputs.size(1)) for w in windows)
        assert sorted(seen) == list(range(len(offsets) - 1)), "each sentence exactly once, ranks disjoint"
        assert len(window_counts) == 1, "every rank runs the same number of windows (DDP lockstep)"


def test_the_order_is_shuffled_per_epoch_reproducibly_and_evaluation_keeps_the_file_order() -> None:
    ids, offsets = synthetic_sentences(count=40)

    def order(epoch: int, shuffle: bool = True, seed: int = 1) -> list[int]:
        stream = MultiSequenceWindows(ids, offsets, 3, 4, PAD, shuffle=shuffle, seed=seed, epoch=lambda: epoch)
        columns = read_columns(epoch_of(stream), ids, offsets)
        return [s for column in columns for s in column]

    assert order(0) == order(0), "the same (seed, epoch), the same order"
    assert order(0) != order(1) and order(1) != order(2), "a new order every epoch"
    assert order(0, seed=2) != order(0)
    counting = MultiSequenceWindows(ids, offsets, 3, 4, PAD, shuffle=True, seed=1)  # no trainer: counts its epochs
    assert [read_columns(epoch_of(counting), ids, offsets) for _ in range(3)][2] == read_columns(
        epoch_of(MultiSequenceWindows(ids, offsets, 3, 4, PAD, shuffle=True, seed=1, epoch=lambda: 2)), ids, offsets
    ), "epoch 2 is the same whether counted or told by the trainer (a resumed run)"
    assert order(0, shuffle=False) == order(7, shuffle=False) == list(range(40)), "evaluation: the corpus order"


def test_columns_are_balanced_to_within_one_sentence() -> None:
    lengths = np.random.default_rng(0).integers(2, 60, size=5000)
    order = np.random.default_rng(1).permutation(5000)
    layout = epoch_layout(lengths, 64, order)
    assert layout.column_length.sum() == lengths.sum()
    assert np.all(layout.column_length <= lengths.sum() / 64 + lengths.max())
    assert np.all(layout.column_length >= lengths.sum() / 64 - lengths.max())


def test_a_resumed_run_continues_the_epoch_where_training_stopped() -> None:
    """The training streams' resuming protocol (datamodules/windows.py): {"epoch": e, "windows": n}."""
    ids, offsets = synthetic_sentences(count=60)

    def stream(epoch=None) -> MultiSequenceWindows:
        return MultiSequenceWindows(ids, offsets, 2, 3, PAD, shuffle=True, seed=4, epoch=epoch)

    uninterrupted = stream()
    epochs = [epoch_of(uninterrupted) for _ in range(3)]
    resumed = stream()
    resumed.load_state_dict({"epoch": 1, "windows": 7})
    rest = epoch_of(resumed)
    assert len(rest) == len(epochs[1]) - 7
    assert all(torch.equal(a.inputs, b.inputs) and torch.equal(a.reset, b.reset) for a, b in zip(rest, epochs[1][7:]))
    assert resumed.state_dict() == {"epoch": 1, "windows": len(epochs[1])}
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(epoch_of(resumed), epochs[2], strict=True))
    ended = stream()
    ended.load_state_dict({"epoch": 0, "windows": len(epochs[0])})
    assert ended.state_dict() == {"epoch": 1, "windows": 0}
    # With the trainer's epoch: the resumed position holds until the trainer is past it (Lightning may start and drop
    # an iterator before restoring its counters).
    trainer_epoch = [0]
    told = stream(lambda: trainer_epoch[0])
    told.load_state_dict({"epoch": 1, "windows": 5})
    assert torch.equal(next(iter(told)).inputs, epochs[1][5].inputs)
    trainer_epoch[0] = 1
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(told, epochs[1][5:], strict=True))
    trainer_epoch[0] = 2
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(told, epochs[2], strict=True))


# ----------------------------------------------------------------------------------------------------- vocabulary
def test_vocabulary_cutoff_counts_and_encoding(tmp_path: Path) -> None:
    root = tmp_path / "gbw"
    (root / TRAIN_DIR).mkdir(parents=True)
    (root / HELDOUT_DIR).mkdir(parents=True)
    (root / TRAIN_DIR / "news.en-00001-of-00100").write_text("the cat sat .\nthe dog sat .\n\n")
    (root / TRAIN_DIR / "news.en-00002-of-00100").write_text("a cat\u00a0x ran .\nthe end .")  # no final newline
    (root / HELDOUT_DIR / "news.en.heldout-00000-of-00050").write_text("the cat .\n")
    (root / HELDOUT_DIR / "news.en.heldout-00001-of-00050").write_text("sat sat\n")
    data = GBWDataModule(str(root), min_count=2)
    tok = data.tokenizer
    # Kept: count >= 2, most frequent first. "cat\u00a0x" is one word: only ASCII white space separates words.
    assert tok.symbols == ["<S>", "</S>", "<UNK>", ".", "the", "sat"]
    # <S> and </S> once per sentence (the blank line is none), <UNK> the sum of the words below the cutoff.
    assert tok.counts == [4, 4, 6, 4, 3, 2]
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2)
    train = data.encoded("train")
    assert train.offsets.tolist() == [0, 6, 12, 18, 23]
    assert train.ids[:12].tolist() == [0, 4, 2, 5, 3, 1, 0, 4, 2, 5, 3, 1]  # <S> the <UNK> sat . </S> ...
    assert train.units.tokens == 15 + 4  # words + one </S> per sentence: what perplexity is taken over
    assert data.units("test").tokens == 3 + 1
    ties = GBWDataModule(str(root), min_count=1).tokenizer.symbols
    assert ties[6:] == ["a", "cat", "cat\u00a0x", "dog", "end", "ran"]  # equal counts: by symbol
    again = GBWDataModule(str(root), min_count=2)
    assert again.tokenizer.state_dict() == tok.state_dict()  # from the cache
    assert again.encoded("train").ids.tolist() == train.ids.tolist()


def test_worker_processes_count_and_encode_the_same(tmp_path: Path) -> None:
    files = match_files(write_gbw_corpus(tmp_path / "gbw", sentences=300), DEFAULT_FILES["train"], "train")
    assert count_words(files, workers=2) == count_words(files, workers=1)
    tokenizer = SentenceTokenizer.from_counts(*count_words(files, workers=1), min_count=2)
    for workers in (1, 2):
        (tmp_path / str(workers)).mkdir()
        encode_files(files, tokenizer, tmp_path / str(workers), workers=workers)
    one, two = load_encoded(tmp_path / "1"), load_encoded(tmp_path / "2")
    assert one is not None and two is not None and one.units == two.units
    assert np.array_equal(one.ids, two.ids) and np.array_equal(one.offsets, two.offsets)
    assert sorted(p.name for p in (tmp_path / "2").iterdir()) == ["ids.bin", "meta.json", "offsets.bin"]


def test_the_sentence_tokenizer_wraps_and_unwraps_sentences() -> None:
    tok = build_tokenizer("sentence", "a b\nb c\n")
    assert isinstance(tok, SentenceTokenizer) and tok.kind == "sentence"
    ids = tok.encode_text("a b\n\nb zz\n")
    assert ids.tolist() == [tok.bos_id, tok.index["a"], tok.index["b"], tok.eos_id] + [
        tok.bos_id,
        tok.index["b"],
        tok.unk_id,
        tok.eos_id,
    ]
    assert tok.decode(ids) == "a b\nb <UNK>\n"
    assert tok.encode_block(b"a b\n\nb zz\n")[0].tolist() == ids.tolist()
    assert build_tokenizer("word", "a b\n").bos_id == build_tokenizer("word", "a b\n").eos_id  # others start at <eos>
    assert tok.sentences and not build_tokenizer("word", "a b\n").sentences  # what sampling and scoring ask


# ---------------------------------------------------------------------------------------------- the real sample
@needs_data("gbw-sample")
def test_the_real_sample_loads_with_the_manifest_counts() -> None:
    shards = {10: (6_111, 155_717), 11: (6_105, 154_773), 12: (5_986, 150_767), 13: (6_119, 155_414)}  # MANIFEST
    data = GBWDataModule(
        str(SAMPLE),
        train_files="news.en.heldout-000??-of-00050",
        valid_files="news.en.heldout-00012-of-00050",
        test_files="news.en.heldout-00013-of-00050",
    )
    train = data.encoded("train")
    assert [p.name[-14:-9] for p in data.files("train")] == ["00010", "00011", "00012", "00013"]
    assert train.num_sentences == 24_321 == sum(s for s, _ in shards.values())
    assert train.units.tokens == 616_671 + 24_321  # every word and every </S>
    assert len(train.ids) == 616_671 + 2 * 24_321
    assert data.encoded("valid").num_sentences == shards[12][0] and data.units("test").tokens == sum(shards[13])
    # The sample configs' vocabulary (shards 10-11, cutoff 3), against a plain count of the files.
    small = GBWDataModule(str(SAMPLE), train_files="news.en.heldout-0001[0-1]-of-00050")
    counts = Counter(w for n in (10, 11) for w in (SAMPLE / f"news.en.heldout-000{n}-of-00050").read_text().split())
    assert small.vocab_size == 3 + sum(1 for n in counts.values() if n >= 3)
    assert small.tokenizer.counts[2] == sum(n for n in counts.values() if n < 3)


# ------------------------------------------------------------------------------------------------------ errors
FIT = """
trainer: {{max_steps: {steps}, enable_progress_bar: false, enable_model_summary: false, default_root_dir: {root},
  logger: false, limit_val_batches: 2}}
model:
  class_path: lightning_modules.LanguageModel
  init_args: {{architecture: lstm, embedding_size: 8, hidden_size: 8, num_layers: 1, init_range: 0.1}}
data:
  class_path: datamodules.GBWDataModule
  init_args: {{corpus: {corpus}, min_count: 2, batch_size: 4, bptt: 6, eval_batch_size: 3}}
checkpoint: {{dirpath: {root}/checkpoints}}
optimizer: {{class_path: torch.optim.SGD, init_args: {{lr: 1.0}}}}
"""


def fit_config(tmp_path: Path, corpus: Path, steps: int = 10) -> Path:
    config = tmp_path / "fit.yaml"
    config.write_text(FIT.format(steps=steps, root=tmp_path / "run", corpus=corpus))
    return config


def test_a_missing_corpus_says_what_to_put_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["fit", "--config", str(fit_config(tmp_path, tmp_path / "nowhere"))])
    one_line_error(capsys, code, "no GBW train file matches", TRAIN_DIR, str(tmp_path / "nowhere"), "statmt.org")


@pytest.mark.parametrize(("content", "fragment"), [(b"", "is empty"), (b"the caf\xe9 .\n", "not valid UTF-8")])
def test_an_empty_or_non_utf8_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, fragment: str
) -> None:
    corpus = write_gbw_corpus(tmp_path / "gbw")
    bad = corpus / TRAIN_DIR / "news.en-00002-of-00100"
    bad.write_bytes(content)
    one_line_error(capsys, cli.main(["fit", "--config", str(fit_config(tmp_path, corpus))]), str(bad), fragment)


# --------------------------------------------------------------------------------- resets in every architecture
@pytest.mark.parametrize("name", zoo.names())
def test_a_sentence_scores_the_same_after_another_sentence_or_alone(name: str) -> None:
    """Léonard 2016: the state is zeroed where a sentence starts, so s2's log-probabilities cannot depend on s1."""
    torch.manual_seed(0)
    preset = dict(zoo.preset(name, "tiny"))
    sizes = {k: preset.pop(k) for k in ("input_size", "hidden_size", "num_layers")}
    model = LanguageModel(
        vocab_size=30,
        architecture=name,
        embedding_size=sizes["input_size"],
        hidden_size=sizes["hidden_size"],
        num_layers=sizes["num_layers"],
        cell_options=preset,
    )
    model = model.double().eval()
    s1 = [0, 5, 9, 3, 12, 7, 7, 21, 4, 1]  # <S> ... </S>
    s2 = [0, 8, 3, 17, 1]

    def nll(sentences: list[list[int]], with_resets: bool = True) -> torch.Tensor:
        ids = np.array([i for s in sentences for i in s], dtype=np.int32)
        offsets = np.cumsum([0] + [len(s) for s in sentences])
        state, scores = None, []
        for window in MultiSequenceWindows(ids, offsets, batch_size=1, bptt=4, pad_id=1):  # s2 starts mid-window
            reset = window.reset if with_resets else None
            window_nll, state = model.token_nll(window.inputs, window.targets, state, reset)  # carried, as evaluate
            scores.append(window_nll[0])
        return torch.cat(scores)

    alone = nll([s2])[: len(s2)]
    after = nll([s1, s2])[len(s1) : len(s1) + len(s2)]
    assert alone[:-1].gt(0).all() and alone[-1] == 0  # </S> predicts nothing
    assert torch.allclose(after, alone, rtol=0, atol=1e-6), (after - alone).abs().max()
    leaked = nll([s1, s2], with_resets=False)[len(s1) : len(s1) + len(s2)]
    assert (leaked - alone).abs().max() > 1e-4, "without the reset s1's state reaches s2 (the test can fail)"


# ------------------------------------------------------------------------------- a GBW model: fit, load, sample
@pytest.fixture
def gbw_run(tmp_path: Path) -> Path:
    corpus = write_gbw_corpus(tmp_path / "gbw")
    assert cli.main(["fit", "--config", str(fit_config(tmp_path, corpus, steps=30))]) == 0
    return tmp_path / "run" / "checkpoints" / "last.ckpt"


def test_a_gbw_checkpoint_rebuilds_its_data_module_and_samples_sentences(
    gbw_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import checkpoints

    loaded = checkpoints.load(str(gbw_run))
    data = loaded.datamodule()
    assert isinstance(data, GBWDataModule) and data.tokenizer.state_dict() == loaded.tokenizer.state_dict()
    capsys.readouterr()
    assert cli.main(["evaluate", str(gbw_run), "--split", "valid", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == data.units("valid").tokens and result["tokenizer"] == "sentence"

    # Sampling: every row starts from <S>, stops at </S>, one sentence per line; 0.7 is the default temperature.
    assert (
        cli.main(["generate", str(gbw_run), "--num-samples", "6", "--seed", "3", "--max-tokens", "40", "--json"]) == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["temperature"] == 0.7 and len(printed["samples"]) == 6
    tokenizer, model = loaded.tokenizer, loaded.model
    start = torch.full((6, 1), tokenizer.bos_id)
    rows = model.generate(start, 40, 0.7, stop_id=tokenizer.eos_id, generator=torch.Generator().manual_seed(3))
    assert printed["samples"] == [tokenizer.decode(ids).rstrip("\n") for ids in rows]  # the same draws from <S>
    assert all(ids[-1] == tokenizer.eos_id or len(ids) == 40 for ids in rows)
    assert sum(ids[-1] == tokenizer.eos_id for ids in rows) >= 3, "a trained model ends most sentences"
    assert all(tokenizer.eos_id not in ids[:-1] for ids in rows), "a row stops at its </S>"
    assert not any("<S>" in s or "</S>" in s or "\n" in s for s in printed["samples"])
    assert cli.main(["generate", str(gbw_run), "--num-samples", "3", "--seed", "3", "--prompt", "w0 w1"]) == 0
    lines = capsys.readouterr().out.strip("\n").split("\n")
    assert len(lines) == 3 and all(line.startswith("w0 w1") for line in lines)
    assert cli.main(["generate", str(gbw_run), "--num-samples", "1", "--temperature", "1.3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["temperature"] == 1.3

    # An export keeps the data module's class, so it evaluates on its corpus like the checkpoint.
    out = tmp_path / "export"
    assert cli.main(["export", str(gbw_run), "--out", str(out), "--splits", "valid", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)["results"][0]
    assert exported["ppl"] == pytest.approx(result["ppl"], rel=1e-9)
    assert isinstance(checkpoints.load(str(out)).datamodule(), GBWDataModule)


def test_word_models_keep_temperature_1_and_start_at_eos(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from checkpoints.export_read import LoadedModel
    from checkpoints.export_write import export_model

    tokenizer = build_tokenizer("word", "a b c\nb c\n")
    model = LanguageModel(vocab_size=tokenizer.vocab_size, embedding_size=4, hidden_size=4, num_layers=1).eval()
    export_model(LoadedModel(model.model, tokenizer, {"corpus": "somewhere"}), tmp_path / "word", results=[])
    assert cli.main(["generate", str(tmp_path / "word"), "--num-samples", "2", "--seed", "0", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["temperature"] == 1.0
    start = torch.full((2, 1), tokenizer.eos_id)
    rows = model.generate(start, 100, 1.0, stop_id=tokenizer.eos_id, generator=torch.Generator().manual_seed(0))
    assert printed["samples"] == [tokenizer.decode(ids).rstrip("\n") for ids in rows]
