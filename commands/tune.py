"""``lm-zoo tune``: hyperparameter search with Optuna (:mod:`lightning_modules.tuning`, the driver) over a space
of dotted LightningCLI keys.

Each trial is ``lm-zoo fit`` run in this process, on one device (a multi-device launcher would re-run the tune
command itself: :func:`lightning_modules.training.in_process_devices`), on a copy of the full config (what
``--print_config`` prints, so every key has a value) with the sampled values set, under ``<workdir>/trial_<n>/``.
In-process because a fresh interpreter per trial pays the torch / Lightning import again (seconds, which is most of a
small trial); parallel trials (``--jobs``) are separate processes instead of Optuna's ``n_jobs`` threads, which would
share torch's global RNG (and ``seed_everything``) and the GIL; on a machine with several GPUs each process trains on
its own (:func:`lightning_modules.tuning.worker_environment`). Several machines share a study through the same
``--storage`` and ``--study-name``.

``--trials N`` is the study's total: the trials it holds that tried their setting to an outcome (complete, pruned or
diverged; see :func:`lightning_modules.tuning.counted_trials`), so the same command run again on the same storage runs
only the trials still missing -- none once the study has N -- and a larger N runs the difference. The best trial's
config is written as a complete YAML for ``lm-zoo fit --config``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.callbacks import Callback

from commands.common import CommandParser, user_error
from commands.fit import run_lightning
from commands.recipes import config_file
from lightning_modules.training import in_process_devices
from lightning_modules.tuning import (
    Objective,
    best_trial,
    check_key,
    config_values,
    counted_trials,
    create_study,
    load_space,
    optimize,
    reseed_resumed,
    short,
    worker_environment,
)
from zoo.errors import ConfigError, LMZooError


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


def run_fit(config: Path, callbacks: list[Callback]) -> None:
    """``lm-zoo fit --config config`` in this process, with extra callbacks that the config cannot name; a user's error
    (one jsonargparse wraps, too) is raised as lm-zoo's own, which the trial reports in one line."""
    try:
        run_lightning(["fit", "--config", str(config)], callbacks)
    except LMZooError:
        raise
    except Exception as err:
        ours = user_error(err)
        if ours is None:
            raise
        raise ours from err


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
    objective, study_name, storage = prepare(args)
    study = create_study(
        storage,
        study_name,
        args.direction,
        args.seed,
        args.pruner,
        args.pruner_startup_trials,
        args.pruner_warmup_steps,
    )
    if args.worker:
        optimize(study, objective, args.share, args.trials)
        return
    seed = reseed_resumed(study, args.seed)
    if args.first_trial_from_config and not study.trials:
        study.enqueue_trial(config_values(objective.base, objective.space, args.config))
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
            optimize(study, objective, shares[0], args.trials)
    finally:
        failed = [helper.args for helper in helpers if helper.wait() != 0]
    if failed:
        raise ConfigError(f"{len(failed)} of the --jobs helper processes failed (their output says why)")
    print_summary(study, done_before, args.metric)
    best = best_trial(study)
    out = Path(args.out or objective.workdir / "best.yaml")
    write_best(out, objective, best, args, study_name)
    print(f"best: trial {best.number}, {args.metric} {best.value:.4f}; config written to {out}")


def prepare(args: argparse.Namespace) -> tuple[Objective, str, str | None]:
    """The trials' objective over the config and space checked (keys, devices, one trial's config parsed), the
    study's name and its storage (a process's own sqlite file under the workdir when ``--jobs`` share it)."""
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
    workdir = Path(args.workdir or Path(trainer.get("default_root_dir") or "runs") / "tune" / study_name)
    workdir.mkdir(parents=True, exist_ok=True)
    storage = args.storage or (f"sqlite:///{(workdir / 'study.db').resolve()}" if args.jobs > 1 else None)
    # The main process's trials show their progress; --jobs helpers, which share its terminal, stay quiet.
    objective = Objective(
        base, space, workdir, args.metric, args.direction == "maximize", run_fit, progress=not args.worker
    )
    if not args.worker:
        # Parse one trial's config before any training, so that a key or value LightningCLI rejects fails now.
        check_trial_config(objective, space, workdir)
    return objective, study_name, storage


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
        except ConfigError as err:  # the parser's one line (commands.fit.LMZooArgumentParser)
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


def print_summary(study: Any, done_before: set[int], metric: str) -> None:
    """One line per trial this run finished: number, state, value, its last reported step, its values."""
    for trial in study.trials:
        if trial.number in done_before or not trial.state.is_finished():
            continue
        value = "-" if trial.value is None else f"{trial.value:.4f}"
        step = max(trial.intermediate_values, default=None)
        params = ", ".join(f"{k}={short(v)}" for k, v in trial.params.items())
        print(f"trial {trial.number:>3} {trial.state.name.lower():<8} {metric} {value:>8}  last step {step}  {params}")


def write_best(out: Path, objective: Objective, best: Any, args: argparse.Namespace, study_name: str) -> None:
    """The best trial's full config, with a header saying where it came from."""
    config = objective.trial_config(best.params, None)
    header = [
        f"# lm-zoo tune --config {args.config} --space {args.space}: the best of study {study_name!r}",
        f"# trial {best.number}: best {args.metric} {best.value:.6g} over its validation checks",
        *(f"#   {key}: {short(value)}" for key, value in best.params.items()),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False))
