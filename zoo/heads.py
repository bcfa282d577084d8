"""Output heads: from the last recurrent layer's output to next-token scores.

The head contract: ``head(h: (B, T, H)) -> (B, T, V)`` scores whose ``log_softmax`` over V is the model's
log-probabilities. Perplexity and ``generate`` only ever apply a (log-)softmax to these scores, so every head is scored
and sampled by the same code. Evaluation scores through ``head.token_nll(h, targets, temperature)``: the full
softmax's per-target NLL, which :class:`SoftmaxHead` computes in slices of the vocabulary (:func:`chunked_nll`) so that
a 793k-word vocabulary never needs ``(B, T, V)`` logits. Training scores through ``head.training_loss(h, targets,
shared_generator)``: each head's own objective, summed over the predicted targets, and how many there were; its
``reports_nats`` says whether that objective is the model's nats (a training perplexity) or, for NCE and sampled
softmax, only a training objective. The training loop calls both without knowing which head it has.

* :class:`SoftmaxHead` -- the full softmax: logits ``W h + b``, ``W`` optionally tied to the input embedding
  (Press & Wolf 2017; Inan et al. 2017).
* ``zoo.nce.NCEHead`` -- the same layer trained by NCE or sampled softmax (its ``training_loss``), for large
  vocabularies; scored and sampled as the full softmax.
* :class:`MixtureOfSoftmaxes` -- Yang et al. 2017, "Breaking the softmax bottleneck: a high-rank RNN language model"
  (arXiv:1711.03953). A single softmax over ``W h`` gives a log-probability matrix (contexts x words) of rank at most
  d + 1; a mixture of K softmaxes is not bounded that way::

      P(w | c) = sum_k pi_k(c) softmax(W h_k(c))_w,   pi(c) = softmax(W_pi h(c)),   h_k(c) = tanh(W_k h(c) + b_k)

  It returns the mixed **log-probabilities** themselves (computed with ``logsumexp`` in log space, never as
  ``log(sum of probabilities + 1e-8)`` as the reference code does). They are normalised, so ``log_softmax`` leaves
  them unchanged and the head still meets the contract above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.layers import sequence_dropout_mask


def _at_least_float32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


# Most logits (rows x vocabulary entries) the full softmax holds at once when scoring: 2^24 float32 = 64 MiB, so a
# 793k-word vocabulary is scored in slices of ~2,600 words for a 128 x 50 window instead of a 20 GB (B, T, V) tensor.
CHUNK_LOGITS = 2**24
# Narrowest vocabulary slice: below it the per-slice GEMMs get too thin to run efficiently; rows are split instead.
CHUNK_COLUMNS = 1024


def scores_nll(scores: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``-log_softmax(scores / temperature)[target]`` per position, in float32, 0 where the target is -100.

    Args:
        scores: ``(B, T, V)`` logits or log-probabilities.
        targets: ``(B, T)`` ids, ``-100`` where nothing is predicted.
        temperature: divides the scores before normalising (1: the model's own distribution).
    """
    scores = _at_least_float32(scores)
    if temperature != 1.0:
        scores = scores / temperature
    return F.cross_entropy(scores.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none").view_as(
        targets
    )


