"""``lm-zoo tune``: Optuna trials of a tiny config in two processes sharing one SQLite study, the best config reused
by ``lm-zoo fit``, median pruning of a clearly worse trial, and one-line errors for a bad space."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
import pytest
import yaml

import cli
from lightning_modules.tuning import load_space
from tests.conftest import TINY_TUNE, one_line_error, write_tiny_recipe, write_word_corpus

ROOT = Path(__file__).resolve().parents[1]


# 8 steps, a validation check (3 batches) every 2 steps: 4 reports per trial.
@pytest.fixture
def workdir(workdir: Path) -> Path:
    """The test's folder (conftest's), holding ``tiny.yaml``: the tiny fit as tune trials it."""
    write_tiny_recipe(workdir / "tiny.yaml", write_word_corpus(workdir / "corpus", "tuning"), workdir, **TINY_TUNE)
    return workdir


def write_space(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.slow
def test_three_trials_in_two_processes_and_a_best_config_fit_accepts(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    space = write_space(
        workdir / "space.yaml",
        "optimizer.init_args.lr: {type: loguniform, low: 0.3, high: 3.0}\n"
        "model.init_args.dropout: {type: float, low: 0.0, high: 0.5}\n"
        "model.init_args.cell_options.forget_bias: {type: categorical, choices: [0.0, 1.0]}\n",
    )
    out = workdir / "best.yaml"
    argv = ["tune", "--config", "tiny.yaml", "--space", str(space), "--trials", "3", "--out", str(out), "--seed", "0"]
    assert cli.main([*argv, "--jobs", "2"]) == 0  # this process and one helper, sharing a SQLite study
    lines = capsys.readouterr().out.splitlines()
    trials = [line for line in lines if line.startswith("trial ")]
    assert len(trials) == 3 and all(" complete " in line for line in trials), lines
    values = {int(line.split()[1]): float(line.split()[4]) for line in trials}
    best_number = min(values, key=values.get)
    assert lines[-1].startswith(f"best: trial {best_number}, val_loss {values[best_number]:.4f}")
    study_dir = workdir / "runs" / "tune" / "tiny-space"
    stored = optuna.load_study(study_name="tiny-space", storage=f"sqlite:///{study_dir / 'study.db'}").trials
    assert sorted(t.number for t in stored) == sorted(values)
    assert len({t.user_attrs["pid"] for t in stored}) == 2  # two trials here, one in the helper process

    # The best config: the tiny config with the best trial's values, complete enough for `lm-zoo fit`.
    best = yaml.safe_load(out.read_text())
    trial_config = yaml.safe_load((study_dir / f"trial_{best_number}" / "config.yaml").read_text())
    lr = best["optimizer"]["init_args"]["lr"]
    assert lr == trial_config["optimizer"]["init_args"]["lr"] and 0.3 <= lr <= 3.0
    assert best["model"]["init_args"]["dropout"] == trial_config["model"]["init_args"]["dropout"]
    assert best["model"]["init_args"]["cell_options"] == trial_config["model"]["init_args"]["cell_options"]
    assert best["model"]["init_args"]["cell_options"]["forget_bias"] in (0.0, 1.0)
    assert best["trainer"]["default_root_dir"] == f"{workdir}/runs"  # the run's own, not the trial's directory
    with pytest.raises(SystemExit) as printed_config:  # LightningCLI exits after printing
        cli.main(["fit", "--config", str(out), "--print_config"])
    assert printed_config.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"]["init_args"]["lr"] == lr
    assert printed["model"]["init_args"]["cell_options"] == best["model"]["init_args"]["cell_options"]


@pytest.mark.slow
def test_the_first_trial_can_be_the_configs_own_values(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    space = write_space(
        workdir / "space.yaml",
        "optimizer.init_args.lr: {type: categorical, choices: [0.5, 1.0, 2.0]}\n"
        "model.init_args.hidden_size: {type: int, low: 4, high: 12}\n",
    )
    storage = f"sqlite:///{workdir / 'study.db'}"
    argv = ["tune", "--config", "tiny.yaml", "--space", str(space), "--trials", "2", "--storage", storage]
    assert cli.main([*argv, "--pruner", "none", "--seed", "3", "--first-trial-from-config"]) == 0
    trials = optuna.load_study(study_name="tiny-space", storage=storage).trials
    assert trials[0].params == {"optimizer.init_args.lr": 1.0, "model.init_args.hidden_size": 8}  # the tiny fit's own
    capsys.readouterr()
    # A config value outside the space cannot be a trial of it: one line, before any training.
    narrow = write_space(workdir / "narrow.yaml", "optimizer.init_args.lr: {type: float, low: 2.0, high: 3.0}\n")
    code = cli.main(
        ["tune", "--config", "tiny.yaml", "--space", str(narrow), "--trials", "1", "--first-trial-from-config"]
    )
    one_line_error(capsys, code, "sets optimizer.init_args.lr to 1.0", "outside the space's range")


@pytest.mark.slow
def test_trials_is_the_studys_total_so_a_rerun_adds_only_the_missing_trials(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    space = write_space(workdir / "space.yaml", "optimizer.init_args.lr: {type: loguniform, low: 0.3, high: 3.0}\n")
    storage = f"sqlite:///{workdir / 'study.db'}"
    argv = ["tune", "--config", "tiny.yaml", "--space", str(space), "--storage", storage, "--pruner", "none"]
    argv += ["--seed", "0"]

    def run(trials: int) -> tuple[str, list[optuna.trial.FrozenTrial]]:
        assert cli.main([*argv, "--trials", str(trials)]) == 0
        return capsys.readouterr().out, optuna.load_study(study_name="tiny-space", storage=storage).trials

    out, first = run(1)
    assert "holds 0 finished trials, --trials 1: running 1" in out and len(first) == 1
    out, again = run(1)  # the same command on the same storage: nothing missing, nothing trained
    assert "holds 1 finished trial, --trials 1: none to run" in out
    assert [t.number for t in again] == [0] and not any(line.startswith("trial ") for line in out.splitlines())
    assert out.splitlines()[-1].startswith("best: trial 0,")  # the best config is still written
    out, raised = run(2)  # a larger total runs the difference
    assert "holds 1 finished trial, --trials 2: running 1" in out
    assert [t.number for t in raised] == [0, 1] and all(t.state.name == "COMPLETE" for t in raised)
    assert [line.split()[1] for line in out.splitlines() if line.startswith("trial ")] == ["1"]
    # The added trial is a new draw, not the first run's sampler replaying its first setting.
    assert raised[1].params != raised[0].params


def test_only_trials_that_tried_their_setting_count(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    space = write_space(workdir / "space.yaml", "optimizer.init_args.lr: {type: loguniform, low: 0.3, high: 3.0}\n")
    storage = f"sqlite:///{workdir / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="tiny-space")
    study.ask()  # RUNNING forever, as after a kill: not counted
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)  # a crash: not counted
    diverged = study.ask()
    diverged.set_user_attr("diverged", "loss nan at step 3")  # as Objective records a TrainingDivergedError
    study.tell(diverged, state=optuna.trial.TrialState.FAIL)  # a setting tried to its outcome: counted
    argv = ["tune", "--config", "tiny.yaml", "--space", str(space), "--storage", storage, "--trials", "2"]
    assert cli.main(argv) == 0
    assert "holds 1 finished trial, --trials 2: running 1" in capsys.readouterr().out
    states = [t.state.name for t in optuna.load_study(study_name="tiny-space", storage=storage).trials]
    assert states == ["RUNNING", "FAIL", "FAIL", "COMPLETE"]


@pytest.mark.slow
def test_median_pruning_stops_a_clearly_worse_trial(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # lr 3 brings the tiny model's validation loss down at every check; lr 1e-6 leaves it at its initial value.
    space = write_space(workdir / "space.yaml", "optimizer.init_args.lr: {type: categorical, choices: [3.0, 1.0e-6]}\n")
    storage = f"sqlite:///{workdir / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="pruning")
    for lr in (3.0, 1e-6):  # a fixed order: a good trial first, so the median has something to compare with
        study.enqueue_trial({"optimizer.init_args.lr": lr})
    argv = ["tune", "--config", "tiny.yaml", "--space", str(space), "--trials", "2", "--storage", storage]
    argv += ["--study-name", "pruning", "--pruner-startup-trials", "1"]
    assert cli.main(argv) == 0
    trials = optuna.load_study(study_name="pruning", storage=storage).trials
    states = [t.state for t in trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED]
    good, bad = trials[0].intermediate_values, trials[1].intermediate_values
    assert list(good) == [2, 4, 6, 8] and list(bad) == [2]  # stopped at its first check, 6 of its 8 steps unrun
    assert bad[2] > good[2]
    assert "best: trial 0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("space", "fragments"),
    [
        (None, ("no such file",)),
        ("[1, 2]", ("expected a mapping",)),
        ("optimizer.init_args.lr: {type: gaussian, low: 1, high: 2}", ("unknown type 'gaussian'",)),
        ("optimizer.init_args.lr: {type: float, low: 0.5, high: 0.1}", ("low must be below high",)),
        ("optimizer.init_args.lr: {type: loguniform, low: 0.0, high: 0.1}", ("needs low > 0",)),
        ("optimizer.init_args.lr: {type: categorical, choices: []}", ("non-empty list",)),
        ("model.init_args.num_layers: {type: int, low: 1.5, high: 3}", ("must be integers",)),
        ("optimizer.init_args.lr: {type: float, lo: 0.1, high: 1}", ("unknown field(s) lo",)),
        (
            "model.init_args.hiden_size: {type: int, low: 4, high: 8}",
            ("no 'hiden_size'", "model.init_args.hidden_size"),
        ),
        ("trainer.max_epoch: {type: int, low: 1, high: 2}", ("no 'max_epoch' under trainer",)),
        ("model.init_args.tie_weights: {type: categorical, choices: [maybe]}", ("LightningCLI rejects",)),
    ],
    ids=["missing", "not-a-mapping", "type", "range", "log", "choices", "int", "field", "key", "trainer-key", "value"],
)
def test_bad_space_is_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], space: str | None, fragments: tuple[str, ...]
) -> None:
    path = workdir / "space.yaml"
    if space is not None:
        path.write_text(space + "\n")
    code = cli.main(["tune", "--config", "tiny.yaml", "--space", str(path), "--trials", "1"])
    one_line_error(capsys, code, *fragments)


def test_a_space_that_does_not_fit_the_model_stops_at_its_first_trial_in_one_line(
    workdir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The key exists (cell_options is free-form), but the LSTM takes no Mogrifier rounds: the first trial finds out.
    Optuna logs a failed trial with two tracebacks of its own; here it gets one line, and lm-zoo's says why."""
    path = write_space(workdir / "space.yaml", "model.init_args.cell_options.rounds: {type: int, low: 1, high: 3}\n")
    code = cli.main(["tune", "--config", "tiny.yaml", "--space", str(path), "--trials", "3"])
    last = one_line_error(capfd, code, "trial 0 (model.init_args.cell_options.rounds=", "no option 'rounds'")
    assert "fix the space or the config" in last


