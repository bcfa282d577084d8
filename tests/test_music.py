"""Polyphonic music: the piano-roll data module, the Bernoulli output, training, and MIDI / PNG output."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import zoo
from datamodules.midi import note_name, roll_layout, write_midi, write_png
from datamodules.music import MusicDataModule
from datamodules.piano_rolls import MUSIC_DATASETS, PianoRolls, read_pieces
from lightning_modules.music import MusicModel
from tests.conftest import DATA_ROOT, needs_data, quiet_trainer, roll_from_midi
from zoo.errors import ConfigError, DataError
from zoo.music import NUM_NOTES, PianoRollLM, bernoulli_nll

needs_music = needs_data("music", "JSB_Chorales.mat")


# ------------------------------------------------------------------------------------------------------- the data
@needs_music
@pytest.mark.parametrize("name", list(MUSIC_DATASETS))
def test_pieces_and_frames_per_split_are_manifest_mds(name):
    # MANIFEST.md: JSB 229/76/77 pieces, 13,807/4,602/4,725 frames; Nottingham 694/173/170, 176,561/45,513/44,463; ...
    spec = MUSIC_DATASETS[name]
    data = MusicDataModule(name, data_root=str(DATA_ROOT), download=False)
    for split in ("train", "valid", "test"):
        rolls = data.encoded(split)
        assert rolls.num_pieces == spec.pieces[split]
        assert rolls.num_frames == spec.frames[split]
        assert rolls.rows.shape == (spec.frames[split] + spec.pieces[split], NUM_NOTES)


@needs_music
def test_the_first_chord_of_the_first_chorale():
    # Boulanger-Lewandowski's JSB_Chorales.pickle: train[0][0] == [60, 72, 79, 88], a C major chord (C4 C5 G5 E6);
    # column j is MIDI note 21 + j.
    first = read_pieces(DATA_ROOT / "music" / "JSB_Chorales.mat", "train")[0]
    assert (np.nonzero(first[0])[0] + 21).tolist() == [60, 72, 79, 88]
    data = MusicDataModule("jsb-chorales", data_root=str(DATA_ROOT), download=False)
    assert np.array_equal(data.encoded("train").piece(0), first)


def test_a_bad_dataset_name_and_a_bad_file_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown music dataset 'bach'.*nottingham"):
        MusicDataModule("bach")
    (tmp_path / "music").mkdir()
    (tmp_path / "music" / "JSB_Chorales.mat").write_bytes(b"not a mat file")
    with pytest.raises(DataError, match="sha256"):  # the registered checksum catches it first
        MusicDataModule("jsb-chorales", data_root=str(tmp_path), download=False).encoded("train")
    with pytest.raises(DataError, match="not a piano-roll .mat file"):
        read_pieces(tmp_path / "music" / "JSB_Chorales.mat", "train")


def random_pieces(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.random((length, NUM_NOTES)) < 0.1).astype(np.uint8) for length in lengths]


@pytest.mark.parametrize("batch_size, bptt", [(1, 4), (2, 3), (3, 5), (6, 2)])  # 6 columns for 5 pieces: one empty
def test_every_frame_is_predicted_once_from_its_own_piece(batch_size, bptt):
    pieces = random_pieces([7, 3, 9, 1, 5])
    data = MusicDataModule(batch_size=batch_size, bptt=bptt)
    data._rolls["valid"] = PianoRolls.from_pieces(pieces)
    stream = data.stream("valid")
    assert stream.num_predicted == sum(len(p) for p in pieces)
    # Replay the windows column by column: the state is reset exactly where a piece starts, each piece's frames come
    # back in order as targets, and the input of each predicted step is the frame before (silence first).
    read: list[list[np.ndarray]] = [[] for _ in range(batch_size)]
    predicted = 0
    for batch in stream:
        assert batch.inputs.shape == batch.targets.shape == (batch_size, batch.mask.size(1), NUM_NOTES)
        for b in range(batch_size):
            for t in range(batch.mask.size(1)):
                if batch.reset[b, t]:
                    assert not batch.inputs[b, t].any()  # the silent frame
                    read[b].append([])
                if batch.mask[b, t]:
                    predicted += 1
                    frame_input, target = batch.inputs[b, t].numpy(), batch.targets[b, t].numpy()
                    previous = read[b][-1][-1] if read[b][-1] else np.zeros(NUM_NOTES)
                    assert np.array_equal(frame_input, previous)
                    read[b][-1].append(target)
                else:
                    assert not batch.targets[b, t].any()
    assert predicted == sum(len(p) for p in pieces)
    got = [np.stack(piece) for column in read for piece in column]
    assert len(got) == len(pieces) and all(np.array_equal(a, b) for a, b in zip(got, pieces))


def test_training_order_changes_with_the_epoch_and_is_reproducible():
    pieces = random_pieces([4] * 12)
    data = MusicDataModule(batch_size=3, bptt=4, seed=5)
    data._rolls["train"] = PianoRolls.from_pieces(pieces)
    first = [b.targets.clone() for b in data.stream("train")]
    again = [b.targets.clone() for b in data.stream("train")]  # a new stream, epoch 0 again
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    stream = data.stream("train")
    list(stream)
    second = [b.targets for b in stream]  # epoch 1
    assert not all(torch.equal(a, b) for a, b in zip(first, second))


# ------------------------------------------------------------------------------------------------ the Bernoulli head
def test_bernoulli_nll_is_the_binary_cross_entropy_summed_over_notes():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, NUM_NOTES) * 3
    targets = (torch.rand(2, 3, NUM_NOTES) < 0.2).float()
    p = 1 / (1 + torch.exp(-logits.double()))  # sigma(z), written out
    by_hand = -(targets * torch.log(p) + (1 - targets) * torch.log(1 - p)).sum(-1)  # (B, T)
    nll = bernoulli_nll(logits, targets)
    assert nll.shape == (2, 3)
    torch.testing.assert_close(nll.double(), by_hand, rtol=1e-5, atol=1e-5)
    # Per step is the sum over notes: with all-zero logits every note costs ln 2, so a frame costs 88 ln 2.
    torch.testing.assert_close(
        bernoulli_nll(torch.zeros(1, NUM_NOTES), targets[0, :1]), torch.tensor([88 * math.log(2)])
    )


@pytest.mark.parametrize("architecture", zoo.names())
def test_every_zoo_architecture_drives_the_bernoulli_head(architecture):
    torch.manual_seed(0)
    model = PianoRollLM(architecture, hidden_size=16, num_layers=2, dropout=0.2)
    frames = (torch.rand(3, 5, NUM_NOTES) < 0.1).float()
    reset = torch.zeros(3, 5, dtype=torch.bool)
    reset[1, 2] = True
    logits, state = model(frames, None, reset)
    assert logits.shape == (3, 5, NUM_NOTES)
    nll, _ = model.frame_nll(frames, frames, state)
    nll.sum().backward()
    assert all(p.grad is not None for p in model.decoder.parameters())
    model.eval()
    sample = model.generate(4, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert sample.shape == (2, 4, NUM_NOTES) and sample.dtype == torch.uint8 and set(sample.unique().tolist()) <= {0, 1}


def test_generation_draws_each_note_from_its_sigmoid():
    # A model whose output ignores the input: the bias alone sets each note's probability, and the sampled frequencies
    # must match those probabilities.
    model = PianoRollLM("rnn_tanh", hidden_size=4).eval()
    with torch.no_grad():
        model.decoder.weight.zero_()
        model.decoder.bias.copy_(torch.linspace(-3, 3, NUM_NOTES))
    sample = model.generate(50, num_samples=40, generator=torch.Generator().manual_seed(1)).float()  # (40, 50, 88)
    frequency = sample.mean((0, 1))
    expected = torch.sigmoid(model.decoder.bias)
    assert (frequency - expected).abs().max() < 0.06  # 2,000 draws a note: 3.5 standard deviations at p = 1/2
    primed = model.generate(3, primer=torch.ones(2, NUM_NOTES), generator=torch.Generator().manual_seed(1))
    assert primed.shape == (1, 3, NUM_NOTES)


# ------------------------------------------------------------------------------------------------------- training
def marginal_baseline_nll(train: PianoRolls, test: PianoRolls) -> float:
    """Nats per frame of the test frames under independent per-note Bernoullis fitted to the training frames."""
    frames = np.concatenate([train.piece(i) for i in range(train.num_pieces)]).astype(np.float64)
    p = (frames.sum(0) + 1) / (len(frames) + 2)  # Laplace-smoothed frequency of each note
    test_frames = np.concatenate([test.piece(i) for i in range(test.num_pieces)]).astype(np.float64)
    log_likelihood = test_frames @ np.log(p) + (1 - test_frames) @ np.log(1 - p)
    return float(-log_likelihood.mean())


@pytest.mark.slow
@needs_music
def test_a_tiny_lstm_trained_briefly_on_jsb_beats_the_per_note_marginals():
    torch.manual_seed(0)
    data = MusicDataModule("jsb-chorales", batch_size=16, bptt=32, data_root=str(DATA_ROOT), download=False, seed=0)
    model = MusicModel(architecture="lstm", hidden_size=32)
    model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=0.02)
    trainer = quiet_trainer(max_epochs=4, gradient_clip_val=5.0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    test_nll = trainer.test(model, datamodule=data, verbose=False)[0]["test_loss"]
    baseline = marginal_baseline_nll(data.encoded("train"), data.encoded("test"))
    assert test_nll < baseline - 1.0, (test_nll, baseline)
    assert trainer.callback_metrics["test_nll_per_note"].item() == pytest.approx(test_nll / NUM_NOTES, rel=1e-6)


# ------------------------------------------------------------------------------------------------ MIDI and PNG
def test_a_written_midi_file_reads_back_with_the_sampled_notes(tmp_path):
    model = PianoRollLM("gru", hidden_size=8).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        model.decoder.bias.fill_(-2.0)  # a sparse roll, with held notes and repeated ones
    roll = model.generate(24, generator=torch.Generator().manual_seed(3))[0].numpy()  # (T, 88)
    assert roll.any()
    path = write_midi(roll, tmp_path / "sample.mid", frame_beats=0.5)
    assert np.array_equal(roll_from_midi(path, len(roll), frame_beats=0.5), roll)  # eighth-note frames


def test_a_piano_roll_png_has_a_cell_per_note_and_frame(tmp_path):
    from PIL import Image

    roll = np.zeros((10, NUM_NOTES), dtype=np.uint8)
    roll[3, 60 - 21] = 1  # middle C in frame 3
    image = np.asarray(Image.open(write_png(roll, tmp_path / "roll.png", cell=2)))
    layout = roll_layout(10, NUM_NOTES, cell=2)
    left, top, right, bottom = layout.box
    assert image.shape == (layout.size[1], layout.size[0])
    inside = image[top:bottom, left:right]  # the roll itself, inside its axes
    assert inside.shape == (NUM_NOTES * 2, 10 * 2)
    black = np.argwhere(inside == 0)
    row = (NUM_NOTES - 1 - (60 - 21)) * 2  # high notes at the top
    assert {tuple(x) for x in black} == {(row + i, 3 * 2 + j) for i in range(2) for j in range(2)}
    # The axes: labels and ticks drawn in the margins, left of and under the roll.
    assert (image[:, : left - 1] < 128).sum() > 50 and (image[bottom + 1 :, :] < 128).sum() > 50


def test_a_piano_roll_has_a_time_axis_and_a_pitch_axis():
    assert (note_name(60), note_name(21), note_name(108), note_name(61)) == ("C4", "A0", "C8", "C#4")
    layout = roll_layout(128, NUM_NOTES, cell=4)
    left, top, right, bottom = layout.box
    assert (right - left, bottom - top) == (128 * 4, NUM_NOTES * 4)
    assert layout.size[0] > right and layout.size[1] > bottom and left > 0 and top > 0  # margins for the axes
    # Frame numbers at a round spacing, from 0 to the end, at the left edge of their column.
    assert [label for _, label in layout.x_ticks] == [str(f) for f in range(0, 129, 16)]
    assert [x for x, _ in layout.x_ticks] == [left + f * 4 for f in range(0, 129, 16)]
    # Every C from C1 to C8, named and numbered, at the middle of its row (C1, MIDI 24, is column 3 from the bottom).
    assert [label for _, label in layout.y_ticks] == [f"C{o} ({12 * (o + 1)})" for o in range(1, 9)]
    assert layout.y_ticks[0][0] == bottom - 3 * 4 - 2
    assert (layout.x_title, layout.y_title) == ("time (frames)", "pitch (note, MIDI number)")
    assert [label for _, label in roll_layout(1000, NUM_NOTES, cell=1).x_ticks][:3] == ["0", "64", "128"]


# ------------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.slow
@needs_music
def test_fit_evaluate_and_generate_a_music_model_through_the_cli(tmp_path, capsys, monkeypatch):
    import json

    import cli
    from tests.conftest import one_line_error

    monkeypatch.setenv("LM_ZOO_DATA", str(DATA_ROOT))
    config = tmp_path / "jsb.yaml"
    config.write_text(
        f"""
