"""``lm-zoo fit|validate|test|predict``: LightningCLI reading lm-zoo's configs, with its errors in one line, the
checkpoint callbacks and atomic writes, ``--ckpt_path last``, and what to do next printed after a fit.

How a fit trains (its callbacks, reload rule, refused settings, devices) is the library's,
:mod:`lightning_modules.training`: this module parses, calls and prints.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import shlex
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning import LightningDataModule
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from checkpoints.ckpt_read import unreadable
from checkpoints.ckpt_write import AtomicCheckpointIO, LastCheckpoint
from commands.recipes import as_given, with_config_files
from datamodules.data_modules import TextDataModule
from datamodules.gbw import GBWDataModule
from datamodules.music import MusicDataModule
from datamodules.reverse_copy import ReverseCopyDataModule
from lightning_modules.averaging import WeightAveragingOnPlateau
from lightning_modules.faults import (
    DEFAULT_PROCESS_GROUP_TIMEOUT,
    forget_peers,
    peer_lost,
    report_stop,
    watch_rank_processes,
)
from lightning_modules.language_model import LanguageModel
from lightning_modules.lightning_private import (
    CheckpointPathReading,
    set_process_group_timeout,
    watch_rank_processes_with,
)
from lightning_modules.music import MusicModel
from lightning_modules.schedules import (
    CosineDecay,
    DecayOnPlateau,
    HalveOnPlateau,
    LinearDecay,
    ZarembaDecay,
    scheduler_config,
)
from lightning_modules.stateful import StatefulTraining
from lightning_modules.training import (
    check_training_settings,
    checkpoint_directories,
    continue_logging_in,
    in_process_devices,
    leave_process_group,
    log_dir_here,
    newest_checkpoint,
    quiet_known_noise,
    trainer_arguments,
    versions_root,
)
from zoo.errors import CheckpointError, ConfigError
from zoo.settings import DEFAULT_MATMUL_PRECISION, MATMUL_PRECISION_HELP, MatmulPrecision


class LMZooArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, with its errors raised as one line (:class:`zoo.errors.ConfigError`, which ``main``
    prints) instead of 70-80 lines of usage before a multi-line report; ``--help`` still prints the usage.

    jsonargparse's own inner parsers are made with ``exit_on_error=False`` and catch their ``ArgumentError``s while
    trying alternatives (union types, subclasses); only the error that would end the program is turned into ours.
    """

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        raise ConfigError(parser_message(self, message)) from ex


# Lines of jsonargparse's reports that say how it searched rather than what is wrong.
_PARSER_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes:|Errors:|Expected a <class 'NoneType'>|"
    r"Given value type:|Given value:|Problem with given class_path)"
)

# lm-zoo's classes that a config or the command line may name by their short names (``--model LanguageModel``):
# jsonargparse resolves a short class name among the subclasses already imported.
SHORT_NAMES = (
    GBWDataModule,
    MusicDataModule,
    ReverseCopyDataModule,
    TextDataModule,
    LanguageModel,
    MusicModel,
    CosineDecay,
    DecayOnPlateau,
    HalveOnPlateau,
    LinearDecay,
    ZarembaDecay,
    WeightAveragingOnPlateau,
)


