"""``lm-zoo fit|validate|test|predict``: LightningCLI with lm-zoo's checkpoints, progress bar, resume, one-line
errors, a recorded float32 matmul precision, and devices chosen on purpose.

Devices: ``lm-zoo fit`` run as its own command keeps Lightning's choice (``devices: auto`` is every GPU, with DDP
when there are several), and says in one line what it chose (:func:`describe_devices`). A fit that runs inside
another command's process (``lm-zoo tune``'s trials, a script or a test calling :func:`run_lightning`) trains on one
device (:func:`in_process_devices`): Lightning's DDP launcher re-runs ``sys.argv`` once per extra rank, which there is
the other command, not this fit.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import re
import shlex
import sys
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning import LightningDataModule
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from checkpoints.ckpt import unreadable
from checkpoints.writing import AtomicCheckpointIO, LastCheckpoint
from commands.recipes import as_given, with_config_files
from datamodules.base import StreamDataModule
from datamodules.gbw import GBWDataModule
from datamodules.music import MusicDataModule
from datamodules.reverse_copy import ReverseCopyDataModule
from datamodules.text import TextDataModule
from lightning_modules.averaging import WeightAveragingOnPlateau
from lightning_modules.faults import DEFAULT_PROCESS_GROUP_TIMEOUT, forget_peers, peer_lost, report_stop, watch_peers
from lightning_modules.language_model import LanguageModel
from lightning_modules.music import MusicModel
from lightning_modules.progress import FitProgressBar
from lightning_modules.schedules import (
    CosineDecay,
    DecayOnPlateau,
    HalveOnPlateau,
    LinearDecay,
    ZarembaDecay,
    scheduler_config,
)
from lightning_modules.stateful import StatefulTraining
from zoo.errors import ConfigError, LMZooError
from zoo.settings import DEFAULT_MATMUL_PRECISION, MATMUL_PRECISION_HELP, MatmulPrecision, set_matmul_precision


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


class LMZooCLI(LightningCLI):
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

    def before_instantiate_classes(self) -> None:
        """Settings that would fail only once the run has started, refused before anything is built or announced
        (:func:`check_training_settings`); an in-process run's devices, pinned in the parsed config, so that its
        ``config.yaml`` says what ran."""
        trainer = self._get(self.config, "trainer")
        optimizer = self._get(self.config, "optimizer", default=None)
        timeout = self._get(self.config, "process_group_timeout", DEFAULT_PROCESS_GROUP_TIMEOUT)
        check_training_settings(trainer, optimizer, timeout)
        if self.in_process:
            trainer["devices"] = in_process_devices(trainer.get("devices", "auto"), trainer.get("num_nodes") or 1)

    def _parse_ckpt_path(self) -> None:
        """LightningCLI (2.6) reads a ``--ckpt_path`` file's hyperparameters here, first of all: a truncated or foreign
        file is said in one line (:func:`checkpoints.ckpt.unreadable`) instead of ``torch.load``'s traceback."""
        try:
            super()._parse_ckpt_path()
        except LMZooError:
            raise
        except Exception as err:
            subcommand = self.config.get("subcommand")
            raise unreadable(self.config[subcommand].get("ckpt_path"), err) from None

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, writing checkpoints atomically unless the config names a CheckpointIO plugin of its own, with
        lm-zoo's progress bar (:class:`lightning_modules.progress.FitProgressBar`) unless the config names one or turns
        it off, and the learning rate logged (``LearningRateMonitor``) wherever there is a logger."""
        trainer_config = self._get(self.config_init, "trainer", default={})
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.append(FitProgressBar())
        if trainer_config.get("logger") is not False and not any(isinstance(c, LearningRateMonitor) for c in callbacks):
            callbacks.append(LearningRateMonitor())  # the schedule, as TensorBoard's lr-<Optimizer> curve
        callbacks.append(RunSettings(self._get(self.config_init, "matmul_precision", DEFAULT_MATMUL_PRECISION)))
        kwargs = {"callbacks": callbacks, **kwargs}

        reloads = trainer_config.get("reload_dataloaders_every_n_epochs")
        if isinstance(self.datamodule, StreamDataModule) and not reloads:
            # A training epoch's number of windows can change from epoch to epoch (shuffled pieces or sentences packed
            # into columns, AWD's variable BPTT), but Lightning reads the loader's length once and validates when the
            # batch index reaches it: an epoch one window shorter would skip its validation, a longer one validate
            # mid-epoch. A loader made afresh each epoch has that epoch's length (the stream takes its epoch from the
            # trainer, so the orders and a resumed position are unchanged).
            kwargs["reload_dataloaders_every_n_epochs"] = 1
        accelerator = str(trainer_config.get("accelerator") or "auto")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ConfigError(
                f"--trainer.accelerator {accelerator}: PyTorch sees no CUDA GPU on this machine: use "
                "--trainer.accelerator cpu (or auto, which picks a GPU where there is one)"
            )
        plugins = self._get(self.config_init, "trainer", default={}).get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        if self.subcommand == "fit" and self._get(self.config_init, "ckpt_path"):
            # A resumed run logs where it was interrupted when there are no version_N directories (logger: false, a
            # fixed version): its config.yaml replaces the interrupted run's instead of stopping the resume.
            self.save_config_kwargs = {**self.save_config_kwargs, "overwrite": True}
        timeout = self._get(self.config_init, "process_group_timeout", DEFAULT_PROCESS_GROUP_TIMEOUT)
        trainer = super().instantiate_trainer(**{"plugins": plugins, **kwargs})
        if hasattr(trainer.strategy, "_timeout"):  # DDP, FSDP, DeepSpeed: read when the process group starts
            trainer.strategy._timeout = timedelta(seconds=timeout)
        return trainer

    def after_fit(self) -> None:
        """Say where the run's work is and what to do with it next."""
        trainer = self.trainer
        if trainer.state.status != "finished" or not trainer.is_global_zero:
            return

        best = next((c for c in trainer.checkpoint_callbacks if not isinstance(c, LastCheckpoint)), None)
        last = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)), None)
        lines = []
        if best is not None and best.best_model_path:
            score = f" ({best.monitor} {float(best.best_model_score):.4f})" if best.best_model_score is not None else ""
            lines.append(f"best checkpoint: {best.best_model_path}{score}")
        if last is not None and last.last_model_path:
            lines.append(f"last checkpoint: {last.last_model_path}")
        if trainer.loggers and trainer.log_dir:
            lines.append(f"logs: {trainer.log_dir}  (tensorboard --logdir {Path(trainer.log_dir).parent})")
        if best is not None and best.best_model_path:
            lines.append(f"evaluate: lm-zoo evaluate {shlex.quote(best.best_model_path)} --split test")
            lines.append(f"sample: lm-zoo generate {shlex.quote(best.best_model_path)} --num-samples 3")
        if last is not None and last.last_model_path:
            configs = " ".join(
                f"--config {shlex.quote(as_given(str(c)))}" for c in self.config[self.subcommand].get("config") or []
            )
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


