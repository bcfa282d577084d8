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

The divergence guard (:class:`~lightning_modules.divergence.DivergenceGuard`) is a callback the module brings
(``configure_callbacks``): the training step hands it the window's loss in its output (``window_loss``), and the
clipping its norm.

Under DDP (:mod:`lightning_modules.resume` has the details) each rank draws its own dropout masks but the same shared
draws (:attr:`StatefulTraining.shared_generator`, e.g. NCE noise words), and a checkpoint keeps every rank's resume
state keyed by rank.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torchmetrics import Metric

from datamodules.windows import epoch_cut_short
from lightning_modules.divergence import WINDOW_LOSS, DivergenceGuard, divergence_guard
from lightning_modules.lightning_private import attached_trainer, writes_logs_this_step
from lightning_modules.resume import (
    RESUME_KEY,
    gathering_world_size,
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
from lightning_modules.sparse_gradients import clip_grad_norm as sparse_clip_grad_norm
from lightning_modules.sparse_gradients import has_sparse_gradients
from lightning_modules.training_step import StepPlan, TrainingObjective, TrainingStep, plan
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
        self._state["val"] = None

    def on_train_end(self) -> None:
        self.step_runner = None  # its graphs' memory with it

    def configure_callbacks(self) -> list[L.Callback]:
        """The divergence guard, with this module's ``divergence_threshold``: a run of an lm-zoo module always has
        one."""
        return [DivergenceGuard(self.divergence_threshold)]

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

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        """Lightning's training step: :meth:`training_objective`, then :meth:`record_training_step`; its output
        (:meth:`step_output`) gives the divergence guard the window's loss."""
        logs = self.logs_this_training_step(batch_idx)
        result = self.training_objective(batch, figures=logs)
        self.record_training_step(result, logs)
        return self.step_output(result)

    @staticmethod
    def step_output(result: TrainingObjective, window_loss: Tensor | None = None) -> dict[str, Tensor]:
        """A training step's output: the objective to minimise (``loss``) and the training loss the divergence guard
        checks (:data:`~lightning_modules.divergence.WINDOW_LOSS`): the window's, or ``window_loss`` (a step of several
        windows: the worst)."""
        return {"loss": result.objective, WINDOW_LOSS: result.loss.detach() if window_loss is None else window_loss}

    def record_training_step(self, result: TrainingObjective, logs: bool) -> None:
        """What a training step leaves behind on the host's side: the epoch's ``train_nll``, and at logging steps the
        per-step figures."""
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
        if not (stage == "train" and epoch_cut_short(self.trainer)):
            # Kept across a stop inside the epoch (max_steps, max_time): its checkpoint carries the sum on, and the
            # run resumed from it logs the whole epoch's mean at the epoch's end, not the mean of its second part.
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
        needs: the carried training state, the epoch's training-loss accumulator and the random number generators.
        (The divergence guard's own hook, called before this one, has named a diverged step as such.)"""
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
        trainer = attached_trainer(self)
        if trainer is not None and epoch_cut_short(trainer):
            # Training ended inside this epoch, which Lightning has counted as ended: written as under way, so that a
            # resumed run carries on with its rest (RESTARTED_MID_EPOCH in Lightning's fit loop), not the next one.
            progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
            for counts in (progress["total"], progress["current"]):
                counts["processed"] -= 1
                counts["completed"] = min(counts["completed"], counts["processed"])
            checkpoint["epoch"] = progress["current"]["completed"]
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
        world_size = gathering_world_size(trainer)
        ranks: list[Any] = [mine] if world_size == 1 else [None] * world_size
        if world_size > 1:
            dist.all_gather_object(ranks, mine)
        checkpoint[RESUME_KEY] = keyed_by_rank(ranks)

    def on_train_start(self) -> None:
        """Give each rank its own generators and all ranks the shared one; resuming, put back this rank's carried
        state, loss accumulator and generators saved with the checkpoint.

        Here, after Lightning's restore and the loader's first fetch, so the next dropout mask is the one the
        interrupted run would have drawn. (A checkpoint taken between epochs resets the state at the epoch start.)

        Raises:
            CheckpointError: the checkpoint was written by another number of processes (:func:`rank_state`).
        """
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

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, with two differences where it clips by norm:

        - sparse gradients (``sparse_gradients``), whose norm torch's ``clip_grad_norm_`` cannot compute, are clipped
          by :func:`~lightning_modules.sparse_gradients.clip_grad_norm` (the same rule);
        - dense ones, where Lightning would call torch's ``clip_grad_norm_`` (its precision plugin's own rule, no
          gradient scaler), get the same call here,

        and the norm either computes, which Lightning drops, goes to the divergence guard: NaN or infinite iff some
        gradient is (or the squares overflow float32, ~1e19, which is divergence all the same), so the guard needs no
        second pass over the gradients."""
        if not gradient_clip_val or gradient_clip_algorithm not in (None, "norm"):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # none, or by value
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        plugin = self.trainer.precision_plugin
        sparse = has_sparse_gradients(parameters)
        lightnings = getattr(plugin, "scaler", None) is not None or (
            type(plugin).clip_grad_by_norm is not Precision.clip_grad_by_norm
        )
        if lightnings and not sparse:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        norm = (sparse_clip_grad_norm if sparse else torch.nn.utils.clip_grad_norm_)(parameters, gradient_clip_val)
        guard = divergence_guard(self.trainer)
        if guard is not None:
            guard.observe_gradients(norm)

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
