"""Output heads: the Mixture of Softmaxes and the adaptive softmax against their formulas written out plainly, their
normalisation, K = 1, and the adaptive head's training loss against its evaluation nats."""

from __future__ import annotations

import pytest
import torch

from zoo.errors import ConfigError
from zoo.heads import AdaptiveSoftmaxHead, MixtureOfSoftmaxes, SoftmaxHead, default_adaptive_cutoffs
from zoo.language_model import RecurrentLM
from zoo.nce import NCEHead

B, T, H, E, V, K = 2, 3, 5, 4, 7, 3


def _mos(components: int = K, **kw) -> MixtureOfSoftmaxes:
    torch.manual_seed(0)
    head = MixtureOfSoftmaxes(H, E, V, components, **kw).double()
    with torch.no_grad():  # PyTorch zeroes no bias here, but make sure every parameter matters in the comparison
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return head


def test_mixture_equals_the_formula_written_out() -> None:
    head = _mos().eval()
    h = torch.randn(B, T, H, dtype=torch.double)
    W_pi = head.prior.weight  # (K, H), no bias
    W_lat, b_lat = head.latent.weight, head.latent.bias  # (K*E, H), (K*E,)
    W_dec, b_dec = head.decoder.weight, head.decoder.bias  # (V, E), (V,)
    expected = torch.empty(B, T, V, dtype=torch.double)
    for b in range(B):
        for t in range(T):
            x = h[b, t]
            prior_logits = W_pi @ x
            pi = torch.exp(prior_logits) / torch.exp(prior_logits).sum()  # (K,)
            p = torch.zeros(V, dtype=torch.double)
            for k in range(K):
                rows = slice(k * E, (k + 1) * E)
                h_k = torch.tanh(W_lat[rows] @ x + b_lat[rows])  # (E,)
                logits = W_dec @ h_k + b_dec  # (V,)
                p += pi[k] * torch.exp(logits) / torch.exp(logits).sum()  # probabilities mixed by the prior
            expected[b, t] = torch.log(p)
    with torch.no_grad():
        actual = head(h)
    assert actual.shape == (B, T, V)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


def test_mixture_is_normalised_and_a_fixed_point_of_log_softmax() -> None:
    head = _mos().float().eval()
    out = head(torch.randn(B, T, H))
    torch.testing.assert_close(out.logsumexp(-1), torch.zeros(B, T), atol=1e-6, rtol=0)
    # cross_entropy (the LanguageModel's nll), perplexity and sampling apply log_softmax: it must change nothing.
    torch.testing.assert_close(torch.log_softmax(out, -1), out, atol=1e-6, rtol=0)


def test_one_component_is_a_softmax_over_tanh_of_a_projection() -> None:
    head = _mos(components=1).eval()
    softmax = SoftmaxHead(E, V).double()
    softmax.load_state_dict(head.decoder.state_dict())
    h = torch.randn(B, T, H, dtype=torch.double)
    with torch.no_grad():
        expected = torch.log_softmax(softmax(torch.tanh(head.latent(h))), -1)
        torch.testing.assert_close(head(h), expected, atol=1e-10, rtol=0)


def test_latent_dropout_locked_over_time_and_off_in_eval() -> None:
    head = _mos(dropout=0.5, locked_dropout=True).float()
    seen = []
    head.decoder.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    h = torch.randn(B, T, H)
    head.train()(h)
    zeros = seen[-1] == 0  # (B, T, K, E): tanh is zero only where the mask dropped it
    assert zeros.any() and (~zeros).any()
    assert (zeros == zeros[:, :1]).all()  # one mask per sequence, the same at every step
    head.eval()
    with torch.no_grad():
        torch.testing.assert_close(head(h), head(h))
    assert not (seen[-1] == 0).any()


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="at least one component"):
        MixtureOfSoftmaxes(H, E, V, components=0)
    with pytest.raises(ValueError, match="dropout"):
        MixtureOfSoftmaxes(H, E, V, dropout=1.0)


