"""Hyperparameter search with Optuna over a space of dotted LightningCLI keys: the driver of ``lm-zoo tune``.

Melis et al. 2020 (Appendix A) tune with Google Vizier's batched Gaussian-process bandits over the ranges of their
Table 4 (``configs/tune/melis-table4.yaml``); Optuna is the open equivalent: a sampler (TPE), a pruner that stops
trials whose validation loss lags the median of earlier trials at the same step, and a storage (in memory, or any
SQLAlchemy URL, or ``grpc://HOST:PORT`` for an ``lm-zoo search serve``) through which several processes share one
study.

This module is the search: the space (:func:`load_space`), the config keys it sets (:func:`check_key`,
:func:`set_key`), a trial (:class:`Objective`, reporting to Optuna through :class:`ReportToOptuna`), the study
(:func:`create_study`) and which of its trials count (:func:`counted_trials`). The fit a trial runs is given to it
(``lm-zoo tune`` gives ``lm-zoo fit`` run in its own process), as is how the command splits the trials between
processes. The trial's value is the best validation metric of its checks (lamb reports its ``best_xe`` to the tuner
the same way).
"""

from __future__ import annotations

import copy
import difflib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import optuna  # the tune extra (pip install "lm-zoo[tune]")
import yaml
from lightning.pytorch.callbacks import Callback

from lightning_modules.storages import open_storage
from zoo.errors import ConfigError, LMZooError, TrainingDivergedError

SPACE_TYPES = ("float", "loguniform", "int", "categorical")


SPACE_FIELDS = {"type", "low", "high", "choices", "step"}


# ------------------------------------------------------------------------------------------------- the space
def load_space(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read and check a space file: ``dotted.key: {type: float|loguniform|int|categorical, low, high | choices}``.

    Raises:
        ConfigError: one line naming the file or entry and what is wrong with it.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--space {path}: no such file (a YAML mapping of dotted config keys to ranges)")
    try:
        space = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"--space {path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(space, dict) or not space:
        raise ConfigError(
            f"--space {path}: expected a mapping of dotted config keys to ranges, e.g. "
            "'optimizer.init_args.lr: {type: loguniform, low: 0.001, high: 0.004}'"
        )
    for key, entry in space.items():
        check_entry(str(key), entry, path)
    return {str(key): entry for key, entry in space.items()}


def check_entry(key: str, entry: Any, path: Path) -> None:
    """One space entry's type and range (see :func:`load_space`)."""
    where = f"--space {path}: {key}"
    if not isinstance(entry, dict) or "type" not in entry:
        raise ConfigError(f"{where}: expected {{type: {'|'.join(SPACE_TYPES)}, ...}}, got {entry!r}")
    kind = entry["type"]
    if kind not in SPACE_TYPES:
        raise ConfigError(f"{where}: unknown type {kind!r} (use {', '.join(SPACE_TYPES)})")
    unknown = set(entry) - SPACE_FIELDS
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))} (known: type, low, high, choices, step)"
        )
    if kind == "categorical":
        choices = entry.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: a categorical entry needs a non-empty list 'choices'")
        if not all(c is None or isinstance(c, (bool, int, float, str)) for c in choices):
            raise ConfigError(f"{where}: choices must be numbers, strings, booleans or null, got {choices!r}")
        return
    low, high = entry.get("low"), entry.get("high")
    numbers = (int,) if kind == "int" else (int, float)
    if not all(isinstance(v, numbers) and not isinstance(v, bool) for v in (low, high)):
        what = "integers" if kind == "int" else "numbers"
        raise ConfigError(f"{where}: low and high must be {what}, got low={low!r}, high={high!r}")
    if not low < high:
        raise ConfigError(f"{where}: low must be below high, got low={low}, high={high}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: a loguniform range needs low > 0, got {low}")


def suggest(trial: Any, key: str, entry: dict[str, Any]) -> Any:
    """Ask the Optuna trial for a value of ``key`` from its range."""
    kind = entry["type"]
    if kind == "categorical":
        return trial.suggest_categorical(key, entry["choices"])
    if kind == "int":
        return trial.suggest_int(key, entry["low"], entry["high"], step=entry.get("step", 1))
    if kind == "loguniform":
        return trial.suggest_float(key, float(entry["low"]), float(entry["high"]), log=True)
    return trial.suggest_float(key, float(entry["low"]), float(entry["high"]), step=entry.get("step"))


