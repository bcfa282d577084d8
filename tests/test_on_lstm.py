"""ON-LSTM (Shen et al. 2019) against its equations 1-15, and the properties the paper states for its master gates."""

from __future__ import annotations

import math

import pytest
import torch

import zoo
from zoo.errors import ConfigError


def _pieces(layer, D: int):
    """The module's fused rows, split by gate: (master-in, master-forget, o, ĉ, i, f) weights and biases."""
    m = layer.n_chunks
    bounds = [0, m, 2 * m, 2 * m + D, 2 * m + 2 * D, 2 * m + 3 * D, 2 * m + 4 * D]
    names = ["mi", "mf", "o", "c", "i", "f"]
    return {
        name: (layer.weight_ih[a:b], layer.weight_hh[a:b], layer.bias[a:b])
        for name, a, b in zip(names, bounds, bounds[1:])
    }


def test_on_lstm_matches_equations_written_out() -> None:
    torch.manual_seed(0)
    D, C, B, T = 8, 2, 3, 6
    Dm = D // C
    stack = zoo.build("on_lstm", 5, D, 1, chunk_size=C)
    layer = stack.layers[0]
    with torch.no_grad():  # wider weights than the init, so that the master gates are far from uniform
        for p in layer.parameters():
            p.mul_(3)
    W = _pieces(layer, D)
    x = torch.randn(B, T, 5)
    h0, c0 = torch.randn(B, D) * 0.5, torch.randn(B, D) * 0.5
    h, c = h0, c0
    outputs, splits = [], []
    for t in range(T):

        def pre(name: str) -> torch.Tensor:
            W_x, U_h, b = W[name]
            return x[:, t] @ W_x.T + h @ U_h.T + b

        f = torch.sigmoid(pre("f"))  # eq. 1
        i = torch.sigmoid(pre("i"))  # eq. 2
        o = torch.sigmoid(pre("o"))  # eq. 3
        c_hat = torch.tanh(pre("c"))  # eq. 4
        master_f = torch.cumsum(torch.softmax(pre("mf"), -1), -1)  # eq. 9, (B, D_m)
        master_i = 1 - torch.cumsum(torch.softmax(pre("mi"), -1), -1)  # eq. 10
        splits.append(Dm - master_f.sum(-1))  # eq. 15
        master_f = master_f.repeat_interleave(C, dim=1)  # each master unit repeated C times: (B, D)
        master_i = master_i.repeat_interleave(C, dim=1)
        omega = master_f * master_i  # eq. 11
        f_hat = f * omega + (master_f - omega)  # eq. 12
        i_hat = i * omega + (master_i - omega)  # eq. 13
        c = f_hat * c + i_hat * c_hat  # eq. 14
        h = o * torch.tanh(c)  # eq. 5
        outputs.append(h)
    y, (h_n, c_n) = stack(x, (h0[None], c0[None]))
    torch.testing.assert_close(y, torch.stack(outputs, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(h_n[0], h, atol=1e-6, rtol=0)
    torch.testing.assert_close(c_n[0], c, atol=1e-6, rtol=0)
    torch.testing.assert_close(stack.split_points()[0], torch.stack(splits, 1), atol=1e-6, rtol=0)


def test_cell_update_matches_eq_14_on_one_step_by_hand() -> None:
    # D = 4 neurons in D_m = 2 chunks of C = 2. All weights 0, so every gate is its bias:
    #   master forget: softmax(0, ln 3) = (1/4, 3/4)  -> f̃ = cumsum = (1/4, 1)  -> per neuron (1/4, 1/4, 1, 1)
    #   master input:  softmax(ln 3, 0) = (3/4, 1/4)  -> ĩ = 1 - cumsum = (1/4, 0) -> per neuron (1/4, 1/4, 0, 0)
    #   f = i = o = sigm(0) = 1/2, ĉ = tanh(atanh(1/2)) = 1/2
    #   ω = f̃ ĩ = (1/16, 1/16, 0, 0)
    #   f̂ = f ω + (f̃ - ω) = f̃ - ω/2 = (7/32, 7/32, 1, 1)
    #   î = i ω + (ĩ - ω) = ĩ - ω/2 = (7/32, 7/32, 0, 0)
    #   c = f̂ c_prev + î ĉ with c_prev = (1, 2, 3, 4): (7/32 + 7/64, 14/32 + 7/64, 3, 4) = (21/64, 35/64, 3, 4)
    stack = zoo.build("on_lstm", 3, 4, 1, chunk_size=2)
    layer = stack.layers[0]
    with torch.no_grad():
        layer.weight_ih.zero_()
        layer.weight_hh.zero_()
        layer.bias.zero_()
        layer.bias[0] = math.log(3)  # master-input pre-activation, chunk 0
        layer.bias[3] = math.log(3)  # master-forget pre-activation, chunk 1
        layer.bias[4 + 4 : 4 + 8] = math.atanh(0.5)  # ĉ rows (after 2 D_m master rows and the o rows)
    c_prev = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    _, (h_n, c_n) = stack(torch.randn(1, 1, 3), (torch.randn(1, 1, 4), c_prev[None]))
    expected = torch.tensor([[21 / 64, 35 / 64, 3.0, 4.0]])
    torch.testing.assert_close(c_n[0], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(h_n[0], 0.5 * torch.tanh(expected), atol=1e-6, rtol=0)
    torch.testing.assert_close(stack.split_points(), torch.tensor([[[2 - 1.25]]]), atol=1e-6, rtol=0)  # D_m - Σ f̃


def test_master_gates_are_monotone_forget_rising_input_falling() -> None:
    torch.manual_seed(1)
    layer = zoo.build("on_lstm", 6, 40, 1, chunk_size=4).layers[0]  # D_m = 10
    pre = torch.randn(50, layer.weight_hh.size(0)) * 5  # random pre-activations (B, 2 D_m + 4D)
    master_forget, master_in = layer.master_gates(pre)
    assert master_forget.shape == master_in.shape == (50, 10)
    assert (master_forget.diff(dim=1) >= 0).all(), "f̃ = cumax(...) must not decrease along the neurons"
    assert (master_in.diff(dim=1) <= 0).all(), "ĩ = 1 - cumax(...) must not increase along the neurons"
    assert master_forget.min() >= 0 and master_in.max() <= 1 + 1e-6
    torch.testing.assert_close(master_forget[:, -1], torch.ones(50))  # ends at 1
    torch.testing.assert_close(master_in[:, -1], torch.zeros(50), atol=1e-6, rtol=0)  # ends at 0


def test_chunks_share_their_master_gate_inside_the_cell() -> None:
    # With f = i = 1 and ĉ = 0, eq. 14 leaves c = f̃ ∘ c_prev (eq. 12: f̂ = f̃ ∘ (ĩ + 1 - ĩ)); from c_prev = 1 the new
    # cell state *is* the master forget gate at neuron level: constant inside each chunk, rising across chunks.
    # With c_prev = 0 and ĉ = 1 it is the master input gate, falling. This reads the gates off the module's own step.
    torch.manual_seed(2)
    D, C = 12, 3
    stack = zoo.build("on_lstm", 5, D, 1, chunk_size=C)
    layer = stack.layers[0]
    rows = {name: slice(8 + k * D, 8 + (k + 1) * D) for k, name in enumerate(["o", "c", "i", "f"])}  # 2 D_m = 8
    with torch.no_grad():
        layer.weight_ih.mul_(5)  # master gates far from uniform
        for name, bias in [("i", 50.0), ("f", 50.0), ("c", 0.0)]:
            layer.weight_ih[rows[name]] = 0
            layer.weight_hh[rows[name]] = 0
            layer.bias[rows[name]] = bias  # sigm(50) = 1 and tanh(0) = 0 exactly in float32
    x = torch.randn(4, 1, 5)
    h0 = torch.randn(1, 4, D)
    _, (_, c_n) = stack(x, (h0, torch.ones(1, 4, D)))
    forget = c_n[0].view(4, D // C, C)
    torch.testing.assert_close(forget, forget[:, :, :1].expand_as(forget), atol=0, rtol=0)  # one value per chunk
    assert (forget[:, :, 0].diff(dim=1) >= 0).all() and not torch.allclose(forget[:, 0, 0], forget[:, -1, 0])
    torch.testing.assert_close(forget[:, -1], torch.ones(4, C))
    # ... and the split points are D_m minus the sum of exactly these chunk values (eq. 15)
    torch.testing.assert_close(stack.split_points()[0, :, 0], D // C - forget[:, :, 0].sum(1), atol=1e-6, rtol=0)

    with torch.no_grad():
        layer.bias[rows["c"]] = 50.0  # ĉ = tanh(50) = 1
    _, (_, c_n) = stack(x, (h0, torch.zeros(1, 4, D)))
    write = c_n[0].view(4, D // C, C)  # c = î = ĩ ∘ (f̃ + 1 - f̃) = ĩ
    torch.testing.assert_close(write, write[:, :, :1].expand_as(write), atol=0, rtol=0)
    assert (write[:, :, 0].diff(dim=1) <= 0).all()
    torch.testing.assert_close(write[:, -1], torch.zeros(4, C), atol=1e-6, rtol=0)  # the top chunk is never written


def test_split_points_per_layer_and_step_in_range_and_detached() -> None:
    torch.manual_seed(3)
    stack = zoo.build("on_lstm", 5, 20, 3, chunk_size=4).train()  # D_m = 5
    x = torch.randn(2, 7, 5, requires_grad=True)
    stack(x)
    d = stack.split_points()
    assert d.shape == (3, 2, 7) and not d.requires_grad
    assert (d >= 0).all() and (d <= 5).all()
    for index, layer in enumerate(stack.layers):
        assert torch.equal(layer.last_split_points, d[index])


def test_split_points_before_any_forward_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="forward"):
        zoo.build("on_lstm", 5, 20, 1, chunk_size=4).split_points()


def test_chunk_size_must_divide_hidden_size() -> None:
    with pytest.raises(ConfigError, match=r"hidden_size 1150 is not divisible by chunk_size 7.*10"):
        zoo.build("on_lstm", 400, 1150, 1, chunk_size=7)
    assert zoo.build("on_lstm", 4, 1150, 1).chunk_size == 10  # the paper's C by default
    assert zoo.build("on_lstm", 4, 16, 1).chunk_size == 8  # the largest divisor up to 10 leaving two chunks
