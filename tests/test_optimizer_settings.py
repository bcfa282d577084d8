"""The optimizer settings of the Melis et al. recipes, as the configs' comments state them.

- Adam's ``weight_decay`` is an L2 penalty in the loss (its gradient added before Adam's moments, like lamb's
  ``l2_penalty * tf.nn.l2_loss``), not AdamW's decoupled decay.
- lamb sums the loss over the T steps of a window where lm-zoo averages per token: with Adam, lamb's ``l2_penalty``
  is ``weight_decay = l2_penalty / T`` here and its ``max_grad_norm`` is ``gradient_clip_val = max_grad_norm / T``.
"""

from __future__ import annotations

import torch
from torch import nn

T = 70  # the word-level BPTT window


def adam_steps(
    weight_decay: float = 0.0,
    penalty: float = 0.0,
    loss_scale: float = 1.0,
    clip: float | None = None,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
    steps: int = 6,
) -> torch.Tensor:
    """A few Adam (beta1 = 0) steps on ``loss_scale * loss(w) + penalty / 2 * |w|^2``, clipped to ``clip``."""
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(6, generator=gen))
    data = torch.randn(steps, 6, generator=gen)
    opt = optimizer([w], lr=0.05, betas=(0.0, 0.999), weight_decay=weight_decay)
    for x in data:
        opt.zero_grad()
        loss = loss_scale * ((w * x).sum() - 1.0) ** 2 + penalty / 2 * w.pow(2).sum()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([w], clip)
        opt.step()
    return w.detach()


def test_adam_weight_decay_is_an_l2_penalty_in_the_loss() -> None:
    l2 = 0.3
    torch.testing.assert_close(adam_steps(weight_decay=l2), adam_steps(penalty=l2))
    # AdamW decays the weights outside the moments: a different update.
    assert not torch.allclose(adam_steps(weight_decay=l2, optimizer=torch.optim.AdamW), adam_steps(penalty=l2))


def test_lamb_summed_loss_maps_to_per_token_settings() -> None:
    l2 = 2.5e-4 * 100  # large enough for the penalty to matter over a few steps
    lamb = adam_steps(loss_scale=T, penalty=l2)  # lamb: loss summed over T steps + l2_penalty * |w|^2 / 2
    ours = adam_steps(weight_decay=l2 / T)  # lm-zoo: the per-token mean, weight_decay = l2_penalty / T
    torch.testing.assert_close(lamb, ours, rtol=1e-5, atol=1e-6)
    # Clipping: lamb's max_grad_norm 10 on the summed loss is 10 / T on the mean.
    lamb = adam_steps(loss_scale=T, clip=10.0)
    ours = adam_steps(clip=10.0 / T)
    torch.testing.assert_close(lamb, ours, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours, adam_steps(), rtol=1e-3)  # the clipping did act
    assert not torch.allclose(adam_steps(clip=10.0), lamb, rtol=1e-3)  # clip 10 on the mean is another setting
