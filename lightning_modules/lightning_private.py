"""Every private Lightning API lm-zoo uses, one function (or, where a private method is overridden, one mixin) each,
saying why no public one serves.

Lightning is pinned below 2.7 (``pyproject.toml``) because of these: an upgrade reads this file first. Each function
is exercised by the suite (the tests named beside it), so that a Lightning that moved one of them fails there, not in a
user's run. Nothing else in lm-zoo touches a private Lightning attribute (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import Tensor
from torch.optim.swa_utils import AveragedModel

from zoo.errors import LMZooError


def set_process_group_timeout(trainer: Trainer, seconds: float) -> None:
    """The collectives' timeout of a DDP, FSDP or DeepSpeed run (``--process_group_timeout``).

    The strategies take it as a constructor argument, but a LightningCLI run names its strategy by string
    (``--trainer.strategy ddp``), so lm-zoo sets the strategy's ``_timeout``, which it reads when the process group
    starts (``tests/test_ddp.py``).
    """
    if hasattr(trainer.strategy, "_timeout"):  # single-device strategies have no process group
        trainer.strategy._timeout = timedelta(seconds=seconds)


def log_on_in_version(logger: Any, version_dir_name: str) -> None:
    """Make a ``TensorBoardLogger`` that has not chosen its version log into ``version_dir_name`` (``version_N``).

    The logger picks its version when first asked (its private ``_version``) and offers no public way to name one
    after construction; a version the user gave in the config is theirs to keep (``tests/test_resume.py``).
    """
    if isinstance(logger, TensorBoardLogger) and logger._version is None:
        number = re.fullmatch(r"version_(\d+)", version_dir_name)
        logger._version = int(number[1]) if number else version_dir_name  # type: ignore[union-attr]


def writes_logs_this_step(trainer: Trainer) -> bool:
    """Whether Lightning writes its step logs at this training step (every ``log_every_n_steps``, and a stopping
    one): its logger connector's ``should_update_logs``, the rule it applies itself, which no public attribute gives
    (``tests/test_language_model.py``)."""
    return bool(trainer._logger_connector.should_update_logs)


def skip_lightnings_sigterm_broadcast(trainer: Any) -> None:
    """Stop Lightning's per-step broadcast of rank 0's SIGTERM flag, for a run whose signals lm-zoo handles.

    Lightning 2.6 broadcasts ``trainer.received_sigterm`` from rank 0 at every step of a multi-process run, and reads it
    back on the host (a collective and a host synchronisation a step). Its own SIGTERM handler sets that flag; lm-zoo's
    (:class:`checkpoints.ckpt_write.LastCheckpoint`) replaces that handler during training and agrees on any rank's
    signal through the step's divergence gather, so the flag stays unset and the broadcast only costs. Lightning has no
    switch for it: the epoch loop's private ``_broadcast_sigterm_tensor`` is shadowed on this trainer's loop alone;
    :func:`restore_lightnings_sigterm_broadcast` gives it back (``tests/test_faults.py``).
    """
    if trainer.world_size > 1:
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast


def restore_lightnings_sigterm_broadcast(trainer: Any) -> None:
    """Give Lightning's epoch loop its SIGTERM broadcast back (:func:`skip_lightnings_sigterm_broadcast`)."""
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def watch_rank_processes_with(watch: Callable[[list[subprocess.Popen]], None]) -> None:
    """Have Lightning's launcher hand the rank processes it starts (the other ranks of this machine, ``ddp``) to
    ``watch`` instead of its own observer.

    Lightning 2.6 starts a thread that polls them every 5 s and, at the first nonzero exit, SIGKILLs them and this
    process: rank 0 died without lm-zoo's line on how the run ended (a rank that raised exits with 1), or while it
    wrote the checkpoint of a stop every rank agreed on (the others exit with 143 first), and the thread's reaping took
    the exit status that line names. No setting turns it off; the launcher calls its module's private
    ``_launch_process_observer``, replaced here for the process (``tests/test_ddp.py``, ``tests/test_faults.py``).
    """
    from lightning.pytorch.strategies.launchers import subprocess_script

    subprocess_script._launch_process_observer = watch


def _no_broadcast() -> None:
    """In place of Lightning's SIGTERM broadcast: lm-zoo's agreed stop carries every rank's signal."""


def hand_result_to_loop(closure: Any, output: Tensor | dict[str, Tensor]) -> None:
    """Give Lightning's automatic-optimization loop the result its closure would have produced.

    The loop reads the step's output from the closure it handed the ``optimizer_step`` hook (``consume_result``), and
    lm-zoo's step (``lightning_modules.training_step``) runs instead of that closure, so it sets the closure's private
    ``_result`` (``tests/test_training_step.py``).
    """
    closure._result = ClosureResult.from_training_step_output(output)


