"""The recurrent language model as a plain ``nn.Module``: embedding -> zoo stack -> output head. No Lightning.

::

    ids (B, T) ──► embedding ──► embedding_dropout (whole words) ──► input_dropout ──► stack ──► output_dropout
               ──► [projection to the embedding width, when tied] ──► head: softmax | MoS | NCE | sampled | adaptive

Use it on its own (``checkpoints.from_pretrained("ptb-lstm-small")`` loads a trained one; ``model.generate(...)``,
``model.token_nll``) or through :class:`lightning_modules.LanguageModel`, which wraps it with the training loop. Its
``state_dict`` is what an export's ``model.safetensors`` holds (:mod:`checkpoints.export_read`); the submodule names
``embedding``, ``rnn``, ``projection`` and ``decoder`` are pytorch/examples' ``word_language_model`` names, kept so
exports and checkpoints written before this class existed load unchanged.

Dropouts act only in training mode; evaluation (``model.eval()``) is deterministic. The recurrent regularisers
(``state_dropout``, ``weight_drop``) live inside the stack (``cell_options``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo import paths, sampling
from zoo.architectures import build
from zoo.errors import ConfigError
from zoo.heads import AdaptiveSoftmaxHead, MixtureOfSoftmaxes, SoftmaxHead
from zoo.layers import sequence_dropout_mask
from zoo.nce import SAMPLERS, NCEHead
from zoo.state import State

if TYPE_CHECKING:
    pass

HEADS = ("softmax", "mos", "nce", "sampled_softmax", "adaptive")
IGNORE_INDEX = -100  # a target that predicts nothing (the batch contract: the data modules' windows pad with it)


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


def _check_options(
    cell_options: dict[str, Any],
    head: str,
    tie_weights: bool,
    inter_layer_dropout: float | None,
    noise_samples: int,
    noise_power: float,
    noise_sampler: str,
) -> None:
    """Refuse :class:`RecurrentLM` options that cannot work together, with one line that says what to do.

    Raises:
        ConfigError: the first problem found.
    """
    if "init_range" in cell_options:
        raise ConfigError("set init_range on the model, not in cell_options (it applies to every weight)")
    if head not in HEADS:
        raise ConfigError(f"unknown head {head!r}: choose one of {', '.join(HEADS)}")
    if noise_samples < 1 or noise_power < 0 or noise_sampler not in SAMPLERS:
        raise ConfigError(
            f"noise_samples must be >= 1, noise_power >= 0 and noise_sampler one of {', '.join(SAMPLERS)}; got "
            f"{noise_samples}, {noise_power} and {noise_sampler!r}"
        )
    if head == "adaptive" and tie_weights:
        raise ConfigError(
            "the adaptive head has one output matrix per frequency cluster, none of which can be tied to the "
            "embedding: set tie_weights false, or choose the softmax head"
        )
    if "dropout" in cell_options and inter_layer_dropout is not None:
        raise ConfigError("set the inter-layer dropout once: inter_layer_dropout or cell_options.dropout")


def _embedding_width(embedding_size: int, hidden_size: int, input_embedding_ratio: float | None) -> int:
    """The embedding width: ``embedding_size``, or Melis et al.'s ratio x ``hidden_size`` when a ratio is set.

    Raises:
        ConfigError: a ratio that is not > 0.
    """
    if input_embedding_ratio is None:
        return embedding_size
    if input_embedding_ratio <= 0:
        raise ConfigError(f"input_embedding_ratio must be > 0, got {input_embedding_ratio}")
    return hidden_size if input_embedding_ratio >= 1 else max(1, round(input_embedding_ratio * hidden_size))


def _check_sizes(**sizes: int) -> None:
    """Refuse a size below 1, naming the option (the keyword): torch would fail later, with a traceback, or build a
    network with no recurrent layer at all.

    Raises:
        ConfigError: the first size below 1.
    """
    for name, size in sizes.items():
        if size < 1:
            raise ConfigError(f"{name} must be at least 1, got {size}")


def _check_rates(**rates: float) -> None:
    """Refuse a dropout rate outside [0, 1), naming the option (the keyword) it came from.

    Raises:
        ConfigError: the first rate out of range.
    """
    for name, rate in rates.items():
        if not 0.0 <= rate < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {rate}")


def _stack_options(
    dropout: float, inter_layer_dropout: float | None, locked_dropout: bool, cell_options: dict[str, Any]
) -> dict[str, Any]:
    """The recurrent stack's options: the model's inter-layer dropout and its locking, then the cell's own."""
    stack_options: dict[str, Any] = {"dropout": dropout if inter_layer_dropout is None else inter_layer_dropout}
    if locked_dropout:
        stack_options["locked_dropout"] = True
    stack_options.update(cell_options)  # the cell's own setting wins
    return stack_options


