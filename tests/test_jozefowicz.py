"""The Jozefowicz et al. 2015 family: LSTM-f/-i/-o, the paper-form GRU, MUT1-3.

Each cell against its equations written out by hand, then independent paths: an ablation is the full LSTM with that
gate pinned to 1; the paper GRU and the cuDNN GRU agree exactly where the reset gate commutes with the matmul; each MUT
differs from the paper GRU in the term §4 changes, and only there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import Tensor

import zoo
from zoo.errors import ConfigError

sig, tanh = torch.sigmoid, torch.tanh
BIG = 1e4  # sigm(1e4) == 1 and sigm(-1e4) == 0 exactly in float32: a gate pinned open or shut
ROOT = Path(__file__).resolve().parents[1]


def _run(name: str, input_size: int, hidden_size: int, seed: int = 0, **options):
    """A one-layer stack with random weights, a random input (B=2, T=5) and a random initial state."""
    torch.manual_seed(seed)
    stack = zoo.build(name, input_size, hidden_size, 1, **options)
    with torch.no_grad():
        for p in stack.parameters():
            p.uniform_(-0.5, 0.5)  # larger than the default init, so every term matters
    x = torch.randn(2, 5, input_size)
    state = tuple(torch.rand_like(s) - 0.5 for s in stack.initial_state(2, x))
    return stack, x, state


def _close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------- LSTM-f, LSTM-i, LSTM-o
def test_lstm_no_forget_matches_equations_written_out() -> None:
    stack, x, (h0, c0) = _run("lstm_no_forget", 3, 4)
    layer = stack.layers[0]
    W_x, W_h, b = layer.weight_ih, layer.weight_hh, layer.bias
    i_, o_, g_ = layer.rows("i"), layer.rows("o"), layer.rows("g")
    h, c = h0[0], c0[0]
    expected = []
    for t in range(5):
        i = sig(x[:, t] @ W_x[i_].T + h @ W_h[i_].T + b[i_])
        o = sig(x[:, t] @ W_x[o_].T + h @ W_h[o_].T + b[o_])
        g = tanh(x[:, t] @ W_x[g_].T + h @ W_h[g_].T + b[g_])
        c = c + i * g
        h = o * tanh(c)
        expected.append(h)
    y, (h_n, c_n) = stack(x, (h0, c0))
    _close(y, torch.stack(expected, 1))
    _close(h_n[0], h)
    _close(c_n[0], c)


def test_lstm_no_input_matches_equations_written_out() -> None:
    stack, x, (h0, c0) = _run("lstm_no_input", 3, 4)
    layer = stack.layers[0]
    W_x, W_h, b = layer.weight_ih, layer.weight_hh, layer.bias
    f_, o_, g_ = layer.rows("f"), layer.rows("o"), layer.rows("g")
    h, c = h0[0], c0[0]
    expected = []
    for t in range(5):
        f = sig(x[:, t] @ W_x[f_].T + h @ W_h[f_].T + b[f_])
        o = sig(x[:, t] @ W_x[o_].T + h @ W_h[o_].T + b[o_])
        g = tanh(x[:, t] @ W_x[g_].T + h @ W_h[g_].T + b[g_])
        c = f * c + g
        h = o * tanh(c)
        expected.append(h)
    y, (h_n, c_n) = stack(x, (h0, c0))
    _close(y, torch.stack(expected, 1))
    _close(h_n[0], h)
    _close(c_n[0], c)


def test_lstm_no_output_matches_equations_written_out() -> None:
    stack, x, (h0, c0) = _run("lstm_no_output", 3, 4)
    layer = stack.layers[0]
    W_x, W_h, b = layer.weight_ih, layer.weight_hh, layer.bias
    i_, f_, g_ = layer.rows("i"), layer.rows("f"), layer.rows("g")
    h, c = h0[0], c0[0]
    expected = []
    for t in range(5):
        i = sig(x[:, t] @ W_x[i_].T + h @ W_h[i_].T + b[i_])
        f = sig(x[:, t] @ W_x[f_].T + h @ W_h[f_].T + b[f_])
        g = tanh(x[:, t] @ W_x[g_].T + h @ W_h[g_].T + b[g_])
        c = f * c + i * g
        h = tanh(c)
        expected.append(h)
    y, (h_n, c_n) = stack(x, (h0, c0))
    _close(y, torch.stack(expected, 1))
    _close(h_n[0], h)
    _close(c_n[0], c)


ABLATIONS = [("lstm_no_forget", "f"), ("lstm_no_input", "i"), ("lstm_no_output", "o")]


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
@pytest.mark.parametrize(("name", "removed"), ABLATIONS)
def test_ablation_is_the_full_lstm_with_that_gate_pinned_open(name: str, removed: str, fused: bool) -> None:
    # An independent path: zoo "lstm" (nn.LSTM's parameters; its own loop, or the fused kernel) whose removed gate has
    # zero weights and bias 1e4, so that it is exactly 1, and whose other gates carry the ablation's weights.
    ablated, x, state = _run(name, 3, 4)
    layer = ablated.layers[0]
    full = zoo.build("lstm", 3, 4, 1, forget_bias=None, fused=fused)
    rnn = full.layers[0].rnn
    with torch.no_grad():
        rnn.bias_hh_l0.zero_()
        for k, gate in enumerate("ifgo"):  # nn.LSTM's row order
            rows = slice(4 * k, 4 * k + 4)
            if gate == removed:
                rnn.weight_ih_l0[rows] = 0.0
                rnn.weight_hh_l0[rows] = 0.0
                rnn.bias_ih_l0[rows] = BIG
            else:
                rnn.weight_ih_l0[rows] = layer.weight_ih[layer.rows(gate)]
                rnn.weight_hh_l0[rows] = layer.weight_hh[layer.rows(gate)]
                rnn.bias_ih_l0[rows] = layer.bias[layer.rows(gate)]
    y, (h, c) = ablated(x, state)
    y_full, (h_full, c_full) = full(x, state)
    torch.testing.assert_close(y, y_full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c, c_full, atol=1e-6, rtol=1e-5)
    # ... and with that gate no longer pinned (bias 0: the gate is 0.5), the full LSTM is a different function.
    with torch.no_grad():
        k = "ifgo".index(removed)
        rnn.bias_ih_l0[4 * k : 4 * k + 4] = 0.0
    assert (full(x, state)[0] - y).abs().max() > 1e-3


@pytest.mark.parametrize(("name", "removed"), ABLATIONS)
def test_removed_gate_has_no_parameters(name: str, removed: str) -> None:
    # Not merely unused: the stack holds three gates' worth of weights and one bias, all of which get gradients
    # (tests/test_zoo.py checks the gradients).
    stack = zoo.build(name, 3, 4, 2)
    for index, layer in enumerate(stack.layers):
        inputs = 3 if index == 0 else 4
        assert removed not in layer.gates and sorted(layer.gates) == sorted(set("ifgo") - {removed})
        assert sum(p.numel() for p in layer.parameters()) == 3 * 4 * (inputs + 4 + 1)


@pytest.mark.parametrize("name", ["lstm_no_input", "lstm_no_output"])
def test_ablation_forget_bias_is_set_after_init_range(name: str) -> None:
    stack = zoo.build(name, 4, 6, 2, init_range=0.1)  # default forget_bias 1.0 (LSTM-b)
    for layer in stack.layers:
        torch.testing.assert_close(layer.bias[layer.rows("f")], torch.ones(6))
        others = [layer.bias[layer.rows(g)] for g in layer.gates if g != "f"]
        assert torch.cat(others).abs().max() <= 0.1
    assert zoo.build(name, 4, 6, 1, forget_bias=None, init_range=0.1).layers[0].bias.abs().max() <= 0.1


def test_lstm_no_forget_has_no_forget_bias_option() -> None:
    with pytest.raises(ConfigError, match="no option 'forget_bias'"):
        zoo.build("lstm_no_forget", 4, 4, forget_bias=1.0)


# ---------------------------------------------------------------------------------------------- the paper GRU
def test_gru_paper_matches_equations_written_out() -> None:
    stack, x, (h0,) = _run("gru_paper", 3, 4)
    layer = stack.layers[0]
    W_x, W_hrz, W_hh, b = layer.weight_ih, layer.weight_hh_rz, layer.weight_hh, layer.bias
    W_xr, W_xz, W_xh = W_x[0:4], W_x[4:8], W_x[8:12]
    W_hr, W_hz = W_hrz[0:4], W_hrz[4:8]
    b_r, b_z, b_h = b[0:4], b[4:8], b[8:12]
    h = h0[0]
    expected = []
    for t in range(5):
        r = sig(x[:, t] @ W_xr.T + h @ W_hr.T + b_r)
        z = sig(x[:, t] @ W_xz.T + h @ W_hz.T + b_z)
        h_tilde = tanh(x[:, t] @ W_xh.T + (r * h) @ W_hh.T + b_h)
        h = z * h + (1 - z) * h_tilde
        expected.append(h)
    y, (h_n,) = stack(x, (h0,))
    _close(y, torch.stack(expected, 1))
    _close(h_n[0], h)


def _gru_pair(seed: int = 0):
    """The cuDNN-form ``gru`` and ``gru_paper`` with the same weights (``b_hn`` zero: cuDNN puts it inside r)."""
    cudnn, x, state = _run("gru", 3, 4, seed)
    rnn = cudnn.layers[0].rnn
    with torch.no_grad():
        rnn.bias_hh_l0[8:12] = 0.0
    paper = zoo.build("gru_paper", 3, 4, 1)
    layer = paper.layers[0]
    with torch.no_grad():
        layer.weight_ih.copy_(rnn.weight_ih_l0)  # rows r, z, n in both
        layer.weight_hh_rz.copy_(rnn.weight_hh_l0[:8])
        layer.weight_hh.copy_(rnn.weight_hh_l0[8:])
        layer.bias.copy_(rnn.bias_ih_l0 + rnn.bias_hh_l0)
    return cudnn, paper, x, state


def test_gru_paper_differs_from_cudnn_gru_only_through_where_the_reset_acts() -> None:
    # cuDNN:  n = tanh(W_xn x + b_n + r * (W_hn h))      paper:  h~ = tanh(W_xh x + b_h + W_hh (r * h))
    cudnn, paper, x, state = _gru_pair()
    assert (cudnn(x, state)[0] - paper(x, state)[0]).abs().max() > 1e-3  # a general W_hh: they differ

    # 1. A diagonal W_hh commutes with the reset, r * (D h) == D (r * h): the two forms are the same function.
    cudnn, paper, x, state = _gru_pair()
    diagonal = torch.diag(torch.randn(4))
    with torch.no_grad():
        cudnn.layers[0].rnn.weight_hh_l0[8:] = diagonal
        paper.layers[0].weight_hh.copy_(diagonal)
    y_cudnn, (h_cudnn,) = cudnn(x, state)
    y_paper, (h_paper,) = paper(x, state)
    torch.testing.assert_close(y_paper, y_cudnn, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h_paper, h_cudnn, atol=1e-6, rtol=1e-5)

    # 2. A reset gate pinned open (r == 1) leaves nothing to put inside or outside: the same function again.
    cudnn, paper, x, state = _gru_pair()
    with torch.no_grad():
        cudnn.layers[0].rnn.bias_ih_l0[0:4] = BIG
        paper.layers[0].bias[0:4] = BIG
    torch.testing.assert_close(paper(x, state)[0], cudnn(x, state)[0], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- MUT1-3
@pytest.mark.parametrize("input_size", [4, 3], ids=["square", "projected"])
def test_mut1_matches_equations_written_out(input_size: int) -> None:
    stack, x, (h0,) = _run("mut1", input_size, 4)
    layer = stack.layers[0]
    W_xz, W_xr = layer.weight_ih[0:4], layer.weight_ih[4:8]
    W_hr, W_hh = layer.weight_hr, layer.weight_hh
    b_z, b_r, b_h = layer.bias[0:4], layer.bias[4:8], layer.bias[8:12]
    P = layer.input_projection  # None in the paper's square case; our projection otherwise
    assert (P is None) == (input_size == 4)
    h = h0[0]
    expected = []
    for t in range(5):
        x_t = x[:, t]
        z = sig(x_t @ W_xz.T + b_z)
        r = sig(x_t @ W_xr.T + h @ W_hr.T + b_r)
        h = tanh((r * h) @ W_hh.T + tanh(x_t if P is None else x_t @ P.T) + b_h) * z + h * (1 - z)
        expected.append(h)
    y, (h_n,) = stack(x, (h0,))
    _close(y, torch.stack(expected, 1))
    _close(h_n[0], h)


@pytest.mark.parametrize("input_size", [4, 3], ids=["square", "projected"])
def test_mut2_matches_equations_written_out(input_size: int) -> None:
    stack, x, (h0,) = _run("mut2", input_size, 4)
    layer = stack.layers[0]
    W_xz, W_xh = layer.weight_ih[0:4], layer.weight_ih[4:8]
    W_hz, W_hr, W_hh = layer.weight_hh_zr[0:4], layer.weight_hh_zr[4:8], layer.weight_hh
    b_z, b_r, b_h = layer.bias[0:4], layer.bias[4:8], layer.bias[8:12]
    P = layer.input_projection
    assert (P is None) == (input_size == 4)
    h = h0[0]
    expected = []
    for t in range(5):
        x_t = x[:, t]
        z = sig(x_t @ W_xz.T + h @ W_hz.T + b_z)
        r = sig((x_t if P is None else x_t @ P.T) + h @ W_hr.T + b_r)
        h = tanh((r * h) @ W_hh.T + x_t @ W_xh.T + b_h) * z + h * (1 - z)
        expected.append(h)
    y, (h_n,) = stack(x, (h0,))
    _close(y, torch.stack(expected, 1))
    _close(h_n[0], h)


def test_mut3_matches_equations_written_out() -> None:
    stack, x, (h0,) = _run("mut3", 3, 4)
    layer = stack.layers[0]
    W_xz, W_xr, W_xh = layer.weight_ih[0:4], layer.weight_ih[4:8], layer.weight_ih[8:12]
    W_hz, W_hr, W_hh = layer.weight_hz, layer.weight_hr, layer.weight_hh
    b_z, b_r, b_h = layer.bias[0:4], layer.bias[4:8], layer.bias[8:12]
    assert layer.input_projection is None  # MUT3 never adds x without a matrix
    h = h0[0]
    expected = []
    for t in range(5):
        x_t = x[:, t]
        z = sig(x_t @ W_xz.T + tanh(h) @ W_hz.T + b_z)
        r = sig(x_t @ W_xr.T + h @ W_hr.T + b_r)
        h = tanh((r * h) @ W_hh.T + x_t @ W_xh.T + b_h) * z + h * (1 - z)
        expected.append(h)
    y, (h_n,) = stack(x, (h0,))
    _close(y, torch.stack(expected, 1))
    _close(h_n[0], h)


def test_mut_parameters_are_the_gru_minus_what_section_4_removes() -> None:
    # Paper GRU: W_x{r,z,h} (3 H x I), W_h{r,z,h} (3 H x H), b_{r,z,h}. MUT1 drops W_hz and W_xh (z sees only x; the
    # candidate sees tanh(x)); MUT2 drops W_xr (r sees x itself); MUT3 keeps them all (its z sees tanh(h) instead of h).
    H = 6
    count = {
        name: sum(p.numel() for p in zoo.build(name, H, H, 1).parameters())
        for name in ("gru_paper", "mut1", "mut2", "mut3")
    }
    assert count["gru_paper"] == 3 * H * H + 3 * H * H + 3 * H
    assert count["mut1"] == count["gru_paper"] - 2 * H * H
    assert count["mut2"] == count["gru_paper"] - H * H
    assert count["mut3"] == count["gru_paper"]


def _recovered_gate(name: str, x: Tensor, h: Tensor, stack) -> Tensor:
    """The gate that mixes h and the candidate c, read off one step of ``stack`` whose W_hh is zero.

    With W_hh = 0 the candidate no longer depends on h (MUT1: c = tanh(tanh(x) + b_h), the others and the GRU:
    c = tanh(W_xh x + b_h)), so it can be computed here, and the update h' = c * z + h * (1 - z) gives
    z = (h' - h) / (c - h). For the GRU (h' = z * h + (1 - z) * c) this returns its 1 - z, the gate on the candidate.
    h is drawn from [2, 3], outside tanh's range, so c - h is never small.
    """
    layer = stack.layers[0]
    H = layer.hidden_size
    with torch.no_grad():
        layer.weight_hh.zero_()
        if name == "mut1":
            c = tanh(tanh(x) + layer.bias[2 * H :])
        else:
            c = tanh(x @ layer.weight_ih[-H:].T + layer.bias[-H:])  # the last H rows are W_xh, b_h in every layout
        h_next, _ = stack(x.unsqueeze(1), (h.unsqueeze(0),))
        return (h_next[:, 0] - h) / (c - h)


def test_mut1_update_gate_ignores_the_state_unlike_the_gru() -> None:
    torch.manual_seed(0)
    x, h_a, h_b = torch.randn(3, 4), 2 + torch.rand(3, 4), 2 + torch.rand(3, 4)
    mut1, gru = _run("mut1", 4, 4)[0], _run("gru_paper", 4, 4)[0]
    z_a, z_b = _recovered_gate("mut1", x, h_a, mut1), _recovered_gate("mut1", x, h_b, mut1)
    layer = mut1.layers[0]
    torch.testing.assert_close(z_a, sig(x @ layer.weight_ih[0:4].T + layer.bias[0:4]), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(z_a, z_b, atol=1e-5, rtol=1e-4)  # another h_prev, the same z
    gru_a, gru_b = _recovered_gate("gru_paper", x, h_a, gru), _recovered_gate("gru_paper", x, h_b, gru)
    assert (gru_a - gru_b).abs().max() > 1e-2  # the GRU's update gate does see h_prev


def test_mut1_candidate_sees_tanh_of_the_input_through_no_matrix() -> None:
    # z pinned to 1 makes h' the candidate; with W_hh = 0 that is tanh(tanh(x) + b_h) for any h and any W_xr, W_hr.
    mut1, x, state = _run("mut1", 4, 4)
    layer = mut1.layers[0]
    with torch.no_grad():
        layer.weight_hh.zero_()
        layer.bias[0:4] = BIG
    y, _ = mut1(x[:, :1], state)
    _close(y[:, 0], tanh(tanh(x[:, 0]) + layer.bias[8:12]))
    # and MUT's z weights the candidate (the GRU's weights the old state): z pinned to 0 copies the state.
    with torch.no_grad():
        layer.bias[0:4] = -BIG
    _close(mut1(x, state)[0][:, -1], state[0][0])


def _gru_like_mut2(mut2) -> torch.nn.Module:
    """A paper GRU holding MUT2's weights, with W_xr = I and the update gate negated (sigm(-a) = 1 - sigm(a))."""
    m = mut2.layers[0]
    gru = zoo.build("gru_paper", 4, 4, 1)
    g = gru.layers[0]
    with torch.no_grad():
        g.weight_ih.copy_(torch.cat([torch.eye(4), -m.weight_ih[0:4], m.weight_ih[4:8]]))  # rows r, z, h
        g.weight_hh_rz.copy_(torch.cat([m.weight_hh_zr[4:8], -m.weight_hh_zr[0:4]]))  # rows r, z
        g.weight_hh.copy_(m.weight_hh)
        g.bias.copy_(torch.cat([m.bias[4:8], -m.bias[0:4], m.bias[8:12]]))
    return gru