def parser_message(parser: argparse.ArgumentParser, message: str) -> str:
    """One line from a jsonargparse error report, naming the option, with a "did you mean" for a misspelt one."""
    unknown = re.search(r"Problem with given class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message)
    key = re.match(r'Parser key "([^"]+)"', message)
    if unknown and key:
        class_path, option = unknown.groups()
        module, _, name = class_path.rpartition(".")
        # What LightningCLI accepts: the signature's names and, where a class passes **kwargs on (LanguageModel's
        # network settings, to LMConfig), the names jsonargparse finds there.
        accepted = ArgumentParser().add_class_arguments(
            getattr(importlib.import_module(module), name), fail_untyped=False
        )
        near = difflib.get_close_matches(option, accepted, n=1)
        hint = f" (did you mean --{key[1]}.init_args.{near[0]}?)" if near else ""
        return f"--{key[1]}.init_args.{option}: {name} has no option {option!r}{hint}"
    extra = re.match(r"unrecognized arguments: (--[\w.]+)", message)
    if extra:
        options = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
        near = difflib.get_close_matches(extra[1], options, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return f"{message}{hint}; lm-zoo {parser.prog.split()[-1]} --help lists the options"
    # A value's problem: the innermost report, under the option's full name (a class's options are under init_args).
    keys = re.findall(r'Parser key "([^"]+)"', message)
    key = ".init_args.".join(keys) if "Problem with given class_path" in message else keys[0] if keys else None
    lines = [re.sub(r'^Parser key "[^"]+":\s*', "", line.strip().removeprefix("- ")) for line in message.splitlines()]
    lines = [line for line in lines if line and not _PARSER_NOISE.match(line)]
    text = "; ".join(lines) or message.strip()
    text = re.sub(r"Expected a <class '([\w.]+)'>\. Got value: ([^;]*)", r"expected \1, got '\2'", text)
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = text[:1].lower() + text[1:]
    return text if key is None else f"--{key}: {text}"


class LMZooCLI(CheckpointPathReading, LightningCLI):
    """LightningCLI with the vocabulary linked from the data, ``best.ckpt`` (``checkpoint.*``) and ``last.ckpt``
    (``last_checkpoint.*``) callbacks, atomic checkpoint writes, and a ``--ckpt_path last`` that finds the last
    checkpoint of the config's previous runs.

    Args:
        in_process: the fit runs inside another command's process (see the module doc): one device, or one line
            refusing a config that asks for several.
    """

    def __init__(self, *args: Any, in_process: bool = False, **kwargs: Any) -> None:
        self.in_process = in_process  # before LightningCLI's __init__, which parses and runs the subcommand
        super().__init__(*args, **kwargs)

    @staticmethod
    def configure_optimizers(
        lightning_module: object,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> object:
        """The YAML's optimizer and scheduler, stepped at the scheduler's own ``interval`` / ``frequency`` if it has
        them (``lightning_modules.schedules.scheduler_config``)."""
        return scheduler_config(optimizer, lr_scheduler)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The vocabulary is built from the training split when the data module is created.
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val_loss",
                "checkpoint.mode": "min",
                "checkpoint.filename": "best",
                "checkpoint.save_last": False,  # last.ckpt is last_checkpoint's, kept fresher than this one would
                "checkpoint.auto_insert_metric_name": False,
            }
        )

        # last.ckpt, for `--ckpt_path last`: every 30 minutes (or every_n_train_steps / train_time_interval), after
        # every validation and at the end, in the best checkpoint's directory.
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.link_arguments("checkpoint.dirpath", "last_checkpoint.dirpath")

        # Top-level keys like seed_everything, so that the run's config.yaml records them.
        parser.add_argument(
            "--matmul_precision", type=MatmulPrecision, default=DEFAULT_MATMUL_PRECISION, help=MATMUL_PRECISION_HELP
        )
        parser.add_argument(
            "--process_group_timeout",
            type=int,
            default=DEFAULT_PROCESS_GROUP_TIMEOUT,
            help="seconds a multi-process run's collective waits for the other ranks before the run fails (PyTorch's "
            "default is 1800; docs/training.md)",
        )

    def _setting(self, config: Any, key: str, default: Any = None) -> Any:
        """A parsed setting, under the subcommand where the config has one (what LightningCLI's private ``_get``
        does, written out so as not to lean on it)."""
        return config.get(str(self.subcommand), config).get(key, default)

    def before_instantiate_classes(self) -> None:
        """Settings that would fail only once the run has started, refused before anything is built or announced
        (:func:`check_training_settings`); an in-process run's devices, pinned in the parsed config, so that its
        ``config.yaml`` says what ran."""
        trainer = self._setting(self.config, "trainer")
        optimizer = self._setting(self.config, "optimizer", default=None)
        timeout = self._setting(self.config, "process_group_timeout", DEFAULT_PROCESS_GROUP_TIMEOUT)
        check_training_settings(trainer, optimizer, timeout)
        if self.in_process:
            trainer["devices"] = in_process_devices(trainer.get("devices", "auto"), trainer.get("num_nodes") or 1)

    def check_ckpt_path_given(self, ckpt_path: str | None) -> None:
        """A ``--ckpt_path`` that is not there is refused (:func:`check_ckpt_path`) before Lightning reads it: before
        it seeds and says ``Seed set to N``, so a refused run prints nothing before its line."""
        check_ckpt_path(ckpt_path)

    def ckpt_path_unreadable(self, ckpt_path: str | None, error: Exception) -> Exception:
        """A truncated or foreign file, said in one line (:func:`checkpoints.ckpt_read.unreadable`) instead of
        ``torch.load``'s traceback."""
        return unreadable(ckpt_path or "", error)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, writing checkpoints atomically unless the config names a CheckpointIO plugin of its own, with
        lm-zoo's progress bar (:class:`lightning_modules.progress.FitProgressBar`) unless the config names one or turns
        it off, and the learning rate logged (``LearningRateMonitor``) wherever there is a logger."""
        trainer_config = self._setting(self.config_init, "trainer", default={})
        precision = self._setting(self.config_init, "matmul_precision", DEFAULT_MATMUL_PRECISION)
        kwargs = {**trainer_arguments(trainer_config, self.datamodule, precision), **kwargs}
        plugins = self._setting(self.config_init, "trainer", default={}).get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        if self.subcommand == "fit" and self._setting(self.config_init, "ckpt_path"):
            # A resumed run logs where it was interrupted when there are no version_N directories (logger: false, a
            # fixed version): its config.yaml replaces the interrupted run's instead of stopping the resume.
            self.save_config_kwargs = {**self.save_config_kwargs, "overwrite": True}
        timeout = self._setting(self.config_init, "process_group_timeout", DEFAULT_PROCESS_GROUP_TIMEOUT)
        trainer = super().instantiate_trainer(**{"plugins": plugins, **kwargs})
        set_process_group_timeout(trainer, timeout)  # DDP, FSDP, DeepSpeed: read when the process group starts
        watch_rank_processes_with(watch_rank_processes)  # before trainer.fit, whose launcher starts the other ranks
        return trainer

    def after_fit(self) -> None:
        """Say where the run's work is and what to do with it next."""
        trainer = self.trainer
        if trainer.state.status != "finished" or not trainer.is_global_zero:
            return

        best = next((c for c in trainer.checkpoint_callbacks if not isinstance(c, LastCheckpoint)), None)
        last = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)), None)
        # Why the run ended before its bounds: Lightning's EarlyStopping keeps its reason but says it only when verbose.
        lines = [
            f"stopped early: {c.stopping_reason_message}"
            for c in trainer.callbacks
            if isinstance(c, EarlyStopping) and c.stopping_reason_message
        ]
        if best is not None and best.best_model_path:
            score = f" ({best.monitor} {float(best.best_model_score):.4f})" if best.best_model_score is not None else ""
            lines.append(f"best checkpoint: {best.best_model_path}{score}")
        if last is not None and last.last_model_path:
            lines.append(f"last checkpoint: {last.last_model_path}")
        if trainer.loggers:
            logs = log_dir_here(trainer)  # rank 0 alone is here: trainer.log_dir would broadcast
            lines.append(f"logs: {logs}  (tensorboard --logdir {logs.parent})")
        if best is not None and best.best_model_path:
            lines.append(f"evaluate: lm-zoo evaluate {shlex.quote(best.best_model_path)} --split test")
            lines.append(f"sample: lm-zoo generate {shlex.quote(best.best_model_path)} --num-samples 3")
        if last is not None and last.last_model_path:
            # The run's own config.yaml (LightningCLI's, every setting the run had), not the recipes it was given: the
            # command line's overrides would be lost, and a data module's are not in the checkpoint's hyperparameters
            # that Lightning restores (a batch size given on the command line came back as the recipe's).
            saved = saved_config(trainer)
            given = self.config[self.subcommand].get("config") or []
            configs = " ".join(f"--config {shlex.quote(as_given(str(c)))}" for c in ([saved] if saved else given))
            limit = "--trainer.max_steps N" if trainer.max_steps and trainer.max_steps > 0 else "--trainer.max_epochs N"
            lines.append(f"train further: lm-zoo fit {configs} --ckpt_path {shlex.quote(last.last_model_path)} {limit}")
        for line in lines:
            print(f"lm-zoo: {line}", file=sys.stderr)

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path``: a resumed run logs on in its checkpoint's TensorBoard version; ``last`` without a
        ``checkpoint.dirpath`` takes the newest ``last*.ckpt`` of the earlier versions (Lightning would look only in
        this run's new ``version_N/checkpoints``), and ``last`` with nothing to resume is one line, not a fresh start
        after a warning."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") not in (None, "last"):
            continue_logging_in(self.trainer, Path(config["ckpt_path"]))
        if config.get("ckpt_path") != "last":
            return
        directories = [Path(c.dirpath) for c in self.trainer.checkpoint_callbacks if c.dirpath]
        # Lightning finds last.ckpt in a dirpath itself, but starts afresh with a warning if there is none.
        searched = directories or checkpoint_directories(self.trainer)
        found = newest_checkpoint(searched, "last*.ckpt")
        if found is not None and not directories:
            config["ckpt_path"] = str(found)
        if found is None:
            where = ", ".join(map(str, directories)) or f"{versions_root(self.trainer)}/*/checkpoints"
            # A run stopped between writing a validation's best.ckpt and its last.ckpt (a kill in the first
            # validation) has no last.ckpt, but that checkpoint holds the whole training state of its step.
            other = newest_checkpoint(searched)
            if other is not None:
                raise ConfigError(
                    f"--ckpt_path last: no last.ckpt from an earlier run of this config (looked in {where}), but "
                    f"{other} holds that run's state: resume from it with --ckpt_path {shlex.quote(str(other))}"
                )
            raise ConfigError(
                f"--ckpt_path last: nothing to resume, no last.ckpt from an earlier run of this config (looked in "
                f"{where}): leave out --ckpt_path to start a new run"
            )
        continue_logging_in(self.trainer, found)