def _make_head(
    head: str,
    *,
    context_size: int,
    hidden_size: int,
    embedding_size: int,
    vocab_size: int,
    mos_components: int,
    mos_dropout: float,
    locked_dropout: bool,
    noise_samples: int,
    noise_power: float,
    noise_per_row: bool,
    noise_sampler: str,
    sparse_gradients: bool,
    adaptive_cutoffs: list[int] | None,
    adaptive_div_value: float,
) -> SoftmaxHead | MixtureOfSoftmaxes | NCEHead | AdaptiveSoftmaxHead:
    """The output head :class:`RecurrentLM` names (its arguments are the model's; ``context_size`` is the width the
    head reads: the embedding width when tied, else the hidden size).

    Raises:
        ConfigError: a head option's value the head refuses.
    """
    try:  # the heads check their own options' values: the user's input, so one line
        if head == "mos":
            return MixtureOfSoftmaxes(
                hidden_size, embedding_size, vocab_size, mos_components, mos_dropout, locked_dropout
            )
        if head == "softmax":
            return SoftmaxHead(context_size, vocab_size)
        if head == "adaptive":
            return AdaptiveSoftmaxHead(context_size, vocab_size, adaptive_cutoffs, adaptive_div_value)
        return NCEHead(
            context_size,
            vocab_size,
            noise_samples,
            head,
            noise_power,
            noise_per_row,
            noise_sampler,
            sparse_gradient=sparse_gradients,
        )
    except ValueError as error:
        raise ConfigError(f"{head} head: {error}") from None


