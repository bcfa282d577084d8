"""Bundled pretrained models end to end on a tiny run: ``python -m release build`` (export, measure the stored weights,
curve, samples, card, hashes, registry entry), loading a registered name from the bundle, a damaged bundle refused,
float16 storage, and ``python -m release publish`` to the loopback Hub, downloaded into a fresh cache without the
bundle."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import checkpoints
import cli
from checkpoints import registry
from checkpoints.export_read import CARD_NAME, CONFIG_NAME, CURVE_NAME, WEIGHTS_NAME
from checkpoints.model_card import render_card
from datamodules.corpora import corpus_level, sha256_file
from datamodules.kinds import MUSIC, TEXT
from lightning_modules.training import hardware, source_commit
from release import bundle
from release.command import main as release_main
from release.curves import (
    BPC,
    BPC_TAG,
    MARK_COLOUR,
    NATS_PER_FRAME,
    PERPLEXITY,
    VALID_TAG,
    RunLog,
    curve_record,
    curve_unit,
    render_record,
)
from tests.conftest import one_line_error
from tests.hub_server import FakeHub
from zoo import RecurrentLM

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def run(exported_run: Path) -> Path:
    return exported_run


@pytest.fixture
def bundle_env(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty registry and bundle folder of the test's own; returns the bundle folder."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(run.parent / "cache"))
    (tmp_path / "registry.json").write_text(json.dumps({"format_version": 2, "models": {}}))
    monkeypatch.setenv("LM_ZOO_REGISTRY", str(tmp_path / "registry.json"))
    monkeypatch.setenv("LM_ZOO_PRETRAINED", str(tmp_path / "pretrained"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return tmp_path / "pretrained"


def _build(run: Path, capsys: pytest.CaptureFixture[str], name: str = "tiny", *extra: str) -> dict:
    capsys.readouterr()
    argv = ["build", name, "--ckpt", str(run / "checkpoints" / "best.ckpt"), "--config", "run.yaml"]
    assert release_main([*argv, "--logs", str(run / "lightning_logs" / "version_0"), "--commit", "abc123", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _evaluate(capsys: pytest.CaptureFixture[str], source: str, *extra: str) -> dict:
    capsys.readouterr()
    assert cli.main(["evaluate", source, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_step_of_several_windows_counts_all_their_tokens() -> None:
    """The run record's tokens per step: batch x BPTT, times the windows a step trains on where the run set them."""
    assert bundle.step_tokens({"batch_size": 4, "bptt": 6}) == 24
    assert bundle.step_tokens({"batch_size": 4, "bptt": 6, "windows_per_step": 3}) == 72