def count_on_from(trainer: Trainer, epochs: int, steps: int) -> None:
    """Set the fit loop's counters as if ``epochs`` epochs and ``steps`` optimizer steps were done.

    Lightning restores these only from a ``.ckpt`` of its own (``fit_loop.load_state_dict``), which a hop carried on
    from an export (``checkpoints.callbacks.InitialWeights``) does not have. These are the progress trackers that
    checkpoint holds: the epochs done (``trainer.current_epoch``), the optimizer steps done (``trainer.global_step``)
    and the private count of steps the loggers log by (``tests/test_initial_weights.py``).
    """
    progress = trainer.fit_loop.epoch_progress
    for counts in (progress.current, progress.total):
        counts.ready = counts.started = counts.processed = counts.completed = epochs
    stepped = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    stepped.ready = stepped.completed = steps
    trainer.fit_loop.epoch_loop._batches_that_stepped = steps


def attached_trainer(module: Any) -> Trainer | None:
    """The trainer running ``module`` (a ``LightningModule``), or ``None`` where it runs outside a fit (a network used
    on its own, a test calling a step by hand): the public ``module.trainer`` raises then, the private ``_trainer``
    is ``None`` (``tests/test_regularisers.py``)."""
    return module._trainer


def write_last_checkpoint(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """Have ``callback`` write its ``last.ckpt`` now, named and rotated as it does at an epoch's end: its private
    ``_save_last_checkpoint`` with the figures it names files by (``_monitor_candidates``). lm-zoo's ``LastCheckpoint``
    also writes at a stop signal, after every validation and when training ends, moments for which ``ModelCheckpoint``
    has no public call (``tests/test_faults.py``, ``tests/test_resume.py``)."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def wrote_at_this_step(callback: ModelCheckpoint, trainer: Trainer) -> bool:
    """Whether ``callback`` has written a checkpoint at the trainer's current step already (its private
    ``_last_global_step_saved``), so that a stop or the end of training writes none twice (``tests/test_faults.py``)."""
    return callback._last_global_step_saved == trainer.global_step


def writes_checkpoints_now(callback: ModelCheckpoint, trainer: Trainer) -> bool:
    """Whether ``callback`` would write a checkpoint at this point of the run: fitting, not a sanity check nor a
    ``fast_dev_run``, nothing written at this step yet (its private ``_should_skip_saving_checkpoint``, the rule it
    applies itself; ``tests/test_resume.py``)."""
    return not callback._should_skip_saving_checkpoint(trainer)


def averaged_model(callback: WeightAveraging) -> AveragedModel | None:
    """The running average a ``WeightAveraging`` callback keeps, ``None`` before its setup: its private
    ``_average_model``, which no public attribute gives (``tests/test_averaging.py``)."""
    return callback._average_model


class CheckpointPathReading:
    """LightningCLI's reading of a ``--ckpt_path`` file's hyperparameters, with a check before it and one line for a
    file it cannot read: a mixin for ``commands.fit.LMZooCLI``, which says both through :meth:`check_ckpt_path_given`
    and :meth:`ckpt_path_unreadable`.

    LightningCLI (2.6) reads the file in its private ``_parse_ckpt_path``, the first thing after parsing, and seeds
    (saying ``Seed set to N``) right after: no public hook runs before that read, and what ``torch.load`` raises for a
    truncated or foreign file would be a traceback (``tests/test_cli.py``,
    ``test_resuming_from_nothing_or_the_wrong_thing``).
    """

    config: Any

    def check_ckpt_path_given(self, ckpt_path: str | None) -> None:
        """Refuse a ``--ckpt_path`` before Lightning reads it (here: anything goes)."""

    def ckpt_path_unreadable(self, ckpt_path: str | None, error: Exception) -> Exception:
        """The error to raise for a file Lightning could not read (here: Lightning's own)."""
        return error

    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if subcommand:
            self.check_ckpt_path_given(ckpt_path)
        try:
            super()._parse_ckpt_path()  # type: ignore[misc]
        except LMZooError:
            raise
        except Exception as err:
            raise self.ckpt_path_unreadable(ckpt_path, err) from None


class OpenEndedEpochs:
    """A mixin for a ``RichProgressBar`` (``lightning_modules.progress.FitProgressBar``): a run without an epoch limit
    (``max_epochs: -1``, the GBW recipes stop at ``max_steps``) reads "Epoch 3", not Rich's "Epoch 3/-2". Lightning
    builds that text in the bar's private ``_get_train_description``, with no public hook (``tests/test_cli.py``,
    ``test_the_progress_bar_says_epochs_and_versions_plainly``)."""

    trainer: Any
    validation_description: str

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)  # type: ignore[misc]
