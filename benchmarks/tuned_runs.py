"""What the benchmark scripts that tune models per table cell share (music_table.py, reverse_copy.py): one cell's
small search through ``lm-zoo tune`` in a directory of its own. (A model's size for a parameter budget is
``zoo.units_for_budget``.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def tune_cell(
    cell: Path, study: str, config: dict[str, Any], space: dict[str, Any], trials: int, jobs: int
) -> tuple[Any, Path, float, dict[str, int]]:
    """Run (or continue) one cell's ``lm-zoo tune`` study to ``trials`` trials in all and find its best trial.

    The study lives in ``cell/study.db`` (SQLite), its first trial is ``config``'s own values
    (``--first-trial-from-config``) and the trials' output goes to ``cell/tune.log``. ``--trials`` is the study's
    total, so a study that already holds ``trials`` trials runs none, and one that holds fewer runs the rest.

    Returns:
        The best Optuna trial (by the monitored validation loss), its ``best.ckpt``, the seconds this call took, and
        the trials the study holds, counted from it (:func:`trial_counts`).
    """
    import optuna
    import yaml

    cell.mkdir(parents=True, exist_ok=True)
    config_file, space_file = cell / "config.yaml", cell / "space.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    space_file.write_text(yaml.safe_dump(space, sort_keys=False))
    storage = f"sqlite:///{(cell / 'study.db').resolve()}"
    command = [sys.executable, "-m", "cli", "tune", "--config", str(config_file), "--space", str(space_file)]
    command += ["--trials", str(trials), "--jobs", str(jobs), "--storage", storage, "--study-name", study]
    command += ["--workdir", str(cell / "trials"), "--pruner", "none", "--seed", "0", "--first-trial-from-config"]
    start = time.monotonic()
    with open(cell / "tune.log", "a") as log:  # the trials' progress and summary; the scripts print a line a cell
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"lm-zoo tune failed for {study}; see {cell / 'tune.log'}")
    seconds = time.monotonic() - start
    loaded = optuna.load_study(study_name=study, storage=storage)
    best = loaded.best_trial
    checkpoint = next((cell / "trials" / f"trial_{best.number}").rglob("best.ckpt"))
    return best, checkpoint, seconds, trial_counts(loaded)


def trial_counts(study: Any) -> dict[str, int]:
    """What a results file records of a cell's search: the trials that count towards ``lm-zoo tune --trials``
    (``trials_run``) and how each ended, read from the study rather than from the command line."""
    from lightning_modules.tuning import counted_trials

    states = [t.state.name for t in counted_trials(study)]
    return {
        "trials_run": len(states),
        "trials_complete": states.count("COMPLETE"),
        "trials_pruned": states.count("PRUNED"),
        "trials_diverged": states.count("FAIL"),  # the only failed trials counted
    }


def check_fresh(cells: list[Path]) -> None:
    """A run that starts a new results file trains every cell afresh: none of its cells' directories may hold a study
    already (whose trials ``lm-zoo tune --trials`` would count, so that nothing would be trained)."""
    from benchmarks.output import fail

    held = [cell for cell in cells if (cell / "study.db").exists()]
    if held:
        fail(
            f"{held[0]} already holds a study ({len(held)} of the cells do): give --resume to continue that run's "
            "results file, or a new --workdir"
        )


def relative(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it (results files name checkpoints portably)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)