seed_everything: 1
trainer: {{max_epochs: 1, limit_train_batches: 6, logger: false, default_root_dir: {tmp_path / "run"}}}
model:
  class_path: lightning_modules.MusicModel
  init_args: {{architecture: gru, hidden_size: 12}}
data:
  class_path: datamodules.MusicDataModule
  init_args: {{dataset: jsb-chorales, batch_size: 8, bptt: 16}}
optimizer: {{class_path: torch.optim.Adam, init_args: {{lr: 0.01}}}}
"""
    )
    assert cli.main(["fit", "--config", str(config)]) == 0
    best = next((tmp_path / "run").rglob("best.ckpt"))
    capsys.readouterr()
    results = []
    for batch, bptt in ((8, 16), (3, 50)):  # every piece starts from zero state: the batching cannot change the figure
        assert (
            cli.main(
                ["evaluate", str(best), "--split", "valid", "--json", "--batch-size", str(batch), "--bptt", str(bptt)]
            )
            == 0
        )
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["frames"] == results[1]["frames"] == MUSIC_DATASETS["jsb-chorales"].frames["valid"]
    assert results[0]["nll_per_step"] == pytest.approx(results[1]["nll_per_step"], rel=1e-5)
    assert results[0]["nll_per_step"] < NUM_NOTES * math.log(2)  # six Adam steps already beat coin flips
    out = tmp_path / "samples"
    argv = ["generate", str(best), "--num-samples", "2", "--frames", "20", "--seed", "3", "--out", str(out)]
    assert cli.main([*argv, "--primer-piece", "1", "--primer-frames", "4", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [s["frames"] for s in record["samples"]] == [24, 24] and record["primer"] == {"piece": 1, "frames": 4}
    assert all(Path(s["midi"]).is_file() and Path(s["png"]).is_file() for s in record["samples"])
    # Bad requests: one line each, exit status 2.
    assert cli.main(["generate", str(best)]) == 2
    one_line_error(capsys, 2, "music model", "--out DIR")
    assert cli.main(["evaluate", str(best), "--temperature", "0.8"]) == 2
    one_line_error(capsys, 2, "music model", "--temperature")
    assert cli.main([*argv, "--primer-piece", "500"]) == 2
    one_line_error(capsys, 2, "--primer-piece 500", "pieces 0 to 76")


def test_lightningcli_reads_the_music_network_settings_from_pianorollconfig():
    """MusicModel passes **network on to PianoRollConfig, whose num_notes is the module's own vocab_size (the data's,
    linked): jsonargparse reads every other field's type and default from there."""
    import dataclasses

    from jsonargparse import ArgumentError, ArgumentParser

    from zoo.music import PianoRollConfig

    parser = ArgumentParser(exit_on_error=False)
    keys = parser.add_class_arguments(MusicModel, "model")
    network = [field.name for field in dataclasses.fields(PianoRollConfig) if field.name != "num_notes"]
    assert keys == [f"model.{name}" for name in ["vocab_size", "divergence_threshold", *network]]
    defaults = parser.get_defaults()
    assert defaults["model.vocab_size"] == NUM_NOTES and defaults["model.hidden_size"] == PianoRollConfig.hidden_size
    with pytest.raises(ArgumentError, match="num_layers"):
        parser.parse_args(["--model.num_layers", "deep"])
    module = MusicModel(vocab_size=12, architecture="gru", hidden_size=8)
    assert module.model.config == PianoRollConfig("gru", 8, num_notes=12)
    settings = {**dataclasses.asdict(module.model.config), "divergence_threshold": None}
    settings["vocab_size"] = settings.pop("num_notes")
    assert dict(module.hparams) == settings  # a .ckpt records every setting, the defaults too


