"""The training loop of a recurrent language model: a LightningModule around :class:`zoo.RecurrentLM` (the network
itself, embedding -> zoo stack -> output head, a plain ``nn.Module`` in ``zoo/language_model.py``).

Stateful truncated BPTT (Lightning 2 removed its TBPTT hook): the recurrent state is carried on the module from one
training window to the next and detached at every window, as pytorch/examples' ``repackage_hidden`` does; each stage
(train / val / test) has its own state, zeroed at the start of every epoch, so evaluation never inherits training
context and vice versa. The data must therefore arrive as ordered contiguous streams (``datamodules.windows``).

Where each regulariser acts (training only; evaluation is deterministic)::

    ids ──► embedding ──► embedding_dropout (whole words) ──► input_dropout ──► stack ──► output_dropout ──► head
                                                                  │  inter_layer_dropout between layers,
                                                                  │  state_dropout / weight_drop inside (cell_options)
    loss = NLL + ar · mean(dropped_output²) + tar · mean((raw_t − raw_{t−1})²) + the cells' own terms

``raw`` is the last layer's output before ``output_dropout``, ``dropped_output`` after it (Merity et al. 2017,
AWD-LSTM ``main.py``). Weight decay (L2) is the optimizer's: ``optimizer.init_args.weight_decay`` in the YAML.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from datamodules.kinds import BPC, TEXT, bits_per_character
from datamodules.windows import IGNORE_INDEX, LMBatch
from lightning_modules.sparse_gradients import check_optimizer
from lightning_modules.stateful import StatefulTraining
from lightning_modules.training_step import TrainingObjective
from zoo.errors import CheckpointError, ConfigError
from zoo.language_model import LMConfig, RecurrentLM
from zoo.state import State, detach_state, mask_state

NO_NOISE = (
    "the nce and sampled_softmax heads need the unigram counts of the training data, and this data module's "
    "tokenizer has none (no `counts`): use a word-level data module, or call model.set_noise_distribution(counts)"
)
# The state-dict prefix of the wrapped network (``self.model``); checkpoints written before the split lack it.
MODEL_PREFIX = "model."
# This module's own: the training loss, its guard, and what training does to the carried state.
TRAINING_OPTIONS = ("ar", "tar", "divergence_threshold", "drop_state_probability")


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``source``'s weights into ``target``, which ``from_network`` built from the same settings and some overrides.

    Raises:
        ConfigError: the overrides changed a weight's shape (the first mismatch named).
    """
    try:
        target.load_state_dict(source.state_dict())
    except RuntimeError as err:
        mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise ConfigError(f"{mismatch.rstrip('.')}: an override changed the network's shape; keep its sizes") from None


def with_model_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A LanguageModel state dict with the network's tensors under ``model.``, whether or not they were written so."""
    if not state or any(name.startswith(MODEL_PREFIX) for name in state):
        return state
    return {MODEL_PREFIX + name: tensor for name, tensor in state.items()}