def check_key(config: dict[str, Any], key: str) -> None:
    """``key`` names a setting of ``config``: every part but the last exists, and the last exists too unless its
    parent is a free-form mapping (such as ``model.init_args.cell_options``), which the model checks itself."""
    parts = key.split(".")
    node: Any = config
    for depth, part in enumerate(parts):
        path = ".".join(parts[:depth]) or "the top level"
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            continue
        if isinstance(node, dict) and part in node:
            node = node[part]
            continue
        last = depth == len(parts) - 1
        free_form = node is None or (isinstance(node, dict) and "class_path" not in node)
        if last and depth >= 2 and parts[depth - 1] not in ("init_args", "trainer") and free_form:
            return
        names = list(node) if isinstance(node, dict) else []
        near = difflib.get_close_matches(part, names, n=1)
        hint = f" (did you mean {'.'.join([*parts[:depth], near[0]])}?)" if near else ""
        raise ConfigError(f"--space key {key}: the config has no {part!r} under {path}{hint}")


def set_key(config: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key in a nested config, creating a free-form mapping on the way (``check_key`` ran first)."""
    parts = key.split(".")
    node: Any = config
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value


def config_values(config: dict[str, Any], space: dict[str, dict[str, Any]], where: str) -> dict[str, Any]:
    """The config's own value of every key of the space (``--first-trial-from-config``), each inside its range."""
    values = {}
    for key, entry in space.items():
        node: Any = config
        for part in key.split("."):
            node = node[int(part)] if isinstance(node, list) else (node or {}).get(part)
        inside = (
            node in entry["choices"]
            if entry["type"] == "categorical"
            else isinstance(node, (int, float)) and entry["low"] <= node <= entry["high"]
        )
        if not inside:
            raise ConfigError(
                f"--first-trial-from-config: {where} sets {key} to {node!r}, outside the space's range; "
                "change the config or the space"
            )
        values[key] = node
    return values


# ------------------------------------------------------------------------------------------------ the trials
class ReportToOptuna(Callback):
    """Reports the monitored loss to the Optuna trial after every validation check and stops a pruned trial.

    optuna-integration's ``PyTorchLightningPruningCallback`` does the same but is a separate package pinned to
    Lightning's versions, and raises ``TrialPruned`` inside Lightning's loop; stopping with ``should_stop`` lets the
    run end normally (loggers and checkpoints closed), and the objective raises ``TrialPruned`` after ``fit``.
    """

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial, self.metric = trial, metric
        self.values: list[float] = []
        self.pruned_at: int | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            logged = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
            raise ConfigError(f"--metric {self.metric}: validation logged {logged}")
        self.values.append(float(value))
        self.trial.report(float(value), trainer.global_step)
        if self.trial.should_prune():
            self.pruned_at = trainer.global_step
            trainer.should_stop = True


class Objective:
    """One trial: the base config with the sampled values, fitted under ``workdir/trial_<n>``."""

    def __init__(
        self,
        base: dict[str, Any],
        space: dict[str, dict[str, Any]],
        workdir: Path,
        metric: str,
        maximize: bool,
        fit: Callable[[Path, list[Callback]], None],
        progress: bool = False,
    ) -> None:
        self.base, self.space, self.workdir, self.metric, self.maximize = base, space, workdir, metric, maximize
        self.fit = fit  # lm-zoo fit --config PATH with extra callbacks, a user's error raised as an LMZooError
        self.progress = progress  # each trial's fit shows its progress (the bar, or lines in a log)
        self.error: LMZooError | None = None  # a trial's settings that cannot work: the study stops, main says why

    def trial_config(self, params: dict[str, Any], root: Path | None) -> dict[str, Any]:
        """The base config with ``params`` set; with ``root``, a trial's quiet run writing under ``root``."""
        config = copy.deepcopy(self.base)
        for key, value in params.items():
            set_key(config, key, value)
        if root is not None:
            trainer = config.setdefault("trainer", {})
            trainer.update(
                {"default_root_dir": str(root), "enable_progress_bar": self.progress, "enable_model_summary": False}
            )
            if isinstance(config.get("checkpoint"), dict):
                config["checkpoint"]["dirpath"] = str(root / "checkpoints")
        return config

    def __call__(self, trial: Any) -> float:
        params = {key: suggest(trial, key, entry) for key, entry in self.space.items()}
        root = self.workdir / f"trial_{trial.number}"
        root.mkdir(parents=True, exist_ok=True)
        path = root / "config.yaml"
        path.write_text(yaml.safe_dump(self.trial_config(params, root), sort_keys=False))
        trial.set_user_attr("config", str(path))
        trial.set_user_attr("pid", os.getpid())
        report = ReportToOptuna(trial, self.metric)
        try:
            self.fit(path, [report])
        except TrainingDivergedError as err:  # the study goes on: optimize(catch=...) records the trial as failed
            trial.set_user_attr("diverged", str(err))
            raise
        except LMZooError as ours:  # e.g. a value the model refuses (jsonargparse's error, made ours by the fit)
            values = ", ".join(f"{k}={short(v)}" for k, v in params.items())
            # Raised, it would be logged by Optuna with two tracebacks before lm-zoo's line; kept, the trial fails
            # with one log line (its value is NaN), the study stops, and `optimize` below raises it.
            self.error = ConfigError(f"trial {trial.number} ({values}): {ours}; fix the space or the config")
            trial.set_user_attr("error", str(self.error))
            trial.study.stop()
            return math.nan
        if report.pruned_at is not None:
            raise optuna.TrialPruned(f"{self.metric} {report.values[-1]:.4f} at step {report.pruned_at}")
        if not report.values:
            raise ConfigError(f"the config ran no validation, so there is no {self.metric} to tune on")
        return max(report.values) if self.maximize else min(report.values)  # the best check, as lamb reports


# ------------------------------------------------------------------------------------------ the study's total
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


def counted_trials(study: Any) -> list[Any]:
    """The trials that count towards ``--trials``: those that tried their setting to an outcome -- complete, pruned,
    or failed because the training diverged (a setting tried, as Optuna's ``n_trials`` counts it). A trial that
    failed otherwise (a crash, or settings the config could not take: see :class:`Objective`) or was left RUNNING by a
    killed process says nothing about its setting, so a rerun runs another in its place."""
    finished = study.get_trials(deepcopy=False, states=FINISHED)
    return [t for t in finished if t.state != optuna.trial.TrialState.FAIL or "diverged" in t.user_attrs]


class StopAtTotal:
    """Stops a process's ``optimize`` once the study holds ``total`` counted trials: Optuna's ``MaxTrialsCallback``
    with :func:`counted_trials` for its count (its filter is by state only). The shares of ``lm-zoo tune`` already sum
    to the missing trials; this matters when other machines run trials of the same study at the same time."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, study: Any, trial: Any) -> None:
        if len(counted_trials(study)) >= self.total:
            study.stop()


def worker_environment(index: int, gpus: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of ``--jobs`` helper ``index`` (1, 2, ...; this process is 0): on a machine with several GPUs,
    ``CUDA_VISIBLE_DEVICES`` shows it one of them, in turn.

    A trial trains on one device, which Lightning takes to be the first visible GPU: without this every process would
    train on that one while the others idle. An index past the GPUs wraps around (processes share a GPU then).

    Args:
        index: the helper's number; 0 is the main process, which keeps the first visible GPU.
        gpus: the GPUs torch sees (``torch.cuda.device_count()``).
        environ: the environment to start from (default: this process's).
    """
    env = dict(os.environ if environ is None else environ)
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    visible = visible or [str(n) for n in range(gpus)]
    if gpus > 1 and len(visible) > 1:
        env["CUDA_VISIBLE_DEVICES"] = visible[index % min(gpus, len(visible))]
    return env


def short(value: Any) -> str:
    """A parameter's value as a line shows it: a float to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def create_study(
    storage: str | None,
    study_name: str,
    direction: str,
    seed: int | None,
    pruner: str = "median",
    pruner_startup_trials: int = 5,
    pruner_warmup_steps: int = 0,
) -> Any:
    """The study ``study_name`` in ``storage`` (in memory if ``None``; ``grpc://`` and journal ``.log`` files too),
    created or loaded, with a TPE sampler and a median pruner (``pruner="none"``: no pruning)."""
    chosen = (
        optuna.pruners.MedianPruner(pruner_startup_trials, pruner_warmup_steps)
        if pruner == "median"
        else optuna.pruners.NopPruner()
    )
    return optuna.create_study(
        storage=open_storage(storage) if storage else None,
        study_name=study_name,
        direction=direction,
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=chosen,
        load_if_exists=True,
    )


def reseed_resumed(study: Any, seed: int | None) -> int | None:
    """The sampler seed of a run that adds trials to ``study``: ``seed`` offset by the trials the study holds (set on
    its sampler), since a sampler seeded as in the first run would draw that run's settings again; the offset is a
    number the storage fixes, so the rerun is reproducible too."""
    if seed is None or not study.trials:
        return seed
    seed += len(study.trials)
    study.sampler = optuna.samplers.TPESampler(seed=seed)
    return seed


def optimize(study: Any, objective: Objective, trials: int, total: int) -> None:
    """Run ``trials`` trials of ``study`` in this process, stopping early once the study holds ``total`` counted
    trials (other processes add theirs); a diverged trial is recorded as failed and the study goes on.

    Raises:
        LMZooError: a trial's settings could not work (:class:`Objective` stopped the study on it).
    """
    study.optimize(
        objective, n_trials=trials, catch=(TrainingDivergedError,), gc_after_trial=True, callbacks=[StopAtTotal(total)]
    )
    if objective.error is not None:
        raise objective.error


def best_trial(study: Any) -> Any:
    """The study's best complete trial.

    Raises:
        ConfigError: no trial completed (all were pruned or diverged).
    """
    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
        raise ConfigError("no trial finished (all were pruned or diverged, see above): no best config to write")
    return study.best_trial