class RunSettings(Callback):
    """The process-wide settings of a run: applies the float32 matmul precision in every process of the run (a
    spawned rank inherits none of the parent's torch flags), records it in the checkpoint (this callback's state), and
    at fit start says in one line, from rank zero, what the run chose (:func:`describe_devices`)."""

    def __init__(self, matmul_precision: str = DEFAULT_MATMUL_PRECISION) -> None:
        self.matmul_precision = matmul_precision

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        set_matmul_precision(self.matmul_precision)
        watch_peers(trainer.global_rank, trainer.world_size)  # the process group is up by now

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            line = describe_devices(trainer, getattr(trainer.datamodule, "batch_size", None))
            print(f"lm-zoo: {line}; float32 matmuls at {self.matmul_precision} precision", file=sys.stderr)

    def state_dict(self) -> dict[str, Any]:
        return {"matmul_precision": self.matmul_precision}


def describe_devices(trainer: Trainer, per_rank: int | None) -> str:
    """What a fit trains on and with which batch: ``training on 2 cpu devices (ddp), 32 columns per rank, 64 in all``.

    Under DDP the data module's ``batch_size`` is each rank's: an optimizer step averages the gradients of
    ``batch_size x devices x nodes x accumulate_grad_batches`` columns (docs/training.md, "Several devices").
    """
    devices, nodes, world = trainer.num_devices, trainer.num_nodes, trainer.world_size
    kind = trainer.strategy.root_device.type
    where = f"{devices} {kind} device{'s' * (devices != 1)}"
    if nodes > 1:
        where = f"{nodes} nodes x {where}"
    if world > 1 or "single" not in type(trainer.strategy).__name__.lower():
        where += f" ({strategy_name(trainer.strategy)})"
    if per_rank is None:
        return f"training on {where}"
    accumulate = trainer.accumulate_grad_batches
    batch = f"{per_rank} columns per rank, {per_rank * world * accumulate} in all"
    if accumulate > 1:
        batch += f" ({per_rank} x {world} rank{'s' * (world != 1)} x {accumulate} accumulated batches)"
    return f"training on {where}, {batch}"