class LanguageModel(StatefulTraining):
    """Trains a :class:`zoo.RecurrentLM` (``self.model``): carried state, losses, regularisers, logging, resume.

    Every argument but the four below is the network's, by position or name: the fields of
    :class:`zoo.language_model.LMConfig`, which documents them (embedding, stack, head and dropout settings). The
    checkpoint's weights are the network's under ``model.``; exports keep the network alone
    (:mod:`checkpoints.export_write`).

    Args:
        ar: activation regularisation alpha: ``ar * mean(dropped_output ** 2)`` (Merity et al. 2017 §4.6).
        tar: temporal activation regularisation beta: ``tar * mean((raw_t - raw_{t-1}) ** 2)``, consecutive steps of
            the same stream (pairs across a reset are left out) (Merity et al. 2017 §4.6).
        divergence_threshold: stop training with one line when a window's mean training loss exceeds this many nats
            (Lightning's ``EarlyStopping`` has the same guard, but only at validation, by when a diverged run has
            spent an epoch at a fraction of its speed). ``None``: 10 x ln(vocab_size), ten times what a model that
            predicts every token uniformly scores; ``0`` turns it off. A non-finite loss always stops training.
        drop_state_probability: in training, each stream's carried state is zeroed at a window start with this
            probability (lamb's ``drop_state_probability``, used by Melis et al.'s released Mogrifier configs at
            0.01), so that the model also learns to start from a zero state, as every evaluation stream does.

    The ``nce`` / ``sampled_softmax`` heads take their noise distribution from the data module's tokenizer
    (``counts``) in :meth:`setup`. ``sparse_gradients`` needs SGD without momentum or weight decay, or Adagrad, and a
    single process; gradient-norm clipping still works (:meth:`StatefulTraining.configure_gradient_clipping`).
    """

    # The network's settings arrive as *args / **network and go to LMConfig, one call that LightningCLI follows:
    # jsonargparse reads each `model.init_args.<name>` (type, default, the docstring's line) from LMConfig's fields,
    # so they are spelt once, in zoo/language_model.py.
    def __init__(
        self,
        *args: Any,
        ar: float = 0.0,
        tar: float = 0.0,
        divergence_threshold: float | None = None,
        drop_state_probability: float = 0.0,
        **network: Any,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # the arguments given by name (LightningCLI gives every one)
        config = LMConfig(*args, **network)  # TypeError for a setting the network does not have
        # and the network's settings given by position or left at their defaults: a .ckpt records every one.
        self.hparams.update({name: value for name, value in asdict(config).items() if name not in self.hparams})
        if ar < 0 or tar < 0:
            raise ConfigError(f"ar and tar must be >= 0, got ar={ar}, tar={tar}")
        if divergence_threshold is not None and divergence_threshold < 0:
            raise ConfigError(f"divergence_threshold must be >= 0 (0: off), got {divergence_threshold}")
        if not 0 <= drop_state_probability < 1:
            raise ConfigError(f"drop_state_probability must be in [0, 1), got {drop_state_probability}")
        self.ar, self.tar = ar, tar
        self.drop_state_probability = drop_state_probability
        self.divergence_threshold = (
            10 * math.log(max(config.vocab_size, 2)) if divergence_threshold is None else divergence_threshold
        )
        self.model = RecurrentLM.from_config(config)

    @classmethod
    def from_network(cls, network: RecurrentLM, **overrides: Any) -> LanguageModel:
        """A LightningModule around a trained network, e.g. to fine-tune it or to run ``Trainer.validate`` on it::

            module = LanguageModel.from_network(checkpoints.load("ptb-lstm-small").model, dropout=0.3)

        Args:
            network: the network (:func:`checkpoints.from_pretrained` loads one); its weights are copied.
            overrides: constructor arguments to change (dropout rates, ``ar`` / ``tar``, ...); the network's shape
                must stay that of its weights.

        Raises:
            ConfigError: ``network`` is not a language model, or the overrides change its weights' shapes.
        """
        if not isinstance(network, RecurrentLM):
            raise ConfigError(
                f"{type(network).__name__} is not a language model (zoo.RecurrentLM): a model of piano rolls trains "
                "in lightning_modules.MusicModel"
            )
        module = cls(**{**asdict(network.config), **overrides})
        copy_weights(network, module.model)
        return module

    # --------------------------------------------------------------------------------------------------- forward
    def forward(self, inputs: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """Next-token scores ``(B, T, V)`` and the state: :meth:`zoo.RecurrentLM.forward`."""
        return self.model(inputs, state, reset)

    def token_nll(
        self,
        inputs: Tensor,
        targets: Tensor,
        state: State | None = None,
        reset: Tensor | None = None,
        temperature: float = 1.0,
    ) -> tuple[Tensor, State]:
        """Full-softmax nats of every target ``(B, T)`` and the state: :meth:`zoo.RecurrentLM.token_nll`."""
        return self.model.token_nll(inputs, targets, state, reset, temperature)

    def _window(self, batch: LMBatch, stage: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        state = self._state[stage]
        if state is not None and state[0].size(1) != batch.inputs.size(0):
            state = None  # a different number of streams (e.g. a resized eval batch): start afresh
        if stage == "train" and state is not None and self.drop_state_probability > 0:
            # lamb's drop_state_probability (deepmind/lamb training.py): each stream forgets its carried state with
            # probability p at a window start, one draw per stream for every layer's h and c alike, so that the
            # model also learns to start from zeros, as evaluation streams do. Never outside training.
            keep = torch.rand(state[0].size(1), device=state[0].device) >= self.drop_state_probability
            state = mask_state(state, keep.to(state[0].dtype))
        # The data module's Resets (where the resets fall, worked out on the host) spares the step a host
        # synchronisation that a bare reset mask on a GPU costs.
        reset = batch.model_reset
        features, state, raw, dropped = self.model.run(batch.inputs, state, reset)
        self._state[stage] = detach_state(state)  # truncated BPTT: the next window starts from values, not a graph
        if stage != "train":  # the full softmax, chunked over the vocabulary: never (B, T, V) logits at 793k words
            total = self.model.decoder.token_nll(features, batch.targets).sum()
            count = (batch.targets != IGNORE_INDEX).sum()
            return total, count, raw, dropped
        if self.model.needs_noise_distribution:
            raise ConfigError(NO_NOISE)
        # The head's own objective (zoo.heads). What it draws for the whole batch (NCE's noise words) comes from the
        # generator every rank seeds alike, so that the global batch shares it as one process's batch does.
        total, count = self.model.decoder.training_loss(features, batch.targets, shared_generator=self.shared_generator)
        return total, count, raw, dropped

    def activation_regularization(self, dropped: Tensor) -> Tensor:
        """AR (Merity et al. 2017 §4.6): ``ar * mean(dropped ** 2)`` over the last layer's output after dropout."""
        return self.ar * dropped.pow(2).mean()

    def temporal_activation_regularization(self, raw: Tensor, reset: Tensor | None = None) -> Tensor:
        """TAR (Merity et al. 2017 §4.6): ``tar * mean((raw_t - raw_{t-1}) ** 2)`` on the last layer's output before
        dropout. AWD-LSTM averages over every consecutive pair of the window; a pair that straddles a reset belongs to
        two different sequences and is left out."""
        diff = (raw[:, 1:] - raw[:, :-1]).pow(2)  # (B, T-1, H)
        if reset is None:
            return self.tar * diff.mean() if diff.numel() else raw.new_zeros(())
        keep = (~reset[:, 1:]).to(diff.dtype).unsqueeze(-1)  # (B, T-1, 1)
        pairs = keep.sum() * diff.size(-1)
        return self.tar * (diff * keep).sum() / pairs.clamp(min=1)

    # ------------------------------------------------------------------------------------------------ the loops
    def training_objective(self, batch: LMBatch, figures: bool = True) -> TrainingObjective:
        """The window's training objective: the head's loss (mean nats per predicted token) plus AWD-LSTM's AR and TAR
        and the cells' own terms, with those terms and the cells' statistics as figures (only when ``figures``)."""
        total, count, raw, dropped = self._window(batch, "train")
        loss = total / count.clamp(min=1)  # mean nats per predicted token
        objective, logged = loss, {}
        # AWD-LSTM's activation regularisers: AR on the dropped output, TAR on the raw one (Merity et al. 2017 §4.6).
        if self.ar > 0:
            logged["train_ar"] = self.activation_regularization(dropped)
            objective = objective + logged["train_ar"]
        if self.tar > 0:
            logged["train_tar"] = self.temporal_activation_regularization(raw, batch.reset)
            objective = objective + logged["train_tar"]
        # Terms a cell adds to its objective (e.g. Skip RNN's budget loss), and what it reports about the window.
        extra = self.model.rnn.regularization_loss()
        if extra is not None:
            logged["train_cell_loss"] = extra
            objective = objective + extra
        if figures:
            logged |= {f"train_{name}": value for name, value in self.model.rnn.statistics().items()}
        # The window's size weighs the epoch mean of the logged values: a host-side number, where the count of
        # predicted tokens would cost a device synchronisation (train_nll weighs by that count exactly). A sampled
        # objective (NCE) is not nats: no training perplexity.
        return TrainingObjective(
            objective, loss, count, batch.targets.numel(), logged if figures else {}, self.model.decoder.reports_nats
        )

    def capturable_window(self, batch: LMBatch) -> bool:
        """A window without resets: where resets fall is worked out on the host (:class:`zoo.state.Resets`), which a
        captured step could not do anew at each replay."""
        return batch.reset is None and batch.resets is None

    def window_nll(self, batch: LMBatch, stage: str) -> tuple[Tensor, Tensor]:
        """Full-softmax nats summed over the window's predicted tokens, and how many (validation and test)."""
        total, count, _, _ = self._window(batch, stage)
        return total, count

    def setup(self, stage: str) -> None:
        """Before fitting an ``nce`` / ``sampled_softmax`` head, take its noise distribution from the data module's
        tokenizer (its ``counts``: the training count of every id)."""
        if stage != "fit" or not self.model.needs_noise_distribution:
            return
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        counts = getattr(tokenizer, "counts", None)
        if counts is None:
            raise ConfigError(NO_NOISE)
        self.set_noise_distribution(counts)

    def set_noise_distribution(self, counts: Sequence[int] | Tensor) -> None:
        """The ``nce`` / ``sampled_softmax`` head's unigram counts: :meth:`zoo.RecurrentLM.set_noise_distribution`."""
        self.model.set_noise_distribution(counts)

    def log_epoch_figures(self, stage: str, loss: Tensor) -> None:
        """Perplexity and, where the text is reported in them (:func:`datamodules.kinds.text_figures`: characters,
        SentencePiece) and the data module knows the text's size, bits per character."""
        self.log(f"{stage}_ppl", torch.exp(loss), prog_bar=stage != "train")
        units = self._units(stage)
        if units is not None:
            self.log(f"{stage}_bpc", bits_per_character(loss * units.tokens, units.chars), prog_bar=stage != "train")

    def _units(self, stage: str) -> Any:
        datamodule = getattr(self.trainer, "datamodule", None)
        split = {"train": "train", "val": "valid", "test": "test"}[stage]
        if datamodule is None or not hasattr(datamodule, "units"):
            return None
        tokenizer = getattr(getattr(datamodule, "tokenizer", None), "kind", None)
        if BPC not in TEXT.figures(getattr(datamodule, "level", "word") == "char", tokenizer):
            return None
        return datamodule.units(split)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint whose vocabulary does not match this model's, with a line that says so; then
        :meth:`StatefulTraining.on_load_checkpoint` (shapes, what resuming needs).

        A checkpoint written before the network moved into ``self.model`` has its weights without the ``model.``
        prefix; they are renamed here, before Lightning loads them, so old runs still resume and evaluate.
        """
        for key in ("state_dict", "current_model_state"):  # the weights, and the live ones beside an average
            if key in checkpoint:
                checkpoint[key] = with_model_prefix(checkpoint[key])
        stored = checkpoint.get("state_dict", {})
        weights = stored.get(MODEL_PREFIX + "embedding.weight")
        if weights is not None and weights.size(0) != self.model.vocab_size:
            raise CheckpointError(
                f"the checkpoint's model has a vocabulary of {weights.size(0)} tokens but this data has "
                f"{self.model.vocab_size}: use the corpus and tokenizer it was trained with"
            )
        super().on_load_checkpoint(checkpoint)  # the shapes, and what resuming needs

    def on_fit_start(self) -> None:
        """Refuse, before the first step, a run that cannot apply sparse gradients (``sparse_gradients``)."""
        if not self.hparams.get("sparse_gradients", False):
            return
        if self.trainer.world_size > 1:
            raise ConfigError(
                "sparse_gradients in a distributed run: DDP's gradient reducer fails on the output layer's sparse "
                "gradient; set model.init_args.sparse_gradients false or train on one device"
            )
        for optimizer in self.trainer.optimizers:
            check_optimizer(optimizer)
        algorithm = self.trainer.gradient_clip_algorithm
        if self.trainer.gradient_clip_val and algorithm not in (None, "norm"):
            raise ConfigError(
                f"gradient_clip_algorithm {getattr(algorithm, 'value', algorithm)!r} with sparse_gradients: only norm "
                "clipping is implemented for sparse gradients; use --trainer.gradient_clip_algorithm norm"
            )

    # ------------------------------------------------------------------------------------------------ sampling
    def generate(self, prompt: Tensor, max_new_tokens: int, *options: Any, **named: Any) -> list[list[int]]:
        """Sample continuations of a batch of prompts: :meth:`zoo.RecurrentLM.generate`, which takes the options."""
        return self.model.generate(prompt, max_new_tokens, *options, **named)