def test_shipped_table_4_space_fits_the_mogrifier_config() -> None:
    space = load_space(ROOT / "configs" / "tune" / "melis-table4.yaml")
    text = (ROOT / "configs" / "tune" / "melis-table4.yaml").read_text()
    assert re.search(r"Table 4", text)
    # Every key names a setting of the paper's PTB config.
    from commands.tune import full_config
    from lightning_modules.tuning import check_key

    base = full_config(ROOT / "configs" / "ptb" / "mogrifier.yaml")
    for key in space:
        check_key(base, key)
    assert space["model.init_args.cell_options.rounds"] == {"type": "int", "low": 0, "high": 6}
    assert space["model.init_args.cell_options.rank"] == {"type": "int", "low": -20, "high": 100}


def test_tune_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", "--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage: lm-zoo tune" in out and "--space" in out and "--storage" in out


def test_helper_processes_get_their_share_of_the_cores() -> None:
    from commands.tune import worker_command

    argv = ["--config", "c.yaml", "--space", "s.yaml", "--trials", "9", "--jobs", "2", "--threads", "8"]
    command = worker_command(argv, "sqlite:///t.db", "study", 9, 4, 7, threads=1)
    assert command[-5:] == ["--worker", "--seed", "7", "--threads", "1"]
    # The study's total, as given, and the part of the missing trials this helper runs.
    assert command[command.index("--trials") + 1] == "9" and command[command.index("--share") + 1] == "4"
    assert command.count("--threads") == 1 and command.count("--trials") == 1
    assert "--jobs" not in command and "8" not in command


def test_trials_of_the_main_process_show_progress_helpers_do_not(tmp_path: Path) -> None:
    from commands.tune import run_fit
    from lightning_modules.tuning import Objective

    base = {"trainer": {"max_epochs": 1}}
    for progress in (True, False):
        objective = Objective(base, {}, tmp_path, "val_loss", False, run_fit, progress=progress)
        config = objective.trial_config({}, tmp_path / "t")
        assert config["trainer"]["enable_progress_bar"] is progress