def strategy_name(strategy: Any) -> str:
    """The name a config gives ``strategy`` (``ddp``, ``ddp_spawn``, ``fsdp``, ...), else its class's name."""
    # DDPStrategy has no strategy_name of its own (Lightning registers it under ddp, ddp_spawn, ... by start method).
    name = getattr(strategy, "strategy_name", None) or type(strategy).__name__.removesuffix("Strategy").lower()
    start = getattr(strategy, "_start_method", "popen")
    return name if start == "popen" else f"{name}_{start}"


def check_training_settings(trainer: Any, optimizer: Any, process_group_timeout: int) -> None:
    """Refuse the trainer and optimizer settings that Lightning and torch accept at first and trip over mid-run (after
    the fit's start-up line, or with a traceback): an ``accumulate_grad_batches`` below 1, a negative
    ``gradient_clip_val``, a process-group timeout below a second, and whatever the optimizer's own constructor
    refuses (a negative learning rate, betas out of range), found by building the optimizer once over a stand-in
    parameter.

    Raises:
        ConfigError: naming the option and the value.
    """
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and accumulate < 1:
        raise ConfigError(f"--trainer.accumulate_grad_batches must be at least 1, got {accumulate}")
    clip = trainer.get("gradient_clip_val")
    if clip is not None and clip < 0:
        raise ConfigError(f"--trainer.gradient_clip_val must be >= 0 (null: no clipping), got {clip}")
    if process_group_timeout < 1:
        raise ConfigError(f"--process_group_timeout must be at least 1 second, got {process_group_timeout}")
    class_path = getattr(optimizer, "class_path", None)
    if not isinstance(class_path, str):
        return
    module, _, name = class_path.rpartition(".")
    init_args = optimizer.get("init_args")
    options = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    try:
        getattr(importlib.import_module(module), name)([torch.nn.Parameter(torch.zeros(1))], **options)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--optimizer {name}: {err}") from None


def requested_devices(devices: Any) -> int | None:
    """How many devices a ``trainer.devices`` value asks for: ``None`` for ``auto``, ``-1`` for all of them, else
    the count (a list or a ``"0,1"`` string of indices is that many)."""
    if devices is None or devices == "auto":
        return None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        if "," in devices:
            return len([part for part in devices.split(",") if part.strip()])
        try:
            return int(devices)
        except ValueError:
            return None  # Lightning says what is wrong with it
    return int(devices)


def in_process_devices(devices: Any, num_nodes: int = 1) -> Any:
    """``trainer.devices`` for a fit inside another command's process: ``auto`` becomes 1, one device stays.

    Why: with several devices Lightning starts DDP, whose launcher re-runs this process's command line (``sys.argv``)
    once per extra rank. Inside ``lm-zoo tune`` that is the whole tune command, inside a test the whole pytest run;
    ``auto`` on a machine with several GPUs would do it unasked. The rule does not depend on the machine, so a config
    does the same in a tune trial on a laptop and on an 8-GPU node. Several devices asked for by name are refused
    rather than run with ``ddp_spawn``: its ranks are fresh processes, so an in-process caller's callbacks (tune's
    reports to Optuna) and objects would never see what rank 0 measured.

    Raises:
        ConfigError: the config asks for more than one device or node.
    """
    count = requested_devices(devices)
    if count is None and num_nodes <= 1:
        return 1
    if count == -1 or (count or 1) * max(num_nodes, 1) > 1:
        asked = f"trainer.devices {devices}" + (f" x trainer.num_nodes {num_nodes}" if num_nodes > 1 else "")
        raise ConfigError(
            f"{asked}: a fit inside another command (lm-zoo tune's trials, a script) trains on one device, since "
            "Lightning would re-run that whole command once per extra device: set trainer.devices to 1 (or auto), and "
            "train on several devices with lm-zoo fit itself"
        )
    return devices


