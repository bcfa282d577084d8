"""Output heads: from the last recurrent layer's output to next-token scores.

The head contract: ``head(h: (B, T, H)) -> (B, T, V)`` scores whose ``log_softmax`` over V is the model's
log-probabilities. The LanguageModel's loss (``cross_entropy``), its perplexity and ``generate`` only ever apply a
(log-)softmax to these scores, so every head is scored and sampled by the same code. Evaluation scores through
``head.token_nll(h, targets, temperature)``: the full softmax's per-target NLL, which :class:`SoftmaxHead` computes in
slices of the vocabulary (:func:`chunked_nll`) so that a 793k-word vocabulary never needs ``(B, T, V)`` logits.

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

from zoo.base import sequence_dropout_mask


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

    def __init__(self, input_size: int, vocab_size: int, chunk_logits: int = CHUNK_LOGITS) -> None:
        super().__init__(input_size, vocab_size)
        self.chunk_logits = chunk_logits

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