@pytest.mark.parametrize("head_name", ["softmax", "mos", "adaptive"])
def test_token_nll_is_minus_the_tempered_log_probability_of_each_target(head_name: str) -> None:
    torch.manual_seed(1)
    heads = {"mos": _mos, "softmax": lambda: SoftmaxHead(H, V).double(), "adaptive": _adaptive}
    head = heads[head_name]().eval()
    h = torch.randn(B, T, H, dtype=torch.double)
    targets = torch.randint(0, V, (B, T))
    targets[0, 1] = -100
    for temperature in (1.0, 0.7):
        nll = head.token_nll(h, targets, temperature)
        scores = head(h)
        for b in range(B):
            for t in range(T):
                if targets[b, t] < 0:
                    assert nll[b, t] == 0
                    continue
                tempered = scores[b, t] / temperature
                expected = torch.logsumexp(tempered, 0) - tempered[targets[b, t]]
                assert nll[b, t].item() == pytest.approx(expected.item(), abs=1e-9)


@pytest.mark.parametrize("head_name", ["softmax", "mos", "adaptive", "nce"])
def test_each_head_trains_on_its_own_loss_and_says_whether_it_is_nats(head_name: str) -> None:
    """The training loop calls ``training_loss`` and reads ``reports_nats`` whatever the head: an exact head's loss is
    its evaluation nats summed over the predicted targets; NCE's sampled objective is none (no training perplexity)."""
    torch.manual_seed(1)
    heads = {"mos": _mos, "softmax": lambda: SoftmaxHead(H, V).double(), "adaptive": _adaptive}
    head = heads[head_name]() if head_name in heads else NCEHead(H, V, noise_samples=3).double()
    if head_name == "nce":
        head.set_noise_distribution(torch.arange(1, V + 1))
    h = torch.randn(B, T, H, dtype=torch.double)
    targets = torch.randint(0, V, (B, T))
    targets[0, 1] = -100
    total, count = head.training_loss(h, targets, shared_generator=torch.Generator().manual_seed(0))
    assert count.item() == B * T - 1
    assert head.reports_nats == (head_name != "nce")
    nats = head.token_nll(h, targets).sum()
    if head.reports_nats:
        torch.testing.assert_close(total.double(), nats.double(), atol=1e-6, rtol=0)
    else:
        assert abs(total.item() - nats.item()) > 1e-3  # a different objective altogether


# --------------------------------------------------------------------------------------------- adaptive softmax
CUTOFFS = [3, 5]  # V = 7: head words 0-2, cluster 1 = words 3-4, cluster 2 = words 5-6


def _adaptive(div_value: float = 2.0) -> AdaptiveSoftmaxHead:
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(H, V, CUTOFFS, div_value=div_value).double()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return head