def checkpoint_directories(trainer: Trainer) -> list[Path]:
    """The ``checkpoints`` folders of the first logger's versions (where checkpoints go without a ``dirpath``)."""
    root = versions_root(trainer)
    return [] if root is None else [path for path in root.glob("*/checkpoints") if path.is_dir()]


def newest_checkpoint(directories: Sequence[Path], pattern: str = "*.ckpt") -> Path | None:
    """The most recently written file matching ``pattern`` in ``directories``, or ``None``."""
    found = (path for directory in directories for path in directory.glob(pattern) if path.is_file())
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


def continue_logging_in(trainer: Trainer, checkpoint: Path) -> None:
    """A run resumed from ``<root>/version_N/checkpoints/*.ckpt`` logs on in ``version_N``: one TensorBoard run with
    one curve, not two halves in two versions (and ``best.ckpt`` keeps being tracked in the same directory)."""
    root = versions_root(trainer)
    logger = trainer.loggers[0] if trainer.loggers else None
    version = checkpoint.resolve().parent.parent
    if root is None or version.parent != root.resolve() or checkpoint.parent.name != "checkpoints":
        return
    # TensorBoard adds an event file beside the earlier ones and shows them as one run; CSVLogger would delete the
    # earlier metrics.csv, so it gets a new version. TensorBoardLogger chooses its version when first asked for it
    # (`_version`); a version given in the config is the user's to keep.
    if isinstance(logger, TensorBoardLogger) and logger._version is None:
        number = re.fullmatch(r"version_(\d+)", version.name)
        logger._version = int(number[1]) if number else version.name  # type: ignore[union-attr]


def versions_root(trainer: Trainer) -> Path | None:
    """Where the first logger's ``version_N`` directories are (``None`` without a logger)."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    return Path(logger.save_dir or trainer.default_root_dir, str(logger.name or ""))


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("💡 Tip:", "You are using a CUDA device"))


def quiet_known_noise() -> None:
    """Filter, by message, third-party warnings that every fit prints and that say nothing about this run.

    - ``isinstance(treespec, LeafSpec)`` is deprecated: Lightning 2.6's ``_pytree`` calls an API that PyTorch 2.13
      deprecates; Lightning's to update, nothing for a user to change.
    - ``IterableDataset`` has ``__len__`` ... ``num_workers > 1``: lm-zoo's loaders use no worker processes
      (``datamodules.base``), so the length is exact.
    - Lightning's "Tip" advertising a logging service, logged at every Trainer creation.
    - Lightning's advice to call ``torch.set_float32_matmul_precision`` on a GPU with tensor cores: lm-zoo's
      ``--matmul_precision`` is that setting, and the fit's first line says which is in force.
    """
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        rank_zero = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in rank_zero.filters):
            rank_zero.addFilter(_DropAdverts())


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
    check_config_files(args[1:])
    callers_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        run_cli(argv, args, given, callbacks, own_command)
    except Exception as error:
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


def leave_process_group() -> None:
    """End this process's part in the process group its multi-process run made, if any, before the process exits.

    Lightning destroys the group at exit for NCCL only. A gloo group (DDP on CPUs) left to the interpreter's exit is
    torn down in whatever order its C++ objects die, and now and then a worker thread of it is destroyed still
    running: the process aborts ("terminate called without an active exception", status -6) after it has printed
    its one-line error, so a run that failed cleanly reports a crash. Destroying the group is local (no collective),
    so a rank may leave while its peers are still running or already gone.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