def test_mut2_is_the_gru_with_the_identity_for_its_reset_input_matrix() -> None:
    # MUT2's r = sigm(x + W_hr h + b_r): the GRU's r with W_xr = I. Everything else is the GRU, with z <-> 1 - z.
    mut2, x, state = _run("mut2", 4, 4)
    gru = _gru_like_mut2(mut2)
    y_mut, (h_mut,) = mut2(x, state)
    y_gru, (h_gru,) = gru(x, state)
    torch.testing.assert_close(y_mut, y_gru, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h_mut, h_gru, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # a learned W_xr, as the GRU has, is a different function
        gru.layers[0].weight_ih[0:4] = torch.randn(4, 4)
    assert (gru(x, state)[0] - y_mut).abs().max() > 1e-3


def test_mut3_update_gate_sees_tanh_of_the_state() -> None:
    mut3 = _run("mut3", 4, 4)[0]
    # 1. With W_hz = 0 the z path ignores h and MUT3 is the GRU (z <-> 1 - z): z is the only place they differ.
    layer = mut3.layers[0]
    torch.manual_seed(1)
    x, state = torch.randn(2, 5, 4), (torch.rand(1, 2, 4) - 0.5,)
    gru = zoo.build("gru_paper", 4, 4, 1)
    g = gru.layers[0]
    with torch.no_grad():
        layer.weight_hz.zero_()
        g.weight_ih.copy_(torch.cat([layer.weight_ih[4:8], -layer.weight_ih[0:4], layer.weight_ih[8:12]]))
        g.weight_hh_rz.copy_(torch.cat([layer.weight_hr, -layer.weight_hz]))
        g.weight_hh.copy_(layer.weight_hh)
        g.bias.copy_(torch.cat([layer.bias[4:8], -layer.bias[0:4], layer.bias[8:12]]))
    torch.testing.assert_close(mut3(x, state)[0], gru(x, state)[0], atol=1e-6, rtol=1e-5)

    # 2. With W_hz back, the gate read off the update is sigm(W_xz x + W_hz tanh(h) + b_z), not the GRU's
    #    sigm(W_xz x + W_hz h + b_z) (h in [2, 3], where tanh(h) and h are far apart).
    mut3 = _run("mut3", 4, 4)[0]
    layer = mut3.layers[0]
    x, h = torch.randn(3, 4), 2 + torch.rand(3, 4)
    W_xz, W_hz, b_z = layer.weight_ih[0:4], layer.weight_hz, layer.bias[0:4]
    z = _recovered_gate("mut3", x, h, mut3)
    with torch.no_grad():
        torch.testing.assert_close(z, sig(x @ W_xz.T + tanh(h) @ W_hz.T + b_z), atol=1e-5, rtol=1e-4)
        assert (z - sig(x @ W_xz.T + h @ W_hz.T + b_z)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------ presets and configs
FAMILY = ["lstm_no_forget", "lstm_no_input", "lstm_no_output", "gru_paper", "mut1", "mut2", "mut3"]


@pytest.mark.parametrize("name", FAMILY)
def test_jozefowicz_ptb_preset_is_a_20m_language_model(name: str) -> None:
    # Table 3's largest PTB models have 20M parameters: stack + embedding (V x H) + softmax (H x V + V), V = 10k.
    size = zoo.preset(name, "jozefowicz-ptb")
    H = size["hidden_size"]
    assert size["input_size"] == H  # embedding = hidden, so MUT1/MUT2 are exactly the paper's cells (no projection)
    stack = zoo.build(name, **size)
    total = sum(p.numel() for p in stack.parameters()) + 2 * 10_000 * H + 10_000
    assert 19.5e6 < total < 20.5e6, total


@pytest.mark.parametrize("model", ["lstm", "gru", "mut1", "mut2", "mut3"])
def test_jozefowicz_configs_use_the_paper_setup(model: str) -> None:
    config = yaml.safe_load((ROOT / "configs" / "ptb" / f"jozefowicz-{model}.yaml").read_text())
    args, data = config["model"]["init_args"], config["data"]["init_args"]
    assert (data["batch_size"], data["bptt"], config["trainer"]["max_epochs"]) == (20, 35, 30)  # §3.5, §3.6
    assert config["lr_scheduler"]["init_args"]["constant_epochs"] in (4, 7, 11)
    assert config["lr_scheduler"]["init_args"]["decay"] in (0.5, 0.65, 0.8)
    assert args["dropout"] in (0.0, 0.1, 0.3, 0.5)
    assert args["embedding_size"] == args["hidden_size"]
    if model == "lstm":
        assert args["cell_options"]["forget_bias"] == 1.0  # LSTM-b
        assert args["hidden_size"] == 650
    else:
        assert args["architecture"] == {"gru": "gru_paper"}.get(model, model)
        preset = zoo.preset(args["architecture"], "jozefowicz-ptb")
        assert (args["hidden_size"], args["num_layers"]) == (preset["hidden_size"], preset["num_layers"])
