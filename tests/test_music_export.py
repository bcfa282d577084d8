"""Music (piano-roll) models through the export format, the bundle builder, the registry and the loopback Hub.

One tiny GRU is trained on JSB Chorales through the CLI (six steps); its checkpoint is exported, bundled and published,
and each copy must score the same NLL per step and give the same logits as the checkpoint's network.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard

import checkpoints
import cli
from checkpoints import registry
from checkpoints.export_read import (
    CARD_NAME,
    CONFIG_NAME,
    CURVE_NAME,
    SAMPLE_MIDI_NAME,
    SAMPLE_PNG_NAME,
    VOCAB_NAME,
    WEIGHTS_NAME,
    load_export,
    read_config,
)
from checkpoints.export_write import export_model
from checkpoints.model_card import render_card
from datamodules.kinds import MUSIC, MUSIC_HEAD
from datamodules.midi import roll_layout
from datamodules.piano_rolls import MUSIC_DATASETS
from lightning_modules import LanguageModel
from release.bundle import SAMPLE_FRAMES, SAMPLE_SEED, table
from release.command import main as release_main
from tests.conftest import DATA_ROOT, assert_same_figure, needs_data, one_line_error, registered_figure, roll_from_midi
from tests.hub_server import FakeHub
from zoo.errors import CheckpointError, ConfigError
from zoo.music import NUM_NOTES, PianoRollLM

needs_music = needs_data("music", "JSB_Chorales.mat")
ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_test_token"
NAME = "jsb-tiny"

# A 1 x 12 GRU, six Adam steps on JSB Chorales, logging train_loss every 2 steps (the bundle draws the curve);
# PublishBest exports the best checkpoint as a training run would.
RUN_CONFIG = """
seed_everything: 1
trainer:
  max_epochs: 1
  limit_train_batches: 6
  log_every_n_steps: 2
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: checkpoints.callbacks.PublishBest
      init_args: {{out_dir: {root}/callback-export, eval_splits: [test]}}
model:
  class_path: lightning_modules.MusicModel
  init_args: {{architecture: gru, hidden_size: 12, dropout: 0.1}}
data:
  class_path: datamodules.MusicDataModule
  init_args: {{dataset: jsb-chorales, batch_size: 8, bptt: 16, eval_batch_size: 16, eval_bptt: 40}}
checkpoint:
  dirpath: {root}/checkpoints
