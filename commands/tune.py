"""``lm-zoo tune``: hyperparameter search with Optuna over a space of dotted LightningCLI keys.

Melis et al. 2020 (Appendix A) tune with Google Vizier's batched Gaussian-process bandits over the ranges of their
Table 4 (``configs/tune/melis-table4.yaml``); Optuna is the open equivalent: a sampler (TPE), a pruner that stops
trials whose validation loss lags the median of earlier trials at the same step, and a storage (in memory, or any
SQLAlchemy URL, or ``grpc://HOST:PORT`` for an ``lm-zoo search serve``) through which several processes -- on one
machine (``--jobs``) or many (the same ``--storage`` and ``--study-name`` on each) -- share one study.

Each trial is ``lm-zoo fit`` run in this process, on one device (:func:`commands.lightning.in_process_devices`: a
multi-device launcher would re-run the tune command itself), on a copy of the full config (what ``--print_config``
prints, so every key has a value) with the sampled values set, under ``<workdir>/trial_<n>/``. In-process because a
fresh interpreter per trial pays the torch / Lightning import again (seconds, which is most of a small trial); parallel
trials are separate processes instead of Optuna's ``n_jobs`` threads, which would share torch's global RNG (and
``seed_everything``) and the GIL; on a machine with several GPUs each process trains on its own
(:func:`worker_environment`). The trial's value is the best validation ``--metric`` of its checks (lamb reports
its ``best_xe`` to the tuner the same way).

``--trials N`` is the study's total: the trials it holds that tried their setting to an outcome (complete, pruned or
diverged; see :func:`counted_trials`), so the same command run again on the same storage runs only the trials still
missing -- none once the study has N -- and a larger N runs the difference. The best trial's config is written as a
complete YAML for ``lm-zoo fit --config``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import io
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import optuna  # the tune extra (pip install "lm-zoo[tune]")
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from commands.common import CommandParser, user_error
from commands.lightning import in_process_devices, run_lightning
from commands.recipes import config_file
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


# ------------------------------------------------------------------------------------------ configs by key
def full_config(config: str | Path) -> dict[str, Any]:
    """The config as ``lm-zoo fit --config X --print_config`` prints it: every key of every class with a value."""
    if not Path(config).is_file():
        raise ConfigError(f"--config {config}: no such file")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            run_lightning(["fit", "--config", str(config), "--print_config"])
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise
    return yaml.safe_load(out.getvalue())


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


def run_fit(config: Path, callbacks: list[Callback]) -> None:
    """``lm-zoo fit --config config`` in this process, with extra callbacks that the config cannot name."""
    run_lightning(["fit", "--config", str(config)], callbacks)


class Objective:
    """One trial: the base config with the sampled values, fitted under ``workdir/trial_<n>``."""

    def __init__(
        self,
        base: dict[str, Any],
        space: dict[str, dict[str, Any]],
        workdir: Path,
        metric: str,
        maximize: bool,
        progress: bool = False,
    ) -> None:
        self.base, self.space, self.workdir, self.metric, self.maximize = base, space, workdir, metric, maximize
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
            run_fit(path, [report])
        except TrainingDivergedError as err:  # the study goes on: optimize(catch=...) records the trial as failed
            trial.set_user_attr("diverged", str(err))
            raise
        except Exception as err:  # e.g. a value the model refuses (wrapped in jsonargparse's error): name the trial
            ours = user_error(err)
            if ours is None:
                raise
            values = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
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
    with :func:`counted_trials` for its count (its filter is by state only). The shares of :func:`cmd_tune` already sum
    to the missing trials; this matters when other machines run trials of the same study at the same time."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, study: Any, trial: Any) -> None:
        if len(counted_trials(study)) >= self.total:
            study.stop()


# --------------------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lm-zoo tune",
        description="search hyperparameters with Optuna; writes the best trial's config for lm-zoo fit --config",
    )
    parser.add_argument(
        "--config", required=True, type=config_file, help="the lm-zoo fit config (or recipe) to start from"
    )
    parser.add_argument(
        "--space",
        required=True,
        type=lambda value: config_file(value, "--space"),
        help="YAML: dotted.config.key: {type, low, high | choices}; or a shipped space's name (tune/melis-table4)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        required=True,
        metavar="N",
        help="the study's total of finished trials (complete, pruned or diverged), over --jobs processes: on a study "
        "in --storage that already holds some, only the missing ones run (none once it holds N)",
    )
    parser.add_argument(
        "--storage",
        help="Optuna storage URL, e.g. sqlite:///tune.db, or grpc://HOST:PORT for an lm-zoo search serve on another "
        "machine (default: in memory)",
    )
    parser.add_argument("--study-name", help="the study in --storage (default: <config>-<space> file names)")
    parser.add_argument("--jobs", type=int, default=1, help="parallel processes on this machine (share --storage)")
    parser.add_argument("--out", help="where to write the best config (default: <workdir>/best.yaml)")
    parser.add_argument("--workdir", help="trial directories (default: <trainer.default_root_dir>/tune/<study>)")
    parser.add_argument("--metric", default="val_loss", help="the validation metric to optimise (default val_loss)")
    parser.add_argument("--direction", choices=("minimize", "maximize"), default="minimize")
    parser.add_argument("--pruner", choices=("median", "none"), default="median")
    parser.add_argument("--pruner-startup-trials", type=int, default=5, help="finished trials before pruning starts")
    parser.add_argument("--pruner-warmup-steps", type=int, default=0, help="steps of a trial before it can be pruned")
    parser.add_argument(
        "--seed", type=int, help="the sampler's seed (a rerun adding trials offsets it by the trials the study holds)"
    )
    parser.add_argument(
        "--first-trial-from-config",
        action="store_true",
        help="a new study's first trial takes the config's own values of the space's keys (a known recipe first)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a --jobs helper process
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)  # a helper's share of the cores
    parser.add_argument("--share", type=int, default=None, help=argparse.SUPPRESS)  # a helper's share of the trials
    return parser


def cmd_tune(argv: Sequence[str]) -> None:
    """``lm-zoo tune --config X --space S --trials N``: run the study, print a summary, write the best config."""
    args = build_parser().parse_args(argv)
    if args.trials < 1 or args.jobs < 1:
        raise ConfigError(f"--trials and --jobs must be at least 1, got {args.trials} and {args.jobs}")
    if args.jobs > 1 and args.storage and args.storage.startswith("sqlite:///:memory:"):
        raise ConfigError("--jobs > 1 needs a storage the processes share, not an in-memory database")
    # --jobs processes share the cores: J processes of torch's default thread count (all cores each) on C cores run
    # many times slower than J processes of C / J threads, as their threads wait on each other's preempted ones.
    threads = args.threads or (max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None)
    if threads:
        torch.set_num_threads(threads)
    space = load_space(args.space)
    base = full_config(args.config)
    for key in space:
        check_key(base, key)
    trainer = base.get("trainer") or {}
    try:  # before any training; a trial would stop at the same check
        in_process_devices(trainer.get("devices", "auto"), trainer.get("num_nodes") or 1)
    except ConfigError as err:
        raise ConfigError(f"--config {args.config}: {err}; --jobs N runs trials side by side instead") from None
    study_name = args.study_name or f"{Path(args.config).stem}-{Path(args.space).stem}"
    root = (base.get("trainer") or {}).get("default_root_dir") or "runs"
    workdir = Path(args.workdir or Path(root) / "tune" / study_name)
    workdir.mkdir(parents=True, exist_ok=True)
    storage = args.storage or (f"sqlite:///{(workdir / 'study.db').resolve()}" if args.jobs > 1 else None)
    # The main process's trials show their progress; --jobs helpers, which share its terminal, stay quiet.
    objective = Objective(base, space, workdir, args.metric, args.direction == "maximize", progress=not args.worker)
    if not args.worker:
        # Parse one trial's config before any training, so that a key or value LightningCLI rejects fails now.
        check_trial_config(objective, space, workdir)
    pruner = (
        optuna.pruners.MedianPruner(args.pruner_startup_trials, args.pruner_warmup_steps)
        if args.pruner == "median"
        else optuna.pruners.NopPruner()
    )
    study = optuna.create_study(
        storage=open_storage(storage) if storage else None,  # grpc:// and journal .log files too
        study_name=study_name,
        direction=args.direction,
        sampler=optuna.samplers.TPESampler(seed=args.seed),
        pruner=pruner,
        load_if_exists=True,
    )
    seed = args.seed
    if seed is not None and not args.worker and study.trials:
        # A rerun that adds trials to a study: a sampler seeded as in the first run would draw that run's settings
        # again. Offset by the trials the study holds (a number the storage fixes, so the rerun is reproducible too).
        seed += len(study.trials)
        study.sampler = optuna.samplers.TPESampler(seed=seed)
    if args.first_trial_from_config and not args.worker and not study.trials:
        study.enqueue_trial(config_values(base, space, args.config))
    enough = StopAtTotal(args.trials)
    if args.worker:
        study.optimize(
            objective, n_trials=args.share, catch=(TrainingDivergedError,), gc_after_trial=True, callbacks=[enough]
        )
        if objective.error is not None:
            raise objective.error
        return
    done_before = {t.number for t in study.trials if t.state.is_finished()}
    held = len(counted_trials(study))
    missing = max(0, args.trials - held)
    print(trials_line(study_name, held, args.trials, missing, args.jobs), flush=True)
    # --jobs J: J - 1 helper processes and this one share the missing trials, each taking its part.
    shares = [missing // args.jobs + (i < missing % args.jobs) for i in range(args.jobs)]
    gpus = torch.cuda.device_count()
    helpers = [
        subprocess.Popen(
            worker_command(argv, storage, study_name, args.trials, share, None if seed is None else seed + i, threads),
            env=worker_environment(i, gpus),
        )
        for i, share in enumerate(shares[1:], start=1)
        if share > 0
    ]
    try:
        if shares[0] > 0:
            study.optimize(
                objective, n_trials=shares[0], catch=(TrainingDivergedError,), gc_after_trial=True, callbacks=[enough]
            )
    finally:
        failed = [helper.args for helper in helpers if helper.wait() != 0]
    if objective.error is not None:
        raise objective.error
    if failed:
        raise ConfigError(f"{len(failed)} of the --jobs helper processes failed (their output says why)")
    print_summary(study, done_before, args.metric)
    finished = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not finished:
        raise ConfigError("no trial finished (all were pruned or diverged, see above): no best config to write")
    best = study.best_trial
    out = Path(args.out or workdir / "best.yaml")
    write_best(out, objective, best, args, study_name)
    print(f"best: trial {best.number}, {args.metric} {best.value:.4f}; config written to {out}")


def check_trial_config(objective: Objective, space: dict[str, dict[str, Any]], workdir: Path) -> None:
    """Parse the config with every key at the low end (first choice) of its range, as a trial would start."""
    low = {key: e["choices"][0] if e["type"] == "categorical" else e["low"] for key, e in space.items()}
    path = workdir / "check.yaml"
    path.write_text(yaml.safe_dump(objective.trial_config(low, None), sort_keys=False))
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            run_lightning(["fit", "--config", str(path), "--print_config"])
        except SystemExit as stop:  # --print_config's normal end
            if stop.code not in (0, None):
                raise
        except ConfigError as err:  # the parser's one line (commands.lightning.LMZooArgumentParser)
            raise ConfigError(f"--space {', '.join(space)}: LightningCLI rejects the values ({err})") from None
    path.unlink()


def trials_line(study_name: str, finished: int, target: int, missing: int, jobs: int) -> str:
    """What this run will do about ``--trials``: how many trials the study holds and how many run now."""
    held = f"study {study_name!r} holds {finished} finished trial{'s' * (finished != 1)}"  # as --trials counts them
    if missing == 0:
        return f"{held}, --trials {target}: none to run"
    over = f" over {min(jobs, missing)} processes" if min(jobs, missing) > 1 else ""
    return f"{held}, --trials {target}: running {missing}{over}"


def worker_command(
    argv: Sequence[str],
    storage: str,
    study_name: str,
    trials: int,
    share: int,
    seed: int | None,
    threads: int | None = None,
) -> list[str]:
    """This command for a helper process: same config and space, the same --trials total, its share of the missing
    trials, the shared storage, its share of the cores."""
    drop = {"--trials", "--jobs", "--storage", "--study-name", "--seed", "--out", "--threads", "--share"}
    kept: list[str] = []
    skip = False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif name in drop:
            skip = "=" not in arg
        else:
            kept.append(arg)
    extra = ["--seed", str(seed)] if seed is not None else []
    extra += ["--threads", str(threads)] if threads else []
    tail = ["--trials", str(trials), "--share", str(share), "--storage", storage, "--study-name", study_name]
    tail += ["--worker", *extra]
    return [sys.executable, "-m", "cli", "tune", *kept, *tail]


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


def print_summary(study: Any, done_before: set[int], metric: str) -> None:
    """One line per trial this run finished: number, state, value, its last reported step, its values."""
    for trial in study.trials:
        if trial.number in done_before or not trial.state.is_finished():
            continue
        value = "-" if trial.value is None else f"{trial.value:.4f}"
        step = max(trial.intermediate_values, default=None)
        params = ", ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
        print(f"trial {trial.number:>3} {trial.state.name.lower():<8} {metric} {value:>8}  last step {step}  {params}")


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def write_best(out: Path, objective: Objective, best: Any, args: argparse.Namespace, study_name: str) -> None:
    """The best trial's full config, with a header saying where it came from."""
    config = objective.trial_config(best.params, None)
    header = [
        f"# lm-zoo tune --config {args.config} --space {args.space}: the best of study {study_name!r}",
        f"# trial {best.number}: best {args.metric} {best.value:.6g} over its validation checks",
        *(f"#   {key}: {_short(value)}" for key, value in best.params.items()),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False))
