"""The models lm-zoo ships (checkpoints/registry.json, pretrained/): every file matches its registered sha256, every
model loads through the CLI, the plain module and the loopback Hub, and re-evaluating it reproduces its registered
test figure. These tests are what keep the registry's numbers true."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import checkpoints
import cli
from checkpoints import registry
from checkpoints.bundle import publish_all, table, xml_nesting
from lightning_modules import LanguageModel, MusicModel
from tests.hub_server import FakeHub
from zoo import RecurrentLM
from zoo.errors import ConfigError
from zoo.music import PianoRollLM

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = registry.load_registry(registry.DEFAULT_PATH)
SHARED = ROOT.parent / "shared" / "data"
needs_data = pytest.mark.skipif(
    not Path(os.environ.get("LM_ZOO_DATA", SHARED)).is_dir(), reason="no corpora: set LM_ZOO_DATA"
)


@pytest.fixture(autouse=True)
def shipped_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The shipped registry and bundle, whatever the environment says; a cache of the test's own."""
    monkeypatch.delenv("LM_ZOO_REGISTRY", raising=False)
    monkeypatch.delenv("LM_ZOO_PRETRAINED", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    if not os.environ.get("LM_ZOO_DATA") and SHARED.is_dir():
        monkeypatch.setenv("LM_ZOO_DATA", str(SHARED))


def _test_figure(capsys: pytest.CaptureFixture[str], name: str, expected: dict | None = None) -> tuple[dict, dict]:
    """The registered test result (or ``expected``) and ``lm-zoo evaluate``'s at its batch size and BPTT."""
    expected = expected or ENTRIES[name].results["test"]
    capsys.readouterr()
    argv = ["evaluate", name, "--split", "test", "--json"]
    assert cli.main([*argv, "--batch-size", str(expected["eval_batch_size"]), "--bptt", str(expected["bptt"])]) == 0
    return expected, json.loads(capsys.readouterr().out)


def _assert_same_figure(expected: dict, measured: dict) -> None:
    """The registered figure (a music model's: NLL per frame) re-measured, on as many tokens (frames)."""
    metric = next(m for m in ("nll_per_step", "bpc", "ppl") if m in expected)
    assert measured[metric] == pytest.approx(expected[metric], rel=1e-4)
    assert (measured["eval_batch_size"], measured["bptt"]) == (expected["eval_batch_size"], expected["bptt"])
    for count in ("tokens", "frames"):
        if count in expected:
            assert measured[count] == expected[count]


def test_the_registry_ships_models_and_the_readme_shows_them() -> None:
    assert ENTRIES, "checkpoints/registry.json lists no pretrained model"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert table(ENTRIES) in readme, "README's pretrained table is stale: run lm-zoo bundle table"
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
    assert config["training"]["run"]["commit"] == entry.training["commit"]


@needs_data
@pytest.mark.parametrize("name", list(ENTRIES))
def test_registered_test_figure_reproduces(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    expected, measured = _test_figure(capsys, name)
    _assert_same_figure(expected, measured)


def _piano_rolls(seed: int = 0) -> torch.Tensor:
    """A window of random frames ``(1, 12, 88)``: what a music model's logits are compared on."""
    return (torch.rand(1, 12, 88, generator=torch.Generator().manual_seed(seed)) < 0.1).float()


def _check_music_model(name: str, capsys: pytest.CaptureFixture[str], out: Path) -> None:
    """A registered music model: the plain module loads the same network, and the CLI samples MIDI files."""
    (model, tokenizer), loaded = checkpoints.from_pretrained(name), checkpoints.load(name)
    assert isinstance(model, PianoRollLM) and tokenizer is None
    module = MusicModel.from_network(model).eval()  # the LightningModule around the same network
    with torch.no_grad():
        assert torch.equal(model(_piano_rolls())[0], loaded.model(_piano_rolls())[0])
        assert torch.equal(module(_piano_rolls())[0], loaded.model(_piano_rolls())[0])
    with pytest.raises(ConfigError, match="lightning_modules.LanguageModel"):
        MusicModel.from_network(checkpoints.load("synthetic-xml-lstm").model)
    capsys.readouterr()
    assert cli.main(["generate", name, "--num-samples", "2", "--frames", "16", "--seed", "1", "--out", str(out)]) == 0
    assert (out / "sample-2.mid").is_file() and (out / "sample-2.png").is_file()


@pytest.mark.parametrize("name", list(ENTRIES))
def test_plain_module_and_lightning_module_agree(name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if ENTRIES[name].is_music:
        _check_music_model(name, capsys, tmp_path / "samples")
        return
    model, tokenizer = checkpoints.from_pretrained(name)
    assert isinstance(model, RecurrentLM)
    module = LanguageModel.from_network(model).eval()
    ids = torch.tensor([tokenizer.encode("the company said")[:3] or [0]])
    with torch.no_grad():
        assert torch.equal(model(ids)[0], module(ids)[0])
    capsys.readouterr()
    assert cli.main(["generate", name, "--num-samples", "2", "--max-tokens", "10", "--seed", "1"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) >= 1


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        yield server


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
        if downloaded.is_music:
            ids = _piano_rolls()  # (1, 12, 88)
        else:
            ids = torch.arange(12).remainder(downloaded.tokenizer.vocab_size).unsqueeze(0)  # (1, 12)
        with torch.no_grad():
            assert torch.equal(downloaded.model(ids)[0], bundled[name].model(ids)[0])


XML = [name for name, entry in ENTRIES.items() if "xml_nesting" in entry.training]


@pytest.mark.parametrize("name", XML)
def test_registered_xml_nesting_reproduces(name: str) -> None:
    recorded = ENTRIES[name].training["xml_nesting"]
    measured = xml_nesting(checkpoints.load(name))
    assert measured["closing_tags"] > 0
    # Sampling is seeded; only a last-bit difference in the logits (another thread count) could flip a draw.
    assert measured["fraction"] == pytest.approx(recorded["fraction"], abs=0.02)