def test_adaptive_softmax_equals_the_formula_written_out() -> None:
    """Grave et al. 2017 eq. (6)-(7): log p(w) = log p_head(w) for a head word, log p_head(c) + log p_c(w) for a word
    of tail cluster c, where the head scores the 3 frequent words and one entry per cluster, and cluster c's words are
    scored from a projection of h to H / div_value**c dimensions."""
    head = _adaptive(div_value=2.0).eval()
    h = torch.randn(B, T, H, dtype=torch.double)
    W_head = head.adaptive.head.weight  # (3 + 2, H): the shortlist, then one row per cluster
    expected = torch.empty(B, T, V, dtype=torch.double)
    for b in range(B):
        for t in range(T):
            x = h[b, t]
            head_logits = W_head @ x
            head_p = torch.exp(head_logits) / torch.exp(head_logits).sum()  # (5,)
            p = torch.empty(V, dtype=torch.double)
            p[:3] = head_p[:3]
            for c, (start, stop) in enumerate([(3, 5), (5, 7)]):
                projection, words = head.adaptive.tail[c][0].weight, head.adaptive.tail[c][1].weight  # no biases
                assert projection.shape == (H // 2 ** (c + 1), H)  # H / div_value**(c+1), at least 1
                logits = words @ (projection @ x)  # (stop - start,)
                p[start:stop] = head_p[3 + c] * torch.exp(logits) / torch.exp(logits).sum()
            expected[b, t] = torch.log(p)
    with torch.no_grad():
        actual = head(h)
    torch.testing.assert_close(actual, expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(actual.logsumexp(-1), torch.zeros(B, T, dtype=torch.double), atol=1e-9, rtol=0)


def test_adaptive_training_loss_is_the_evaluation_nats_of_the_predicted_targets() -> None:
    head = _adaptive()
    h = torch.randn(B, T, H, dtype=torch.double, requires_grad=True)
    targets = torch.tensor([[0, 4, -100], [6, 2, 5]])
    total, count = head.training_loss(h, targets)
    assert count.item() == 5
    torch.testing.assert_close(total, head.token_nll(h, targets).sum().double(), atol=1e-6, rtol=0)
    log_p = head(h)
    by_hand = -sum(log_p[b, t, targets[b, t]] for b in range(B) for t in range(T) if targets[b, t] >= 0)
    torch.testing.assert_close(total, by_hand, atol=1e-9, rtol=0)
    total.backward()  # the loss reaches the input through the head and the chosen tails
    assert h.grad is not None and h.grad[0, 2].abs().sum() == 0 and h.grad[0, 1].abs().sum() > 0
    nothing, none = head.training_loss(h, torch.full((B, T), -100))
    assert nothing.item() == 0 and none.item() == 0


def test_adaptive_head_in_the_language_model_trains_on_its_exact_nats() -> None:
    """The LanguageModel's training step uses the adaptive loss; with no dropout it is the evaluation's nats."""
    from datamodules.windows import LMBatch
    from lightning_modules import LanguageModel

    model = LanguageModel(vocab_size=40, embedding_size=6, hidden_size=16, num_layers=1, head="adaptive")
    assert model.model.decoder.adaptive.cutoffs[:-1] == default_adaptive_cutoffs(40) == [2, 10]
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = LMBatch(ids[:, :-1], ids[:, 1:])
    total, count, _, _ = model._window(batch, "train")
    nll, _ = model.model.token_nll(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(total, nll.sum(), atol=1e-5, rtol=0)
    assert count.item() == 10


def test_adaptive_head_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="tie_weights false"):
        RecurrentLM(vocab_size=40, head="adaptive", tie_weights=True)
    for cutoffs in ([10, 5], [0, 5], [5, 39], []):
        with pytest.raises(ConfigError, match="cutoffs must be increasing ids between 1 and 38"):
            RecurrentLM(vocab_size=40, head="adaptive", adaptive_cutoffs=cutoffs)
    with pytest.raises(ConfigError, match="narrower than 1: lower adaptive_div_value"):
        RecurrentLM(vocab_size=40, hidden_size=15, head="adaptive")  # 15 / 4^2 < 1
    assert default_adaptive_cutoffs(33278) == [2079, 8319]
    assert default_adaptive_cutoffs(4) == [1, 2]


def test_adaptive_training_loss_touches_every_cluster_without_changing_loss_or_gradients() -> None:
    """A tail cluster with no target in the step (words 5-6 here) still takes part in the graph, with exact-zero
    gradients, so that DDP's reducer hears from every parameter (tests/test_ddp_heads.py); the loss and every gradient
    are bit for bit those of torch's ``AdaptiveLogSoftmaxWithLoss`` alone, which leaves that cluster out."""
    import copy

    targets = torch.tensor([[0, 4, -100], [3, 2, 1]])  # no word of cluster 2
    head = _adaptive()
    reference = copy.deepcopy(head)
    h = torch.randn(B, T, H, dtype=torch.double)

    h_new = h.clone().requires_grad_(True)
    total, count = head.training_loss(h_new, targets)
    total.backward()

    h_old = h.clone().requires_grad_(True)
    predicted = targets.reshape(-1) != -100
    rows = h_old.reshape(-1, H)[predicted]
    expected = -reference.adaptive(rows, targets.reshape(-1)[predicted]).output.sum()  # the code path before
    expected.backward()

    assert count.item() == 5 and torch.equal(total, expected)
    assert torch.equal(h_new.grad, h_old.grad)
    left_out = []
    for (name, new), old in zip(head.named_parameters(), reference.parameters(), strict=True):
        assert new.grad is not None, name  # every parameter reached by the backward pass
        if old.grad is None:
            left_out.append(name)
            assert torch.equal(new.grad, torch.zeros_like(new)), name
        else:
            assert torch.equal(new.grad, old.grad), name
    assert left_out == ["adaptive.tail.1.0.weight", "adaptive.tail.1.1.weight"]  # the situation did occur

    head.zero_grad(set_to_none=True)
    nothing, none = head.training_loss(h_new, torch.full((B, T), -100))  # a window of padding only
    nothing.backward()
    assert nothing.item() == 0 and none.item() == 0
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in head.parameters())
