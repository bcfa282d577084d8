"""The architecture search of Jozefowicz, Zaremba & Sutskever 2015 (§3): candidates, their tasks and
hyperparameters, and the evaluation of one candidate on one task with one setting.

What is the paper's:
- a candidate is a cell genome (:mod:`zoo.genome`), run as the ``genome`` architecture of a language model whose
  embedding is as wide as its hidden layer ("all nodes have the same dimensionality");
- the hyperparameters of §3.7: the initialisation scale (``Uniform(+-scale / sqrt(units))``), the learning rate, the
  gradient-norm limit, the number of layers, and the parameter budget (the units found by binary search for it);
- every task is next-step prediction with a minibatch of 20 unrolled 35 steps, the state carried between windows,
  SGD, and the §3.6 search schedule: after 3 epochs without a better validation accuracy, halve the rate at every
  epoch for 4 more epochs, then stop; the measure is the best validation next-step accuracy;
- the tasks: memorisation (5 symbols of 26, then reproduced; scored on the reproduction, teacher-forced), arithmetic
  with distractors and XML (:mod:`datamodules.synthetic`), and PTB.

What is scaled to a CPU (options in ``configs/search/*.yaml``): the parameter budgets, the corpus sizes, the number
of epochs and the training windows per epoch. The learning rate and the gradient limit are the paper's: they apply
to the loss its code (Zaremba et al.'s) trains on, the window's cross-entropy summed over the steps and averaged over
the minibatch, and so does this loop. On the memorisation task only the reproduction is scored, 5 of a window's 11
steps; a per-token mean scaled by the window length would have run its SGD 11/5 times faster than the paper's.

The training loop is a plain one over the data module's windows, not a Lightning ``Trainer``: a search runs
thousands of models of seconds each, for which a trainer's set-up, checkpointing and logging cost more than the
training; nothing of it is kept but the accuracy.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import datamodules
from datamodules.windows import IGNORE_INDEX
from lightning_modules.schedules import HalveOnPlateau
from zoo import RecurrentLM, units_for_budget
from zoo.errors import ConfigError

# §3.7's grids.
INIT_SCALES = (0.3, 0.7, 1.0, 1.4, 2.0, 2.8)
LEARNING_RATES = (0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
GRADIENT_NORMS = (1.0, 2.5, 5.0, 10.0, 20.0)
NUM_LAYERS = (1, 2, 3, 4)
MEMORISE = "memorise"


@dataclass(frozen=True, order=True)
class Setting:
    """One hyperparameter setting of §3.7 (the paper's units)."""

    init_scale: float
    learning_rate: float
    max_grad_norm: float
    num_layers: int
    num_params: int

    def key(self) -> str:
        """A stable text form, what the store records and compares."""
        return (
            f"scale={self.init_scale:g},lr={self.learning_rate:g},clip={self.max_grad_norm:g},"
            f"layers={self.num_layers},params={self.num_params}"
        )

    @classmethod
    def from_key(cls, key: str) -> Setting:
        values = dict(part.split("=") for part in key.split(","))
        return cls(
            float(values["scale"]),
            float(values["lr"]),
            float(values["clip"]),
            int(values["layers"]),
            int(values["params"]),
        )


@dataclass(frozen=True)
class Grid:
    """The values each hyperparameter may take (§3.7 unless a config narrows them)."""

    init_scale: tuple[float, ...] = INIT_SCALES
    learning_rate: tuple[float, ...] = LEARNING_RATES
    max_grad_norm: tuple[float, ...] = GRADIENT_NORMS
    num_layers: tuple[int, ...] = NUM_LAYERS

    def draw(self, rng: random.Random, num_params: tuple[int, ...]) -> Setting:
        """A setting drawn uniformly from the grid, with one of the task's parameter budgets."""
        return Setting(
            rng.choice(self.init_scale),
            rng.choice(self.learning_rate),
            rng.choice(self.max_grad_norm),
            rng.choice(self.num_layers),
            rng.choice(num_params),
        )

    def size(self, num_params: tuple[int, ...]) -> int:
        return (
            len(self.init_scale)
            * len(self.learning_rate)
            * len(self.max_grad_norm)
            * len(self.num_layers)
            * len(num_params)
        )


@dataclass(frozen=True)
class Task:
    """One of the search's problems.

    Attributes:
        name: ``memorise``, ``arithmetic``, ``xml``, ``ptb`` or any other name a config gives.
        data: the data module: ``class_path`` (``datamodules.TextDataModule`` or ``datamodules.ReverseCopyDataModule``)
            and its ``init_args``.
        num_params: the parameter budgets a setting may take (§3.7: 250K or 1M for arithmetic and XML, 5M for PTB).
        epochs: the most epochs a candidate trains (the §3.6 schedule may stop it earlier).
        train_windows: training windows per epoch (``None``: the whole split). Consecutive epochs take consecutive
            slices of the split, the recurrent state carried across, and go round to its start when it ends, so a run
            of ``epochs`` x ``train_windows`` windows reads that much of the corpus, not the same first slice again.
        valid_windows: validation windows scored per epoch (``None``: the whole split).
        stop_at: stop training once the validation accuracy reaches this (``None``: never). A filter passed or failed
            at a threshold (memorisation, §3.1) learns nothing from the epochs after it reaches it.
        scored_span: score only the targets after an input of the first symbol, up to and including the second
            (arithmetic: ``("=", ".")``, the answer); ``None``: every target. §3.5 has the network read the problem
            "until it observes the '=' sign, after which it is to output the answer": the operands and distractors
            are random, so no cell predicts them, and Table 1's 0.29-0.92 are accuracies on answers. Training still
            predicts every character (the paper's "next step prediction formulation").
    """

    name: str
    data: dict[str, Any]
    num_params: tuple[int, ...]
    epochs: int = 10
    train_windows: int | None = None
    valid_windows: int | None = None
    stop_at: float | None = None
    scored_span: tuple[str, str] | None = None

    def datamodule(self) -> Any:
        """A fresh data module for the task (its splits are generated or read from the cache)."""
        class_name = self.data.get("class_path", "datamodules.TextDataModule").rsplit(".", 1)[-1]
        if class_name not in datamodules.__all__:
            raise ConfigError(f"task {self.name!r}: unknown data module {class_name!r}")
        return getattr(datamodules, class_name)(**self.data.get("init_args", {}))


def hidden_for_budget(architecture: str, options: dict[str, Any], vocab_size: int, layers: int, budget: int) -> int:
    """The most units (embedding = hidden) whose language model has at most ``budget`` parameters (§3.7)."""

    def count(units: int) -> int:
        with torch.device("meta"):
            model = RecurrentLM(
                vocab_size=vocab_size,
                architecture=architecture,
                embedding_size=units,
                hidden_size=units,
                num_layers=layers,
                cell_options=options,
            )
        return model.num_parameters()

    return units_for_budget(count, budget, what=f"a {layers}-layer {architecture} model")


@dataclass
class Outcome:
    """What training one candidate on one task with one setting gave.

    Attributes:
        accuracy: the best validation next-step accuracy over the epochs (0 if training diverged at once).
        epochs: epochs trained.
        hidden_size: the units the budget allowed.
        parameters: the model's parameter count.
        diverged: training met a non-finite loss (it stops there; the accuracy so far counts).
        history: validation accuracy after each epoch.
    """

    accuracy: float
    epochs: int
    hidden_size: int
    parameters: int
    diverged: bool = False
    history: list[float] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return asdict(self)


def window_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """Correct argmax predictions and predicted tokens in a window (targets ``-100`` are not predicted)."""
    scored = targets != IGNORE_INDEX
    return int((logits.argmax(-1) == targets)[scored].sum()), int(scored.sum())


@dataclass(frozen=True)
class Span:
    """Token ids of a scored span (``Task.scored_span``): it opens after an input ``start``, closes with the target
    ``end`` (scored), and a line end closes it too."""

    start: int
    end: int
    line_end: int

    @classmethod
    def of(cls, task: Task, tokenizer: Any) -> Span:
        """The task's ``scored_span`` in the tokenizer's ids."""
        ids = [tokenizer.encode(symbol) for symbol in task.scored_span or ()]
        if len(ids) != 2 or any(len(i) != 1 or i[0] == tokenizer.unk_id for i in ids):
            raise ConfigError(
                f"task {task.name!r}: scored_span {list(task.scored_span)} must be two symbols of the corpus, "
                "e.g. ['=', '.']"
            )
        return cls(ids[0][0], ids[1][0], tokenizer.eos_id)

    def targets(
        self, inputs: torch.Tensor, targets: torch.Tensor, inside: torch.Tensor, reset: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's targets with those outside a span set to ``-100``.

        Args:
            inputs: ``(B, T)`` the window's inputs.
            targets: ``(B, T)`` its targets.
            inside: ``(B,)`` bool, whether each stream's previous window ended inside a span.
            reset: ``(B, T)`` bool or ``None``: a stream that starts anew before step t starts outside a span.

        Returns:
            The masked targets ``(B, T)`` and ``inside`` after the window ``(B,)``.
        """
        scored = torch.empty_like(inputs, dtype=torch.bool)  # (B, T)
        for t in range(inputs.size(1)):
            token = inputs[:, t]  # (B,)
            if reset is not None:
                inside = inside & ~reset[:, t]
            inside = (inside | (token == self.start)) & (token != self.end) & (token != self.line_end)
            scored[:, t] = inside
        return targets.masked_fill(~scored, IGNORE_INDEX), inside


def validation_accuracy(model: Any, windows: Any, limit: int | None, span: Span | None = None) -> float:
    """Next-step accuracy over the validation windows, the state carried from window to window.

    Args:
        model: the language model.
        windows: the validation stream.
        limit: score at most this many windows (``None``: all).
        span: score only the targets in this span (``None``: every target).
    """
    model.eval()
    correct = total = 0
    state = inside = None
    with torch.no_grad():
        for index, window in enumerate(windows):
            if limit is not None and index >= limit:
                break
            logits, state = model(window.inputs, state, window.reset)
            targets = window.targets
            if span is not None:
                if inside is None:
                    inside = torch.zeros(targets.size(0), dtype=torch.bool)
                targets, inside = span.targets(window.inputs, targets, inside, window.reset)
            right, count = window_accuracy(logits, targets)
            correct, total = correct + right, total + count
    return correct / max(total, 1)


def passes(stream: Any) -> Iterator[tuple[bool, Any]]:
    """``stream``'s windows, pass after pass without end, each with whether it starts a pass (one iteration of the
    stream: a new epoch of its orders)."""
    while True:
        for index, window in enumerate(stream):
            yield index == 0, window


def candidate_model(architecture: str, options: dict[str, Any], vocab_size: int, setting: Setting) -> RecurrentLM:
    """The language model a candidate trains: the cell, its width set by the parameter budget
    (:func:`hidden_for_budget`), embedding as wide, initialised uniformly in +-``init_scale / sqrt(width)``."""
    hidden = hidden_for_budget(architecture, options, vocab_size, setting.num_layers, setting.num_params)
    return RecurrentLM(
        vocab_size=vocab_size,
        architecture=architecture,
        embedding_size=hidden,
        hidden_size=hidden,
        num_layers=setting.num_layers,
        init_range=setting.init_scale / math.sqrt(hidden),
        cell_options=options,
    )


def train_candidate(architecture: str, options: dict[str, Any], task: Task, setting: Setting, seed: int = 0) -> Outcome:
    """Train a language model of this cell on ``task`` with ``setting`` and score it (module docstring).

    Args:
        architecture: a zoo architecture (``genome`` for a candidate; ``lstm``, ``gru_paper``, ... for Table 1).
        options: its cell options (``{"genome": "..."}`` for a candidate).
        task: the task.
        setting: the hyperparameters.
        seed: seeds the initialisation and the training order.
    """
    torch.manual_seed(seed)
    datamodule = task.datamodule()
    model = candidate_model(architecture, options, datamodule.vocab_size, setting)
    hidden = model.config.hidden_size
    span = Span.of(task, datamodule.tokenizer) if task.scored_span is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=setting.learning_rate)
    outcome = Outcome(0.0, 0, hidden, model.num_parameters())
    # §3.6: three epochs without improvement start the decay: x0.5 per epoch for four more, then stop.
    schedule = HalveOnPlateau(patience=3, factor=0.5, decays=4)
    train = datamodule.stream("train")  # one stream for the run: it counts the epochs it is read (new orders)
    slices = passes(train)  # with train_windows: each epoch the next slice
    state = None
    for epoch in range(task.epochs):
        model.train()
        if task.train_windows is None:
            epoch_windows: Iterator[tuple[bool, Any]] = ((index == 0, w) for index, w in enumerate(train))
        else:
            epoch_windows = itertools.islice(slices, task.train_windows)
        for first, window in epoch_windows:
            if first:  # a pass over the split starts: its first window starts from zeros
                state = None
            nll, state = model.token_nll(window.inputs, window.targets, state, window.reset)
            predicted = (window.targets != IGNORE_INDEX).sum()
            if int(predicted) == 0:
                state = tuple(s.detach() for s in state)
                continue
            loss = nll.sum() / window.inputs.size(0)  # summed over the steps, averaged over the minibatch
            if not torch.isfinite(loss):
                outcome.diverged = True
                return outcome
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), setting.max_grad_norm)
            optimizer.step()
            state = tuple(s.detach() for s in state)
        accuracy = validation_accuracy(model, datamodule.stream("valid"), task.valid_windows, span)
        outcome.history.append(accuracy)
        outcome.epochs = epoch + 1
        outcome.accuracy = max(outcome.accuracy, accuracy)
        if task.stop_at is not None and accuracy >= task.stop_at:
            break
        action = schedule.step(-accuracy)  # the schedule's figure is lower-is-better
        if action == "stop":
            break
        if action == "halve":
            for group in optimizer.param_groups:
                group["lr"] *= schedule.factor
    return outcome
