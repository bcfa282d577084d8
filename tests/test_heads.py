"""Output heads: the Mixture of Softmaxes against its formula written out plainly, its normalisation, K = 1."""

from __future__ import annotations

import pytest
import torch

from zoo.heads import MixtureOfSoftmaxes, SoftmaxHead

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


@pytest.mark.parametrize("head_name", ["softmax", "mos"])
def test_token_nll_is_minus_the_tempered_log_probability_of_each_target(head_name: str) -> None:
    torch.manual_seed(1)
    head = (_mos() if head_name == "mos" else SoftmaxHead(H, V).double()).eval()
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
