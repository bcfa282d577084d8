"""How lm-zoo trains, whoever starts the Trainer (``lm-zoo fit``, ``lm-zoo tune``'s trials, a script): the callbacks
every fit gets, the rule that reloads stream loaders every epoch, the settings refused before a run starts, the devices
a fit inside another command's process may take, where a resumed run finds its last checkpoint and logs on, and the
process-wide settings of a run (:class:`RunSettings`).

Devices: ``lm-zoo fit`` run as its own command keeps Lightning's choice (``devices: auto`` is every GPU, with DDP
when there are several), and says in one line what it chose (:func:`describe_devices`). A fit that runs inside
another command's process (``lm-zoo tune``'s trials, a script or a test calling ``commands.fit.run_lightning``)
trains on one device (:func:`in_process_devices`): Lightning's DDP launcher re-runs ``sys.argv`` once per extra rank,
which there is the other command, not this fit.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from datamodules.data_modules import StreamDataModule
from lightning_modules.cores import CoreSharing
from lightning_modules.faults import watch_peers
from lightning_modules.lightning_private import log_on_in_version
from lightning_modules.progress import FitProgressBar
from zoo import window
from zoo.errors import ConfigError
from zoo.settings import DEFAULT_MATMUL_PRECISION, set_matmul_precision


def trainer_arguments(trainer_config: dict[str, Any], datamodule: Any, matmul_precision: str) -> dict[str, Any]:
    """What lm-zoo adds to the config's Trainer arguments: its callbacks and, for stream data, loaders made afresh
    every epoch.

    The callbacks: the config's own, with lm-zoo's progress bar (:class:`~lightning_modules.progress.FitProgressBar`)
    unless the config names one or turns it off, the learning rate logged (``LearningRateMonitor``) wherever there is
    a logger, and :class:`RunSettings`.

    Raises:
        ConfigError: the config asks for a GPU on a machine where PyTorch sees none.
    """
    accelerator = str(trainer_config.get("accelerator") or "auto")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"--trainer.accelerator {accelerator}: PyTorch sees no CUDA GPU on this machine: use "
            "--trainer.accelerator cpu (or auto, which picks a GPU where there is one)"
        )
    callbacks = trainer_config.get("callbacks") or []
    callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
    if trainer_config.get("enable_progress_bar") is not False and not any(
        isinstance(c, ProgressBar) for c in callbacks
    ):
        callbacks.append(FitProgressBar())
    if trainer_config.get("logger") is not False and not any(isinstance(c, LearningRateMonitor) for c in callbacks):
        callbacks.append(LearningRateMonitor())  # the schedule, as TensorBoard's lr-<Optimizer> curve
    callbacks.append(RunSettings(matmul_precision))
    arguments: dict[str, Any] = {"callbacks": callbacks}
    if isinstance(datamodule, StreamDataModule) and not trainer_config.get("reload_dataloaders_every_n_epochs"):
        # A training epoch's number of windows can change from epoch to epoch (shuffled pieces or sentences packed
        # into columns, AWD's variable BPTT), but Lightning reads the loader's length once and validates when the
        # batch index reaches it: an epoch one window shorter would skip its validation, a longer one validate
        # mid-epoch. A loader made afresh each epoch has that epoch's length (the stream takes its epoch from the
        # trainer, so the orders and a resumed position are unchanged).
        arguments["reload_dataloaders_every_n_epochs"] = 1
    return arguments


def hardware(device: torch.device | None = None) -> str:
    """A device in words: the GPU's name, or the CPU's core count (default: the first GPU if there is one)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()}-core CPU ({platform.machine()})"


#: The folder the packages were imported from: a clone's top level (with ``.git`` beside the packages), or
#: site-packages for an installed wheel, which is no git checkout even where its environment sits inside one.
PACKAGES_ROOT = Path(__file__).resolve().parents[1]


def source_commit() -> str:
    """The lm-zoo commit this code is: ``$LM_ZOO_COMMIT`` where the checkout's git is not the code's (a working tree
    copied to a GPU machine), else git's ``HEAD``, with ``-dirty`` when tracked files have uncommitted changes;
    ``unknown`` outside a clone (an installed wheel), where no git command runs."""
    if os.environ.get("LM_ZOO_COMMIT"):
        return os.environ["LM_ZOO_COMMIT"]
    directory = PACKAGES_ROOT
    if not (directory / ".git").exists():
        return "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=directory, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def run_environment(trainer: Trainer) -> dict[str, Any]:
    """Where a run trains: its devices in words (rank 0's), the torch and CUDA versions, the lm-zoo commit."""
    device = trainer.strategy.root_device
    name = hardware(device)
    if trainer.world_size > 1:  # GPUs are one per rank; CPU ranks share a machine's cores
        name = f"{trainer.world_size} x {name}" if device.type == "cuda" else f"{name}, {trainer.world_size} processes"
    return {
        "hardware": name,
        "torch_version": str(torch.__version__),  # a str subclass, which weights_only loading refuses
        "cuda_version": torch.version.cuda if device.type == "cuda" else None,
        "commit": source_commit(),
    }


