"""What every lm-zoo training module shares, whatever its data: the recurrent state carried from window to window,
the guards that stop a diverging run before it writes bad weights, and what a checkpoint keeps for an exact resume.

:class:`~lightning_modules.language_model.LanguageModel` (tokens) and :class:`~lightning_modules.music.MusicModel`
(piano-roll frames) subclass it. A subclass sets ``self.divergence_threshold`` and ``self.model`` (the plain network),
keeps each stage's state in ``self._state[stage]`` (zeroed here at every epoch start), implements
:meth:`StatefulTraining.window_nll` (validation and test steps are this module's),
:meth:`StatefulTraining.training_objective` (the training window's device work: the training step and what it records
are this module's) and :meth:`StatefulTraining.log_epoch_figures`.

A training step runs the objective, its backward pass, the clipping and the optimizer's update either in Lightning's
closure or, where it can, in lm-zoo's own step (:mod:`lightning_modules.training_step`), which on a GPU replays them
as one captured CUDA graph.

Under DDP (:mod:`lightning_modules.resume` has the details) each rank draws its own dropout masks but the same shared
draws (:attr:`StatefulTraining.shared_generator`, e.g. NCE noise words), a checkpoint keeps every rank's resume state
keyed by rank, and the divergence guard decides on every rank's loss at once, so that all ranks stop at the same step.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_modules.lightning_private import attached_trainer, writes_logs_this_step
from lightning_modules.resume import (
    RESUME_KEY,
    generator_state,
    keyed_by_rank,
    new_shared_generator,
    non_finite,
    rank_state,
    rng_states,
    seed_rank,
    set_generator_state,
    set_rng_states,
)
from lightning_modules.training_step import StepPlan, TrainingObjective, TrainingStep, gradients_sum, plan
from zoo.errors import CheckpointError, TrainingDivergedError
from zoo.state import State

STAGES = ("train", "val", "test")


class WeightedMean(Metric):
    """The weighted mean of the values it is given (nats per unit, weighted by the units): torchmetrics' ``MeanMetric``
    without its NaN check.

    ``MeanMetric`` asks the device whether a value is NaN at every update, two host synchronisations a step, to drop
    it; with ``nan_strategy="disable"`` torchmetrics (1.9) also drops the weights, and every window would count
    alike. Here a NaN training loss stops the run anyway (the divergence guard), and a NaN in evaluation should show
    in the result, not vanish from it. The states keep ``MeanMetric``'s names and meaning (``mean_value`` the weighted
    sum, ``weight`` the weights' sum), which checkpoints store; both are summed across ranks.
    """

    full_state_update = False
    mean_value: Tensor
    weight: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("mean_value", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: Tensor, weight: Tensor) -> None:
        """Add ``value`` with ``weight`` (a tensor or a number; the predicted units of a window)."""
        weight = torch.as_tensor(weight, device=self.weight.device)
        self.mean_value += (value * weight).sum()
        self.weight += weight.sum()

    def compute(self) -> Tensor:
        return self.mean_value / self.weight


class StatefulTraining(L.LightningModule):
    """Stateful truncated BPTT's bookkeeping: per-stage carried state, divergence guards and exact resume."""

    divergence_threshold: float  # nats per predicted unit; 0 turns the guard off
    model: nn.Module
    # Draws that must be equal on every rank (NCE noise words), from fit's first step on; None outside fit, where
    # draws fall back to the global generator.
    shared_generator: torch.Generator | None = None
    # A signal noted on this rank (SIGINT, SIGTERM: checkpoints.ckpt_write.LastCheckpoint notes it), and the stop every
    # rank agreed on at this step: (the lowest rank that noted one, its signal), from check_divergence's gather.
    stop_signal: int | None = None
    agreed_stop: tuple[int, int] | None = None
    # This step's training loss, which the divergence guard reads with the gradients (record_training_step sets it).
    divergence_loss: Tensor | None = None
    # Who runs each training step where Lightning's closure does not: chosen at the start of training.
    step_runner: TrainingStep | None = None
    step_plan: StepPlan | None = None

    def __init__(self) -> None:
        super().__init__()
        self._state: dict[str, State | None] = dict.fromkeys(STAGES)
        self._resume: dict[str, Any] | None = None  # what a checkpoint kept for resuming fit, used by on_train_start
        self.metrics = nn.ModuleDict({f"{stage}_nll": WeightedMean() for stage in STAGES})

    def on_train_epoch_start(self) -> None:
        self._state["train"] = None

    def on_validation_epoch_start(self) -> None:
        self.settle_divergence_check()  # no validation of a diverged step's weights
        self._state["val"] = None

    def on_train_end(self) -> None:
        self.settle_divergence_check()  # the last step's check
        self.step_runner = None  # its graphs' memory with it

    def step_summary(self) -> str | None:
        """Who runs this fit's training steps, in words, and what capturing them cost so far (``None`` before the fit
        starts training)."""
        if self.step_runner is not None:
            return self.step_runner.summary()
        return None if self.step_plan is None else self.step_plan.describe()

    def on_test_epoch_start(self) -> None:
        self._state["test"] = None

    # ------------------------------------------------------------------------------------------------ training
    def training_objective(self, batch: Any, figures: bool = True) -> TrainingObjective:
        """The window's objective and figures, carrying the training state: device work only, nothing recorded, so
        that a captured step can replay it (``figures``: compute the per-step figures too)."""
        raise NotImplementedError

    def capturable_window(self, batch: Any) -> bool:
        """Whether a captured training step can replay this window (shapes aside): here, never."""
        return False

    @property
    def training_state(self) -> State | None:
        """The state carried from one training window to the next (``None``: zeros, as at an epoch's start)."""
        return self._state["train"]

    @training_state.setter
    def training_state(self, state: State | None) -> None:
        self._state["train"] = state

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Lightning's training step: :meth:`training_objective`, then :meth:`record_training_step`."""
        logs = self.logs_this_training_step(batch_idx)
        result = self.training_objective(batch, figures=logs)
        self.record_training_step(result, logs)
        return result.objective

    def record_training_step(self, result: TrainingObjective, logs: bool) -> None:
        """What a training step leaves behind on the host's side: the loss for the divergence guard (read with the
        gradients at the optimizer step), the epoch's ``train_nll``, and at logging steps the per-step figures."""
        self.divergence_loss = result.loss.detach()
        if result.reports_nats:
            self.metrics["train_nll"].update(result.loss.detach(), weight=result.count)
        if logs:
            self.log("train_loss", result.loss, prog_bar=True, batch_size=result.window)
            for name, value in result.figures.items():
                self.log(name, value, batch_size=result.window)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.step_runner is not None:
            self.step_runner.next_batch(batch, batch_idx)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's optimizer step, or lm-zoo's whole step where :attr:`step_runner` runs it
        (:mod:`lightning_modules.training_step`: forward, backward, clipping and update in one, captured on a GPU)."""
        if self.step_runner is None:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            return
        self.step_runner.step(optimizer_closure)

    # ------------------------------------------------------------------------------------- evaluation and logging
    def window_nll(self, batch: Any, stage: str) -> tuple[Tensor, Tensor]:
        """Summed nats over a window's predicted units and how many there were, carrying ``stage``'s state."""
        raise NotImplementedError

    def log_epoch_figures(self, stage: str, loss: Tensor) -> None:
        """Log what ``stage``'s mean nats per unit ``loss`` mean for this kind of data (perplexity, per note, ...)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: Any, stage: str) -> None:
        total, count = self.window_nll(batch, stage)
        # A window with nothing to predict (a column's padding) adds 0 with weight 0: asking whether count > 0 would
        # make the host wait for the device.
        self.metrics[f"{stage}_nll"].update(total / count.clamp(min=1), weight=count)

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def _log_epoch(self, stage: str) -> None:
        """Log the stage's mean nats per unit (``val_loss`` is what ``best.ckpt`` keeps), then its figures."""
        metric = self.metrics[f"{stage}_nll"]
        if metric.weight == 0:  # nothing seen (e.g. no validation batches)
            return
        loss = metric.compute()
        metric.reset()
        self.log(f"{stage}_loss_epoch" if stage == "train" else f"{stage}_loss", loss)
        self.log_epoch_figures(stage, loss)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, in one line, a checkpoint whose tensors have other shapes than this module's; keep what it holds
        for resuming ``fit`` until training starts (evaluation never uses it, older checkpoints lack it).

        Raises:
            CheckpointError: e.g. ``--model.init_args.hidden_size`` changed on resume.
        """
        stored = checkpoint.get("state_dict", {})
        expected = self.state_dict()
        different = [name for name in stored if name in expected and stored[name].shape != expected[name].shape]
        if different:  # say so before Lightning's traceback
            name = different[0]
            raise CheckpointError(
                f"the checkpoint's {name} has shape {tuple(stored[name].shape)} but this model's is "
                f"{tuple(expected[name].shape)} ({len(different)} tensors differ): use the model settings it was "
                "trained with (its run's config.yaml), or start a new run without --ckpt_path"
            )
        self._resume = checkpoint.get(RESUME_KEY)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Never write non-finite weights (the previous checkpoint stays the last good one); add what an exact resume
        needs: the carried training state, the epoch's training-loss accumulator and the random number generators."""
        self.settle_divergence_check()  # a diverged step is named as such, before its weights are looked at
        parameters = {name for name, _ in self.named_parameters(remove_duplicate=False)}  # not buffers
        bad = [
            name
            for weights in (checkpoint.get("state_dict", {}), checkpoint.get("current_model_state", {}))  # avg, live
            for name in non_finite({k: weights[k] for k in sorted(parameters & weights.keys())})
        ]
        if bad:
            raise TrainingDivergedError(
                f"the weights became NaN or infinite by step {self.global_step} (epoch {self.current_epoch}; "
                f"{', '.join(bad[:3])}), so no checkpoint was written: lower the learning rate or set "
                "--trainer.gradient_clip_val, then resume from the last checkpoint"
            )
        train_nll = self.metrics["train_nll"]
        state = self._state["train"]
        # On the CPU: the gather pickles tensors with their device, and rank 0 must not unpickle rank 1's GPU tensors.
        mine = {
            "train_state": None if state is None else tuple(s.cpu() for s in state),
            "train_nll": {"mean_value": train_nll.mean_value.detach().cpu(), "weight": train_nll.weight.detach().cpu()},
            "rng": rng_states(),
        }
        if self.shared_generator is not None:
            mine["shared_rng"] = generator_state(self.shared_generator)
        # Lightning calls this hook on every rank but only rank 0 writes: gather every rank's own state first.
        world_size = self._distributed_world_size()
        ranks: list[Any] = [mine] if world_size == 1 else [None] * world_size
        if world_size > 1:
            dist.all_gather_object(ranks, mine)
        checkpoint[RESUME_KEY] = keyed_by_rank(ranks)

    def _distributed_world_size(self) -> int:
        """The number of ranks whose state must be gathered (1 outside a process group)."""
        trainer = attached_trainer(self)
        world_size = trainer.world_size if trainer is not None else 1
        return world_size if world_size > 1 and dist.is_available() and dist.is_initialized() else 1

    def on_train_start(self) -> None:
        """Give each rank its own generators and all ranks the shared one; resuming, put back this rank's carried
        state, loss accumulator and generators saved with the checkpoint.

        Here, after Lightning's restore and the loader's first fetch, so the next dropout mask is the one the
        interrupted run would have drawn. (A checkpoint taken between epochs resets the state at the epoch start.)

        Raises:
            CheckpointError: the checkpoint was written by another number of processes (:func:`rank_state`).
        """
        self.__dict__.pop("_pending_check", None)  # a module fitted again starts with none
        self.step_plan = chosen = plan(self.trainer, self)
        self.step_runner = None if chosen.path == "lightning" else TrainingStep(self, self.trainer, chosen)
        resume, self._resume = self._resume, None
        # Rank 0's seed (after seed_everything: the run's seed, the same on every rank) for the rank offsets and the
        # shared generator: broadcast, so that they agree even in a run that seeded nothing.
        seed = int(self.trainer.strategy.broadcast(torch.initial_seed()))
        self.shared_generator = new_shared_generator(seed, self.device)
        if resume is None:
            seed_rank(seed, self.global_rank)
            return
        resume = rank_state(resume, self.global_rank, self.trainer.world_size)
        state = resume.get("train_state")
        self._state["train"] = None if state is None else tuple(s.to(self.device) for s in state)
        train_nll = self.metrics["train_nll"]
        for name, value in resume.get("train_nll", {}).items():
            setattr(train_nll, name, value.to(self.device))
        # An update that adds nothing: torchmetrics counts updates and warns when an epoch that resumes at its very
        # end (no window left) computes a restored accumulator without one.
        train_nll.update(torch.zeros((), device=self.device), weight=torch.zeros((), device=self.device))
        set_rng_states(resume["rng"])
        if "shared_rng" in resume:  # checkpoints written before the shared generator start it from the seed
            set_generator_state(self.shared_generator, resume["shared_rng"])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Stop a diverged run before any checkpoint holds its weights: a training loss that is NaN, infinite or
        above ``divergence_threshold``, or a NaN or infinite gradient (a finite loss can still give one, e.g. through
        an overflowing cell). Both in one copy to the host, which the host does not wait for: decided a step later
        (:meth:`check_divergence`).
        Gradients are not checked under a gradient scaler (16-bit mixed precision), which itself skips the steps whose
        scaled gradients overflowed.

        Where the clipping that follows computes the gradients' norm (:meth:`divergence_checked_when_clipping`), the
        check waits for it and reads that norm: a second pass over every gradient saved, on each step."""
        # Decided once per step: the clipping hook checks exactly when this one did not.
        self._divergence_check_at_clipping = self.divergence_checked_when_clipping(optimizer)
        if self._divergence_check_at_clipping:
            return
        trainer = attached_trainer(self)
        scaled = trainer is not None and getattr(trainer.precision_plugin, "scaler", None) is not None
        self.check_divergence(None if scaled else gradients_sum(self.parameters()))

    def logs_this_training_step(self, batch_idx: int) -> bool:
        """Whether this training step logs its per-step figures (``train_loss`` and the like): the first step, and
        the steps at which Lightning writes its logs (every ``trainer.log_every_n_steps``, and a stopping one).

        Each ``self.log`` call costs Lightning's bookkeeping, some 0.6 ms (measured on the PTB 2 x 200 LSTM's 63 ms
        step), and between those steps nothing reads a per-step value but the progress bar, which shows the last one
        logged. With ``log_every_n_steps: 0`` every step logs, as before."""
        trainer = attached_trainer(self)
        if trainer is None or batch_idx == 0 or trainer.log_every_n_steps == 0:
            return True
        return writes_logs_this_step(trainer)  # Lightning's own rule for writing step logs

    def divergence_checked_when_clipping(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this step's gradient clipping computes the gradients' norm and :meth:`check_divergence` runs
        there; a module whose ``configure_gradient_clipping`` does so says when (here: never)."""
        return False

    def check_divergence(self, gradients: Tensor | None) -> None:
        """Start this step's divergence check and decide on the previous step's.

        The check reads this step's training loss and ``gradients`` (a scalar that is NaN or infinite iff some
        gradient is: their sum or their norm; ``None``: not checked). Reading them on the host at once would make the
        host wait for the GPU at every step, and Lightning's per-step Python would then add to the GPU's time instead
        of overlapping it. So they are copied to the host without waiting (:class:`PendingCheck`) and decided on one
        step later, by when the copy has long landed. A diverged step's update has then reached the weights, but
        no checkpoint is written from them: every save decides on the pending check first (:meth:`on_save_checkpoint`,
        which also refuses non-finite weights), as do validation and the end of training, and the error names the
        step that diverged, as before.

        Under DDP the decision is every rank's: the losses (each rank's own columns) are gathered before the host
        copy, so every rank sees the same values and raises the same error at the same step. A rank that raised alone
        would leave the others blocked in the next gradient all-reduce. (The gradients are all-reduced already.)

        A signal noted on any rank (:attr:`stop_signal`) travels in the same gather, last: every rank sets
        :attr:`agreed_stop` at the same step (the step after the gather, where it is read), and the rank that writes
        ``last.ckpt`` and stops does so in step with the others (:mod:`lightning_modules.faults`). One process stops
        at the step its signal came in."""
        loss = self.divergence_loss
        checked = ([loss.float()] if loss is not None else []) + ([gradients.float()] if gradients is not None else [])
        device = checked[0].device if checked else self.device
        # The signal as a fill on the device, not torch.tensor(value, device=...), which is a copy the host waits for.
        signal = torch.full((), float(self.stop_signal or 0), device=device)
        values = torch.stack([*checked, signal])  # (1 to 3,): the loss, the gradients' sum or norm, this rank's signal
        world_size = self._distributed_world_size()
        if world_size > 1:
            # all_gather into a list: all_gather_into_tensor is deprecated in torch 2.13 and its successor,
            # all_gather_single, is newer than the oldest torch lm-zoo supports.
            gathered = [torch.empty_like(values) for _ in range(world_size)]
            dist.all_gather(gathered, values)
            rows = torch.stack(gathered)  # (W, 1 to 3): every rank's values
        else:
            rows = values.unsqueeze(0)  # (1, 1 to 3)
            # One process has nothing to agree on: its own signal stops it at this step, not the next.
            self.agreed_stop = (0, self.stop_signal) if self.stop_signal else None
        pending = PendingCheck(rows, self.global_step, self.current_epoch, loss is not None, bool(checked))
        previous, self._pending_check = self.__dict__.get("_pending_check"), pending
        if previous is not None:
            self._decide(previous)

    def settle_divergence_check(self) -> None:
        """Decide on the pending divergence check now (waiting for its copy if it has not landed): before a
        checkpoint is written, before validation, at the end of training."""
        pending = self.__dict__.pop("_pending_check", None)
        if pending is not None:
            self._decide(pending)

    def _decide(self, pending: PendingCheck) -> None:
        rows = pending.rows()
        if len(rows) > 1:
            signalled = [(rank, int(row[-1])) for rank, row in enumerate(rows) if row[-1]]
            self.agreed_stop = signalled[0] if signalled else None
        rows = [row[:-1] for row in rows]
        if not pending.checked:
            return
        if pending.has_loss:
            for rank, row in enumerate(rows):  # the lowest failing rank names the step's failure, on every rank
                self._check_loss(row[0], pending.step, pending.epoch, rank if len(rows) > 1 else None)
        values = rows[0][1:] if pending.has_loss else rows[0]  # the all-reduced gradients: the same on every rank
        if values and not math.isfinite(values[0]):
            raise TrainingDivergedError(
                f"a gradient became NaN or infinite at step {pending.step} (epoch {pending.epoch}) with a "
                "finite loss; lower the learning rate or set --trainer.gradient_clip_val, then resume from the last "
                "checkpoint"
            )

    def _check_loss(self, value: float, step: int, epoch: int, rank: int | None = None) -> None:
        if not math.isfinite(value) or 0 < self.divergence_threshold < value:
            limit = f" > model.init_args.divergence_threshold {self.divergence_threshold:.4g}" * math.isfinite(value)
            where = "" if rank is None else f"rank {rank}'s "
            raise TrainingDivergedError(
                f"{where}training loss became {value:.4g}{limit} at step {step} (epoch {epoch}); lower the learning "
                "rate or set --trainer.gradient_clip_val, then resume from the last checkpoint"
            )


class PendingCheck:
    """A step's divergence figures on their way to the host: copied without waiting (into pinned memory on a GPU,
    so that the copy is truly asynchronous), and read once the copy has landed (:meth:`rows`).

    Args:
        rows: ``(W, k)`` on the device: each rank's loss, gradients' sum or norm, signal (those present).
        step: the step they belong to, for the message.
        epoch: its epoch.
        has_loss: whether the first column is the training loss.
        checked: whether anything but the signal is in them.
    """

    def __init__(self, rows: Tensor, step: int, epoch: int, has_loss: bool, checked: bool) -> None:
        self.step, self.epoch, self.has_loss, self.checked = step, epoch, has_loss, checked
        on_gpu = rows.device.type == "cuda"
        self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=on_gpu)
        self._host.copy_(rows, non_blocking=True)  # on the CPU, a copy like any other
        self._event: torch.cuda.Event | None = None
        if on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def rows(self) -> list[list[float]]:
        """The figures, per rank; waits for the copy only if it has not landed (a step later, it has)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
