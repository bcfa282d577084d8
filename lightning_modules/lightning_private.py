"""Every private Lightning API lm-zoo uses, one function each, saying why no public one serves.

Lightning is pinned below 2.7 (``pyproject.toml``) because of these: an upgrade reads this file first. Each function
is exercised by the suite (the tests named beside it), so that a Lightning that moved one of them fails there, not in a
user's run. Nothing else in lm-zoo touches a private Lightning attribute.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import Tensor


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