def chunked_nll(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    max_logits: int = CHUNK_LOGITS,
) -> Tensor:
    """Full-softmax ``-log_softmax(W h + b)[target]`` without ever holding more than ``max_logits`` logits.

    The log-partition is a running ``logaddexp`` of per-slice ``logsumexp`` over slices of the vocabulary, and each
    target's logit is picked from the slice that holds it (the same GEMM output the unchunked path would use). Slices
    run over the vocabulary rather than over rows so that the ``(V, D)`` weight is read once per call, not once per
    row block: at V = 793k it is the largest thing the step touches. Rows are split too only when even one slice of
    ``CHUNK_COLUMNS`` words over all rows would exceed the budget.

    Args:
        h: ``(..., D)`` vectors to score.
        weight: ``(V, D)`` output word vectors.
        bias: ``(V,)`` or ``None``.
        targets: ``(...)`` ids, ``-100`` where nothing is predicted.
        temperature: divides the logits before normalising.
        max_logits: the memory budget, in logits held at once; when all rows x V fit, this is :func:`scores_nll`.

    Returns:
        ``targets``-shaped float32 (or float64) nats, 0 where the target is -100.
    """
    shape = targets.shape
    h = h.reshape(-1, h.size(-1))  # (N, D)
    targets = targets.reshape(-1)  # (N,)
    num_rows, vocab_size = h.size(0), weight.size(0)
    if num_rows * vocab_size <= max_logits:
        return scores_nll(F.linear(h, weight, bias).unsqueeze(0), targets.unsqueeze(0), temperature).view(shape)
    columns = min(vocab_size, max(max_logits // max(num_rows, 1), CHUNK_COLUMNS))
    rows = min(num_rows, max(1, max_logits // columns))
    pieces = []
    for r0 in range(0, num_rows, rows):
        h_rows, t_rows = h[r0 : r0 + rows], targets[r0 : r0 + rows]  # (R, D), (R,)
        log_partition = None
        target_logit = None
        for v0 in range(0, vocab_size, columns):
            logits = F.linear(h_rows, weight[v0 : v0 + columns], None if bias is None else bias[v0 : v0 + columns])
            logits = _at_least_float32(logits)  # (R, C)
            if temperature != 1.0:
                logits = logits / temperature
            slice_lse = logits.logsumexp(-1)  # (R,)
            log_partition = slice_lse if log_partition is None else torch.logaddexp(log_partition, slice_lse)
            local = t_rows - v0
            inside = (local >= 0) & (local < logits.size(1))
            picked = logits.gather(1, local.clamp(0, logits.size(1) - 1).unsqueeze(1)).squeeze(1)  # (R,)
            target_logit = picked if target_logit is None else torch.where(inside, picked, target_logit)
        nll = log_partition - target_logit
        pieces.append(torch.where(t_rows != -100, nll, torch.zeros_like(nll)))
    return torch.cat(pieces).view(shape)


def summed_nll(scores: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Summed negative log-likelihood (nats) over the predicted targets, and how many were predicted.

    Args:
        scores: ``(B, T, V)`` any head's scores: ``cross_entropy`` applies ``log_softmax``, which leaves MoS's already
            normalised log-probabilities unchanged.
        targets: ``(B, T)`` ids, ``-100`` where nothing is predicted.
    """
    total = F.cross_entropy(scores.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


class SoftmaxHead(nn.Linear):
    """The full softmax output layer: ``logits = W h + b`` over the whole vocabulary.

    An ``nn.Linear`` (parameters ``weight (V, D)`` and ``bias (V,)``), so the LanguageModel's state-dict keys
    ``decoder.weight`` / ``decoder.bias`` are the same as before heads existed and older checkpoints still load.

    Args:
        input_size: width D of the vectors it scores.
        vocab_size: V.
        chunk_logits: memory budget of :meth:`token_nll`, in logits held at once (see :func:`chunked_nll`); an
            attribute, not a parameter, so it can be changed on a loaded model.
    """

    reports_nats = True  # its training loss is the model's own nats

    def __init__(self, input_size: int, vocab_size: int, chunk_logits: int = CHUNK_LOGITS) -> None:
        super().__init__(input_size, vocab_size)
        self.chunk_logits = chunk_logits

    def forward(self, h: Tensor) -> Tensor:
        """Logits ``(B, T, V)`` of ``h`` ``(B, T, D)``.

        ``h`` is made contiguous first: a batch-first ``nn.LSTM`` returns its output as a transposed view, and
        ``F.linear`` folds only a contiguous input into one ``addmm`` with the bias; otherwise it adds the bias in
        a pass of its own over the logits, the largest tensor of a training step (measured: the linear's own time
        per PTB 2 x 200 step went from 15.8 to 15.1 ms of about 64, ``benchmarks/results/fit_profile*.json``). The
        copy is of ``h``, V / D times smaller.
        """
        return F.linear(h.contiguous(), self.weight, self.bias)

    @property
    def output_layer(self) -> nn.Linear:
        """The ``(V, D)`` word-vector layer, the one tied to the input embedding."""
        return self

    @property
    def context_size(self) -> int:
        """Width of the word vectors (what the embedding must have to be tied)."""
        return self.in_features

    def token_nll(self, h: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """Full-softmax negative log-likelihood of each target, never more than ``chunk_logits`` logits at once
        (see :func:`chunked_nll`).

        Args:
            h: ``(B, T, D)`` the vectors to score.
            targets: ``(B, T)`` ids, ``-100`` where nothing is predicted.
            temperature: divides the logits.

        Returns:
            ``(B, T)`` float32 nats, 0 where the target is -100.
        """
        return chunked_nll(h, self.weight, self.bias, targets, temperature, self.chunk_logits)

    def training_loss(
        self, h: Tensor, targets: Tensor, shared_generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Cross-entropy of the full softmax, summed over the predicted targets (:func:`summed_nll`).

        Args:
            h: ``(B, T, D)`` the vectors to score.
            targets: ``(B, T)`` ids, ``-100`` where nothing is predicted.
            shared_generator: unused (the full softmax draws nothing); every head's training loss takes it.

        Returns:
            ``(summed nats, number of predicted positions)``.
        """
        return summed_nll(self(h), targets)


class MixtureOfSoftmaxes(nn.Module):
    """Mixture of Softmaxes (Yang et al. 2017), the structure of their AWD-LSTM-MoS code (``zihangdai/mos``).

    For each position, from the last layer's (dropped) output ``h``::

        log pi   = log_softmax(W_pi h)                       (B, T, K)   prior, no bias (as in the reference)
        h_k      = tanh(W_k h + b_k),  k = 1..K              (B, T, K, E) one latent projection to K x E
        log p_k  = log_softmax(W_dec h_k + b_dec)            (B, T, K, V) the decoder is shared by all components
        log p    = logsumexp_k (log pi_k + log p_k)          (B, T, V)

    Args:
        input_size: width H of the recurrent output.
        context_size: width E of each component's context ``h_k`` (the embedding size, so the shared decoder can be
            tied to the embedding).
        vocab_size: V.
        components: K, the number of softmaxes mixed (15 in the paper's PTB and WikiText-2 models).
        dropout: dropout on the component contexts ``h_k`` (the reference's ``dropoutl``).
        locked_dropout: one ``dropout`` mask per sequence, shared by every step (the reference's ``LockedDropout``),
            instead of one per element.
    """

    reports_nats = True  # its training loss is the model's own nats

    def __init__(
        self,
        input_size: int,
        context_size: int,
        vocab_size: int,
        components: int = 15,
        dropout: float = 0.0,
        locked_dropout: bool = False,
    ) -> None:
        super().__init__()
        if components < 1:
            raise ValueError(f"a mixture needs at least one component, got {components}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.components = components
        self.dropout = dropout
        self.locked_dropout = locked_dropout
        self.prior = nn.Linear(input_size, components, bias=False)
        self.latent = nn.Linear(input_size, components * context_size)
        self.decoder = SoftmaxHead(context_size, vocab_size)

    @property
    def output_layer(self) -> nn.Linear:
        """The shared ``(V, E)`` decoder, the one tied to the input embedding."""
        return self.decoder

    @property
    def context_size(self) -> int:
        return self.decoder.in_features

    def token_nll(self, h: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """Negative log-likelihood of each target under the mixture, the tempered mixture renormalised over V."""
        return scores_nll(self(h), targets, temperature)

    def training_loss(
        self, h: Tensor, targets: Tensor, shared_generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """The mixture's negative log-likelihood summed over the predicted targets, and how many there were
        (``shared_generator`` unused: the mixture draws nothing)."""
        return summed_nll(self(h), targets)

    def forward(self, h: Tensor) -> Tensor:
        """Mixed log-probabilities.

        Args:
            h: ``(B, T, H)`` the last recurrent layer's output.

        Returns:
            ``(B, T, V)`` log-probabilities (``logsumexp`` over V is 0).
        """
        B, T, _ = h.shape
        # Normalise in at least float32: a bf16/fp16 logsumexp over V would lose the small probabilities.
        log_prior = torch.log_softmax(_at_least_float32(self.prior(h)), dim=-1)  # (B, T, K)
        contexts = torch.tanh(self.latent(h))  # (B, T, K*E)
        if self.training and self.dropout > 0:
            if self.locked_dropout:
                contexts = contexts * sequence_dropout_mask(contexts[:, 0], self.dropout).unsqueeze(1)
            else:
                contexts = F.dropout(contexts, self.dropout, training=True)
        contexts = contexts.view(B, T, self.components, self.context_size)  # (B, T, K, E)
        log_probs = torch.log_softmax(_at_least_float32(self.decoder(contexts)), dim=-1)  # (B, T, K, V)
        return torch.logsumexp(log_prior.unsqueeze(-1) + log_probs, dim=2)  # (B, T, V)


def _full_precision(like: Tensor) -> torch.autocast:
    """No autocast: ``nn.AdaptiveLogSoftmaxWithLoss`` copies each cluster's log-probabilities into a tensor of the
    input's dtype (``index_copy_``), which fails when autocast made the cluster's in another; the head's few small
    products run in float32 instead."""
    return torch.autocast(like.device.type, enabled=False)


def default_adaptive_cutoffs(vocab_size: int) -> list[int]:
    """Cluster boundaries when none are given: the most frequent 1/16 of the vocabulary in the head, the next 3/16 in
    a first tail cluster and the rest in a second (WikiText-2's 33,278 words: 2,079 | 6,240 | 24,959).

    Grave et al. 2017 §5 choose the boundaries so that the head holds the words that make up most of the text (Zipf's
    law puts ~90% of WikiText's tokens in its most frequent ~4k words); fixed fractions of a frequency-sorted vocabulary
    give that for the corpora lm-zoo ships without a per-corpus table. lm-zoo's vocabularies are sorted by frequency
    (``datamodules.tokenizers``), which the adaptive softmax needs.
    """
    cutoffs = sorted({max(1, vocab_size // 16), max(2, vocab_size // 4)})
    return [c for c in cutoffs if c < vocab_size - 1] or [max(1, vocab_size // 2)]


class AdaptiveSoftmaxHead(nn.Module):
    """The adaptive softmax (Grave et al. 2017, "Efficient softmax approximation for GPUs", arXiv:1609.04309).

    The frequent words sit in a head softmax that also holds one entry per tail cluster; the rare words of cluster c
    are scored only when the head predicts c, through a projection to ``D / div_value**c`` dimensions::

        log p(w) = log p_head(w)                                  w in the head
        log p(w) = log p_head(cluster(w)) + log p_cluster(w)      otherwise

    This is an exact, normalised distribution (not a sampled approximation): training, evaluation and sampling all
    use it, and training costs a fraction of the full softmax because most tokens never reach a tail. It wraps
    ``torch.nn.AdaptiveLogSoftmaxWithLoss``, whose training loss only scores each target's own cluster; what the
    wrapper adds is the lm-zoo head contract: ``(B, T)`` ids with ``-100`` for nothing to predict, ``forward`` as full
    ``(B, T, V)`` log-probabilities for sampling, a temperature, and rows in slices so that scoring never holds more
    than ``chunk_logits`` log-probabilities.

    The token ids must be sorted by frequency, most frequent first (lm-zoo's vocabularies are). No weight tying: each
    cluster has its own output matrix (Baevski & Auli 2019's adaptive inputs would tie them; not implemented).

    Args:
        input_size: width D of the vectors it scores.
        vocab_size: V.
        cutoffs: increasing ids where each tail cluster starts, all in ``(0, V - 1)``; ``None``:
            :func:`default_adaptive_cutoffs`.
        div_value: each cluster's projection is ``div_value`` times narrower than the previous one's (4 in the paper).
        chunk_logits: most log-probabilities held at once by :meth:`token_nll` at a temperature other than 1.
    """

    reports_nats = True  # exact nats, though each target scores only its own cluster

    def __init__(
        self,
        input_size: int,
        vocab_size: int,
        cutoffs: list[int] | None = None,
        div_value: float = 4.0,
        chunk_logits: int = CHUNK_LOGITS,
    ) -> None:
        super().__init__()
        cutoffs = default_adaptive_cutoffs(vocab_size) if cutoffs is None else list(cutoffs)
        if cutoffs != sorted(set(cutoffs)) or not cutoffs or cutoffs[0] <= 0 or cutoffs[-1] >= vocab_size - 1:
            raise ValueError(
                f"adaptive softmax cutoffs must be increasing ids between 1 and {vocab_size - 2}, got {cutoffs}"
            )
        if input_size // div_value ** len(cutoffs) < 1:  # torch would build a 0-wide projection and say nothing
            raise ValueError(
                f"adaptive softmax: the last cluster's projection, {input_size} / {div_value}^{len(cutoffs)}, is "
                "narrower than 1: lower adaptive_div_value or give fewer cutoffs"
            )
        self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(input_size, vocab_size, cutoffs, div_value=div_value)
        self.vocab_size = vocab_size
        self.chunk_logits = chunk_logits

    @property
    def output_layer(self) -> None:
        """No single ``(V, D)`` word-vector matrix: nothing to tie to the embedding or to initialise as one."""
        return None

    @property
    def context_size(self) -> int:
        return self.adaptive.in_features

    def forward(self, h: Tensor) -> Tensor:
        """Full log-probabilities ``(B, T, V)`` (``logsumexp`` over V is 0), for sampling and inspection."""
        flat = h.reshape(-1, h.size(-1))  # (B*T, D)
        with _full_precision(h):
            return self.adaptive.log_prob(_at_least_float32(flat)).view(*h.shape[:-1], self.vocab_size)

    def training_loss(
        self, h: Tensor, targets: Tensor, shared_generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Summed negative log-likelihood of the predicted targets, scoring only each target's own cluster
        (``shared_generator`` unused: the adaptive softmax draws nothing).

        Returns:
            ``(summed nats, number of predicted positions)``: unlike NCE, these are the model's true nats.
        """
        predicted = targets.reshape(-1) != -100
        rows = _at_least_float32(h.reshape(-1, h.size(-1))[predicted])  # (N, D), N may be 0
        with _full_precision(h):
            target_log_probs = self.adaptive(rows, targets.reshape(-1)[predicted]).output  # (N,)
            # torch skips a tail cluster that no target of the step falls in, leaving its parameters without a
            # gradient, and DDP (without find_unused_parameters) then stops ("Expected to have finished reduction in
            # the prior iteration") as soon as one rank's window has no word of that cluster. So every cluster also
            # scores the empty set of rows: its output sums to exactly 0 and its gradients are exact zeros, so loss
            # and gradients are unchanged while every parameter is in every step's graph and DDP's bucketed
            # all-reduce runs as usual. find_unused_parameters=True would instead traverse the autograd graph after
            # every forward of every run to find the missing ones. Empty rows rather than 0 * (an output): 0 * inf
            # is NaN.
            untouched = sum(cluster(rows[:0]).sum() for cluster in self.adaptive.tail)  # 0.0
        return untouched - target_log_probs.sum(), predicted.sum()

    def token_nll(self, h: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """Negative log-likelihood of each target, ``(B, T)`` float32 (or float64) nats, 0 where the target is -100.

        At temperature 1 only each target's cluster is scored; otherwise the full distribution is tempered
        (``p ** (1 / temperature)`` renormalised, as for the other heads) in row slices of at most ``chunk_logits``.
        """
        nll = torch.zeros(targets.shape, dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        predicted = targets != -100
        rows, wanted = _at_least_float32(h[predicted]), targets[predicted]  # (N, D), (N,)
        if rows.size(0) == 0:
            return nll
        with _full_precision(h):
            if temperature == 1.0:
                nll[predicted] = -self.adaptive(rows, wanted).output.to(nll.dtype)
                return nll
            step = max(1, self.chunk_logits // self.vocab_size)
            pieces = [
                scores_nll(self.adaptive.log_prob(rows[i : i + step])[None], wanted[None, i : i + step], temperature)[0]
                for i in range(0, rows.size(0), step)
            ]
        nll[predicted] = torch.cat(pieces).to(nll.dtype)
        return nll
