"""The ``lm-zoo`` command: help, shipped configs, fit -> evaluate -> generate, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
import yaml

import cli
from commands.common import device_argument
from commands.fit import check_ckpt_path
from lightning_modules.training import continue_logging_in
from tests.conftest import one_line_error, write_tiny_recipe, write_word_corpus

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(  # not recipes: tune/ holds search spaces, search/ architecture searches
    p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name not in ("tune", "search")
)


def _config(workdir: Path, corpus: Path, name: str = "run") -> Path:
    return write_tiny_recipe(workdir / f"{name}.yaml", corpus)


# --------------------------------------------------------------------------------------------------------- help
def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in cli.COMMANDS:
        assert f"  {command} " in out


@pytest.mark.parametrize("command", ["fit", "validate", "test", "evaluate", "generate", "models", "parse", "syneval"])
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage:" in out
    if command == "fit":
        assert "--config" in out and "--print_config" in out


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("lm-zoo")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "evaluate" in result.stdout


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c.relative_to(ROOT / "configs")) for c in CONFIGS])
def test_every_shipped_config_parses(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    parsed = yaml.safe_load(printed)  # its checkpoints go in the run's own version folder, wherever the root moves
    assert parsed["checkpoint"]["dirpath"] is None and parsed["last_checkpoint"].get("dirpath") is None  # linked
    if config.parent.name == "music":  # piano rolls: the music model on a music dataset
        assert "class_path: lightning_modules.MusicModel" in printed
        assert "class_path: datamodules.MusicDataModule" in printed
        return
    assert "class_path: lightning_modules.LanguageModel" in printed
    assert any(
        f"class_path: datamodules.{name}" in printed
        for name in ("TextDataModule", "GBWDataModule", "ReverseCopyDataModule")
    )


def dirpaths(node: object, where: str = "") -> list[str]:
    """The keys (dotted) under which a parsed YAML sets a ``dirpath``, at any depth (a ``checkpoint:`` section, a
    callback's ``init_args``, a dotted ``checkpoint.dirpath`` key)."""
    if isinstance(node, list):
        return [found for i, item in enumerate(node) for found in dirpaths(item, f"{where.removesuffix('.')}[{i}].")]
    if not isinstance(node, dict):
        return []
    found = [f"{where}{key}" for key, value in node.items() if str(key).split(".")[-1] == "dirpath" and value]
    return found + [hit for key, value in node.items() for hit in dirpaths(value, f"{where}{key}.")]


def test_no_recipe_fixes_where_its_checkpoints_go() -> None:
    """Every recipe's checkpoints go in its own run's version folder, Lightning's default without a dirpath
    (``<default_root_dir>/lightning_logs/version_N/checkpoints``), wherever ``--trainer.default_root_dir`` moves the
    run: a fixed ``checkpoint.dirpath`` (or ``last_checkpoint.dirpath``, linked to it) stayed put when the root moved,
    and two runs of the recipe wrote into one folder. Every YAML under configs/, the tuning and search ones too."""
    recipes = sorted((ROOT / "configs").rglob("*.yaml"))
    assert len(recipes) > 40
    fixed = {str(p.relative_to(ROOT)): found for p in recipes if (found := dirpaths(yaml.safe_load(p.read_text())))}
    assert not fixed, f"recipes that fix where checkpoints go (drop the dirpath): {fixed}"


def test_two_runs_of_a_recipe_keep_their_own_checkpoints(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a dirpath, a second run of a recipe under the same root writes version_1, the first run's checkpoints
    untouched; moving the root moves the checkpoints with the logs."""
    corpus = write_word_corpus(workdir / "corpus", "a")
    config = write_tiny_recipe(workdir / "run.yaml", corpus, checkpoint=None, trainer={"limit_train_batches": 2})
    for root in ("runs/a", "runs/a", "runs/b"):
        assert cli.main(["fit", "--config", str(config), "--trainer.default_root_dir", root]) == 0
    versions = workdir / "runs" / "a" / "lightning_logs"
    assert sorted(p.relative_to(workdir).as_posix() for p in (workdir / "runs").rglob("best.ckpt")) == [
        "runs/a/lightning_logs/version_0/checkpoints/best.ckpt",
        "runs/a/lightning_logs/version_1/checkpoints/best.ckpt",
        "runs/b/lightning_logs/version_0/checkpoints/best.ckpt",
    ]
    assert (versions / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert not (workdir / "run").exists()  # the recipe's own default root is not written when the root moves


def test_models_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "--json"]) == 0
    names = {row["name"] for row in json.loads(capsys.readouterr().out)}
    assert {"lstm", "gru", "rnn_tanh"} <= names


# ------------------------------------------------------------------------------------- fit, evaluate, generate
def test_fit_evaluate_generate(trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert trained.exists() and (trained.parent / "best.ckpt").exists()
    capsys.readouterr()
    assert cli.main(["evaluate", str(trained), "--split", "test", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "test" and result["eval_batch_size"] == 2 and result["bptt"] == 5
    assert result["ppl"] == pytest.approx(torch.tensor(result["loss"]).exp().item(), rel=1e-6)
    assert 1 < result["ppl"] < 43  # better than uniform over 40 words + specials after a few steps
    assert cli.main(["evaluate", str(trained), "--split", "valid", "--batch-size", "1", "--bptt", "50", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_batch_size"] == 1
    samples = []
    for _ in range(2):
        assert cli.main(["generate", str(trained), "--num-samples", "3", "--seed", "7", "--prompt", "w1 zebra"]) == 0
        samples.append(capsys.readouterr().out)
    assert samples[0] == samples[1]  # same seed, same samples
    lines = samples[0].strip("\n").split("\n")
    assert len(lines) == 3 and all(line.startswith("w1 <unk>") for line in lines)  # unknown prompt word -> <unk>


def test_a_fit_stopped_early_says_why(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning's EarlyStopping ends a run before its bounds silently unless verbose: lm-zoo fit's closing lines say
    it, with the callback's own reason. A validation loss cannot drop by 100 nats, so the second check stops it."""
    early = {"class_path": "lightning.pytorch.callbacks.EarlyStopping",
             "init_args": {"monitor": "val_loss", "patience": 1, "min_delta": 100.0}}  # fmt: skip
    trainer = {"max_steps": 40, "val_check_interval": 2, "limit_val_batches": 2, "callbacks": [early]}
    config = write_tiny_recipe(workdir / "run.yaml", write_word_corpus(workdir / "corpus", "early"), trainer=trainer)
    assert cli.main(["fit", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    stopped = [line for line in err.splitlines() if line.startswith("lm-zoo: stopped early: ")]
    assert len(stopped) == 1 and "val_loss did not improve in the last 1 records" in stopped[0], err[-2000:]
    step = torch.load(workdir / "run" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    assert step == 4, step  # the second check, 2 steps after the first


def test_max_tokens_scores_the_first_windows_of_each_stream(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--max-tokens N``: the windows up to the one holding the N-th predicted token, summed by hand here from the
    network's own per-token NLL; the result says N, and N past the split's end is the whole split."""
    import checkpoints

    last = str(tiny_run / "run" / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    assert cli.main(["evaluate", last, "--max-tokens", "23", "--json"]) == 0
    part = json.loads(capsys.readouterr().out)
    loaded = checkpoints.load(last)
    nats, tokens, state = 0.0, 0, None
    with torch.no_grad():
        for batch in loaded.datamodule().stream("test", batch_size=2, bptt=5):  # the run's eval sizes
            if tokens >= 23:
                break
            nll, state = loaded.model.eval().token_nll(batch.inputs, batch.targets, state, batch.reset)
            nats, tokens = nats + float(nll.sum()), tokens + int((batch.targets != -100).sum())
    assert part["tokens"] == tokens == 30 and part["max_tokens"] == 23  # 3 windows of 2 x 5
    assert part["loss"] == pytest.approx(nats / tokens, rel=1e-6)
    assert cli.main(["evaluate", last, "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["tokens"] > 100 and "max_tokens" not in whole
    assert cli.main(["evaluate", last, "--max-tokens", str(10 * whole["tokens"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(whole["loss"], rel=1e-9)
    one_line_error(capsys, cli.main(["evaluate", last, "--max-tokens", "0"]), "--max-tokens must be an integer >= 1")


def test_validate_and_test_through_lightning(trained: Path, workdir: Path) -> None:
    config = workdir / "run.yaml"
    assert cli.main(["test", "--config", str(config), "--ckpt_path", str(trained)]) == 0


# ------------------------------------------------------------------------------------------------- bad input
def test_unknown_architecture(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    code = cli.main(["fit", "--config", str(config), "--model.init_args.architecture", "lstmx"])
    one_line_error(capsys, code, "unknown architecture 'lstmx'", "lstm")


def test_missing_corpus(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(workdir, workdir)
    code = cli.main(
        [
            "fit",
            "--config",
            str(config),
            "--data.init_args.corpus",
            "ptb",
            "--data.init_args.data_root",
            str(workdir / "nowhere"),
            "--data.init_args.download",
            "false",
        ]
    )
    one_line_error(capsys, code, "ptb.train.txt", str(workdir / "nowhere"))


@pytest.mark.parametrize(("content", "fragment"), [(b"", "empty"), (b"caf\xe9 ok\n", "UTF-8")])
def test_empty_or_non_utf8_training_file(
    workdir: Path, capsys: pytest.CaptureFixture[str], content: bytes, fragment: str
) -> None:
    corpus = write_word_corpus(workdir / "corpus", "a")
    (corpus / "train.txt").write_bytes(content)
    code = cli.main(["fit", "--config", str(_config(workdir, corpus))])
    one_line_error(capsys, code, "train.txt", fragment)


def test_corrupt_checkpoint(trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truncated = workdir / "truncated.ckpt"
    truncated.write_bytes(trained.read_bytes()[:2000])
    # Random bytes make torch.load fail in many ways (pickle errors, IndexError, EOFError, ...): try a fixed spread.
    garbage = []
    for seed in range(25):
        path = workdir / f"garbage-{seed}.ckpt"
        path.write_bytes(random.Random(seed).randbytes(500))
        garbage.append(path)
    capsys.readouterr()
    for path in (truncated, *garbage):
        one_line_error(capsys, cli.main(["evaluate", str(path)]), str(path), "not a readable checkpoint")
    one_line_error(capsys, cli.main(["generate", str(workdir / "missing.ckpt")]), "does not exist")


def test_checkpoint_of_another_vocabulary(trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = write_word_corpus(workdir / "other", "b", words=70)  # a larger vocabulary
    config = _config(workdir, other, name="other")
    code = cli.main(["test", "--config", str(config), "--ckpt_path", str(trained)])
    one_line_error(capsys, code, "vocabulary of 42 tokens", "72")
    # a checkpoint whose weights and tokenizer disagree
    ckpt = torch.load(trained, weights_only=True)
    ckpt["TextDataModule"]["tokenizer"]["symbols"] = ckpt["TextDataModule"]["tokenizer"]["symbols"][:-1]
    ckpt["TextDataModule"]["tokenizer"]["counts"] = ckpt["TextDataModule"]["tokenizer"]["counts"][:-1]
    tampered = workdir / "tampered.ckpt"
    torch.save(ckpt, tampered)
    one_line_error(capsys, cli.main(["evaluate", str(tampered)]), "expects 42 tokens", "41")


def test_nan_loss_exits_1_naming_the_step(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    code = cli.main(["fit", "--config", str(config), "--model.init_args.init_range", "1e38"])
    one_line_error(capsys, code, "training loss became", "at step 0", expected_code=1)


def test_a_loss_that_explodes_without_becoming_nan_is_stopped(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lr 1e30 sends the loss to ~1e15 and the steps to a crawl, but never to NaN: 10 x ln V stops it at once."""
    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    code = cli.main(["fit", "--config", str(config), "--optimizer.init_args.lr", "1e30"])
    last = one_line_error(capsys, code, "training loss became", "divergence_threshold 37.38", expected_code=1)
    assert "nan" not in last and "inf" not in last
    # The guard can be turned off; the same run then ends normally (its loss stays finite in 8 steps).
    code = cli.main(
        [
            "fit",
            "--config",
            str(config),
            "--optimizer.init_args.lr",
            "1e30",
            "--model.init_args.divergence_threshold",
            "0",
        ]
    )
    assert code == 0, capsys.readouterr().err


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(capsys, cli.main(["trian"]), "unknown command 'trian'")


def test_a_closed_pipe_ends_quietly() -> None:
    # `lm-zoo models | head -1`: the reader exits first; no traceback, the shell's status for SIGPIPE.
    process = subprocess.Popen(
        [sys.executable, "-c", "import cli, sys; sys.exit(cli.main(['models']))"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait() == 141, stderr
    assert stderr == ""


# ---------------------------------------------------------------------------- bad input: one line, never usage
@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        (["--data.init_args.batch_size", "0"], ["batch_size must be at least 1", "got 0"]),
        (["--data.init_args.bptt", "-5"], ["bptt must be at least 1", "-5"]),
        (["--model.init_args.hiden_size", "3"], ["hiden_size", "did you mean --model.init_args.hidden_size?"]),
        (["--data.init_args.batchsize", "3"], ["did you mean --data.init_args.batch_size?"]),
        (["--trainer.max_steps", "abc"], ["--trainer.max_steps: expected int, got 'abc'"]),
        (["--model.init_args.dropout", "abc"], ["--model.init_args.dropout: expected float, got 'abc'"]),
        (["--trainer.bogus", "3"], ["unrecognized arguments: --trainer.bogus", "lm-zoo fit --help"]),
        (
            ["--model.init_args.cell_options", "{rounds: -1}", "--model.init_args.architecture", "mogrifier"],
            ["mogrifier", "rounds must be >= 0"],
        ),
    ],
)
def test_bad_options_get_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], override: list[str], fragments: list[str]
) -> None:
    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    one_line_error(capsys, cli.main(["fit", "--config", str(config), *override]), *fragments)


def test_bad_config_files_get_one_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(
        capsys, cli.main(["fit", "--config", "nothere.yaml"]), "--config nothere.yaml: no such file", "recipes"
    )
    (workdir / "tab.yaml").write_text("trainer:\n\tmax_epochs: 1\n")
    one_line_error(capsys, cli.main(["fit", "--config", "tab.yaml"]), "tab.yaml, line 2, column 1", "not tabs")
    (workdir / "open.yaml").write_text("trainer:\n  max_epochs: [1\n")
    one_line_error(capsys, cli.main(["fit", "--config=open.yaml"]), "open.yaml, line 3", "not valid YAML")


def test_a_good_config_is_read_by_jsonargparse_alone(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-zoo reads a config's YAML itself only to say where a broken one is broken, never before a good one runs."""
    import commands.fit

    read: list[str] = []
    monkeypatch.setattr(commands.fit, "check_config_files", lambda args: read.append(" ".join(args)))
    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(config), "--print_config"])
    assert read == []
    (workdir / "tab.yaml").write_text("trainer:\n\tmax_epochs: 1\n")
    cli.main(["fit", "--config", "tab.yaml"])
    assert read == ["--config tab.yaml"]


def test_a_shipped_recipe_is_named_without_a_clone(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--config ptb/smoke``, and the README's ``configs/ptb/smoke.yaml`` from a directory that has no such file,
    name the shipped recipe; a file of that path in the working directory is the user's own and wins."""
    assert not (workdir / "configs").exists()
    for name in ("ptb/smoke", "configs/ptb/smoke.yaml", "--config=ptb/smoke.yaml"):
        argv = ["fit", name] if name.startswith("--") else ["fit", "--config", name]
        with pytest.raises(SystemExit):
            cli.main([*argv, "--print_config"])
        assert "default_root_dir: runs/ptb/smoke" in capsys.readouterr().out
    own = workdir / "configs" / "ptb" / "smoke.yaml"
    own.parent.mkdir(parents=True)
    own.write_text((ROOT / "configs" / "ptb" / "smoke.yaml").read_text().replace("runs/ptb/smoke", "mine"))
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", "configs/ptb/smoke.yaml", "--print_config"])
    assert "default_root_dir: mine" in capsys.readouterr().out
    one_line_error(capsys, cli.main(["fit", "--config", "ptb/smoek"]), "no shipped recipe", "did you mean ptb/smoke?")


def test_recipes_lists_every_shipped_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["recipes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in rows} == {
        p.relative_to(ROOT / "configs").with_suffix("").as_posix() for p in (ROOT / "configs").rglob("*.yaml")
    }
    assert all(row["summary"] for row in rows), [row["name"] for row in rows if not row["summary"]]
    assert cli.main(["recipes", "ptb-char"]) == 0
    listed = capsys.readouterr().out
    assert "ptb-char/lstm " in listed and "ptb/lstm-small" not in listed
    one_line_error(capsys, cli.main(["recipes", "ptx"]), "no recipes for 'ptx'", "ptb")


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--data.init_args.batch_size", "0", "batch_size must be at least 1, got 0"),
        ("--data.init_args.eval_batch_size", "0", "eval_batch_size must be at least 1, got 0"),
        ("--data.init_args.bptt", "0", "bptt must be at least 1, got 0"),
        ("--model.init_args.num_layers", "0", "num_layers must be at least 1, got 0"),
        ("--model.init_args.embedding_size", "-3", "embedding_size must be at least 1, got -3"),
        ("--trainer.accumulate_grad_batches", "0", "--trainer.accumulate_grad_batches must be at least 1, got 0"),
        ("--trainer.gradient_clip_val", "-1", "--trainer.gradient_clip_val must be >= 0 (null: no clipping), got -1"),
        ("--optimizer.init_args.lr", "-1", "--optimizer SGD: Invalid learning rate: -1.0"),
    ],
)
def test_a_bad_setting_is_refused_before_the_run_announces_itself(
    workdir: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, said: str
) -> None:
    """Each of these used to fail after the start-up line ("training on 1 cpu device, 0 columns per rank"), or with a
    traceback: the error is now the only line lm-zoo prints."""
    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    code = cli.main(["fit", "--config", str(config), option, value])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("lm-zoo:")] == [f"lm-zoo: error: {said}"], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_asked_for_where_there_is_none(trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(workdir, workdir / "corpus")
    code = cli.main(["fit", "--config", str(config), "--trainer.accelerator", "gpu"])
    one_line_error(capsys, code, "--trainer.accelerator gpu", "no CUDA GPU", "--trainer.accelerator cpu")
    assert device_argument("auto") == "cpu"  # every command's default
    for command in ("evaluate", "generate", "export"):
        code = cli.main([command, str(trained), "--device", "cuda", *(["--out", "x"] if command == "export" else [])])
        one_line_error(capsys, code, "--device", "no CUDA GPU", "--device cpu")


def test_resuming_from_nothing_or_the_wrong_thing(
    trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = _config(workdir, workdir / "corpus", name="fresh")
    one_line_error(capsys, cli.main(["fit", "--config", str(fresh), "--ckpt_path", "last"]), "nothing to resume")
    config = _config(workdir, workdir / "corpus")
    code = cli.main(["fit", "--config", str(config), "--ckpt_path", str(workdir / "missing.ckpt")])
    one_line_error(capsys, code, f"--ckpt_path {workdir / 'missing.ckpt'}: no such file", "(or last)")
    code = cli.main(["fit", "--config", str(config), "--ckpt_path", str(workdir)])
    one_line_error(capsys, code, f"--ckpt_path {workdir}: a directory, not a checkpoint file")
    truncated = workdir / "truncated.ckpt"
    truncated.write_bytes(trained.read_bytes()[:3000])
    code = cli.main(["fit", "--config", str(config), "--ckpt_path", str(truncated)])
    last = one_line_error(capsys, code, "truncated.ckpt is not a readable checkpoint")
    assert "weights_only" not in last  # PyTorch's advice to unpickle anything is never passed on
    code = cli.main(["fit", "--config", str(config), "--ckpt_path", "last", "--model.init_args.hidden_size", "12"])
    one_line_error(capsys, code, "has shape", "(32, 8)", "(48, 8)", "config.yaml")


def test_resuming_last_names_a_later_checkpoint_when_last_ckpt_is_missing(
    trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kill between a validation's best.ckpt and its last.ckpt leaves no last.ckpt: the line names the checkpoint
    that is there and the flag that resumes from it, and that flag resumes."""
    best = trained.with_name("best.ckpt")
    assert best.is_file()
    trained.unlink()
    config = _config(workdir, workdir / "corpus")
    code = cli.main(["fit", "--config", str(config), "--ckpt_path", "last"])
    one_line_error(capsys, code, "no last.ckpt", str(best), f"--ckpt_path {best}")
    assert cli.main(["fit", "--config", str(config), "--ckpt_path", str(best), "--trainer.max_epochs", "2"]) == 0


def test_the_train_further_line_carries_the_run_on_with_every_setting_it_had(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The line a fit ends with, run as printed: it names the run's saved config, so the command line's overrides come
    back too, the data's batch size among them, which is not in the hyperparameters Lightning restores from the
    checkpoint (naming the recipe, the resumed run trained on its batch of 4)."""
    import shlex

    config = _config(workdir, write_word_corpus(workdir / "corpus", "further"))
    assert (
        cli.main(["fit", "--config", str(config), "--data.init_args.batch_size", "3", "--trainer.max_steps", "3"]) == 0
    )
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("lm-zoo: train further: "))
    *command, limit = shlex.split(line.removeprefix("lm-zoo: train further: lm-zoo "))
    assert limit == "N" and command[-1] == "--trainer.max_steps", line
    assert cli.main([*command, "6"]) == 0
    resumed = torch.load(command[command.index("--ckpt_path") + 1], weights_only=True)
    assert resumed["global_step"] == 6 and resumed["datamodule_hyper_parameters"]["batch_size"] == 3
    assert resumed["lm_zoo_resume"]["rank_0"]["train_state"][0].shape[1] == 3  # the carried state of 3 columns


def test_resuming_never_unpickles_an_object(trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fit --ckpt_path`` reads with ``weights_only=True``: a checkpoint that holds an arbitrary pickled object (here
    a path, a global no lm-zoo checkpoint needs) is refused in one line, not loaded."""
    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["callbacks"] = {"planted": Path("/an/object")}  # pickled as pathlib.PosixPath: a global
    planted = workdir / "planted.ckpt"
    torch.save(checkpoint, planted)
    config = _config(workdir, workdir / "corpus")
    code = cli.main(["fit", "--config", str(config), "--ckpt_path", str(planted)])
    one_line_error(capsys, code, "planted.ckpt is not a readable checkpoint")


def test_plain_commands_get_one_line_not_usage(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(capsys, cli.main(["evaluate"]), "required: source", "lm-zoo evaluate --help")
    one_line_error(capsys, cli.main(["evaluate", str(trained), "--split", "tset"]), "invalid choice: 'tset'")
    one_line_error(capsys, cli.main(["generate", str(trained), "--num-samples", "x"]), "--num-samples")


def test_the_console_script_prints_one_line(tmp_path: Path) -> None:
    """Through the installed ``lm-zoo`` in a process of its own: what a user's shell sees."""
    script = Path(sys.executable).with_name("lm-zoo")
    result = subprocess.run(
        [str(script), "fit", "--config", "nothere.yaml"], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "lm-zoo: error: --config nothere.yaml: no such file, and no shipped recipe of that name; lm-zoo recipes "
        "lists them"
    ]


def test_a_missing_checkpoint_is_refused_before_lightning_says_anything(tmp_path: Path) -> None:
    """``fit --ckpt_path missing.ckpt`` is one line, and none of Lightning's start-up lines (the seed, the devices, a
    warning about the checkpoint folder) comes before it: through the installed ``lm-zoo`` in a process of its own,
    where Lightning's log lines reach stderr as a user's shell sees them."""
    config = write_tiny_recipe(tmp_path / "run.yaml", write_word_corpus(tmp_path / "corpus", "a"))
    script = Path(sys.executable).with_name("lm-zoo")
    result = subprocess.run(
        [str(script), "fit", "--config", str(config), "--ckpt_path", "missing.ckpt"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "LM_ZOO_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "lm-zoo: error: --ckpt_path missing.ckpt: no such file: give the path of a .ckpt written by lm-zoo fit "
        "(or last)"
    ]
    assert "Seed set" not in result.stderr and "GPU available" not in result.stderr


@pytest.mark.parametrize(
    "ckpt_path", ["last", "best", "hpc", "registry:my-model", "s3://bucket/run/last.ckpt", "hf://user/repo/last.ckpt"]
)
def test_named_and_remote_checkpoints_are_left_to_lightning(
    ckpt_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``last`` (which lm-zoo's before_fit resolves), Lightning's other named checkpoints and its registry, and a
    remote path (fsspec reads it) name no local file, so the early check lets them pass."""
    monkeypatch.chdir(tmp_path)  # where no file of these names is
    check_ckpt_path(ckpt_path)


def test_an_unwritable_cache_is_one_line(workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    (workdir / "a-file").write_text("")
    monkeypatch.setenv("LM_ZOO_CACHE", str(workdir / "a-file" / "cache"))  # a file where a directory must be
    one_line_error(capsys, cli.main(["fit", "--config", str(config)]), "not a directory", "set LM_ZOO_CACHE")


def test_words_outside_the_vocabulary_are_said(
    trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert cli.main(["generate", str(trained), "--prompt", "w1 W2 zebra", "--num-samples", "1", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "2 prompt word(s) not in the model's vocabulary, read as <unk>: W2, zebra" in err
    assert "lower-case: w2 would be known" in err
    # Evaluation says how much of the scored text is <unk>: none of the training corpus, most of another's.
    other = workdir / "other"
    other.mkdir()
    for split in ("train", "valid", "test"):
        (other / f"{split}.txt").write_text("w1 q q q\n" * 5)  # 20 tokens + 5 <eos>: 15 unknown
    assert cli.main(["evaluate", str(trained), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unk_rate"] == 0
    assert cli.main(["evaluate", str(trained), "--corpus", str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unk_rate"] == pytest.approx(15 / 25)
    assert cli.main(["evaluate", str(trained), "--corpus", str(other)]) == 0
    assert "60.00% of them <unk>" in capsys.readouterr().out


def test_the_training_split_is_evaluated_at_the_evaluation_sizes(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert cli.main(["evaluate", str(trained), "--split", "train", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["eval_batch_size"], result["bptt"]) == (2, 5)  # the run's eval sizes, not its 4 x 6 training ones


def test_a_resumed_run_logs_on_in_its_tensorboard_version(tmp_path: Path) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    checkpoint = tmp_path / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt"
    trainer = Trainer(logger=TensorBoardLogger(tmp_path), default_root_dir=tmp_path)
    continue_logging_in(trainer, checkpoint)
    assert trainer.logger.version == 3 and Path(trainer.logger.log_dir) == checkpoint.parent.parent
    # A checkpoint elsewhere (a dirpath of its own) or a CSVLogger (which would delete the earlier metrics.csv): a new
    # version, as before.
    for logger, elsewhere in [
        (TensorBoardLogger(tmp_path), tmp_path / "ckpts" / "last.ckpt"),
        (CSVLogger(tmp_path), checkpoint),
    ]:
        trainer = Trainer(logger=logger, default_root_dir=tmp_path)
        continue_logging_in(trainer, elsewhere)
        assert trainer.logger.version == 0


def test_long_work_shows_progress_in_a_log(
    trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str], zoo_settings
) -> None:
    """Without a terminal (here: captured), a line every $LM_ZOO_PROGRESS_SECONDS instead of a bar."""
    zoo_settings(progress_seconds=0.0)
    capsys.readouterr()
    assert cli.main(["evaluate", str(trained), "--dynamic"]) == 0
    err = capsys.readouterr().err
    assert "lm-zoo: gradient statistics on train: 1/" in err and "lm-zoo: test: 1/" in err
    # fit: training and validation lines (with the loss), then where everything is and what to run next.
    config = _config(workdir, workdir / "corpus", name="barred")
    code = cli.main(["fit", "--config", str(config), "--trainer.enable_progress_bar", "true"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "lm-zoo: epoch 0: 1/8 batches (12%)" in err and ", train_loss " in err and "lm-zoo: validation: 1/" in err
    best = workdir / "barred" / "checkpoints" / "best.ckpt"
    assert f"lm-zoo: best checkpoint: {best} (val_loss " in err
    assert f"lm-zoo: evaluate: lm-zoo evaluate {best} --split test" in err
    saved = next((workdir / "barred").rglob("config.yaml"))  # the run's own, every setting it had
    assert f"--config {saved} --ckpt_path {workdir / 'barred' / 'checkpoints' / 'last.ckpt'}" in err


def test_the_progress_bar_says_epochs_and_versions_plainly() -> None:
    from types import SimpleNamespace

    from lightning_modules.progress import FitProgressBar

    bar = FitProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)  # GBW: max_steps, no epoch limit
    assert bar._get_train_description(3).strip() == "Epoch 3"
    bar._trainer = SimpleNamespace(max_epochs=10)
    assert bar._get_train_description(3).strip() == "Epoch 3/9"


def test_a_run_directory_is_a_source(trained: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``lm-zoo evaluate runs/x``: the run's newest best.ckpt, whatever version it went to."""
    capsys.readouterr()
    assert cli.main(["evaluate", str(workdir / "run"), "--json"]) == 0
    by_directory = json.loads(capsys.readouterr().out)
    assert cli.main(["evaluate", str(workdir / "run" / "checkpoints" / "best.ckpt"), "--json"]) == 0
    by_file = json.loads(capsys.readouterr().out)
    assert by_directory["source"] == by_file["source"] and by_directory["ppl"] == by_file["ppl"]
    empty = workdir / "empty-run"
    empty.mkdir()
    one_line_error(capsys, cli.main(["evaluate", str(empty)]), str(empty))


class RecordProcessGroupTimeout(L.Callback):
    """Test helper: the process group's timeout the strategy starts with, in ``seen``."""

    seen: object = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        RecordProcessGroupTimeout.seen = trainer.strategy._timeout


@pytest.mark.slow
def test_the_process_group_timeout_is_a_recorded_setting(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ten minutes by default (PyTorch's is thirty), set on the DDP strategy, written to the run's config.yaml."""
    from datetime import timedelta

    config = _config(workdir, write_word_corpus(workdir / "corpus", "a"))
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "1", "--trainer.accelerator", "cpu"]
    callback = ["--trainer.callbacks+=tests.test_cli.RecordProcessGroupTimeout"]
    # A DDP fit in this process leaves its rendezvous in os.environ (MASTER_PORT, WORLD_SIZE, LOCAL_RANK, ...), which
    # the multi-process runs of later tests would inherit and take for a launcher's: put the environment back.
    with mock.patch.dict(os.environ):
        assert cli.main(["fit", "--config", str(config), *ddp, *callback]) == 0
        assert RecordProcessGroupTimeout.seen == timedelta(seconds=600)
        assert cli.main(["fit", "--config", str(config), *ddp, *callback, "--process_group_timeout", "42"]) == 0
        assert RecordProcessGroupTimeout.seen == timedelta(seconds=42)
    saved = sorted((workdir / "run").rglob("config.yaml"))[-1].read_text()
    assert "process_group_timeout: 42" in saved
    code = cli.main(["fit", "--config", str(config), "--process_group_timeout", "0"])
    one_line_error(capsys, code, "--process_group_timeout must be at least 1 second, got 0")