@dataclass
class LMConfig:
    """Everything that describes a :class:`RecurrentLM`: the one place its settings are spelt.

    :class:`RecurrentLM` is built from one (``RecurrentLM(**settings)`` or :meth:`RecurrentLM.from_config`) and keeps
    it as ``model.config``; :class:`lightning_modules.LanguageModel` passes its arguments on to it, so that
    LightningCLI types, defaults and documents ``model.init_args.<field>`` from these fields (jsonargparse follows
    ``**network`` into this class); an export's ``config.json`` holds ``dataclasses.asdict(model.config)`` as its
    ``"model"``. The fields may be given by position in this order (``RecurrentLM(10000, "lstm", 200, 200, 2)``).

    Dropout: ``dropout`` is Zaremba et al.'s single rate on the embeddings, between layers and before the head; each
    of ``input_dropout``, ``inter_layer_dropout``, ``output_dropout`` overrides it for its own place when set (Melis et
    al. 2018 tune the three separately; AWD-LSTM's dropouti / dropouth / dropout).

    Attributes:
        vocab_size: number of token ids.
        architecture: a zoo name (``lm-zoo models`` lists them).
        embedding_size: input embedding width (ignored when ``input_embedding_ratio`` is set).
        hidden_size: units per recurrent layer.
        num_layers: stacked recurrent layers.
        dropout: the default rate of ``input_dropout``, ``inter_layer_dropout`` and ``output_dropout`` (Zaremba et al.
            2014: non-recurrent connections only).
        tie_weights: share the input embedding and the softmax weights (Press & Wolf 2017; Inan et al. 2017); with the
            softmax head and a last layer narrower or wider than ``embedding_size`` a linear projection maps it to the
            embedding width (MoS needs none: its latent layer already produces embedding-width contexts). AWD-LSTM
            gives its last layer the embedding's width instead (``cell_options``' ``last_layer_size``).
        init_range: if set, embeddings, softmax and recurrent weights start Uniform(-r, r) (Zaremba: 0.1 small,
            0.05 medium); ``None`` keeps PyTorch's defaults. The LSTM forget bias is applied after this. MoS's prior
            and latent layers keep PyTorch's initialisation, as in the reference code.
        cell_options: further options of the architecture (e.g. ``{"forget_bias": 1.0}``) and the recurrent
            regularisers of the stack: ``state_dropout`` (Melis et al. 2018, one mask per sequence on h_{t-1}),
            ``weight_drop`` (AWD-LSTM's DropConnect on hidden-to-hidden weights), ``last_layer_size`` (the last
            layer's units where they differ from ``hidden_size``); ``dropout`` / ``locked_dropout``
            here are the same as ``inter_layer_dropout`` / ``locked_dropout`` below.
        head: ``"softmax"`` (full softmax), ``"mos"`` (Mixture of Softmaxes, Yang et al. 2017), ``"nce"``
            (trained by noise-contrastive estimation, Mnih & Teh 2012, output bias starting at -log V so that Z = 1)
            or ``"sampled_softmax"`` (trained by a softmax over the target and the noise words, Jean et al. 2015).
            The last two are full softmaxes everywhere but in training (``zoo/nce.py``) and need the unigram counts
            of the training data (:meth:`set_noise_distribution`). ``"adaptive"``: the adaptive softmax (Grave et al.
            2017, ``zoo.heads.AdaptiveSoftmaxHead``), exact probabilities everywhere at a fraction of the full
            softmax's training cost for large vocabularies; no ``tie_weights``.
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
        embedding_init_range: if set, the embedding and the output word vectors alone start Uniform(-r, r) with a
            zero output bias, overriding ``init_range`` for them: AWD-LSTM and MoS use 0.1 there and leave the LSTM
            at PyTorch's initialisation (``nn.Embedding``'s default N(0, 1) would give huge initial logits).
        noise_samples: k, noise words per time step of the ``nce`` / ``sampled_softmax`` heads (400 in the GBW
            recipes of Léonard et al. 2016).
        noise_power: the noise distribution is the unigram distribution raised to this power (and renormalised).
        noise_per_row: draw k noise words for every row and step instead of one set per step shared by the batch
            (dpnn's ``rownoise``; the shared default is its ``batchnoise``).
        noise_sampler: ``"alias"`` (Walker's alias table) or ``"multinomial"`` (``torch.multinomial``).
        sparse_gradients: row-sparse gradients for the vocabulary-sized matrices: the input embedding, and the output
            layer of the ``nce`` / ``sampled_softmax`` heads, get only the rows a step touches instead of a dense
            ``(V, D)`` gradient (dpnn's ``LookupTable`` / ``NCEModule`` updates).
        adaptive_cutoffs: the ``adaptive`` head's cluster boundaries (ids, increasing); ``None``: 1/16 and 1/4 of the
            vocabulary (``zoo.heads.default_adaptive_cutoffs``).
        adaptive_div_value: each tail cluster's projection is this many times narrower than the previous one's.
    """

    vocab_size: int = 10000
    architecture: str = "lstm"
    embedding_size: int = 200
    hidden_size: int = 200
    num_layers: int = 2
    dropout: float = 0.0
    tie_weights: bool = False
    init_range: float | None = None
    cell_options: dict[str, Any] | None = None
    head: str = "softmax"
    mos_components: int = 15
    mos_dropout: float = 0.0
    input_dropout: float | None = None
    inter_layer_dropout: float | None = None
    output_dropout: float | None = None
    embedding_dropout: float = 0.0
    locked_dropout: bool = False
    input_embedding_ratio: float | None = None
    embedding_init_range: float | None = None
    noise_samples: int = 100
    noise_power: float = 1.0
    noise_per_row: bool = False
    noise_sampler: str = "alias"
    sparse_gradients: bool = False
    adaptive_cutoffs: list[int] | None = None
    adaptive_div_value: float = 4.0

    def __post_init__(self) -> None:
        # A copy, {} for None: an export records the options the model was built with, never the caller's dict.
        self.cell_options = dict(self.cell_options or {})