@pytest.mark.slow
@needs_music
def test_every_training_epoch_ends_with_its_validation_although_epochs_differ_in_length(tmp_path, monkeypatch):
    # Shuffled pieces packed into columns make each epoch a different number of windows. Lightning validates when the
    # batch index reaches the loader's length as it read it once, so without a fresh loader each epoch (cli.py) an
    # epoch shorter than the first skipped its validation and a longer one validated before its end.
    import lightning as L

    from commands.fit import run_lightning

    monkeypatch.setenv("LM_ZOO_DATA", str(DATA_ROOT))
    data = MusicDataModule("jsb-chorales", batch_size=8, bptt=16, data_root=str(DATA_ROOT))
    train = data.stream("train")
    windows = [train.num_windows(epoch) for epoch in range(3)]
    assert len(set(windows)) > 1  # the premise: the epochs' lengths differ

    class Checks(L.Callback):
        steps: list[int] = []

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.steps.append(trainer.global_step)

    config = tmp_path / "jsb.yaml"
    config.write_text(
        f"""
seed_everything: 1
trainer: {{max_epochs: 3, logger: false, enable_progress_bar: false, default_root_dir: {tmp_path / "run"}}}
model:
  class_path: lightning_modules.MusicModel
  init_args: {{architecture: gru, hidden_size: 8}}
data:
  class_path: datamodules.MusicDataModule
  init_args: {{dataset: jsb-chorales, batch_size: 8, bptt: 16}}
optimizer: {{class_path: torch.optim.Adam, init_args: {{lr: 0.01}}}}
"""
    )
    run_lightning(["fit", "--config", str(config)], [Checks()])
    assert Checks.steps == list(np.cumsum(windows))  # one check per epoch, after its last window