# The --ckpt_path values that name no file: Lightning's named checkpoints ("last", which LMZooCLI.before_fit resolves
# among the earlier runs, "best", "hpc") and its model registry ("registry" or "registry:NAME").
NAMED_CHECKPOINT = re.compile(r"^(last|best|hpc|registry(:.*)?)$", re.IGNORECASE)


def check_ckpt_path(ckpt_path: str | None) -> None:
    """Refuse a ``--ckpt_path`` naming a local checkpoint file that is not there, in one line, before the run is
    seeded, built or announced (Lightning would say so only after its start-up lines and the trainer's set-up). A
    named checkpoint (:data:`NAMED_CHECKPOINT`) and a remote path (``s3://``, ``gs://``, ``hf://``: fsspec reads them)
    are left to Lightning.

    Raises:
        CheckpointError: the path does not exist, or is a directory.
    """
    if ckpt_path is None or NAMED_CHECKPOINT.match(str(ckpt_path)) or "://" in str(ckpt_path):
        return
    path = Path(ckpt_path)
    if path.is_dir():
        raise CheckpointError(
            f"--ckpt_path {ckpt_path}: a directory, not a checkpoint file: give the path of a .ckpt written by "
            "lm-zoo fit (a run's is in lightning_logs/version_N/checkpoints/), or last"
        )
    if not path.is_file():
        raise CheckpointError(
            f"--ckpt_path {ckpt_path}: no such file: give the path of a .ckpt written by lm-zoo fit (or last)"
        )