class RecurrentLM(nn.Module):
    """A recurrent LM from the zoo with a full-softmax, mixture-of-softmaxes, sampled (NCE) or adaptive softmax head.

    Args:
        *args: :class:`LMConfig`'s fields by position, in its order.
        **settings: :class:`LMConfig`'s fields by name (it documents them all).

    Raises:
        TypeError: a setting :class:`LMConfig` does not have.
        ConfigError: settings that cannot work, alone or together.
    """

    def __init__(self, *args: Any, **settings: Any) -> None:
        super().__init__()
        # What an export's config.json stores to rebuild this model (dataclasses.asdict of it).
        self.config = config = LMConfig(*args, **settings)
        self.vocab_size = vocab_size = config.vocab_size
        self.head = head = config.head
        cell_options = dict(config.cell_options)
        _check_options(
            cell_options,
            head,
            config.tie_weights,
            config.inter_layer_dropout,
            config.noise_samples,
            config.noise_power,
            config.noise_sampler,
        )
        hidden_size, num_layers = config.hidden_size, config.num_layers
        _check_sizes(
            vocab_size=vocab_size, embedding_size=config.embedding_size, hidden_size=hidden_size, num_layers=num_layers
        )
        embedding_size = _embedding_width(config.embedding_size, hidden_size, config.input_embedding_ratio)
        dropout = config.dropout
        self.input_dropout = dropout if config.input_dropout is None else config.input_dropout
        self.output_dropout = dropout if config.output_dropout is None else config.output_dropout
        self.embedding_dropout = config.embedding_dropout
        self.locked_dropout = config.locked_dropout
        _check_rates(
            dropout=dropout,
            input_dropout=self.input_dropout,
            output_dropout=self.output_dropout,
            embedding_dropout=config.embedding_dropout,
            mos_dropout=config.mos_dropout,
        )
        stack_options = _stack_options(dropout, config.inter_layer_dropout, config.locked_dropout, cell_options)
        self.embedding = nn.Embedding(vocab_size, embedding_size, sparse=config.sparse_gradients)
        self.rnn = build(
            config.architecture, embedding_size, hidden_size, num_layers, init_range=config.init_range, **stack_options
        )
        output_size = self.rnn.hidden_size  # the last layer's units (AWD-LSTM's stack: cell_options' last_layer_size)
        # The output head keeps the attribute name ``decoder`` (pytorch/examples, AWD-LSTM): for the softmax head the
        # state-dict keys are those of checkpoints written before heads existed.
        self.projection: nn.Linear | None = None
        self.decoder: SoftmaxHead | MixtureOfSoftmaxes | NCEHead | AdaptiveSoftmaxHead
        # Tying needs the decoder's input width to equal the embedding width (MoS's contexts already have it).
        if config.tie_weights and head != "mos" and output_size != embedding_size:
            self.projection = nn.Linear(output_size, embedding_size, bias=False)
        self.decoder = _make_head(
            head,
            context_size=embedding_size if config.tie_weights else output_size,
            hidden_size=output_size,
            embedding_size=embedding_size,
            vocab_size=vocab_size,
            mos_components=config.mos_components,
            mos_dropout=config.mos_dropout,
            locked_dropout=config.locked_dropout,
            noise_samples=config.noise_samples,
            noise_power=config.noise_power,
            noise_per_row=config.noise_per_row,
            noise_sampler=config.noise_sampler,
            sparse_gradients=config.sparse_gradients,
            adaptive_cutoffs=config.adaptive_cutoffs,
            adaptive_div_value=config.adaptive_div_value,
        )
        self._init_word_vectors(
            config.init_range if config.embedding_init_range is None else config.embedding_init_range
        )
        if config.tie_weights:
            self.decoder.output_layer.weight = self.embedding.weight

    @classmethod
    def from_config(cls, config: LMConfig) -> RecurrentLM:
        """The network ``config`` describes (nanoGPT's ``GPT(config)``)."""
        return cls(**asdict(config))

    def _init_word_vectors(self, init_range: float | None) -> None:
        """Start the embedding and the output word vectors Uniform(-r, r) with a zero output bias (``None``: keep
        PyTorch's initialisation), then give an NCE head its -log V bias."""
        output_layer = self.decoder.output_layer  # None for the adaptive head, which keeps PyTorch's initialisation
        if init_range is not None:
            nn.init.uniform_(self.embedding.weight, -init_range, init_range)
            if output_layer is not None:
                nn.init.uniform_(output_layer.weight, -init_range, init_range)
                nn.init.zeros_(output_layer.bias)
        if isinstance(self.decoder, NCEHead):
            self.decoder.reset_bias()  # -log V, so that Z = 1 from the start, whatever the word vectors' init

    # --------------------------------------------------------------------------------------------------- forward
    def forward(self, inputs: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """Next-token scores.

        Args:
            inputs: ``(B, T)`` token ids.
            state: the recurrent state after the previous window, or ``None`` (zeros).
            reset: ``(B, T)`` bool; zero stream b's state before step t.

        Returns:
            ``(scores (B, T, V), state)``: logits for the softmax head, log-probabilities for MoS; either way
            ``log_softmax(scores)`` is the model's log-probabilities.
        """
        features, state, _, _ = self.run(inputs, state, reset)
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
        features, state, _, _ = self.run(inputs, state, reset)
        return self.decoder.token_nll(features, targets, temperature), state

    def features(self, inputs: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """The head's input ``(B, T, D)`` and the state: :meth:`token_nll` is ``self.decoder.token_nll`` of these.

        They do not depend on the softmax temperature, so evaluation keeps them to score one pass at many temperatures.
        """
        features, state, _, _ = self.run(inputs, state, reset)
        return features, state

    def run(self, inputs: Tensor, state: State | None, reset: Tensor | None) -> tuple[Tensor, State, Tensor, Tensor]:
        """The head's input ``(B, T, D)`` and the state, with the last layer's output ``(B, T, H)`` before and after
        output dropout (what AR / TAR regularise, Merity et al. 2017 §4.6)."""
        x = self.embedding(inputs)  # (B, T, E)
        if self.training:
            if self.embedding_dropout > 0:
                x = embedding_dropout(inputs, x, self.embedding_dropout, self.vocab_size)
            x = sequence_dropout(x, self.input_dropout, self.locked_dropout)
        raw, state = self.rnn(x, state, reset)  # (B, T, H)
        dropped = sequence_dropout(raw, self.output_dropout, self.locked_dropout) if self.training else raw
        features = dropped if self.projection is None else self.projection(dropped)  # (B, T, E) when projected
        return features, state, raw, dropped

    @property
    def needs_noise_distribution(self) -> bool:
        """Whether the head trains on noise words (``nce`` / ``sampled_softmax``) and has no unigram counts yet:
        :meth:`set_noise_distribution` must come before training."""
        return isinstance(self.decoder, NCEHead) and not self.decoder.noise.ready

    def set_noise_distribution(self, counts: Sequence[int] | Tensor) -> None:
        """Set the unigram training counts (one per id) the ``nce`` / ``sampled_softmax`` head draws noise from.

        Args:
            counts: ``(V,)`` counts; raised to ``noise_power`` and normalised.
        """
        if not isinstance(self.decoder, NCEHead):
            raise ConfigError(f"the {self.head!r} head draws no noise words: only nce and sampled_softmax do")
        try:
            self.decoder.set_noise_distribution(counts)
        except ValueError as error:
            raise ConfigError(f"noise distribution: {error}") from None

    def num_parameters(self) -> int:
        """Trainable numbers, tied weights counted once."""
        return sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once

    # ------------------------------------------------------------------------------------------------ sampling
    @torch.no_grad()
    def score(
        self, rows: Sequence[Sequence[int]], batch_size: int = 64, carry_state: bool = False, by_length: bool = True
    ) -> list[Tensor]:
        """The full-softmax log-probability (nats) of every token of each row given the tokens before it.

        A row's first id is context only (the ``<eos>`` / ``<S>`` a sentence starts after); every later id is scored.
        Each row starts from the zero state, unless ``carry_state``: then the rows are consecutive pieces of one text,
        read in order as one stream, each from the state the previous one left (begin each row with the previous
        row's last id, which that row scored but did not read).

        ``batch_size`` rows share a forward pass, rows of similar length together (``by_length``; else in the given
        order); a row is padded at its end only, which the steps before cannot see, so a row's scores do not depend on
        the rows beside it (beyond float rounding). The softmax runs over padded steps too, so sorting saves most of
        the work when lengths vary.

        Args:
            rows: token ids, each row at least 1 long.
            batch_size: rows per forward pass (1 with ``carry_state``).
            carry_state: score the rows as one running document.
            by_length: batch rows of similar length together (the returned order is the given one either way).

        Returns:
            One ``(len(row) - 1,)`` float64 tensor of log-probabilities per row, on the CPU, in the rows' order.
        """
        if any(len(row) < 1 for row in rows):
            raise ConfigError("every row needs at least its first (context) id")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        if carry_state:
            return list(self.score_document(rows))
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        scores: list[Tensor | None] = [None] * len(rows)
        try:
            order = sorted(range(len(rows)), key=lambda i: len(rows[i])) if by_length else list(range(len(rows)))
            for first in range(0, len(order), batch_size):
                chosen = order[first : first + batch_size]
                longest = max(len(rows[i]) for i in chosen)
                inputs = torch.full((len(chosen), max(longest - 1, 1)), rows[chosen[0]][0], dtype=torch.long)
                targets = torch.full_like(inputs, IGNORE_INDEX)  # padding predicts nothing
                for b, i in enumerate(chosen):
                    row = torch.tensor(rows[i], dtype=torch.long)
                    inputs[b, : len(row) - 1] = row[:-1]
                    targets[b, : len(row) - 1] = row[1:]
                nll, _ = self.token_nll(inputs.to(device), targets.to(device))  # (B, T), 0 where padded
                for b, i in enumerate(chosen):
                    scores[i] = -nll[b, : len(rows[i]) - 1].double().cpu()
            return scores  # type: ignore[return-value]
        finally:
            self.train(was_training)

    @torch.no_grad()  # torch's decorator keeps a generator's every step under it
    def score_document(self, rows: Iterable[Sequence[int]]) -> Iterator[Tensor]:
        """:meth:`score` with ``carry_state``, one row at a time: each row's log-probabilities as soon as it is read,
        the state carried to the next, so that a text of any length is scored in the memory of one row.

        Args:
            rows: consecutive pieces of one text, each beginning with the previous piece's last id.

        Yields:
            One ``(len(row) - 1,)`` float64 tensor of log-probabilities per row, on the CPU.
        """
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        state = None
        try:
            for row in rows:
                if len(row) < 1:
                    raise ConfigError("every row needs at least its first (context) id")
                ids = torch.tensor([list(row)], device=device)  # (1, T + 1)
                nll, state = self.token_nll(ids[:, :-1], ids[:, 1:], state)  # (1, T)
                yield -nll[0].double().cpu()
        finally:
            self.train(was_training)

    def _sampling_step(self, like: Tensor) -> Callable[[Tensor, State], tuple[Tensor, State]]:
        """One token's next scores ``(B, V)`` and state: ``forward`` of a ``(B, 1)`` window, or, where the stack runs
        as one kernel call (:meth:`zoo.stack.RecurrentStack._merged_kernel`), embedding, that call and the head
        directly. A sampling step at batch 1 takes a few hundred microseconds, and the module calls and checks around
        the kernel took some 2% of them; the outputs are the same bits (``tests/test_language_model.py``)."""
        merged = None
        if self.projection is None and paths.window_path(self.rnn, like, resets=False).stack == "merged":
            merged = self.rnn._merged_kernel()

        def general(token: Tensor, state: State) -> tuple[Tensor, State]:
            scores, state = self(token, state)
            return scores[:, -1], state

        if merged is None:
            return general

        def fused(token: Tensor, state: State) -> tuple[Tensor, State]:
            y, final = merged(self.embedding(token), state if len(state) > 1 else state[0])  # (B, 1, H)
            return self.decoder(y)[:, -1], final if isinstance(final, tuple) else (final,)

        return fused

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

        On CUDA with graphs on (:func:`zoo.sampling.captures`), the tokens are drawn on the device, one captured step
        a token (:mod:`zoo.sampling`): the same distribution as the plain path's, other ids for the same seed.

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
        step = self._sampling_step(prompt)
        logits, state = self(prompt)
        logits = logits[:, -1]  # (B, V)
        if sampling.captures(prompt.device):  # one captured step a token, read back once (zoo/sampling.py)
            return sampling.sample(step, logits, state, max_new_tokens, temperature, top_k, stop_id, generator)
        # The plain path, any device: multinomial draws from a CPU generator; on the CPU nothing moves. Without a
        # stop_id nothing needs the ids on the host before the end: one copy then, rather than one per step.
        on_host = prompt.device.type == "cpu"
        tokens: list[Tensor] = []  # (B, 1) each
        done = [False] * prompt.size(0)
        for _ in range(max_new_tokens):
            probs = torch.softmax(sampling.next_token_scores(logits, temperature, top_k), dim=-1, dtype=torch.float32)
            token = torch.multinomial(probs if on_host else probs.cpu(), 1, generator=generator)  # (B, 1)
            tokens.append(token)
            if stop_id is not None:
                done = [d or value == stop_id for d, value in zip(done, token.flatten().tolist(), strict=True)]
                if all(done):
                    break
            logits, state = step(token if on_host else token.to(prompt.device), state)
        rows = torch.cat(tokens, 1).tolist() if tokens else [[] for _ in range(prompt.size(0))]
        return sampling.cut_at_stop(rows, stop_id)