class RunSettings(Callback):
    """The process-wide settings of a run: applies the float32 matmul precision in every process of the run (a
    spawned rank inherits none of the parent's torch flags), records it in the checkpoint (this callback's state), and
    at fit start says in one line, from rank zero, what the run chose (:func:`describe_devices`).

    The checkpoint also records where the run trained (:func:`run_environment`), one entry per distinct machine of a
    run resumed elsewhere, so that a model trained on a lent GPU and bundled at home says so on its card.
    """

    def __init__(self, matmul_precision: str = DEFAULT_MATMUL_PRECISION) -> None:
        self.matmul_precision = matmul_precision
        self._first_step_reported = False
        self._captures_reported = 0
        self._environment: dict[str, Any] | None = None
        self._earlier_environments: list[dict[str, Any]] = []  # of the runs this one resumed

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        # The run's precision for its own work only: a script or a tune trial that fits in its process gets its own
        # back at teardown.
        self._precision_before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
        set_matmul_precision(self.matmul_precision)
        watch_peers(trainer.global_rank, trainer.world_size)  # the process group is up by now
        if stage == "fit":
            self._environment = run_environment(trainer)

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        cores = self.__dict__.pop("_cores", None)
        if cores is not None:
            cores.restore()
        before = self.__dict__.pop("_precision_before", None)
        if before is not None:
            torch.set_float32_matmul_precision(before[0])
            torch.backends.cudnn.allow_tf32 = before[1]

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._cores = CoreSharing()  # every rank its own: they share the machine's cores with whatever else runs
        threads = self._cores.start()
        if trainer.is_global_zero:
            line = describe_devices(trainer, getattr(trainer.datamodule, "batch_size", None))
            print(f"lm-zoo: {line}; float32 matmuls at {self.matmul_precision} precision; {threads}", file=sys.stderr)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        """Every few seconds, the CPU threads fitted to the other work on the cores (:class:`CoreSharing`: a line when
        they change). After the run's first training step, one line on who runs the steps
        (``StatefulTraining.step_summary``) and one on what capturing the per-step stacks' windows cost on a GPU
        (:func:`zoo.window.summary`); after the step where a whole step was first captured, that step's line again
        with what its capture cost."""
        cores = self.__dict__.get("_cores")
        changed = cores.check() if cores is not None else None
        if changed is not None and trainer.is_global_zero:
            print(f"lm-zoo: from step {trainer.global_step:,}: {changed}", file=sys.stderr)
        if not trainer.is_global_zero:
            return
        runner = getattr(pl_module, "step_runner", None)
        captured = len(runner.capture_seconds) if runner is not None else 0
        if self._first_step_reported and captured <= self._captures_reported:
            return
        summary = getattr(pl_module, "step_summary", lambda: None)()
        lines = [summary] if summary is not None and (captured or not self._first_step_reported) else []
        if not self._first_step_reported:
            lines.append(window.summary(pl_module))
        self._first_step_reported, self._captures_reported = True, max(captured, 1)
        for line in filter(None, lines):
            print(f"lm-zoo: {line}", file=sys.stderr)

    def state_dict(self) -> dict[str, Any]:
        environments = list(self._earlier_environments)
        if self._environment is not None and self._environment not in environments:
            environments.append(self._environment)
        return {"matmul_precision": self.matmul_precision, "environments": environments}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._earlier_environments = list(state_dict.get("environments", []))  # none before lm-zoo recorded them


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
    # earlier metrics.csv, so it gets a new version.
    log_on_in_version(logger, version.name)


def versions_root(trainer: Trainer) -> Path | None:
    """Where the first logger's ``version_N`` directories are (``None`` without a logger)."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    return Path(logger.save_dir or trainer.default_root_dir, str(logger.name or ""))


def log_dir_here(trainer: Trainer) -> Path:
    """``trainer.log_dir`` as this process has it, without the broadcast that property makes.

    For what one rank does alone after training (rank 0 says where the run's work is, exports it): a collective there
    waits for ranks that never join it, or, with gloo, fails on the closed connection of a rank that has already left
    (``lm-zoo: error: rank 1 ... exited with status 0``). The first logger's directory, as Lightning's, else the
    trainer's root.
    """
    if not trainer.loggers:
        return Path(trainer.default_root_dir)
    logger = trainer.loggers[0]
    return Path(logger.log_dir if isinstance(logger, TensorBoardLogger | CSVLogger) else logger.save_dir)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("💡 Tip:", "You are using a CUDA device"))


def quiet_known_noise() -> None:
    """Filter, by message, third-party warnings that every fit prints and that say nothing about this run.

    - ``isinstance(treespec, LeafSpec)`` is deprecated: Lightning 2.6's ``_pytree`` calls an API that PyTorch 2.13
      deprecates; Lightning's to update, nothing for a user to change.
    - ``IterableDataset`` has ``__len__`` ... ``num_workers > 1``: lm-zoo's loaders use no worker processes
      (``datamodules.data_modules``), so the length is exact.
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