def saved_config(trainer: Trainer) -> Path | None:
    """Where LightningCLI saved the run's whole config (``config.yaml`` in its log directory), if it did."""
    saver = next((c for c in trainer.callbacks if isinstance(c, SaveConfigCallback)), None)
    if saver is None:
        return None
    path = log_dir_here(trainer) / saver.config_filename
    return path if path.is_file() else None


def run_lightning(argv: Sequence[str] | None, callbacks: Sequence[Any] = (), own_command: bool | None = None) -> None:
    """Run a LightningCLI subcommand (``fit``, ``validate``, ``test``, ``predict``); ``None`` reads ``sys.argv``.

    Args:
        argv: the subcommand and its arguments, or ``None``.
        callbacks: trainer callbacks a config cannot name (``lm-zoo tune``'s reporting to Optuna), added to the
            config's own.
        own_command: ``argv`` is this process's own command line (``lm-zoo fit ...``), which Lightning may re-run
            for the other ranks of a multi-device run; default: only when ``argv`` is ``None``. Otherwise the run
            trains on one device (:func:`in_process_devices`).
    """
    quiet_known_noise()
    given = list(sys.argv[1:] if argv is None else argv)
    args = [*given[:1], *with_config_files(given[1:])]  # a shipped recipe's name becomes its file
    callers_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        run_cli(argv, args, given, callbacks, own_command)
    except Exception as error:
        if isinstance(error, ConfigError) and YAML_TEXT in str(error):
            check_config_files(args[1:])  # which file, in words: the YAML read again only on this error's path
        # A multi-process run: a collective that failed because another rank stopped becomes one line naming it; any
        # other error of this rank is written where the other ranks will read it (lightning_modules/faults.py).
        lost = peer_lost(error)
        if lost is not None:
            raise lost from error
        report_stop(error)
        raise
    finally:
        forget_peers()
        if not callers_group:  # a group the caller made (a script under torchrun) is the caller's to end
            leave_process_group()