optimizer: {{class_path: torch.optim.Adam, init_args: {{lr: 0.01}}}}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("music-export")
    config = root / "run.yaml"
    config.write_text(RUN_CONFIG.format(root=root / "run"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LM_ZOO_DATA", str(DATA_ROOT))
        assert cli.main(["fit", "--config", str(config)]) == 0
    return root / "run"


@pytest.fixture(autouse=True)
def data_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_DATA", str(DATA_ROOT))


@pytest.fixture(scope="module")
def exported(run: Path) -> Path:
    """``lm-zoo export`` of the run's best checkpoint (valid and test measured for the card)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LM_ZOO_DATA", str(DATA_ROOT))
        assert cli.main(["export", str(run / "checkpoints" / "best.ckpt"), "--out", str(run.parent / "export")]) == 0
    return run.parent / "export"


def _json_out(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert cli.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def _frames(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(2, 9, NUM_NOTES, generator=generator) < 0.1).float()  # (B, T, 88)


def _logits(model: PianoRollLM, frames: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        first, state = model(frames[:, :4])
        second, _ = model(frames[:, 4:], state)  # the carried state too
    return torch.cat([first, second], dim=1)


# ------------------------------------------------------------------------------------------------ the export format
@pytest.mark.slow  # trains the module's music model (JSB Chorales read and encoded, six steps, its export measured)
@needs_music
def test_an_export_holds_the_music_model_and_loads_to_the_same_logits(run: Path, exported: Path) -> None:
    ckpt = checkpoints.load(run / "checkpoints" / "best.ckpt")
    config = json.loads((exported / CONFIG_NAME).read_text())
    assert (config["format_version"], config["head"], config["tokenizer"]) == (3, MUSIC_HEAD, None)
    assert config["model"] == asdict(ckpt.model.config) and config["architecture"] == "gru"
    data = config["training"]["data"]
    assert data["dataset"] == "jsb-chorales" and data["class_path"] == "datamodules.MusicDataModule"
    assert "data_root" not in data  # the training machine's, not the recipe's
    assert [(r["split"], r["dataset"], r["frames"]) for r in config["results"]] == [
        ("valid", "jsb-chorales", MUSIC_DATASETS["jsb-chorales"].frames["valid"]),
        ("test", "jsb-chorales", MUSIC_DATASETS["jsb-chorales"].frames["test"]),
    ]
    assert set(config["results"][0]) == {
        "split",
        "dataset",
        "nll_per_step",
        "nll_per_note",
        "frames",
        "pieces",
        "eval_batch_size",
        "bptt",
    }
    assert (config["results"][1]["eval_batch_size"], config["results"][1]["bptt"]) == (16, 40)  # the run's own
    assert {p.name for p in exported.iterdir()} == {CONFIG_NAME, WEIGHTS_NAME, CARD_NAME}  # no tokenizer file
    loaded = load_export(exported)
    assert loaded.kind is MUSIC and loaded.tokenizer is None and isinstance(loaded.model, PianoRollLM)
    assert not loaded.model.training
    frames = _frames()
    assert torch.equal(_logits(loaded.model, frames), _logits(ckpt.model, frames))
    assert torch.equal(_logits(checkpoints.from_pretrained(exported)[0], frames), _logits(ckpt.model, frames))
    # The export a run's PublishBest callback wrote is the same model with the same figure.
    from_callback = json.loads((run / "callback-export" / CONFIG_NAME).read_text())
    assert from_callback["head"] == MUSIC_HEAD and from_callback["results"] == config["results"][1:]


@pytest.mark.slow  # trains the module's music model (JSB Chorales read and encoded, six steps, its export measured)
@needs_music
def test_float16_storage_computes_in_float32_within_rounding(run: Path, tmp_path: Path) -> None:
    ckpt = checkpoints.load(run / "checkpoints" / "best.ckpt")
    export_model(ckpt, tmp_path / "half", results=[], dtype="float16")
    half = load_export(tmp_path / "half")
    assert json.loads((tmp_path / "half" / CONFIG_NAME).read_text())["dtype"] == "float16"
    assert half.model.decoder.weight.dtype == torch.float32
    assert torch.equal(half.model.decoder.weight, ckpt.model.decoder.weight.half().float())
    assert ckpt.model.decoder.weight.dtype == torch.float32  # the caller's model kept its precision
    frames = _frames(1)
    torch.testing.assert_close(_logits(half.model, frames), _logits(ckpt.model, frames), atol=5e-3, rtol=5e-3)


@pytest.mark.slow  # trains the module's music model (JSB Chorales read and encoded, six steps, its export measured)
@needs_music
def test_evaluate_and_generate_an_export_as_the_checkpoint(
    run: Path, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    best = str(run / "checkpoints" / "best.ckpt")
    from_ckpt = _json_out(capsys, "evaluate", best, "--split", "valid", "--json")
    from_export = _json_out(capsys, "evaluate", str(exported), "--split", "valid", "--json")
    assert from_export["nll_per_step"] == from_ckpt["nll_per_step"]
    assert from_export["frames"] == from_ckpt["frames"] == MUSIC_DATASETS["jsb-chorales"].frames["valid"]
    recorded = json.loads((exported / CONFIG_NAME).read_text())["results"][0]
    assert recorded["nll_per_step"] == pytest.approx(from_export["nll_per_step"], rel=1e-6)
    # The same seed gives the same piece from either: the MIDI files are byte for byte equal.
    for source, out in ((best, tmp_path / "a"), (str(exported), tmp_path / "b")):
        argv = ["generate", source, "--num-samples", "2", "--frames", "12", "--seed", "5", "--out", str(out)]
        assert cli.main(argv) == 0
    for name in ("sample-1.mid", "sample-2.mid", "sample-1.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.slow  # trains the module's music model (JSB Chorales read and encoded, six steps, its export measured)
@needs_music
def test_a_broken_music_export_is_one_clear_line(
    exported: Path, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(edit) -> str:
        directory = Path(shutil.copytree(exported, tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"))
        config = json.loads((directory / CONFIG_NAME).read_text())
        edit(config)
        (directory / CONFIG_NAME).write_text(json.dumps(config))
        return str(directory)

    cases = [
        (lambda c: c.pop("model"), 'has no "model" object'),
        (lambda c: c.update(tokenizer={"kind": "word", "vocab_size": 88}), "yet names a tokenizer"),
        (lambda c: c["model"].update(hidden_size=13), "size mismatch"),
        (lambda c: c["model"].update(voices=4), "settings this lm-zoo does not know"),
        (lambda c: c.update(format_version=4), "newer than this lm-zoo reads (3)"),
    ]
    for edit, fragment in cases:
        one_line_error(capsys, cli.main(["evaluate", broken(edit), "--split", "valid"]), fragment)
    # A text model's result is never written into a music model's card, nor the other way round.
    loaded = checkpoints.load(run / "checkpoints" / "best.ckpt")
    text_result = {"split": "test", "loss": 4.0, "ppl": 54.6, "eval_batch_size": 1, "bptt": 35}
    with pytest.raises(CheckpointError, match="is a music model but a result to export is a perplexity / bpc one"):
        export_model(loaded, tmp_path / "mixed", results=[text_result])
    assert not (tmp_path / "mixed").exists() or not any((tmp_path / "mixed").iterdir())
    # And the LightningModules say which one trains which network.
    with pytest.raises(ConfigError, match="lightning_modules.MusicModel"):
        LanguageModel.from_network(checkpoints.from_pretrained(exported)[0])


def test_shipped_text_bundles_read_and_render_as_before() -> None:
    # Music support must leave every text export as it was: the same format, and cards that `lm-zoo publish`
    # re-renders byte for byte (else publishing would change the registered hashes).
    entries = registry.load_registry(registry.DEFAULT_PATH)
    for name, entry in entries.items():
        directory = ROOT / "pretrained" / name
        config = read_config(directory, name)
        if entry.kind is MUSIC:  # a music bundle (nottingham-gru) is format 3; its card re-renders the same way
            assert config["format_version"] == 3 and config["head"] == MUSIC_HEAD
        else:
            assert config["format_version"] == 2 and config["head"] != MUSIC_HEAD
        card = render_card(config, entry.repo_id, entry.revision)
        assert card == (directory / CARD_NAME).read_text(encoding="utf-8"), name
    assert table(entries) in (ROOT / "README.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------ the bundle, the registry
@pytest.fixture(scope="module")
def bundle(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m release build`` of the run (float16) into a registry and bundle folder of the module's own."""
    root = tmp_path_factory.mktemp("music-bundle")
    (root / "registry.json").write_text(json.dumps({"format_version": 2, "models": {}}))
    argv = ["build", NAME, "--ckpt", str(run / "checkpoints" / "best.ckpt"), "--config", "jsb.yaml"]
    argv += ["--logs", str(run / "lightning_logs" / "version_0"), "--commit", "abc123", "--dtype", "float16"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LM_ZOO_DATA", str(DATA_ROOT))
        env.setenv("LM_ZOO_REGISTRY", str(root / "registry.json"))
        env.setenv("LM_ZOO_PRETRAINED", str(root / "pretrained"))
        assert release_main(argv) == 0
    return root


@pytest.fixture
def bundle_env(bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The module's registry and bundle, and an empty Hugging Face cache; returns the bundled export."""
    monkeypatch.setenv("LM_ZOO_REGISTRY", str(bundle / "registry.json"))
    monkeypatch.setenv("LM_ZOO_PRETRAINED", str(bundle / "pretrained"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return bundle / "pretrained" / NAME


@pytest.mark.slow  # trains the module's music model (JSB Chorales read and encoded, six steps, its export measured)
@needs_music
def test_bundle_build_measures_samples_and_cards_a_music_model(
    bundle_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = bundle_env
    entry = registry.load_registry()[NAME]
    assert entry.kind is MUSIC and entry.dataset == "jsb-chorales" and entry.architecture == "gru"
    assert set(entry.files) == {CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, CURVE_NAME, SAMPLE_MIDI_NAME, SAMPLE_PNG_NAME}
    assert VOCAB_NAME not in {p.name for p in directory.iterdir()}
    test = entry.results["test"]
    assert set(test) == {"nll_per_step", "eval_batch_size", "bptt", "frames"}
    assert (test["eval_batch_size"], test["bptt"]) == (16, 40)  # the run's own: batching cannot change the figure
    # What tests/test_pretrained.py does for every registered model: re-measure the figure at its batch size.
    expected, measured = registered_figure(capsys, NAME, expected=test)
    assert_same_figure(expected, measured)
    # The sample: the model's own piece (seed 1, from silence), read back from the MIDI file with mido.
    config = json.loads((directory / CONFIG_NAME).read_text())
    sample = config["training"]["run"]["sample"]
    beats = MUSIC_DATASETS["jsb-chorales"].frame_beats
    assert (sample["seed"], sample["frames"], sample["frame_beats"]) == (SAMPLE_SEED, SAMPLE_FRAMES, beats)
    model, _ = checkpoints.from_pretrained(NAME)
    roll = model.generate(SAMPLE_FRAMES, generator=torch.Generator().manual_seed(SAMPLE_SEED))[0].numpy()
    assert roll.sum() == sample["notes_sounding"] > 0
    assert np.array_equal(roll_from_midi(directory / SAMPLE_MIDI_NAME, SAMPLE_FRAMES, beats), roll)
    from PIL import Image

    with Image.open(directory / SAMPLE_PNG_NAME) as png:
        assert png.format == "PNG" and png.size == roll_layout(SAMPLE_FRAMES, NUM_NOTES).size  # the roll, its axes
    # The card: the figure in the model-index and the table, the piano roll shown, the MIDI linked, no tokenizer.
    card_text = (directory / CARD_NAME).read_text()
    for fragment in (
        "NLL per time step (nats)",
        f"![piano roll of the sampled piece]({SAMPLE_PNG_NAME})",
        f"[{SAMPLE_MIDI_NAME}]({SAMPLE_MIDI_NAME})",
        "model of polyphonic music",
        "frames/s",
        "No tokenizer",
        f"lm-zoo generate {NAME} --num-samples 3 --seed 1 --out samples/",  # the registered name: offline
    ):
        assert fragment in card_text, fragment
    card = ModelCard.load(directory / CARD_NAME)
    assert "tokenizer" not in card_text.lower().replace("no tokenizer", "")
    assert [(r.dataset_split, r.metric_type, r.metric_value) for r in card.data.eval_results] == [
        (split, "nll_per_step", round(r["nll_per_step"], 4))
        for split, r in zip(("validation", "test"), config["results"], strict=True)
    ]
    # The README's table and `lm-zoo models --pretrained`.
    row = table(registry.load_registry()).splitlines()[-1]
    assert f"{test['nll_per_step']:.2f} NLL/step" in row and "--seed 1 --out samples/` |" in row
    capsys.readouterr()
    assert cli.main(["models", "--pretrained"]) == 0
    assert f"test nll_per_step {test['nll_per_step']:.6g}" in capsys.readouterr().out
    # The registered name samples MIDI files through the CLI.
    assert cli.main(["generate", NAME, "--frames", "8", "--seed", "1", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "sample-1.mid").is_file()


def test_the_registry_reads_music_results_and_refuses_mixed_ones() -> None:
    entry = {
        "repo_id": "lm-zoo/jsb-lstm",
        "revision": "v1",
        "dataset": "jsb-chorales",
        "architecture": "lstm",
        "results": {"test": {"nll_per_step": 8.54, "eval_batch_size": 20, "bptt": 35, "frames": 4725}},
    }
    parsed = registry.parse_registry({"format_version": 2, "models": {"jsb-lstm": entry}}, "registry.json")
    assert parsed["jsb-lstm"].kind is MUSIC and parsed["jsb-lstm"].results["test"]["frames"] == 4725
    bad = [
        ({"nll_per_step": 8.5, "ppl": 3.0}, "mixes a text model's ppl/bpc with a music model's nll_per_step"),
        ({"nll_per_step": -1.0}, "needs a positive ppl or bpc (a music model: nll_per_step)"),
        ({"nll_per_frame": 8.5}, "unknown keys ['nll_per_frame']"),
    ]
    for result, message in bad:
        broken = {**entry, "results": {"test": {**result, "eval_batch_size": 20, "bptt": 35}}}
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            registry.parse_registry({"format_version": 2, "models": {"jsb-lstm": broken}}, "registry.json")


# ---------------------------------------------------------------------------------------------------- the Hub
@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        yield server


@pytest.mark.slow  # trains the module's music model (JSB Chorales read and encoded, six steps, its export measured)
@needs_music
def test_publish_and_download_a_music_bundle(
    bundle_env: Path, hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    entry = registry.load_registry()[NAME]
    capsys.readouterr()
    assert release_main(["publish"]) == 0  # checks afterwards that the bundle's hashes still hold
    repo = hub.repos[f"lm-zoo/{NAME}"]
    assert set(repo.commits[repo.tags["v1"]]) - {".gitattributes"} == set(entry.files)
    # A user without the bundle: the registry's pinned revision from the Hub, sample files included and hash-checked.
    monkeypatch.setenv("LM_ZOO_PRETRAINED", str(tmp_path / "no-bundle"))
    directory = checkpoints.registered_directory(entry)
    assert directory.is_relative_to(tmp_path / "hf-home")
    assert {SAMPLE_MIDI_NAME, SAMPLE_PNG_NAME} <= {p.name for p in directory.iterdir()}
    downloaded, bundled = checkpoints.load(NAME), load_export(bundle_env)
    assert downloaded.kind is MUSIC and downloaded.source == f"lm-zoo/{NAME}@v1"
    frames = _frames(2)
    assert torch.equal(_logits(downloaded.model, frames), _logits(bundled.model, frames))