def test_the_table_2_script_builds_configs_lightning_accepts_with_the_recipe_inside_its_space(tmp_path):
    # benchmarks/music_table.py runs for an hour; what can drift without anyone noticing is its configs and spaces.
    import argparse
    import importlib.util

    import yaml

    from commands.fit import run_lightning
    from commands.tune import full_config
    from lightning_modules.tuning import check_key, config_values

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("music_table", root / "benchmarks" / "music_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert list(table.ARCHITECTURES) == [
        "Tanh",
        "LSTM",
        "LSTM-f",
        "LSTM-i",
        "LSTM-o",
        "LSTM-b",
        "GRU",
        "MUT1",
        "MUT2",
        "MUT3",
    ]
    assert all(len(values) == len(table.ARCHITECTURES) for values in table.PAPER.values())
    args = argparse.Namespace(epochs=2, patience=1, factor=0.5, workdir=tmp_path, data_root=str(DATA_ROOT))
    base = full_config(table.BASE_CONFIG)
    for row, name in [("N-dropout", "MUT1"), ("P", "LSTM-b")]:
        architecture, options = table.ARCHITECTURES[name]
        hidden = zoo.units_for_budget(lambda units: table.parameters(architecture, units, options), 100_000)
        assert (
            table.parameters(architecture, hidden, options)
            <= 100_000
            < table.parameters(architecture, hidden + 1, options)
        )
        config, space = table.cell_config(base, row, name, hidden, args), table.cell_space(row, hidden)
        for key in space:
            check_key(config, key)
        first = config_values(config, space, "the cell config")  # --first-trial-from-config: the recipe's values
        assert first["optimizer.init_args.lr"] == 0.5 * 35 and ("model.init_args.dropout" in first) == (row != "P")
        path = tmp_path / f"{row}.yaml"
        path.write_text(yaml.safe_dump(config))
        with pytest.raises(SystemExit) as printed:
            run_lightning(["fit", "--config", str(path), "--print_config"])
        assert printed.value.code in (0, None)
