"""The models lm-zoo ships (checkpoints/registry.json, pretrained/): every file matches its registered sha256, every
model loads through the CLI, the plain module and the loopback Hub, the loaded network computes what its stored
weights say (a re-implementation in plain torch, read from the files by hand), and re-evaluating it reproduces its
registered figures. These tests are what keep the registry's numbers true.

Each run re-measures every model's check figure (``check_results``: the first windows of the test split, up to its
``max_tokens``-th token, at the recipe's eval batch size: a few seconds each); ``make verify-pretrained``
(``pytest -m verify_pretrained``, which CI runs after ``make test``) re-measures the registered whole-split figures,
most at batch 1, which take minutes each on a CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import checkpoints
import cli
from checkpoints import registry
from datamodules.kinds import MUSIC
from lightning_modules import LanguageModel, MusicModel
from release.bundle import publish_all, registry_training, table, xml_nesting
from tests.conftest import assert_same_figure, needs_data, registered_figure
from tests.hub_server import FakeHub
from zoo import RecurrentLM
from zoo.errors import ConfigError
from zoo.music import PianoRollLM

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = registry.load_registry(registry.DEFAULT_PATH)


@pytest.fixture(autouse=True)
def shipped_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The shipped registry and bundle, whatever the environment says; a cache of the test's own."""
    monkeypatch.delenv("LM_ZOO_REGISTRY", raising=False)
    monkeypatch.delenv("LM_ZOO_PRETRAINED", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_the_registry_ships_models_and_the_readme_shows_them() -> None:
    assert ENTRIES, "checkpoints/registry.json lists no pretrained model"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert table(ENTRIES) in readme, "README's pretrained table is stale: run python -m release table"
    bundled = {p.name for p in (ROOT / "pretrained").iterdir() if p.is_dir()}
    assert bundled == set(ENTRIES), "every bundle is registered and every registered model is bundled"


@pytest.mark.parametrize("name", list(ENTRIES))
def test_bundle_files_match_the_registry(name: str) -> None:
    entry = ENTRIES[name]
    directory = registry.bundled(entry)  # raises on a missing or changed file
    assert directory == ROOT / "pretrained" / name
    assert entry.size_bytes == sum((directory / f).stat().st_size for f in entry.files)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    assert config["num_parameters"] == entry.num_parameters
    # The registry keeps the card's record of how the model was made: where (hardware, torch, CUDA), at which commit;
    # for weights that several runs made in turn, each earlier run's too.
    run = config["training"]["run"]
    assert entry.training == registry_training(run)
    assert {"commit", "hardware", "torch_version", "wall_time_s"} <= entry.training.keys()


@pytest.mark.slow
@needs_data()
@pytest.mark.parametrize("name", list(ENTRIES))
def test_registered_check_figure_reproduces(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The test split's first windows at the recipe's eval batch size: the same weights, files and code path as the
    registered whole-split figure (which ``make verify-pretrained`` re-measures), in a fraction of the time."""
    check = ENTRIES[name].check_results.get("test")
    assert check is not None, f"{name} records no check_results.test: python -m release check records one"
    assert check.get("max_tokens") == registry.CHECK_TOKENS, f"{name}'s check figure is stale: python -m release check"
    expected, measured = registered_figure(capsys, name, check)
    assert_same_figure(expected, measured)


@pytest.mark.verify_pretrained
@pytest.mark.slow
@needs_data()
@pytest.mark.parametrize("name", list(ENTRIES))
def test_registered_test_figure_reproduces(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every registered test figure (the whole split, most at eval batch 1), re-measured: ``make verify-pretrained``."""
    expected, measured = registered_figure(capsys, name)
    assert_same_figure(expected, measured)


def _piano_rolls(seed: int = 0, batch: int = 1) -> torch.Tensor:
    """A window of random frames ``(batch, 12, 88)``: what a music model's logits are compared on."""
    return (torch.rand(batch, 12, 88, generator=torch.Generator().manual_seed(seed)) < 0.1).float()


# ---------------------------------------------------------------------------------------------------------------------
# The loaded network against the stored weights, read by hand and run through plain torch ops written here: a loader
# that put a tensor in the wrong place, read a setting wrongly or ran another function would differ. The reference
# runs in float64 on the stored values (a float16 bundle's, widened exactly, as the loader widens them to float32), so
# what separates it from the float32 network is float32 rounding over 12 steps: at most 1e-5 on these log-probabilities
# (measured), where a bias left out moves them by ~10 and weights rounded to float16 by ~3e-3.
REFERENCE_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
# The bundled word and character models a plain LSTM and a softmax over the vocabulary describe (NCE's output layer
# is a softmax layer at evaluation); test_the_reference_covers_these_models checks their settings still say so.
PLAIN_LSTMS = [
    "gbw-sample-lstm-nce",
    "gbw-sample-lstm-softmax",
    "ptb-char-lstm",
    "ptb-lstm-3x400",
    "ptb-lstm-medium",
    "ptb-lstm-small",
    "synthetic-xml-lstm",
]
PAPER_GRU_MUSIC = ["nottingham-gru"]  # a Jozefowicz et al. GRU with a Bernoulli output per note


def _stored(name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``pretrained/<name>``'s config.json and its tensors in float64, read without lm-zoo's loader."""
    directory = ROOT / "pretrained" / name
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    return config, {key: value.double() for key, value in load_file(directory / "model.safetensors").items()}


def _lstm_layer(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An LSTM layer from zero state (PyTorch's gate order i, f, g, o): ``x (B, T, I)`` -> ``h (B, T, H)``."""
    h = c = x.new_zeros(x.size(0), w_hh.size(1))
    outputs = []
    for x_t in x.unbind(1):
        i, f, g, o = (x_t @ w_ih.T + h @ w_hh.T + b).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, 1)


def _paper_gru_layer(
    x: torch.Tensor, w_ih: torch.Tensor, w_rz: torch.Tensor, w_hh: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """Jozefowicz et al. 2015's GRU from zero state: r and z from x and h; the candidate from x and r * h (the reset
    before the product); ``h' = z * h + (1 - z) * candidate``. ``x (B, T, I)`` -> ``h (B, T, H)``."""
    hidden = w_hh.size(0)
    h = x.new_zeros(x.size(0), hidden)
    outputs = []
    for x_t in x.unbind(1):
        pre = x_t @ w_ih.T + b  # (B, 3H): r, z, candidate
        r, z = torch.sigmoid(pre[:, : 2 * hidden] + h @ w_rz.T).chunk(2, dim=1)
        candidate = torch.tanh(pre[:, 2 * hidden :] + (r * h) @ w_hh.T)
        h = z * h + (1 - z) * candidate
        outputs.append(h)
    return torch.stack(outputs, 1)


def test_the_reference_covers_these_models() -> None:
    """The models compared with the plain re-implementations are still what they implement."""
    for name in PLAIN_LSTMS:
        config, weights = _stored(name)
        model = config["model"]
        assert (config["architecture"], config["head"]) in {("lstm", "softmax"), ("lstm", "nce")}, name
        # forget_bias only initialises; weight_drop only acts in training
        assert set(model["cell_options"]) <= {"forget_bias", "weight_drop"}, (name, model["cell_options"])
        assert model["input_embedding_ratio"] is None and not model.get("sum_layer_outputs"), name
        assert set(weights) <= {"embedding.weight", "decoder.weight", "decoder.bias"} | {
            f"rnn.layers.{i}.rnn.{p}_l0"
            for i in range(model["num_layers"])
            for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        }, name
    for name in PAPER_GRU_MUSIC:
        config, _ = _stored(name)
        assert (config["architecture"], config["head"], config["model"]["cell_options"]) == (
            "gru_paper",
            "bernoulli",
            {},
        )


def test_loading_a_registered_model_reads_and_hashes_each_file_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's check of the bundle covers the export's own record of its weights and tokenizer: a load reads
    each file for its sha256 once, and a changed file is still refused (test_bundle's damaged-bundle test)."""
    import checkpoints.export_read

    hashed: list[str] = []
    real = checkpoints.export_read.sha256_file

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(checkpoints.export_read, "sha256_file", counting)
    checkpoints.load("ptb-lstm-small")
    assert sorted(hashed) == sorted(ENTRIES["ptb-lstm-small"].files)


def test_a_loaded_models_data_module_uses_its_tokenizer_object() -> None:
    """The data a loaded model is scored on is encoded by the model's own tokenizer, handed over as it is (not
    serialised and rebuilt)."""
    loaded = checkpoints.load("ptb-lstm-small")
    assert loaded.datamodule().tokenizer is loaded.tokenizer


@pytest.mark.parametrize("name", PLAIN_LSTMS)
def test_a_loaded_lstm_computes_what_its_stored_weights_say(name: str) -> None:
    config, weights = _stored(name)
    settings = config["model"]
    ids = torch.randint(settings["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))  # (B, T)
    # Tied weights are stored once, under the decoder's name (safetensors keeps one copy).
    x = (weights["embedding.weight"] if "embedding.weight" in weights else weights["decoder.weight"])[ids]
    for i in range(settings["num_layers"]):
        layer = {p: weights[f"rnn.layers.{i}.rnn.{p}_l0"] for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
        x = _lstm_layer(x, layer["weight_ih"], layer["weight_hh"], layer["bias_ih"] + layer["bias_hh"])
    expected = torch.log_softmax(x @ weights["decoder.weight"].T + weights["decoder.bias"], dim=-1)  # (B, T, V)

    model, _ = checkpoints.from_pretrained(name)
    with torch.no_grad():
        scores, _ = model(ids)
    torch.testing.assert_close(torch.log_softmax(scores.double(), dim=-1), expected, **REFERENCE_TOLERANCE)


@pytest.mark.parametrize("name", PAPER_GRU_MUSIC)
def test_a_loaded_music_gru_computes_what_its_stored_weights_say(name: str) -> None:
    config, weights = _stored(name)
    frames = _piano_rolls(batch=2)  # (B, T, 88)
    x = frames.double()
    for i in range(config["model"]["num_layers"]):
        layer = [weights[f"rnn.layers.{i}.{p}"] for p in ("weight_ih", "weight_hh_rz", "weight_hh", "bias")]
        x = _paper_gru_layer(x, *layer)
    expected = x @ weights["decoder.weight"].T + weights["decoder.bias"]  # (B, T, 88): each note's Bernoulli logit

    model, tokenizer = checkpoints.from_pretrained(name)
    assert isinstance(model, PianoRollLM) and tokenizer is None
    with torch.no_grad():
        logits, _ = model(frames)
    torch.testing.assert_close(logits.double(), expected, **REFERENCE_TOLERANCE)


@pytest.mark.parametrize("name", list(ENTRIES))
def test_every_model_loads_wraps_and_generates(name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The plain module loads; the LightningModule around it adds nothing to its scores (it holds the same network,
    so this checks the wrapper, not the weights: the tests above do that); ``lm-zoo generate`` samples."""
    model, tokenizer = checkpoints.from_pretrained(name)
    if ENTRIES[name].kind is MUSIC:
        assert isinstance(model, PianoRollLM) and tokenizer is None
        module, inputs = MusicModel.from_network(model).eval(), _piano_rolls()  # (1, 12, 88)
        with pytest.raises(ConfigError, match="lightning_modules.LanguageModel"):
            MusicModel.from_network(checkpoints.load("synthetic-xml-lstm").model)
        argv = ["generate", name, "--num-samples", "2", "--frames", "16", "--seed", "1", "--out", str(tmp_path)]
    else:
        assert isinstance(model, RecurrentLM)
        module = LanguageModel.from_network(model).eval()
        inputs = torch.tensor([tokenizer.encode("the company said")[:3] or [0]])
        argv = ["generate", name, "--num-samples", "2", "--max-tokens", "10", "--seed", "1"]
    with torch.no_grad():
        assert torch.equal(module(inputs)[0], model(inputs)[0])
    capsys.readouterr()
    assert cli.main(argv) == 0
    if ENTRIES[name].kind is MUSIC:
        assert (tmp_path / "sample-2.mid").is_file() and (tmp_path / "sample-2.png").is_file()
    else:
        assert len(capsys.readouterr().out.strip().splitlines()) >= 1


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        yield server


@pytest.mark.slow
def test_publish_every_bundled_model_and_download_it_into_a_fresh_cache(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_maintainer")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    published = publish_all()  # what `make publish-pretrained` runs
    assert [name for name, _ in published] == list(ENTRIES)
    bundled = {name: checkpoints.load(name) for name in ENTRIES}
    monkeypatch.setenv("LM_ZOO_PRETRAINED", str(tmp_path / "no-bundle"))  # as a pip-installed user
    for name in ENTRIES:
        directory = checkpoints.registered_directory(ENTRIES[name])  # the registry's hashes, checked
        assert directory.is_relative_to(tmp_path / "hf-home")
        # The same bytes as the bundle (the hashes say so), whose test figure test_registered_test_figure_reproduces
        # re-measures; here the downloaded copy must load into the same network: equal scores on a window.
        downloaded = checkpoints.load(name)
        assert downloaded.source != bundled[name].source
        if downloaded.kind is MUSIC:
            ids = _piano_rolls()  # (1, 12, 88)
        else:
            ids = torch.arange(12).remainder(downloaded.tokenizer.vocab_size).unsqueeze(0)  # (1, 12)
        with torch.no_grad():
            assert torch.equal(downloaded.model(ids)[0], bundled[name].model(ids)[0])


XML = [name for name, entry in ENTRIES.items() if "xml_nesting" in entry.training]


@pytest.mark.slow
@pytest.mark.parametrize("name", XML)
def test_registered_xml_nesting_reproduces(name: str) -> None:
    recorded = ENTRIES[name].training["xml_nesting"]
    measured = xml_nesting(checkpoints.load(name))
    assert measured["closing_tags"] > 0
    # Sampling is seeded; only a last-bit difference in the logits (another thread count) could flip a draw.
    assert measured["fraction"] == pytest.approx(recorded["fraction"], abs=0.02)