def test_build_records_what_a_user_needs_and_serves_the_name(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = _build(run, capsys)
    directory = bundle_env / "tiny"
    assert registry.load_registry()["tiny"].to_json() == entry
    assert entry["repo_id"] == "lm-zoo/tiny" and entry["revision"] == "v1"
    assert set(entry["files"]) == {CONFIG_NAME, WEIGHTS_NAME, "vocab.txt", CARD_NAME, CURVE_NAME}
    assert all(sha256_file(directory / f) == h for f, h in entry["files"].items())
    assert entry["size_bytes"] == sum((directory / f).stat().st_size for f in entry["files"])
    # Every figure at eval batch 1 and at the run's eval batch (2), each re-measurable on the stored weights.
    config = json.loads((directory / CONFIG_NAME).read_text())
    assert sorted((r["split"], r["eval_batch_size"]) for r in config["results"]) == [
        ("test", 1),
        ("test", 2),
        ("valid", 1),
        ("valid", 2),
    ]
    test = entry["results"]["test"]
    assert test["eval_batch_size"] == 1 and test["bptt"] == 5
    again = _evaluate(capsys, "tiny", "--split", "test", "--batch-size", "1")
    assert again["ppl"] == pytest.approx(test["ppl"], rel=1e-4) and again["tokens"] == test["tokens"]
    # The check figure, which the suite re-measures: the test split's first CHECK_TOKENS tokens' windows at the run's
    # own eval batch size (here the whole split, which is shorter), not shown on the card.
    check = entry["check_results"]["test"]
    at_two = next(r for r in config["results"] if (r["split"], r["eval_batch_size"]) == ("test", 2))
    assert at_two["tokens"] < registry.CHECK_TOKENS
    assert check == {
        "ppl": at_two["ppl"],
        "eval_batch_size": 2,
        "bptt": 5,
        "tokens": at_two["tokens"],
        "max_tokens": registry.CHECK_TOKENS,
    }
    again = _evaluate(
        capsys, "tiny", "--split", "test", "--batch-size", "2", "--max-tokens", str(registry.CHECK_TOKENS)
    )
    assert again["ppl"] == pytest.approx(check["ppl"], rel=1e-4) and again["max_tokens"] == registry.CHECK_TOKENS
    assert all("max_tokens" not in r for r in config["results"])
    # How it was made, on the card and in config.json.
    made = config["training"]["run"]
    assert (made["commit"], made["command"], made["seed"]) == ("abc123", "lm-zoo fit --config run.yaml", 1)
    assert made["hardware"] == bundle.hardware() and entry["training"]["hardware"] == made["hardware"]
    assert made["torch_version"] == entry["training"]["torch_version"] == torch.__version__
    assert "cuda_version" not in made  # trained on the CPU
    assert (made["steps"], made["epochs"], made["tokens"]) == (8, 1, 8 * 4 * 6) and made["wall_time_s"] > 0
    assert len(made["samples"]["texts"]) == 3 and made["samples"]["max_tokens"] == 60
    # The curve's points, kept so that the card's picture can be drawn again without the run's events: the logged
    # training loss (every 4 steps) and validation perplexity (a word model's unit), the exported step marked.
    curve = made["curve"]
    assert (curve["unit"], curve["tokens_per_step"]) == ("perplexity", 4 * 6)
    assert curve["exported_step"] == config["training"]["global_step"] == 8
    assert [step for step, _ in curve["train_loss"]["points"]] == [3, 7]
    assert len(curve["valid"]["points"]) == 1 and curve["valid"]["points"][0][1] > 1  # a perplexity
    assert curve["valid"]["label"] == "validation perplexity"
    card = (directory / CARD_NAME).read_text()
    for fragment in ("## How it was made", "abc123", f"![learning curve]({CURVE_NAME})", "## Samples", "lm-zoo/tiny"):
        assert fragment in card
    # The run's length and the exported checkpoint's place in it, each said once, labelled; epochs counted from 1.
    assert card.count("8 steps in 1 epochs") == 1 and card.count(f"{8 * 4 * 6:,} training tokens") == 1
    assert "`best.ckpt` (the run's lowest validation loss), written at step 8, the run's last step, in epoch 1" in card
    assert "Stopped after" not in card and "| epochs |" not in card
    assert "dashed line marks the exported checkpoint (step 8)" in card
    # The registered name first (it loads the bundle offline); the Hub repo only as the registry's place for it.
    assert "lm-zoo evaluate tiny --split test" in card and 'from_pretrained("tiny")' in card
    assert "lm-zoo evaluate lm-zoo/tiny" not in card and "`lm-zoo/tiny` at revision `v1`" in card
    assert "lr 1 (the recipe's initial rate;" in card or "lr 1 (the recipe's; unchanged" in card
    with Image.open(directory / CURVE_NAME) as picture:
        assert picture.format == "PNG" and picture.size == (1000, 380)
    # The name loads from the bundle: CLI, the plain module, download's path.
    model, tokenizer = checkpoints.from_pretrained("tiny")
    assert isinstance(model, RecurrentLM) and tokenizer.vocab_size == config["tokenizer"]["vocab_size"]
    capsys.readouterr()
    assert cli.main(["download", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(directory)
    assert cli.main(["models", "--pretrained"]) == 0
    assert "tiny" in capsys.readouterr().out


def test_a_card_is_rendered_again_from_its_edited_notes(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m release card`: the notes in config.json edited, the card and curve drawn again without the run's
    events, and only the changed files' sha256 and the bundle's size rewritten in the registry."""
    entry = _build(run, capsys)
    directory = bundle_env / "tiny"
    path = Path(registry.registry_path())
    data = json.loads(path.read_text())
    data["models"]["tiny"]["description"] = "edited by hand"  # another field: left as it is
    path.write_text(json.dumps(data, indent=2) + "\n")
    config = json.loads((directory / CONFIG_NAME).read_text())
    config["training"]["run"]["notes"] = "Trained to test the card."
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    (directory / CURVE_NAME).unlink()  # drawn again from the points config.json keeps
    capsys.readouterr()
    assert release_main(["card", "tiny"]) == 0
    assert capsys.readouterr().out == f"tiny: {CARD_NAME}, {CONFIG_NAME}\n"  # the curve came out the same
    assert "Trained to test the card." in (directory / CARD_NAME).read_text()
    after = json.loads(path.read_text())["models"]["tiny"]
    assert after["description"] == "edited by hand" and after["results"] == entry["results"]
    assert after["files"][WEIGHTS_NAME] == entry["files"][WEIGHTS_NAME]
    assert after["size_bytes"] == sum((directory / f).stat().st_size for f in after["files"])
    assert registry.bundled(registry.load_registry()["tiny"]) == directory  # every hash holds
    # A damaged file is never registered: the weights changed, the card is not rendered again.
    (directory / WEIGHTS_NAME).write_bytes(b"x" + (directory / WEIGHTS_NAME).read_bytes()[1:])
    one_line_error(capsys, release_main(["card", "tiny"]), f"{WEIGHTS_NAME} does not match the sha256")


def test_a_corpus_spec_names_the_measures_a_bundle_computes() -> None:
    """The XML task's nesting measure is the synthetic-xml spec's (``measures``), and every measure a spec names is
    one the release tool computes; corpora without one (and a directory of one's own) get none."""
    from datamodules.corpora import CORPORA, SYNTHETIC_CORPORA, corpus_measures
    from release.bundle import CORPUS_MEASURES

    assert corpus_measures("synthetic-xml") == ("xml_nesting",)
    assert corpus_measures("synthetic-arithmetic") == corpus_measures("ptb") == corpus_measures("./mine") == ()
    named = {measure for spec in [*CORPORA.values(), *SYNTHETIC_CORPORA.values()] for measure in spec.measures}
    assert named <= set(CORPUS_MEASURES)


def test_a_character_model_curve_is_in_bits_per_character() -> None:
    units = [curve_unit(TEXT, kind) for kind in ("char", "byte", "word", "sentencepiece")]
    assert units == [BPC, BPC, PERPLEXITY, PERPLEXITY]
    assert curve_unit(MUSIC, None) == NATS_PER_FRAME
    # A character-level corpus read word by word (ptb-char's space-separated symbols) is scored per character, as its
    # training logs and lm-zoo evaluate score it (datamodules.kinds.per_character); its pieces are pieces.
    assert curve_unit(TEXT, "word", corpus_level("ptb-char")) == BPC
    assert curve_unit(TEXT, "sentencepiece", corpus_level("ptb-char")) == PERPLEXITY
    assert curve_unit(TEXT, "word", corpus_level("synthetic-xml")) == BPC
    assert (
        curve_unit(TEXT, "word", corpus_level("ptb")) == curve_unit(TEXT, "word", corpus_level("./mine")) == PERPLEXITY
    )
    # Logged: the training loss in nats per character, the validation perplexity per character (an older run).
    log = RunLog(train_loss=[(0, math.log(8.0)), (9, math.log(2.0))], valid=[(9, 4.0)], valid_tag=VALID_TAG)
    record = curve_record(log, BPC, 100, 10)
    assert record["train_loss"] == {"label": "training loss (bits per character)", "points": [[0, 3.0], [9, 1.0]]}
    assert record["valid"] == {"label": "validation bits per character", "points": [[9, 2.0]]}  # log2(4)
    # A run that logged val_bpc: taken as it is.
    logged = replace(log, valid=[(9, 1.5)], valid_tag=BPC_TAG)
    assert curve_record(logged, BPC, 100, 10)["valid"]["points"] == [[9, 1.5]]
    # A word model's curve keeps its perplexity and nats.
    word = curve_record(log, PERPLEXITY, 100, 10)
    assert word["valid"]["points"] == [[9, 4.0]] and word["train_loss"]["points"][0] == [0, round(math.log(8.0), 5)]


def test_the_exported_step_is_marked_on_the_curve(tmp_path: Path) -> None:
    log = RunLog(
        train_loss=[(step, 5.0 - step / 100) for step in range(0, 400, 10)],
        valid=[(99, 50.0), (199, 40.0), (299, 45.0), (399, 47.0)],
    )
    record = curve_record(log, PERPLEXITY, 10, 200)
    marked = np.asarray(Image.open(render_record(record, tmp_path / "marked.png", "t")).convert("RGB"))
    plain = np.asarray(Image.open(render_record({**record, "exported_step": None}, tmp_path / "plain.png", "t")))
    grey = np.all(marked == MARK_COLOUR, axis=-1) & ~np.all(plain == MARK_COLOUR, axis=-1)
    columns = np.flatnonzero(grey.sum(axis=0) > 100)  # the dashed lines: half of each panel's 289-pixel height
    # Two panels 410 pixels wide from x = 60 and x = 530, each x axis from 0 to its last point: the training loss's
    # at step 390 (3,900 tokens), the validation's at step 399 (3,990 tokens). The checkpoint is at 2,000 tokens.
    expected = [60 + 2000 / 3900 * 410, 530 + 2000 / 3990 * 410]
    assert len(columns) == 2 and np.allclose(columns, expected, atol=1.5), columns


def test_a_card_without_curve_points_says_what_its_picture_shows() -> None:
    """The shipped bundles predate stored curves: a character model's picture is in per-character perplexity, and
    its card says so (and how to read it in bits per character) instead of calling it bpc."""
    root = Path(__file__).resolve().parents[1] / "pretrained"
    config = json.loads((root / "ptb-char-lstm" / CONFIG_NAME).read_text())
    assert "curve" not in config["training"]["run"]
    card = render_card(config, "lm-zoo/ptb-char-lstm", "v1")
    assert "validation perplexity per character (right), not bits per character: bpc = log2(perplexity)" in card
    assert "The exported checkpoint (step 11,830, 37,856,000 training tokens) is not marked on it." in card


def test_a_card_states_the_recipes_stopping_rule_from_its_config() -> None:
    """The rule is read from the run's LightningCLI config: its bounds, whichever comes first, any early stopping
    (Lightning's: stop once ``patience`` checks in a row fail to lower the monitored figure by ``min_delta``), and how
    often it validated."""
    root = Path(__file__).resolve().parents[1] / "pretrained"
    config = json.loads((root / "ptb-char-lstm" / CONFIG_NAME).read_text())
    assert config["training"]["config"]["trainer"]["max_time"] == "00:01:58:00"
    card = render_card(config, "lm-zoo/ptb-char-lstm", "v1")
    assert (
        "- **The recipe's stopping rule:** it ends at the first of 8 epochs; 1 h 58 min of training. Validation at the "
        "end of every epoch; no test figure is read." in card
    )
    trainer = config["training"]["config"]["trainer"]
    trainer.update(max_epochs=None, max_steps=3000, max_time=None, val_check_interval=250)
    trainer["callbacks"] = [
        {"class_path": "lightning.pytorch.callbacks.EarlyStopping",
         "init_args": {"monitor": "val_loss", "patience": 2, "min_delta": 0.01}},
    ]  # fmt: skip
    card = render_card(config, "lm-zoo/ptb-char-lstm", "v1")
    # Lightning's EarlyStopping starts from no best: the run's first check always counts as lowering it.
    assert (
        "it ends at the first of 3,000 steps; early stopping after 2 validation checks in a row that do not lower the "
        "validation loss by at least 0.01 below its best (never the run's first check: with no best before it, that "
        "one always counts as lowering it). Validation every 250 steps;" in card
    )


def test_lightnings_early_stopping_never_stops_at_the_first_check() -> None:
    """What the card says of the rule: the first check is an improvement whatever its figure, as no best precedes
    it; the second is measured against the first."""
    from lightning.pytorch.callbacks import EarlyStopping

    rule = EarlyStopping(monitor="val_loss", min_delta=0.01, patience=1)
    assert rule._evaluate_stopping_criteria(torch.tensor(5.0))[0] is False
    assert rule._evaluate_stopping_criteria(torch.tensor(4.995))[0] is True  # lowered by less than 0.01


def _earlier_config(curve: dict, exported_step: int) -> dict:
    """An earlier revision's config.json, as far as its run record goes."""
    run = {
        "name": "tiny",
        "command": "lm-zoo fit --config first.yaml, resumed with --ckpt_path last at step 50",
        "config_file": "first.yaml",
        "seed": 7,
        "commit": "c0ffee",
        "torch_version": "2.13.0+cpu",
        "hardware": "2-core CPU (x86_64)",
        "wall_time_s": 3000.0,
        "steps": 100,
        "tokens": 100 * 24,
        "tokens_per_s": 0.8,
        "epochs": 3,
        "notes": "not kept",
        "curve": curve,
    }
    return {"training": {"global_step": exported_step, "run": run}}


def test_weights_made_by_two_runs_show_both_on_the_card_and_in_the_registry(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m release continues NAME COMMIT`: the run started from the export of NAME's revision bundled at COMMIT
    (read with git), whose run record goes into config.json, a row of the card's run table (with the total) and the
    registry; the card sets the run's first validation beside the earlier run's at its exported checkpoint."""
    entry = _build(run, capsys)
    directory = bundle_env / "tiny"
    config = json.loads((directory / CONFIG_NAME).read_text())
    now = config["training"]["run"]
    first = now["curve"]["valid"]["points"][0][1]
    earlier_curve = {
        "unit": "perplexity",
        "tokens_per_step": 24,
        "exported_step": 90,
        "train_loss": {"label": "training loss (nats per token)", "points": [[3, 5.0]]},
        "valid": {"label": "validation perplexity", "points": [[49, first * 2], [89, first * 1.005], [99, first]]},
    }
    earlier = _earlier_config(earlier_curve, 90)
    files = {
        "checkpoints/registry.json": json.dumps({"models": {"tiny": {"revision": "v0"}}}),
        f"pretrained/tiny/{CONFIG_NAME}": json.dumps(earlier),
    }

    def git(*args: str) -> str:  # two files at one commit stand in for the clone's history
        if args[0] == "rev-parse":
            return "f" * 40 + "\n"
        commit, path = args[1].split(":", 1)
        assert (args[0], commit) == ("show", "f" * 40)
        return files[path]

    monkeypatch.setattr(bundle, "_git", git)
    capsys.readouterr()
    assert release_main(["continues", "tiny", "abc"]) == 0
    assert capsys.readouterr().out == f"tiny: carries on from v0 (first.yaml, {'f' * 40})\n"
    config = json.loads((directory / CONFIG_NAME).read_text())
    [record] = config["training"]["run"]["earlier_runs"]
    assert record["revision"] == "v0" and record["exported_step"] == 90 and "notes" not in record
    assert record["curve"] == {k: v for k, v in earlier_curve.items() if k != "train_loss"}
    assert record["source"] == {"commit": "f" * 40, "file": f"pretrained/tiny/{CONFIG_NAME}"}
    after = registry.load_registry()["tiny"]
    assert after.training == bundle.registry_training(config["training"]["run"])
    [kept] = after.training["earlier_runs"]
    assert kept["wall_time_s"] == 3000.0 and "curve" not in kept and kept["source"] == record["source"]
    assert after.files[WEIGHTS_NAME] == entry["files"][WEIGHTS_NAME]
    assert registry.bundled(after) == directory  # every hash holds
    card = (directory / CARD_NAME).read_text()
    total = (3000.0 + now["wall_time_s"]) / 60
    assert "| `v0`: `first.yaml` | 7 | `c0ffee` | 2.13.0+cpu | 2-core CPU (x86_64) | 50.0 min | 1 |" in card
    assert "| `v1`: this run | 1 | `abc123` |" in card and f"| in all | | | | | {total:.1f} min |" in card
    assert "- **The run of `v0`:** `lm-zoo fit --config first.yaml, resumed" in card and "(step 90)" in card
    assert "- **This run:** 8 steps in 1 epochs" in card
    # The earlier run's validation at its exported step (the point nearest it), against this run's first.
    assert f"against `v0`'s {first * 1.005:g} at the exported checkpoint it started from (step 90): 0.50% lower" in card
    # Again: the same record, not a second one.
    assert release_main(["continues", "tiny", "abc"]) == 0
    assert len(json.loads((directory / CONFIG_NAME).read_text())["training"]["run"]["earlier_runs"]) == 1
    assert "validation after" not in card  # v0's record has no registered validation figure
    # With one (v0's export registered at ppl 121.5 on valid), the run table is the hop ledger: each run's
    # validation figure after it, this run's its own registered one.
    v0_valid = {"split": "valid", "loss": 4.8, "ppl": 121.5, "eval_batch_size": 1, "tokens": 100}
    files[f"pretrained/tiny/{CONFIG_NAME}"] = json.dumps({**earlier, "results": [v0_valid]})
    assert release_main(["continues", "tiny", "abc"]) == 0
    config = json.loads((directory / CONFIG_NAME).read_text())
    [record] = config["training"]["run"]["earlier_runs"]
    assert record["valid_after"] == {"figure": "ppl", "value": 121.5, "eval_batch_size": 1}
    valid = next(r for r in config["results"] if r["split"] == "valid")
    card = (directory / CARD_NAME).read_text()
    assert "| tokens/s | validation after (eval batch size) |" in card
    assert "| 50.0 min | 1 | ppl 121.50 (1) |" in card
    assert f"| ppl {valid['ppl']:.2f} ({valid['eval_batch_size']}) |" in card
    assert registry.bundled(registry.load_registry()["tiny"]) == directory  # the card's new hash registered


def test_the_shipped_continued_run_says_its_first_check_could_not_stop_it() -> None:
    """wikitext-2-lstm v4 started from v3's export under an early-stopping rule: its card has both runs, and says that
    its first check, though it lowered the validation loss below v3's by less than the rule asks, was no stop."""
    root = Path(__file__).resolve().parents[1] / "pretrained"
    config = json.loads((root / "wikitext-2-lstm" / CONFIG_NAME).read_text())
    run = config["training"]["run"]
    [v3] = run["earlier_runs"]
    assert (v3["revision"], v3["config_file"]) == ("v3", "configs/wikitext-2/lstm-medium-cpu-tied.yaml")
    start = min(v3["curve"]["valid"]["points"], key=lambda point: abs(point[0] - v3["exported_step"]))[1]
    first = run["curve"]["valid"]["points"][0][1]
    [rule] = [c for c in config["training"]["config"]["trainer"]["callbacks"] if "EarlyStopping" in c["class_path"]]
    assert math.log(start / first) < rule["init_args"]["min_delta"]  # a stop, had it not been the first check
    card = (root / "wikitext-2-lstm" / CARD_NAME).read_text()
    assert card == render_card(config, "lm-zoo/wikitext-2-lstm", "v4")
    assert f"| {(v3['wall_time_s'] + run['wall_time_s']) / 60:.1f} min |" in card
    assert f"{start / first - 1:.2%} lower" in card and "as the run's first check it could not stop the run" in card


def test_a_changed_byte_is_refused_naming_the_file(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _build(run, capsys)
    weights = bundle_env / "tiny" / WEIGHTS_NAME
    original = weights.read_bytes()
    data = bytearray(original)
    data[-1] ^= 1  # one bit of the last weight: still a valid safetensors file
    weights.write_bytes(bytes(data))
    for argv in (["evaluate", "tiny"], ["generate", "tiny"], ["download", "tiny"]):
        one_line_error(capsys, cli.main(argv), f"{WEIGHTS_NAME} does not match the sha256", "restore it")
    weights.write_bytes(original)
    (bundle_env / "tiny" / "vocab.txt").unlink()
    one_line_error(capsys, cli.main(["evaluate", "tiny"]), "has no vocab.txt, whose sha256 the registry lists")


def test_the_checkpoint_says_where_it_trained_and_the_card_and_registry_repeat_it(
    run: Path, bundle_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model trained on a GPU machine is bundled on another: its card and registry entry name the machine, torch,
    CUDA and commit of the training, which the checkpoint recorded (lightning_modules.training.RunSettings), not this
    one's."""
    checkpoint = torch.load(run / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=False)
    here = {
        "hardware": hardware(torch.device("cpu")),
        "torch_version": str(torch.__version__),
        "cuda_version": None,
        "commit": source_commit(),
    }
    assert checkpoint["callbacks"]["RunSettings"]["environments"] == [here]
    # The same run as if begun on a CPU and resumed on an H100 at another commit.
    gpu = {"hardware": "NVIDIA H100 80GB HBM3", "torch_version": "2.11.0+cu130", "cuda_version": "13.0", "commit": "c2"}
    checkpoint["callbacks"]["RunSettings"]["environments"] = [{**here, "commit": "c1"}, gpu]
    moved = tmp_path / "gpu-run" / "best.ckpt"
    moved.parent.mkdir()
    torch.save(checkpoint, moved)
    capsys.readouterr()
    argv = [
        "build",
        "tiny-gpu",
        "--ckpt",
        str(moved),
        "--config",
        "run.yaml",
        "--logs",
        str(run / "lightning_logs/version_0"),
    ]
    assert release_main(argv) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert training["hardware"] == f"{here['hardware']}, then NVIDIA H100 80GB HBM3"
    assert training["torch_version"] == f"{torch.__version__}, then 2.11.0+cu130"
    assert (training["cuda_version"], training["commit"]) == ("13.0", "c1, then c2")
    card = (bundle_env / "tiny-gpu" / CARD_NAME).read_text()
    assert f"| `c1, then c2` | {torch.__version__}, then 2.11.0+cu130 (CUDA 13.0) | {training['hardware']} |" in card


def test_float16_bundle_is_measured_on_its_stored_weights(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A run trained on a GPU machine and bundled on another names the machine it was trained on, not this one.
    entry = _build(run, capsys, "tiny16", "--dtype", "float16", "--hardware", "NVIDIA H100 80GB HBM3")
    assert entry["training"]["hardware"] == "NVIDIA H100 80GB HBM3"
    assert "| NVIDIA H100 80GB HBM3 |" in (bundle_env / "tiny16" / CARD_NAME).read_text()
    with safe_open(bundle_env / "tiny16" / WEIGHTS_NAME, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    loaded = checkpoints.load("tiny16")
    assert loaded.model.embedding.weight.dtype == torch.float32  # computes in float32
    again = _evaluate(capsys, "tiny16", "--split", "test", "--batch-size", "1")
    assert again["ppl"] == pytest.approx(entry["results"]["test"]["ppl"], rel=1e-4)
    full = checkpoints.load(run / "checkpoints" / "best.ckpt").model.embedding.weight
    assert not torch.equal(full, loaded.model.embedding.weight)  # really rounded
    assert torch.equal(full.half().float(), loaded.model.embedding.weight)


def test_a_bundle_in_shards_is_registered_and_served_by_its_name(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bundle build --max-shard-size``: the registry lists and hashes every shard and the index, the name loads and
    scores as the one-file bundle does, and a changed shard is named."""
    entry = _build(run, capsys, "tinyshards", "--max-shard-size", "2KB")
    directory = bundle_env / "tinyshards"
    shards = sorted(p.name for p in directory.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and WEIGHTS_NAME not in entry["files"]
    assert {*shards, "model.safetensors.index.json"} <= set(entry["files"])
    assert all(sha256_file(directory / f) == h for f, h in entry["files"].items())
    sharded = _evaluate(capsys, "tinyshards", "--split", "test", "--batch-size", "1")
    assert sharded["ppl"] == pytest.approx(entry["results"]["test"]["ppl"], rel=1e-6)
    shard = directory / shards[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    one_line_error(capsys, cli.main(["evaluate", "tinyshards", "--split", "test"]), shards[0])


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        yield server


def test_publish_every_bundled_model_then_download_without_the_bundle(
    run: Path,
    bundle_env: Path,
    hub: FakeHub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entry = _build(run, capsys)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    capsys.readouterr()
    assert release_main(["publish"]) == 0
    assert capsys.readouterr().out.startswith("tiny: ")
    repo = hub.repos["lm-zoo/tiny"]
    assert set(repo.commits[repo.tags["v1"]]) - {".gitattributes"} == set(entry["files"])  # the Hub adds it
    # A user without the bundle (a pip install) and with an empty cache: the pinned revision from the Hub.
    shutil.move(bundle_env, tmp_path / "moved")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "fresh-hf-home"))
    again = _evaluate(capsys, "tiny", "--split", "test", "--batch-size", "1")
    assert again["ppl"] == pytest.approx(entry["results"]["test"]["ppl"], rel=1e-4)
    assert cli.main(["download", "tiny"]) == 0
    assert "fresh-hf-home" in capsys.readouterr().out
    # The registry's hashes hold for what the Hub serves too: a v1 whose card was edited is refused.
    tampered = hub.add_repo("lm-zoo/tiny", {**repo.commits[repo.tags["v1"]], CARD_NAME: b"edited\n"})
    hub.repos["lm-zoo/tiny"].tags["v1"] = tampered
    monkeypatch.setenv("HF_HOME", str(tmp_path / "another-hf-home"))
    one_line_error(capsys, cli.main(["evaluate", "tiny"]), f"lm-zoo/tiny@v1/{CARD_NAME} does not match the sha256")
    # A model the Hub does not have and no bundle: one line that says so.
    hub.repos.pop("lm-zoo/tiny")
    one_line_error(capsys, cli.main(["evaluate", "tiny"]), "tiny is not bundled with this installation")


def test_wall_time_leaves_out_the_pause_of_a_run_resumed_into_the_same_log_directory(tmp_path: Path) -> None:
    """``--ckpt_path last`` logs on into the run's directory, in an events file of its own: the wall time sums each
    file's span, not the directory's (which would count the hours between the two runs)."""
    from torch.utils.tensorboard import SummaryWriter

    from release.curves import read_run

    for start, steps in ((1_000.0, range(0, 5)), (9_000.0, range(5, 10))):  # 8,000 s apart, 40 s of training each
        writer = SummaryWriter(str(tmp_path), filename_suffix=f".{int(start)}")
        for step in steps:
            writer.add_scalar("train_loss", 1.0, step, walltime=start + 10 * (step % 5))
        writer.add_scalar("val_ppl", 2.0, steps[-1], walltime=start + 40)
        writer.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    log = read_run([tmp_path])
    assert log.wall_time == pytest.approx(80.0) and log.steps == 10
