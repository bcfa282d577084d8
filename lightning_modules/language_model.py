"""The recurrent language model as a LightningModule: embedding -> zoo stack -> output head (softmax | MoS | NCE).

Stateful truncated BPTT (Lightning 2 removed its TBPTT hook): the recurrent state is carried on the module from one
training window to the next and detached at every window, as pytorch/examples' ``repackage_hidden`` does; each stage
(train / val / test) has its own state, zeroed at the start of every epoch, so evaluation never inherits training
context and vice versa. The data must therefore arrive as ordered contiguous streams (``datamodules.streams``).

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
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric

import zoo
from datamodules.streams import IGNORE_INDEX, LMBatch
from lightning_modules.resume import RESUME_KEY, non_finite, rng_states, set_rng_states
from lightning_modules.sparse_gradients import check_optimizer, clip_grad_norm, has_sparse_gradients
from zoo.base import State, detach_state, sequence_dropout_mask
from zoo.errors import CheckpointError, ConfigError, TrainingDivergedError
from zoo.heads import MixtureOfSoftmaxes, SoftmaxHead
from zoo.nce import SAMPLERS, NCEHead

STAGES = ("train", "val", "test")
HEADS = ("softmax", "mos", "nce", "sampled_softmax")
NO_NOISE = (
    "the nce and sampled_softmax heads need the unigram counts of the training data, and this data module's "
    "tokenizer has none (no `counts`): use a word-level data module, or call model.set_noise_distribution(counts)"
)


def embedding_dropout(ids: Tensor, embedded: Tensor, p: float, num_embeddings: int) -> Tensor:
    """Drop whole words: every occurrence of a dropped id gets a zero vector, the kept ones are scaled by 1/(1-p).

    AWD-LSTM's ``embedded_dropout`` (Merity et al. 2017 §4.3; Gal & Ghahramani 2016) masks rows of the embedding
    matrix, one mask per batch; indexing a ``(V,)`` row mask with the ids is the same function and gradient without
    copying the ``(V, E)`` matrix.

    Args:
        ids: ``(B, T)`` token ids.
        embedded: ``(B, T, E)`` their embeddings.
        p: probability of dropping a word type.
        num_embeddings: V.
    """
    keep = torch.bernoulli(embedded.new_full((num_embeddings,), 1 - p)) / (1 - p)  # (V,) one draw per word type
    return embedded * keep[ids].unsqueeze(-1)  # (B, T, E)


def sequence_dropout(x: Tensor, p: float, locked: bool) -> Tensor:
    """Dropout on ``(B, T, D)`` in training: one mask per sequence shared by every step (locked / variational,
    Gal & Ghahramani 2016; AWD-LSTM's ``LockedDropout``) or, if not ``locked``, one per element (Zaremba et al.)."""
    if p == 0:
        return x
    if locked:
        return x * sequence_dropout_mask(x[:, 0], p).unsqueeze(1)  # (B, 1, D) over all steps
    return F.dropout(x, p, training=True)


class LanguageModel(L.LightningModule):
    """A recurrent LM from the zoo with a full-softmax or mixture-of-softmaxes output head.

    Dropout: ``dropout`` keeps its old meaning (Zaremba et al. 2014: the same rate on the embeddings, between layers
    and before the head); each of ``input_dropout``, ``inter_layer_dropout``, ``output_dropout`` overrides it for its
    own place when set (Melis et al. 2018 tune the three separately; AWD-LSTM's dropouti / dropouth / dropout).

    Args:
        vocab_size: number of token ids (the CLI links it from the data module).
        architecture: a zoo name (``lm-zoo models`` lists them).
        embedding_size: input embedding width (ignored when ``input_embedding_ratio`` is set).
        hidden_size: units per recurrent layer.
        num_layers: stacked recurrent layers.
        dropout: the default rate of ``input_dropout``, ``inter_layer_dropout`` and ``output_dropout`` (Zaremba et al.
            2014: non-recurrent connections only).
        tie_weights: share the input embedding and the softmax weights (Press & Wolf 2017; Inan et al. 2017); with the
            softmax head and ``hidden_size != embedding_size`` a linear projection maps the last layer to the embedding
            width (MoS needs none: its latent layer already produces embedding-width contexts).
        init_range: if set, embeddings, softmax and recurrent weights start Uniform(-r, r) (Zaremba: 0.1 small,
            0.05 medium); ``None`` keeps PyTorch's defaults. The LSTM forget bias is applied after this. MoS's prior
            and latent layers keep PyTorch's initialisation, as in the reference code.
        embedding_init_range: if set, the embedding and the output word vectors alone start Uniform(-r, r) with a
            zero output bias, overriding ``init_range`` for them: AWD-LSTM and MoS use 0.1 there and leave the LSTM
            at PyTorch's initialisation (``nn.Embedding``'s default N(0, 1) would give huge initial logits).
        cell_options: further options of the architecture (e.g. ``{"forget_bias": 1.0}``) and the recurrent
            regularisers of the stack: ``state_dropout`` (Melis et al. 2018, one mask per sequence on h_{t-1}),
            ``weight_drop`` (AWD-LSTM's DropConnect on hidden-to-hidden weights); ``dropout`` / ``locked_dropout``
            here are the same as ``inter_layer_dropout`` / ``locked_dropout`` below.
        head: ``"softmax"`` (full softmax), ``"mos"`` (Mixture of Softmaxes, Yang et al. 2017), ``"nce"``
            (trained by noise-contrastive estimation, Mnih & Teh 2012, output bias starting at -log V so that Z = 1)
            or ``"sampled_softmax"`` (trained by a softmax over the target and the noise words, Jean et al. 2015).
            The last two are full softmaxes everywhere but in ``training_step`` (``zoo/nce.py``) and need the
            unigram counts of the training data: ``setup`` takes them from the data module's tokenizer (``counts``),
            or call :meth:`set_noise_distribution`.
        mos_components: K, the number of softmaxes mixed by the MoS head.
        mos_dropout: dropout on the MoS component contexts (the reference's ``dropoutl``).
        input_dropout: dropout on the embeddings fed to the stack (Melis; AWD ``dropouti``); ``None``: ``dropout``.
        inter_layer_dropout: dropout between recurrent layers (Melis; AWD ``dropouth``); ``None``: ``dropout``.
        output_dropout: dropout on the last layer's output before the head (Melis; AWD ``dropout``); ``None``:
            ``dropout``.
        embedding_dropout: drop whole words, i.e. rows of the embedding matrix, one mask per batch, the rest scaled
            by 1/(1-p) (Merity et al. 2017; AWD ``dropoute``).
        locked_dropout: one dropout mask per sequence, shared by every step, for input, inter-layer, output and MoS
            dropout (Gal & Ghahramani 2016; AWD-LSTM), instead of a fresh mask per element.
        input_embedding_ratio: Melis et al. 2018: embedding size = ratio x hidden size (rounded); a ratio >= 1 means
            embedding size = hidden size and no projection. Replaces ``embedding_size`` when set.
        ar: activation regularisation alpha: ``ar * mean(dropped_output ** 2)`` (Merity et al. 2017 §4.6).
        tar: temporal activation regularisation beta: ``tar * mean((raw_t - raw_{t-1}) ** 2)``, consecutive steps of
            the same stream (pairs across a reset are left out) (Merity et al. 2017 §4.6).
        noise_samples: k, noise words per time step of the ``nce`` / ``sampled_softmax`` heads (400 in the GBW
            recipes of Léonard et al. 2016).
        noise_power: the noise distribution is the unigram distribution raised to this power (and renormalised).
        noise_per_row: draw k noise words for every row and step instead of one set per step shared by the batch
            (dpnn's ``rownoise``; the shared default is its ``batchnoise``).
        noise_sampler: ``"alias"`` (Walker's alias table) or ``"multinomial"`` (``torch.multinomial``);
            ``benchmarks/nce.py`` compares them.
        sparse_gradients: row-sparse gradients for the vocabulary-sized matrices: the input embedding, and the output
            layer of the ``nce`` / ``sampled_softmax`` heads, get only the rows a step touches instead of a dense
            ``(V, D)`` gradient (dpnn's ``LookupTable`` / ``NCEModule`` updates). Needs SGD without momentum or
            weight decay, or Adagrad, and a single process; gradient-norm clipping still works
            (:mod:`lightning_modules.sparse_gradients`).
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
        head: str = "softmax",
        mos_components: int = 15,
        mos_dropout: float = 0.0,
        input_dropout: float | None = None,
        inter_layer_dropout: float | None = None,
        output_dropout: float | None = None,
        embedding_dropout: float = 0.0,
        locked_dropout: bool = False,
        input_embedding_ratio: float | None = None,
        ar: float = 0.0,
        tar: float = 0.0,
        embedding_init_range: float | None = None,
        noise_samples: int = 100,
        noise_power: float = 1.0,
        noise_per_row: bool = False,
        noise_sampler: str = "alias",
        sparse_gradients: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        cell_options = dict(cell_options or {})
        if "init_range" in cell_options:
            raise ConfigError("set init_range on the model, not in cell_options (it applies to every weight)")
        if head not in HEADS:
            raise ConfigError(f"unknown head {head!r}: choose one of {', '.join(HEADS)}")
        if noise_samples < 1 or noise_power < 0 or noise_sampler not in SAMPLERS:
            raise ConfigError(
                f"noise_samples must be >= 1, noise_power >= 0 and noise_sampler one of {', '.join(SAMPLERS)}; got "
                f"{noise_samples}, {noise_power} and {noise_sampler!r}"
            )
        if "dropout" in cell_options and inter_layer_dropout is not None:
            raise ConfigError("set the inter-layer dropout once: inter_layer_dropout or cell_options.dropout")
        if input_embedding_ratio is not None:
            if input_embedding_ratio <= 0:
                raise ConfigError(f"input_embedding_ratio must be > 0, got {input_embedding_ratio}")
            embedding_size = (
                hidden_size if input_embedding_ratio >= 1 else max(1, round(input_embedding_ratio * hidden_size))
            )
        self.input_dropout = dropout if input_dropout is None else input_dropout
        self.output_dropout = dropout if output_dropout is None else output_dropout
        self.embedding_dropout = embedding_dropout
        self.locked_dropout = locked_dropout
        for name, rate in [
            ("dropout", dropout),
            ("input_dropout", self.input_dropout),
            ("output_dropout", self.output_dropout),
            ("embedding_dropout", embedding_dropout),
            ("mos_dropout", mos_dropout),
        ]:
            if not 0.0 <= rate < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {rate}")
        if ar < 0 or tar < 0:
            raise ConfigError(f"ar and tar must be >= 0, got ar={ar}, tar={tar}")
        self.ar, self.tar = ar, tar
        stack_options = {"dropout": dropout if inter_layer_dropout is None else inter_layer_dropout}
        if locked_dropout:
            stack_options["locked_dropout"] = True
        stack_options.update(cell_options)  # the cell's own setting wins
        self.embedding = nn.Embedding(vocab_size, embedding_size, sparse=sparse_gradients)
        self.rnn = zoo.build(
            architecture, embedding_size, hidden_size, num_layers, init_range=init_range, **stack_options
        )
        # The output head keeps the attribute name ``decoder`` (pytorch/examples, AWD-LSTM): for the softmax head the
        # state-dict keys are those of checkpoints written before heads existed.
        self.projection: nn.Linear | None = None
        self.decoder: SoftmaxHead | MixtureOfSoftmaxes
        if head == "mos":
            self.decoder = MixtureOfSoftmaxes(
                hidden_size, embedding_size, vocab_size, mos_components, mos_dropout, locked_dropout
            )
        else:
            # Tying needs the decoder's input width to equal the embedding width.
            if tie_weights and hidden_size != embedding_size:
                self.projection = nn.Linear(hidden_size, embedding_size, bias=False)
            context_size = embedding_size if tie_weights else hidden_size
            if head == "softmax":
                self.decoder = SoftmaxHead(context_size, vocab_size)
            else:
                self.decoder = NCEHead(
                    context_size,
                    vocab_size,
                    noise_samples,
                    head,
                    noise_power,
                    noise_per_row,
                    noise_sampler,
                    sparse_gradient=sparse_gradients,
                )
        output_layer = self.decoder.output_layer
        word_init_range = init_range if embedding_init_range is None else embedding_init_range
        if word_init_range is not None:
            nn.init.uniform_(self.embedding.weight, -word_init_range, word_init_range)
            nn.init.uniform_(output_layer.weight, -word_init_range, word_init_range)
            nn.init.zeros_(output_layer.bias)
        if isinstance(self.decoder, NCEHead):
            self.decoder.reset_bias()  # -log V, so that Z = 1 from the start, whatever the word vectors' init
        if tie_weights:
            output_layer.weight = self.embedding.weight
        self._state: dict[str, State | None] = dict.fromkeys(STAGES)
        self._resume: dict[str, Any] | None = None  # what a checkpoint kept for resuming fit, used by on_train_start
        self.metrics = nn.ModuleDict({f"{stage}_nll": MeanMetric() for stage in STAGES})

    # --------------------------------------------------------------------------------------------------- forward
    def forward(self, inputs: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """Next-token scores.

        Args:
            inputs: ``(B, T)`` token ids.
            state: the recurrent state after the previous window, or ``None``.
            reset: ``(B, T)`` bool; zero stream b's state before step t.

        Returns:
            ``(scores (B, T, V), state)``: logits for the softmax head, log-probabilities for MoS; either way
            ``log_softmax(scores)`` is the model's log-probabilities.
        """
        features, state, _, _ = self._run(inputs, state, reset)
        return self.decoder(features), state

    def token_nll(
        self,
        inputs: Tensor,
        targets: Tensor,
        state: State | None = None,
        reset: Tensor | None = None,
        temperature: float = 1.0,
    ) -> tuple[Tensor, State]:
        """Full-softmax negative log-likelihood of every target: what evaluation scores, whatever the training head.

        Args:
            inputs: ``(B, T)`` token ids.
            targets: ``(B, T)`` next-token ids, ``-100`` where nothing is predicted.
            state: the recurrent state after the previous window, or ``None``.
            reset: ``(B, T)`` bool; zero stream b's state before step t.
            temperature: the softmax temperature (scores divided by it before normalising).

        Returns:
            ``(nll (B, T) float32 nats, 0 where the target is -100; state)``.
        """
        features, state, _, _ = self._run(inputs, state, reset)
        return self.decoder.token_nll(features, targets, temperature), state

    def features(self, inputs: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """The head's input ``(B, T, D)`` and the state: :meth:`token_nll` is ``self.decoder.token_nll`` of these.

        They do not depend on the softmax temperature, so evaluation keeps them to score one pass at many temperatures.
        """
        features, state, _, _ = self._run(inputs, state, reset)
        return features, state

    def _run(self, inputs: Tensor, state: State | None, reset: Tensor | None) -> tuple[Tensor, State, Tensor, Tensor]:
        """The head's input ``(B, T, D)`` and the state, with the last layer's output before and after output dropout
        (for AR / TAR)."""
        x = self.embedding(inputs)  # (B, T, E)
        if self.training:
            if self.embedding_dropout > 0:
                x = embedding_dropout(inputs, x, self.embedding_dropout, self.vocab_size)
            x = sequence_dropout(x, self.input_dropout, self.locked_dropout)
        raw, state = self.rnn(x, state, reset)  # (B, T, H)
        dropped = sequence_dropout(raw, self.output_dropout, self.locked_dropout) if self.training else raw
        features = dropped if self.projection is None else self.projection(dropped)  # (B, T, E) when projected
        return features, state, raw, dropped

    @staticmethod
    def nll(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Summed negative log-likelihood (nats) over predicted targets, and how many were predicted.

        ``logits`` are any head's scores: ``cross_entropy`` applies ``log_softmax``, which leaves MoS's already
        normalised log-probabilities unchanged.
        """
        total = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total, (targets != IGNORE_INDEX).sum()

    def _window(self, batch: LMBatch, stage: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        state = self._state[stage]
        if state is not None and state[0].size(1) != batch.inputs.size(0):
            state = None  # a different number of streams (e.g. a resized eval batch): start afresh
        features, state, raw, dropped = self._run(batch.inputs, state, batch.reset)
        self._state[stage] = detach_state(state)  # truncated BPTT: the next window starts from values, not a graph
        if stage != "train":  # the full softmax, chunked over the vocabulary: never (B, T, V) logits at 793k words
            total = self.decoder.token_nll(features, batch.targets).sum()
            count = (batch.targets != IGNORE_INDEX).sum()
        elif isinstance(self.decoder, NCEHead):
            if not self.decoder.noise.ready:
                raise ConfigError(NO_NOISE)
            total, count = self.decoder.training_loss(features, batch.targets)
        else:
            total, count = self.nll(self.decoder(features), batch.targets)
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
    def training_step(self, batch: LMBatch, batch_idx: int) -> Tensor:
        total, count, raw, dropped = self._window(batch, "train")
        loss = total / count.clamp(min=1)  # mean nats per predicted token
        if not torch.isfinite(loss):
            raise TrainingDivergedError(
                f"training loss became {loss.item()} at step {self.global_step} (epoch {self.current_epoch}); "
                "lower the learning rate or set --trainer.gradient_clip_val, then resume from the last checkpoint"
            )
        if not isinstance(self.decoder, NCEHead):  # a sampled objective is not nats: no training perplexity
            self.metrics["train_nll"].update(loss.detach(), weight=count)
        self.log("train_loss", loss, prog_bar=True, batch_size=int(count))
        # AWD-LSTM's activation regularisers: AR on the dropped output, TAR on the raw one (Merity et al. 2017 §4.6).
        if self.ar > 0:
            ar = self.activation_regularization(dropped)
            self.log("train_ar", ar, batch_size=int(count))
            loss = loss + ar
        if self.tar > 0:
            tar = self.temporal_activation_regularization(raw, batch.reset)
            self.log("train_tar", tar, batch_size=int(count))
            loss = loss + tar
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
        total, count, _, _ = self._window(batch, stage)
        if count > 0:
            self.metrics[f"{stage}_nll"].update(total / count, weight=count)

    def setup(self, stage: str) -> None:
        """Before fitting an ``nce`` / ``sampled_softmax`` head, take its noise distribution from the data module's
        tokenizer (its ``counts``: the training count of every id)."""
        if stage != "fit" or not isinstance(self.decoder, NCEHead) or self.decoder.noise.ready:
            return
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        counts = getattr(tokenizer, "counts", None)
        if counts is None:
            raise ConfigError(NO_NOISE)
        self.set_noise_distribution(counts)

    def set_noise_distribution(self, counts: Sequence[int] | Tensor) -> None:
        """Set the unigram training counts (one per id) the ``nce`` / ``sampled_softmax`` head draws noise from.

        Args:
            counts: ``(V,)`` counts; raised to ``noise_power`` and normalised.
        """
        if not isinstance(self.decoder, NCEHead):
            raise ConfigError(f"the {self.hparams.head!r} head draws no noise words: only nce and sampled_softmax do")
        try:
            self.decoder.set_noise_distribution(counts)
        except ValueError as error:
            raise ConfigError(f"noise distribution: {error}") from None

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
        """Refuse a checkpoint whose vocabulary does not match this model's, with a line that says so; keep what it
        holds for resuming ``fit`` until training starts (evaluation never uses it, older checkpoints lack it)."""
        weights = checkpoint.get("state_dict", {}).get("embedding.weight")
        if weights is not None and weights.size(0) != self.vocab_size:
            raise CheckpointError(
                f"the checkpoint's model has a vocabulary of {weights.size(0)} tokens but this data has "
                f"{self.vocab_size}: use the corpus and tokenizer it was trained with"
            )
        self._resume = checkpoint.get(RESUME_KEY)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Never write non-finite weights (the previous checkpoint stays the last good one); add what an exact resume
        needs: the carried training state, the epoch's training-loss accumulator and the random number generators."""
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
        checkpoint[RESUME_KEY] = {
            "train_state": self._state["train"],
            "train_nll": {"mean_value": train_nll.mean_value.detach(), "weight": train_nll.weight.detach()},
            "rng": rng_states(),
        }

    def on_train_start(self) -> None:
        """Resuming: put back the carried state, the loss accumulator and the generators saved with the checkpoint.

        Here, after Lightning's restore and the loader's first fetch, so the next dropout mask is the one the
        interrupted run would have drawn. (A checkpoint taken between epochs resets the state at the epoch start.)
        """
        resume, self._resume = self._resume, None
        if resume is None:
            return
        state = resume.get("train_state")
        self._state["train"] = None if state is None else tuple(s.to(self.device) for s in state)
        train_nll = self.metrics["train_nll"]
        for name, value in resume.get("train_nll", {}).items():
            setattr(train_nll, name, value.to(self.device))
        # An update that adds nothing: torchmetrics counts updates and warns when an epoch that resumes at its very
        # end (no window left) computes a restored accumulator without one.
        train_nll.update(torch.zeros((), device=self.device), weight=torch.zeros((), device=self.device))
        set_rng_states(resume["rng"])

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

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, except for sparse gradients, whose norm torch's ``clip_grad_norm_`` cannot compute:
        those are clipped by :func:`~lightning_modules.sparse_gradients.clip_grad_norm` (the same rule)."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if not gradient_clip_val or not has_sparse_gradients(parameters):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ConfigError(
                f"gradient_clip_algorithm {gradient_clip_algorithm!r} with sparse_gradients: only norm clipping is "
                "implemented for sparse gradients; use --trainer.gradient_clip_algorithm norm"
            )
        clip_grad_norm(parameters, gradient_clip_val)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Stop at a NaN or infinite gradient before the optimizer writes it into the weights (a finite loss can
        still give one, e.g. through an overflowing cell). Skipped under a gradient scaler (16-bit mixed precision),
        which itself skips the steps whose scaled gradients overflowed."""
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            return
        # A sum is NaN or infinite iff some element is (short of ~1e38 gradients), with no per-element temporary.
        sums = [p.grad.sum(dtype=torch.float32) for p in self.parameters() if p.grad is not None]
        if sums and not bool(torch.isfinite(torch.stack(sums).sum())):
            raise TrainingDivergedError(
                f"a gradient became NaN or infinite at step {self.global_step} (epoch {self.current_epoch}) with a "
                "finite loss; lower the learning rate or set --trainer.gradient_clip_val, then resume from the last "
                "checkpoint"
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
