"""The recurrent language model as a LightningModule: embedding -> zoo stack -> full-softmax head.

Stateful truncated BPTT (Lightning 2 removed its TBPTT hook): the recurrent state is carried on the module from one
training window to the next and detached at every window, as pytorch/examples' ``repackage_hidden`` does; each stage
(train / val / test) has its own state, zeroed at the start of every epoch, so evaluation never inherits training
context and vice versa. The data must therefore arrive as ordered contiguous streams (``datamodules.streams``).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric

import zoo
from datamodules.streams import IGNORE_INDEX, LMBatch
from zoo.base import State, detach_state
from zoo.errors import CheckpointError, ConfigError, TrainingDivergedError

STAGES = ("train", "val", "test")


class LanguageModel(L.LightningModule):
    """A recurrent LM from the zoo with a full-softmax output layer.

    Args:
        vocab_size: number of token ids (the CLI links it from the data module).
        architecture: a zoo name (``lm-zoo models`` lists them).
        embedding_size: input embedding width.
        hidden_size: units per recurrent layer.
        num_layers: stacked recurrent layers.
        dropout: dropout on the embeddings, between recurrent layers and before the softmax (Zaremba et al. 2014:
            non-recurrent connections only).
        tie_weights: share the input embedding and the softmax weights (Press & Wolf 2017; Inan et al. 2017); when
            ``hidden_size != embedding_size`` a linear projection maps the last layer to the embedding width.
        init_range: if set, embeddings, softmax and recurrent weights start Uniform(-r, r) (Zaremba: 0.1 small,
            0.05 medium); ``None`` keeps PyTorch's defaults. The LSTM forget bias is applied after this.
        cell_options: further options of the architecture (e.g. ``{"forget_bias": 1.0}``).
    """

    def __init__(
        self,
        vocab_size: int = 10000,
        architecture: str = "lstm",
        embedding_size: int = 200,
        hidden_size: int = 200,
        num_layers: int = 2,
        dropout: float = 0.0,
        tie_weights: bool = False,
        init_range: float | None = None,
        cell_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        cell_options = dict(cell_options or {})
        if "init_range" in cell_options:
            raise ConfigError("set init_range on the model, not in cell_options (it applies to every weight)")
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.rnn = zoo.build(
            architecture,
            embedding_size,
            hidden_size,
            num_layers,
            dropout=dropout,
            init_range=init_range,
            **cell_options,
        )
        self.drop = nn.Dropout(dropout)
        # Tying needs the decoder's input width to equal the embedding width.
        self.projection = (
            nn.Linear(hidden_size, embedding_size, bias=False)
            if tie_weights and (hidden_size != embedding_size)
            else None
        )
        self.decoder = nn.Linear(embedding_size if tie_weights else hidden_size, vocab_size)
        if init_range is not None:
            nn.init.uniform_(self.embedding.weight, -init_range, init_range)
            nn.init.uniform_(self.decoder.weight, -init_range, init_range)
            nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.embedding.weight
        self._state: dict[str, State | None] = dict.fromkeys(STAGES)
        self.metrics = nn.ModuleDict({f"{stage}_nll": MeanMetric() for stage in STAGES})

    # --------------------------------------------------------------------------------------------------- forward
    def forward(self, inputs: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """Next-token logits.

        Args:
            inputs: ``(B, T)`` token ids.
            state: the recurrent state after the previous window, or ``None``.
            reset: ``(B, T)`` bool; zero stream b's state before step t.

        Returns:
            ``(logits (B, T, V), state)``.
        """
        x = self.drop(self.embedding(inputs))  # (B, T, E)
        y, state = self.rnn(x, state, reset)  # (B, T, H)
        y = self.drop(y)
        if self.projection is not None:
            y = self.projection(y)  # (B, T, E)
        return self.decoder(y), state  # (B, T, V)

    @staticmethod
    def nll(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Summed negative log-likelihood (nats) over predicted targets, and how many were predicted."""
        total = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total, (targets != IGNORE_INDEX).sum()

    def _window(self, batch: LMBatch, stage: str) -> tuple[Tensor, Tensor]:
        state = self._state[stage]
        if state is not None and state[0].size(1) != batch.inputs.size(0):
            state = None  # a different number of streams (e.g. a resized eval batch): start afresh
        logits, state = self(batch.inputs, state, batch.reset)
        self._state[stage] = detach_state(state)  # truncated BPTT: the next window starts from values, not a graph
        total, count = self.nll(logits, batch.targets)
        return total, count

    # ------------------------------------------------------------------------------------------------ the loops
    def training_step(self, batch: LMBatch, batch_idx: int) -> Tensor:
        total, count = self._window(batch, "train")
        loss = total / count.clamp(min=1)  # mean nats per predicted token
        if not torch.isfinite(loss):
            raise TrainingDivergedError(
                f"training loss became {loss.item()} at step {self.global_step} (epoch {self.current_epoch}); "
                "lower the learning rate or set --trainer.gradient_clip_val, then resume from the last checkpoint"
            )
        self.metrics["train_nll"].update(loss.detach(), weight=count)
        self.log("train_loss", loss, prog_bar=True, batch_size=int(count))
        # Terms a cell adds to its objective (e.g. Skip RNN's budget loss), and what it reports about the window.
        extra = self.rnn.regularization_loss()
        if extra is not None:
            self.log("train_cell_loss", extra, batch_size=int(count))
            loss = loss + extra
        for name, value in self.rnn.statistics().items():
            self.log(f"train_{name}", value, batch_size=int(count))
        return loss

    def validation_step(self, batch: LMBatch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: LMBatch, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: LMBatch, stage: str) -> None:
        total, count = self._window(batch, stage)
        if count > 0:
            self.metrics[f"{stage}_nll"].update(total / count, weight=count)

    def on_train_epoch_start(self) -> None:
        self._state["train"] = None

    def on_validation_epoch_start(self) -> None:
        self._state["val"] = None

    def on_test_epoch_start(self) -> None:
        self._state["test"] = None

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def _log_epoch(self, stage: str) -> None:
        """Log loss, perplexity and (when the data module knows the text's size) bits per character."""
        metric = self.metrics[f"{stage}_nll"]
        if metric.weight == 0:  # nothing seen (e.g. no validation batches)
            return
        loss = metric.compute()
        metric.reset()
        self.log(f"{stage}_loss_epoch" if stage == "train" else f"{stage}_loss", loss)
        self.log(f"{stage}_ppl", torch.exp(loss), prog_bar=stage != "train")
        units = self._units(stage)
        if units is not None:
            self.log(f"{stage}_bpc", loss * units.tokens / units.chars / math.log(2), prog_bar=stage != "train")

    def _units(self, stage: str) -> Any:
        datamodule = getattr(self.trainer, "datamodule", None)
        split = {"train": "train", "val": "valid", "test": "test"}[stage]
        if datamodule is None or not hasattr(datamodule, "units") or getattr(datamodule, "level", "word") != "char":
            return None
        return datamodule.units(split)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint whose vocabulary does not match this model's, with a line that says so."""
        weights = checkpoint.get("state_dict", {}).get("embedding.weight")
        if weights is not None and weights.size(0) != self.vocab_size:
            raise CheckpointError(
                f"the checkpoint's model has a vocabulary of {weights.size(0)} tokens but this data has "
                f"{self.vocab_size}: use the corpus and tokenizer it was trained with"
            )

    # ------------------------------------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        stop_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        """Sample continuations of a batch of prompts (nanoGPT's ``generate``, for a recurrent state).

        Args:
            prompt: ``(B, T)`` ids to condition on (T >= 1), e.g. the end-of-line id to start a sentence.
            max_new_tokens: most tokens sampled per row.
            temperature: divides the logits; < 1 is more conservative.
            top_k: sample only among the k most likely tokens.
            stop_id: a row stops after sampling this id (included in its output).
            generator: for reproducible samples.

        Returns:
            The sampled ids of each row (without the prompt).
        """
        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        logits, state = self(prompt)
        logits = logits[:, -1]  # (B, V)
        samples: list[list[int]] = [[] for _ in range(prompt.size(0))]
        done = [False] * prompt.size(0)
        for _ in range(max_new_tokens):
            logits = logits.float() / temperature
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            token = torch.multinomial(probs.cpu(), 1, generator=generator).to(prompt.device)  # (B, 1)
            for row, value in enumerate(token.flatten().tolist()):  # one host copy per step
                if not done[row]:
                    samples[row].append(value)
                    done[row] = value == stop_id
            if all(done):
                break
            logits, state = self(token, state)
            logits = logits[:, -1]
        return samples
