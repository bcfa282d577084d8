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
) -> tuple[Any, Path, float]:
    """Run (or continue) one cell's ``lm-zoo tune`` study and find its best trial.

    The study lives in ``cell/study.db`` (SQLite), its first trial is ``config``'s own values
    (``--first-trial-from-config``) and the trials' output goes to ``cell/tune.log``.

    Returns:
        The best Optuna trial (by the monitored validation loss), its ``best.ckpt`` and the seconds the search took.
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
    best = optuna.load_study(study_name=study, storage=storage).best_trial
    checkpoint = next((cell / "trials" / f"trial_{best.number}").rglob("best.ckpt"))
    return best, checkpoint, seconds


def relative(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it (results files name checkpoints portably)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)
