"""Large-vocabulary training objectives over a unigram noise: NCE and sampled softmax.

Noise-contrastive estimation (Mnih & Teh 2012, "A fast and simple algorithm for training neural probabilistic
language models", arXiv:1206.6426), in the form of Léonard et al.'s Torch ``NCEModule`` that trained the
Google Billion Word models (the 2016 Torch blog, ``../shared/papers/004``). With the model's unnormalised score
``s(w, h) = W_w · h + b_w`` taken as a log-probability (Z = 1), ``k`` noise words ``n_1..n_k`` drawn from the
noise distribution ``q`` and ``Δ(w) = s(w, h) − log(k q(w))``::

    P(D = 1 | w, h) = σ(Δ(w))                      the posterior that w came from the data, not the noise
    loss(w, h)     = −log σ(Δ(w)) − Σ_j log(1 − σ(Δ(n_j)))
                   = BCEWithLogits(Δ(w), 1) + Σ_j BCEWithLogits(Δ(n_j), 0)

computed from the logits Δ, never from probabilities (dpnn's probability-space version needs an eps; Pytorch-NCE
moved to logit space for stability). Only the rows of ``W`` for the targets and the noise words are touched: no
``(B, T, V)`` tensor exists in training. Z = 1 holds from the start only if the output bias starts at ``−log V``
(dpnn ``NCEModule:reset``; the blog's "NCE papers forget to mention the initialisation"), which this head does.
Accidental hits (a noise word equal to the target) are kept, as in dpnn and Pytorch-NCE.

Sampled softmax (Jean et al. 2015, "On using very large target vocabulary for neural machine translation",
arXiv:1412.2007; the logit correction of TensorFlow's ``sampled_softmax_loss``)::

    loss(w, h) = −log softmax over {w} ∪ {n_j} of (s − log(k q))   at w

with the noise words equal to the target removed (their corrected logit set to −inf), as TensorFlow does by default:
otherwise a frequent target competes against copies of itself.

The noise words are shared by every row of the batch, one set of ``k`` per time step, as dpnn's default
``batchnoise`` (the blog: "sampled once and used for the whole batch, but still once per time step"), which turns the
noise scores into one batched matrix product over time; ``per_row`` draws ``k`` for every (row, step) instead
(dpnn ``rownoise``). Either way evaluation uses the full softmax (:meth:`SoftmaxHead.token_nll`).

Noise words are drawn with Walker's alias method (Vose's construction, vectorised below) or ``torch.multinomial``;
``benchmarks/nce.py`` times both at V = 793,471.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.heads import CHUNK_LOGITS, SoftmaxHead, _at_least_float32

OBJECTIVES = ("nce", "sampled_softmax")
SAMPLERS = ("alias", "multinomial")
NOISE_TABLES = ("probs", "log_probs", "accept", "alias")  # UnigramNoise's tensors, derived from the counts

# log q of a word with a zero count (e.g. a symbol the training text never contains): finite, so that the target term
# of such a word stays finite (s + 30 instead of +inf, whose BCE is NaN); it is never drawn as noise.
MIN_LOG_NOISE = -30.0


def alias_table(probs: Tensor) -> tuple[Tensor, Tensor]:
    """Walker's alias table of a distribution: bucket i keeps word i with probability ``accept[i]``, else ``alias[i]``.

    Sampling is then O(1) per draw: a uniform bucket and a coin (:meth:`UnigramNoise.sample`). The table is built by
    the sweep of Hübschle-Schneider & Sanders ("Parallel weighted random sampling", 2019, §4) in closed form, so it
    is a few prefix sums and one ``searchsorted`` instead of Vose's word-by-word loop (seconds in Python at 793k).
    With masses ``w = V p`` (mean 1), light words ``w < 1`` in id order with deficits ``d = 1 - w`` and heavy words in
    id order with excesses ``e = w - 1``, ``D`` and ``C`` their prefix sums (``D_0 = C_0 = 0``), the sweep lets heavy
    j fill, in order, the bucket of heavy j-1 and then every light i whose deficit starts within its excess
    (``C_{j-1} < D_{i-1} <= C_j``); after the last of them it holds ``r_j = 1 + C_j - P_j`` (``P_j``: the deficit
    filled so far), less than 1, and heavy j+1 fills the rest of its bucket. Heavy j's total is
    ``r_j + (P_j - P_{j-1}) + (P_{j-1} - C_{j-1}) = 1 + e_j = w_j``, as it must be.

    Args:
        probs: ``(V,)`` non-negative weights (normalised here).

    Returns:
        ``accept (V,) float64`` in [0, 1] and ``alias (V,) int64``.
    """
    size = probs.numel()
    mass = probs.detach().double().cpu()
    mass = mass * (size / mass.sum())  # (V,) mean 1
    accept = torch.ones(size, dtype=torch.float64)
    alias = torch.arange(size)
    is_light = mass < 1
    is_light[mass.argmax()] = False  # the largest is >= 1 exactly; after rounding all could read < 1
    light, heavy = torch.nonzero(is_light).squeeze(1), torch.nonzero(~is_light).squeeze(1)  # (L,), (H,) with H >= 1
    deficit = 1 - mass[light]  # (L,)
    deficit_ends = torch.cumsum(deficit, 0)  # D_i
    deficit_starts = deficit_ends - deficit  # D_{i-1}
    excess_ends = torch.cumsum(mass[heavy] - 1, 0)  # C_j
    # Light i goes to the first heavy j with C_j >= D_{i-1} (clamped: rounding may leave the total excess a hair short).
    owner = torch.searchsorted(excess_ends, deficit_starts).clamp(max=heavy.numel() - 1)
    accept[light] = mass[light]
    alias[light] = heavy[owner]
    # P_j: the deficit filled when heavy j stops, the end of the last light with D_{i-1} <= C_j.
    taken = torch.searchsorted(deficit_starts, excess_ends, right=True)  # (H,) lights taken by heavies 1..j
    filled = torch.cat([deficit_ends.new_zeros(1), deficit_ends])[taken]  # (H,) P_j
    accept[heavy[:-1]] = (1 + excess_ends[:-1] - filled[:-1]).clamp(0.0, 1.0)
    alias[heavy[:-1]] = heavy[1:]
    return accept, alias


class UnigramNoise(nn.Module):
    """The noise distribution ``q(w) ∝ count(w) ** power`` and a sampler for it.

    Its tables (``probs``, ``log_probs``, ``accept``, ``alias``) follow the model across devices and dtypes like
    buffers but are neither buffers nor in the state dict: an exported model (which only ever needs the full softmax)
    loads without them, and data-parallel wrappers leave them alone (:meth:`_apply`). They are empty until
    :meth:`set_counts`.

    Args:
        vocab_size: V.
        power: exponent on the counts (1: the unigram distribution; word2vec uses 0.75).
        sampler: ``"alias"`` (Walker's alias table, O(1) per sample) or ``"multinomial"`` (``torch.multinomial``).
    """

    def __init__(self, vocab_size: int, power: float = 1.0, sampler: str = "alias") -> None:
        super().__init__()
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown noise sampler {sampler!r}: choose one of {', '.join(SAMPLERS)}")
        if power < 0:
            raise ValueError(f"noise power must be >= 0, got {power}")
        self.vocab_size = vocab_size
        self.power = power
        self.sampler = sampler
        self.probs = torch.empty(0)
        self.log_probs = torch.empty(0)
        self.accept = torch.empty(0)
        self.alias = torch.empty(0, dtype=torch.long)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> UnigramNoise:
        """Move and cast the tables as ``nn.Module`` does buffers (``.to``, ``.cuda``, ``.double``, ...).

        Why they are not buffers: DDP (``broadcast_buffers=True``, its default and Lightning's) broadcasts every buffer
        from rank 0 before every forward, here four vocabulary-sized tables (20 bytes a word: 16 MB a step at V =
        793k) that every rank already computes identically from the same training counts and that never change in
        training. lm-zoo's modules have no other buffer, so DDP has nothing to broadcast, and the default stays: a
        buffer that does change in training (running statistics), should one appear, is still synchronised.
        """
        for name in NOISE_TABLES:
            setattr(self, name, fn(getattr(self, name)))
        return super()._apply(fn, recurse)

    @property
    def ready(self) -> bool:
        """Whether the counts have been set."""
        return self.probs.numel() == self.vocab_size

    def set_counts(self, counts: Sequence[int] | Tensor) -> None:
        """Set the distribution from unigram counts (one per id, in id order).

        Args:
            counts: ``(V,)`` training counts.
        """
        counts = torch.as_tensor(counts, dtype=torch.float64).flatten().cpu()
        if counts.numel() != self.vocab_size:
            raise ValueError(f"{counts.numel()} unigram counts for a vocabulary of {self.vocab_size} words")
        if (counts < 0).any() or not torch.isfinite(counts).all() or counts.sum() <= 0:
            raise ValueError("unigram counts must be finite, >= 0 and not all zero")
        weights = counts.pow(self.power) if self.power != 1.0 else counts
        weights = torch.where(counts > 0, weights, torch.zeros_like(weights))  # 0 ** 0 is 1: keep unseen words out
        probs = weights / weights.sum()
        # The module's device and floating dtype (float32 unless the model was made double).
        device, dtype = self.probs.device, self.probs.dtype
        self.probs = probs.to(device, dtype)
        self.log_probs = probs.log().clamp(min=MIN_LOG_NOISE).to(device, dtype)
        if self.sampler == "alias":
            accept, alias = alias_table(probs)
            self.accept = accept.to(device, dtype)
            self.alias = alias.to(device)

    def sample(self, shape: Sequence[int], generator: torch.Generator | None = None) -> Tensor:
        """Draw ids from ``q``, independently, with replacement.

        Args:
            shape: the shape of the result.
            generator: for reproducible draws (on the buffers' device).

        Returns:
            ``shape`` int64 ids.
        """
        if not self.ready:
            raise RuntimeError("the noise distribution is not set: call set_counts(counts) first")
        shape = tuple(shape)
        device = self.probs.device
        if self.sampler == "multinomial":
            draws = torch.multinomial(self.probs, math.prod(shape), replacement=True, generator=generator)
            return draws.view(shape)
        bucket = torch.randint(self.vocab_size, shape, generator=generator, device=device)
        coin = torch.rand(shape, generator=generator, device=device)
        return torch.where(coin < self.accept[bucket], bucket, self.alias[bucket])

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, power={self.power}, sampler={self.sampler!r}"


class NCEHead(SoftmaxHead):
    """An output layer trained by NCE or sampled softmax, scored by the full softmax.

    The same ``nn.Linear`` as :class:`SoftmaxHead` (``weight (V, D)``, ``bias (V,)``; tied like it), so
    ``forward(h) -> (B, T, V)`` logits, :meth:`token_nll` (chunked full softmax), generation and export are the
    softmax's; :meth:`training_loss` is the sampled objective the LanguageModel trains on instead of cross-entropy.

    Args:
        input_size: width D of the vectors it scores.
        vocab_size: V.
        noise_samples: k, noise words per time step (per row and step with ``per_row``); the blog's GBW recipes use
            400.
        objective: ``"nce"`` or ``"sampled_softmax"``.
        noise_power: exponent on the unigram counts.
        per_row: draw ``k`` noise words for every row and step instead of sharing them across the batch.
        sampler: ``"alias"`` or ``"multinomial"``.
        chunk_logits: memory budget of the full-softmax :meth:`token_nll`.
        sparse_gradient: give ``weight`` a row-sparse gradient (a sparse COO tensor holding only the rows of the
            targets and noise words) instead of a dense ``(V, D)`` one, as dpnn's ``NCEModule`` updates only those
            rows. The optimizer must take sparse gradients (:mod:`lightning_modules.sparse_gradients`).
    """

    reports_nats = False  # a sampled objective: the model's nats only come from the full softmax (token_nll)

    def __init__(
        self,
        input_size: int,
        vocab_size: int,
        noise_samples: int = 100,
        objective: str = "nce",
        noise_power: float = 1.0,
        per_row: bool = False,
        sampler: str = "alias",
        chunk_logits: int = CHUNK_LOGITS,
        sparse_gradient: bool = False,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
        if noise_samples < 1:
            raise ValueError(f"noise_samples must be >= 1, got {noise_samples}")
        super().__init__(input_size, vocab_size, chunk_logits)
        self.noise_samples = noise_samples
        self.objective = objective
        self.per_row = per_row
        self.sparse_gradient = sparse_gradient
        self.noise = UnigramNoise(vocab_size, noise_power, sampler)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_bias()

    def reset_bias(self) -> None:
        """Output bias ``−log V``: with small initial weights every word then scores ``≈ −log V``, so the partition
        function is ``≈ 1`` from the start, the assumption NCE's unnormalised scores rest on (dpnn ``NCEModule:reset``).
        """
        with torch.no_grad():
            self.bias.fill_(-math.log(self.out_features))

    def set_noise_distribution(self, counts: Sequence[int] | Tensor) -> None:
        """Noise distribution from unigram training counts (one per id), raised to ``noise_power``."""
        self.noise.set_counts(counts)

    def sample_noise(self, batch_size: int, steps: int, generator: torch.Generator | None = None) -> Tensor:
        """Noise ids for a window: ``(T, k)`` shared across the batch, or ``(B, T, k)`` with ``per_row``."""
        shape = (batch_size, steps, self.noise_samples) if self.per_row else (steps, self.noise_samples)
        return self.noise.sample(shape, generator)

    def training_loss(
        self,
        h: Tensor,
        targets: Tensor,
        noise: Tensor | None = None,
        shared_generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The sampled objective, summed over predicted positions.

        Args:
            h: ``(B, T, D)`` the vectors to score.
            targets: ``(B, T)`` ids, ``-100`` where nothing is predicted.
            noise: ``(T, k)`` (shared by the batch) or ``(B, T, k)`` noise ids; ``None`` draws them.
            shared_generator: what ``None`` noise shared by the batch is drawn from (on ``h``'s device); ``None``:
                the global generator. Under data parallelism every replica passes one seeded alike, so that the noise
                words are shared by the whole batch across ranks, as they are by one process's batch (dpnn's
                ``batchnoise``). Per-row noise is each replica's own, like its dropout masks: drawn from the global
                generator whatever is passed.

        Returns:
            ``(summed loss, number of predicted positions)``.
        """
        if not self.noise.ready:
            raise RuntimeError("the noise distribution is not set: call set_noise_distribution(counts) first")
        B, T, _ = h.shape
        if noise is None:
            noise = self.sample_noise(B, T, None if self.per_row else shared_generator)
        predicted = targets != -100  # (B, T)
        safe_targets = targets.clamp(min=0)
        log_kq = self.noise.log_probs + math.log(noise.size(-1))  # (V,)  log(k q(w))
        # The only rows of W the step touches, gathered in one lookup: its backward builds one (V, D) gradient, where
        # two gathers would build and add two. Dense, that gradient is zeros + scatter over all V rows (6.5 GB at
        # V = 793k, D = 2048); sparse, it is the (B*T + n, D) rows alone. The bias's dense (V,) gradient is cheap.
        ids = torch.cat([safe_targets.flatten(), noise.flatten()])
        vectors = F.embedding(ids, self.weight, sparse=self.sparse_gradient)  # (B*T + n, D)
        biases = self.bias[ids]  # (B*T + n,)
        target_vectors, noise_vectors = vectors.split([B * T, noise.numel()])
        target_biases, noise_biases = biases.split([B * T, noise.numel()])
        target_scores = (h * target_vectors.view(B, T, -1)).sum(-1) + target_biases.view(B, T)  # (B, T)
        noise_vectors = noise_vectors.view(*noise.shape, -1)  # (T, k, D) or (B, T, k, D)
        noise_biases = noise_biases.view(noise.shape)
        if noise.dim() == 2:  # shared by the batch: one batched (B, D) x (D, k) product per step
            noise_scores = torch.einsum("btd,tkd->btk", h, noise_vectors) + noise_biases  # (B, T, k)
        else:
            noise_scores = torch.einsum("btd,btkd->btk", h, noise_vectors) + noise_biases  # (B, T, k)
        logits = _at_least_float32(
            torch.cat([(target_scores - log_kq[safe_targets]).unsqueeze(-1), noise_scores - log_kq[noise]], dim=-1)
        )  # (B, T, 1 + k): Δ = s − log(k q), in float32 or wider
        if self.objective == "nce":
            labels = torch.zeros_like(logits)
            labels[..., 0] = 1.0  # the data word; the k noise words are label 0
            loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(-1)  # (B, T)
        else:
            hits = noise.expand(B, T, -1) == safe_targets.unsqueeze(-1)  # (B, T, k) noise words equal to the target
            logits = torch.cat([logits[..., :1], logits[..., 1:].masked_fill(hits, float("-inf"))], dim=-1)
            loss = torch.logsumexp(logits, dim=-1) - logits[..., 0]  # (B, T)  −log softmax at the target
        total = torch.where(predicted, loss, torch.zeros_like(loss)).sum()
        return total, predicted.sum()

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, objective={self.objective!r}, noise_samples={self.noise_samples}, "
            f"per_row={self.per_row}, sparse_gradient={self.sparse_gradient}"
        )