def run_cli(
    argv: Sequence[str] | None, args: list[str], given: list[str], callbacks: Sequence[Any], own_command: bool | None
) -> None:
    """LightningCLI on ``args``, the subcommand and its arguments with recipe names made paths (``given``: as they
    came; ``argv`` and the rest as :func:`run_lightning` takes them)."""
    with warnings.catch_warnings():
        # Given argv (lm-zoo tune, tests), LightningCLI warns that the process's own command line differs: on purpose.
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter")
        LMZooCLI(
            StatefulTraining,  # LanguageModel (tokens) or MusicModel (piano rolls)
            LightningDataModule,  # any data module (TextDataModule, GBWDataModule, MusicDataModule, ...)
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_class=LMZooArgumentParser,
            args=None if argv is None and args == given else args,
            trainer_defaults={"callbacks": list(callbacks)} if callbacks else None,
            in_process=not (argv is None if own_command is None else own_command),
        )


YAML_TEXT = '"<unicode string>"'  # where jsonargparse says a YAML error is, having read the file's text itself


def check_config_files(args: Sequence[str]) -> None:
    """Every ``--config FILE`` that exists parses as YAML, or one line naming the file, line and column.

    jsonargparse reports a YAML error without the file's name (``in "<unicode string>"``); a tab in the indentation,
    the usual cause, gets said in words.
    """
    paths = [b for a, b in zip(args, args[1:], strict=False) if a == "--config"]
    paths += [a.removeprefix("--config=") for a in args if a.startswith("--config=")]
    for path in map(Path, paths):
        if not path.is_file():
            continue  # a config given inline (jsonargparse takes YAML text too)
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            lines = text.splitlines()
            tab = mark is not None and mark.line < len(lines) and "\t" in lines[mark.line]
            hint = ": YAML indents with spaces, not tabs" if tab else ""
            raise ConfigError(f"{path}{where}: not valid YAML ({problem}){hint}") from None
