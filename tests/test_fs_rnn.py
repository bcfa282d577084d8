"""FS-RNN (Mujika et al. 2017) against its update equations, with each LSTM cell computed separately by hand."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.errors import ConfigError


def lstm_cell(x, h, c, W_ih, W_hh, b):
    """One plain LSTM step (gate order i, f, g, o); ``x``/``W_ih`` are ``None`` for a cell without input."""
    z = h @ W_hh.T + b
    if x is not None:
        z = z + x @ W_ih.T
    n = h.size(1)
    i = torch.sigmoid(z[:, :n])
    f = torch.sigmoid(z[:, n : 2 * n])
    g = torch.tanh(z[:, 2 * n : 3 * n])
    o = torch.sigmoid(z[:, 3 * n :])
    c = f * c + i * g
    return o * torch.tanh(c), c


def _weights(cell):
    return getattr(cell, "weight_ih", None), cell.weight_hh, cell.bias


@pytest.mark.parametrize("fast_cells", [2, 3, 4])
def test_fs_rnn_follows_the_update_equations(fast_cells: int) -> None:
    torch.manual_seed(fast_cells)
    H, S, B, T = 4, 3, 2, 5  # fast and slow sizes differ on purpose
    stack = zoo.build("fs_rnn", 6, H, 1, fast_cells=fast_cells, slow_size=S)
    layer = stack.layers[0]
    F = [_weights(cell) for cell in layer.fast]
    slow = _weights(layer.slow)
    x = torch.randn(B, T, 6)
    state = [torch.randn(B, H), torch.randn(B, H), torch.randn(B, S), torch.randn(B, S)]
    h, c, h_s, c_s = state  # h, c: the fast state h^{Fk}_{t-1}; h_s, c_s: the slow state
    outputs = []
    for t in range(T):
        h, c = lstm_cell(x[:, t], h, c, *F[0])  # h^{F1}_t = f^{F1}(h^{Fk}_{t-1}, x_t)
        h_s, c_s = lstm_cell(h, h_s, c_s, *slow)  # h^S_t = f^S(h^S_{t-1}, h^{F1}_t)
        h, c = lstm_cell(h_s, h, c, *F[1])  # h^{F2}_t = f^{F2}(h^{F1}_t, h^S_t)
        for i in range(2, fast_cells):
            h, c = lstm_cell(None, h, c, *F[i])  # h^{Fi}_t = f^{Fi}(h^{F(i-1)}_t): no external input
        outputs.append(h)  # y_t reads h^{Fk}_t
    y, final = stack(x, tuple(s[None] for s in state))
    torch.testing.assert_close(y, torch.stack(outputs, 1), atol=1e-6, rtol=0)
    for got, want in zip(final, (h, c, h_s, c_s)):
        torch.testing.assert_close(got[0], want, atol=1e-6, rtol=0)


def test_only_f1_and_f2_take_an_input() -> None:
    layer = zoo.build("fs_rnn", 6, 4, 1, fast_cells=4, slow_size=3).layers[0]
    assert layer.fast[0].weight_ih.shape == (16, 6)  # F_1 reads x_t
    assert layer.fast[1].weight_ih.shape == (16, 3)  # F_2 reads h^S_t
    assert layer.slow.weight_ih.shape == (12, 4)  # S reads h^{F1}_t
    assert not any(hasattr(cell, "weight_ih") for cell in layer.fast[2:])  # F_3, F_4: only the previous fast cell


def test_state_layout_and_sizes() -> None:
    stack = zoo.build("fs_rnn", 6, 4, 2, slow_size=3)
    x = torch.randn(2, 3, 6)
    y, (h_fast, c_fast, h_slow, c_slow) = stack(x)
    assert h_fast.shape == c_fast.shape == (2, 2, 4) and h_slow.shape == c_slow.shape == (2, 2, 3)
    torch.testing.assert_close(y[:, -1], h_fast[-1])  # state[0] is the output h^{Fk}


def test_gradients_reach_every_parameter_with_three_fast_cells() -> None:
    torch.manual_seed(5)
    stack = zoo.build("fs_rnn", 5, 6, 2, fast_cells=3, slow_size=4)
    x = torch.randn(3, 6, 5)
    y, _ = stack(x)
    (y * torch.randn_like(y)).sum().backward()
    for name, p in stack.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_forget_bias_starts_every_cell_forget_gate() -> None:
    layer = zoo.build("fs_rnn", 5, 6, 1, fast_cells=3, slow_size=4, forget_bias=1.5).layers[0]
    for cell in [*layer.fast, layer.slow]:
        n = cell.hidden_size
        torch.testing.assert_close(cell.bias[n : 2 * n], torch.full((n,), 1.5))


def test_fast_cells_below_two_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="fast_cells must be at least 2"):
        zoo.build("fs_rnn", 5, 6, 1, fast_cells=1)


def test_mujika_ptb_preset_has_the_papers_parameter_count() -> None:
    # FS-LSTM-2 on PTB characters: 7.2M parameters (Table 1), with a 50-character vocabulary, embedding 128 and an
    # untied softmax around the stack.
    options = zoo.preset("fs_rnn", "mujika-ptb")
    stack = zoo.build("fs_rnn", **options)
    E, H, V = options["input_size"], options["hidden_size"], 50
    total = sum(p.numel() for p in stack.parameters()) + V * E + H * V + V
    assert options["fast_cells"] == 2 and round(total / 1e5) == 72
