"""The Mogrifier LSTM and the mLSTM against Melis, Kočiský & Blunsom 2020 (§2 eqs. 1-2, §4.1, §4.2), written out.

Sizes: input m = 5, hidden n = 7 (m != n, so a transposed Q^i or R^i cannot go unnoticed).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import zoo

M, N = 5, 7


def _randomise(stack: torch.nn.Module, scale: float = 0.6) -> None:
    """Weights large enough that every gate (and every round) visibly matters."""
    torch.manual_seed(11)
    with torch.no_grad():
        for p in stack.parameters():
            p.uniform_(-scale, scale)


def _lstm(x: Tensor, h: Tensor, c: Tensor, rnn: torch.nn.LSTM, cap: bool = False) -> tuple[Tensor, Tensor]:
    """The LSTM update of §2 (PyTorch's gate order i, f, g, o; the paper's j is g); with ``cap``, lamb's
    ``cap_input_gate`` (tiled_lstm.py: ``c = f * state.c + tf.minimum(1-f, i) * j``)."""
    z = x @ rnn.weight_ih_l0.T + h @ rnn.weight_hh_l0.T + rnn.bias_ih_l0 + rnn.bias_hh_l0
    i = torch.sigmoid(z[:, 0:N])
    f = torch.sigmoid(z[:, N : 2 * N])
    j = torch.tanh(z[:, 2 * N : 3 * N])
    o = torch.sigmoid(z[:, 3 * N : 4 * N])
    if cap:
        i = torch.minimum(1 - f, i)
    c = f * c + i * j
    return o * torch.tanh(c), c


def _matrix(layer: torch.nn.Module, name: str, rank: int) -> Tensor:
    """Q^i or R^i from the module's parameters: the full matrix, or left @ right at low rank."""
    if rank > 0:
        return layer.mog[f"{name}_left"] @ layer.mog[f"{name}_right"]
    return layer.mog[name]


def _mogrifier_by_hand(
    layer: torch.nn.Module,
    x: Tensor,
    h: Tensor,
    c: Tensor,
    rounds: int,
    rank: int,
    zigzag: bool,
    bias: bool = False,
    cap: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Eqs. 1-2 (zigzag) or the §4.1 no-zigzag updates, then the LSTM, step by step."""
    outputs = []
    for t in range(x.size(1)):
        xs = {-1: x[:, t]}  # x^{-1} = x
        hs = {0: h}  # h^0 = h_prev
        for i in range(1, rounds + 1):
            if i % 2 == 1:  # odd i: x^i = 2 sigm(Q^i h^{i-1}) * x^{i-2}; no zigzag: Q^i h_prev
                Q = _matrix(layer, f"Q{i}", rank)
                pre = (hs[i - 1] if zigzag else h) @ Q.T
                pre = pre + layer.mog[f"Q{i}_bias"] if bias else pre
                xs[i] = 2 * torch.sigmoid(pre) * xs[i - 2]
            else:  # even i: h^i = 2 sigm(R^i x^{i-1}) * h^{i-2}; no zigzag: R^i x
                R = _matrix(layer, f"R{i}", rank)
                pre = (xs[i - 1] if zigzag else x[:, t]) @ R.T
                pre = pre + layer.mog[f"R{i}_bias"] if bias else pre
                hs[i] = 2 * torch.sigmoid(pre) * hs[i - 2]
        x_up, h_up = xs[max(xs)], hs[max(hs)]  # the highest-indexed x^i and h^i
        h, c = _lstm(x_up, h_up, c, layer.rnn, cap)  # LSTM(x^↑, c_prev, h_prev^↑); the new h is the next h_prev
        outputs.append(h)
    return torch.stack(outputs, 1), h, c


def _compare_with_gradients(stack: torch.nn.Module, by_hand) -> None:
    """Outputs, final states and every parameter's gradient of the module equal the hand-written loop's."""
    torch.manual_seed(12)
    x = torch.randn(3, 4, M)
    h0, c0 = torch.randn(3, N) * 0.5, torch.randn(3, N) * 0.5
    y, (h_n, c_n) = stack(x, (h0[None], c0[None]))
    y_ref, h_ref, c_ref = by_hand(x, h0, c0)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(h_n[0], h_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(c_n[0], c_ref, atol=1e-6, rtol=0)
    direction = torch.randn_like(y)
    grads = torch.autograd.grad((y * direction).sum() + c_n.sum(), list(stack.parameters()))
    grads_ref = torch.autograd.grad((y_ref * direction).sum() + c_ref.sum(), list(stack.parameters()))
    for (name, _), g, g_ref in zip(stack.named_parameters(), grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "no-zigzag"])
@pytest.mark.parametrize("rank", [0, 3], ids=["full-rank", "rank-3"])
@pytest.mark.parametrize("rounds", range(6))
def test_mogrifier_matches_equations_written_out(rounds: int, rank: int, zigzag: bool) -> None:
    stack = zoo.build("mogrifier", M, N, 1, rounds=rounds, rank=rank, zigzag=zigzag, fused=False)
    _randomise(stack)
    layer = stack.layers[0]
    _compare_with_gradients(stack, lambda x, h, c: _mogrifier_by_hand(layer, x, h, c, rounds, rank, zigzag))


@pytest.mark.parametrize(("rounds", "rank", "zigzag"), [(0, 0, True), (1, 0, True), (4, 3, True), (5, 3, False)])
def test_cap_input_gate_is_lambs_min_of_one_minus_f_and_i(rounds: int, rank: int, zigzag: bool) -> None:
    # Asked for with the fast paths on: neither nn.LSTM's kernel nor the window kernel computes the cap, so the
    # layer must take the per-step path by itself.
    stack = zoo.build("mogrifier", M, N, 1, rounds=rounds, rank=rank, zigzag=zigzag, cap_input_gate=True)
    _randomise(stack)
    layer = stack.layers[0]
    assert not layer.fused and not layer.window_kernel
    _compare_with_gradients(stack, lambda x, h, c: _mogrifier_by_hand(layer, x, h, c, rounds, rank, zigzag, cap=True))
    uncapped = zoo.build("mogrifier", M, N, 1, rounds=rounds, rank=rank, zigzag=zigzag)
    uncapped.load_state_dict(stack.state_dict())
    x = torch.randn(3, 4, M)
    assert not torch.allclose(stack(x)[0], uncapped(x)[0], atol=1e-3)  # the cap binds with these weights


def test_cap_input_gate_on_the_lstm() -> None:
    stack = zoo.build("lstm", M, N, 1, cap_input_gate=True)
    _randomise(stack)
    rnn = stack.layers[0].rnn

    def by_hand(x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        outputs = []
        for t in range(x.size(1)):
            h, c = _lstm(x[:, t], h, c, rnn, cap=True)
            outputs.append(h)
        return torch.stack(outputs, 1), h, c

    assert not stack.layers[0].fused
    _compare_with_gradients(stack, by_hand)


@pytest.mark.parametrize(("rounds", "rank", "zigzag"), [(3, 0, True), (4, 3, True), (5, 3, False), (4, 0, False)])
def test_mogrifier_round_bias_is_inside_the_sigmoid(rounds: int, rank: int, zigzag: bool) -> None:
    # Not in eqs. 1-2, but in the paper's code (lamb/tiled_lstm.py): 2 sigm(Q^i h + b^i).
    stack = zoo.build("mogrifier", M, N, 1, rounds=rounds, rank=rank, zigzag=zigzag, round_bias=True)
    _randomise(stack)
    layer = stack.layers[0]
    _compare_with_gradients(stack, lambda x, h, c: _mogrifier_by_hand(layer, x, h, c, rounds, rank, zigzag, True))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "loop"])
def test_zero_rounds_is_the_lstm(fused: bool) -> None:
    # "r = 0 recovers the LSTM" (§2): same weights (the LSTM layout, so the state dict copies over), same function.
    torch.manual_seed(13)
    lstm = zoo.build("lstm", M, N, 2, fused=fused)
    mogrifier = zoo.build("mogrifier", M, N, 2, rounds=0, fused=fused)
    mogrifier.load_state_dict(lstm.state_dict())  # strict: r = 0 has no parameters beyond the LSTM's
    x = torch.randn(3, 6, M)
    state = tuple(torch.rand_like(s) for s in lstm.initial_state(3, x))
    y, final = mogrifier(x, state)
    y_lstm, final_lstm = lstm(x, state)
    torch.testing.assert_close(y, y_lstm, atol=1e-6, rtol=0)
    for a, b in zip(final, final_lstm):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    (y.sum() + final[1].sum()).backward()
    (y_lstm.sum() + final_lstm[1].sum()).backward()
    for (name, p), q in zip(mogrifier.named_parameters(), lstm.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_first_round_gates_the_input_and_leaves_h_prev_alone() -> None:
    # Eq. 1 with i = 1: x^1 = 2 sigm(Q^1 h_prev) * x, and h_prev^↑ = h^0 = h_prev (no even round). So one step of the
    # r = 1 Mogrifier is one LSTM step on the gated input from the unchanged state. A loop that gates h first (the
    # trap in peers.md §4) computes LSTM(x, c, 2 sigm(R x) * h_prev) instead, which this would catch.
    for rank in (0, 3):
        stack = zoo.build("mogrifier", M, N, 1, rounds=1, rank=rank)
        _randomise(stack)
        lstm = zoo.build("lstm", M, N, 1, fused=False)
        lstm.load_state_dict(stack.state_dict(), strict=False)
        layer = stack.layers[0]
        assert set(layer.mog) == ({"Q1"} if rank <= 0 else {"Q1_left", "Q1_right"})  # one round: one matrix, Q^1
        x = torch.randn(2, 1, M)
        h0, c0 = torch.randn(1, 2, N), torch.randn(1, 2, N)
        y, (h1, c1) = stack(x, (h0, c0))
        gated = 2 * torch.sigmoid(h0[0] @ _matrix(layer, "Q1", rank).T) * x[:, 0]  # (B, m)
        y_lstm, (h_lstm, c_lstm) = lstm(gated[:, None], (h0, c0))
        torch.testing.assert_close(y, y_lstm, atol=1e-6, rtol=0)
        torch.testing.assert_close(c1, c_lstm, atol=1e-6, rtol=0)
        assert not torch.allclose(gated, x[:, 0])  # the input really was changed
        assert not torch.allclose(y, lstm(x, (h0, c0))[0], atol=1e-4)


@pytest.mark.parametrize("rank", [0, 3], ids=["full-rank", "rank-3"])
def test_factor_two_makes_zero_matrices_the_identity(rank: int) -> None:
    # With Q^i = R^i = 0 every gate is 2 sigm(0) = 1, so x and h_prev pass unchanged: the LSTM, for any r.
    torch.manual_seed(14)
    stack = zoo.build("mogrifier", M, N, 2, rounds=5, rank=rank)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if ".mog." in name and (rank <= 0 or name.endswith("_left")):
                p.zero_()
    lstm = zoo.build("lstm", M, N, 2)
    lstm.load_state_dict(stack.state_dict(), strict=False)
    x = torch.randn(3, 5, M)
    state = tuple(torch.rand_like(s) for s in lstm.initial_state(3, x))
    y, final = stack(x, state)
    y_lstm, final_lstm = lstm(x, state)
    torch.testing.assert_close(y, y_lstm, atol=1e-6, rtol=0)
    torch.testing.assert_close(final[1], final_lstm[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("rank", [0, -1, -20])
def test_rank_zero_or_below_is_full_rank(rank: int) -> None:
    # Appendix A: "mogrifier_rank <= 0 is taken to mean full rank Q, R without factorization".
    layer = zoo.build("mogrifier", M, N, 1, rounds=4, rank=rank).layers[0]
    shapes = {name: tuple(p.shape) for name, p in layer.mog.items()}
    assert shapes == {"Q1": (M, N), "R2": (N, M), "Q3": (M, N), "R4": (N, M)}  # Q^i in R^{m x n}, R^i in R^{n x m}


def test_positive_rank_factorises_every_round() -> None:
    layer = zoo.build("mogrifier", M, N, 1, rounds=3, rank=2).layers[0]
    shapes = {name: tuple(p.shape) for name, p in layer.mog.items()}
    assert shapes == {
        "Q1_left": (M, 2),
        "Q1_right": (2, N),  # Q^1 = Q^1_left Q^1_right, m x k times k x n
        "R2_left": (N, 2),
        "R2_right": (2, M),
        "Q3_left": (M, 2),
        "Q3_right": (2, N),
    }


@pytest.mark.parametrize("rounds", range(7))
def test_no_zigzag_equals_zigzag_only_up_to_one_round(rounds: int) -> None:
    # §4.1 replaces eqs. 1-2 by x^i = 2 sigm(Q^i h_prev) * x^{i-2} and h^i = 2 sigm(R^i x) * h^{i-2}: every gate reads
    # the ORIGINAL x and h_prev. Round 1 reads h^0 = h_prev either way, so r <= 1 is the same function. Round 2 is
    # not: eq. 2 gates with R^2 x^1, the ablation with R^2 x, and x^1 = 2 sigm(Q^1 h_prev) * x differs from x. So the
    # two differ from r = 2 on (the paper's remark that no-zigzag performs "on par with r = 2" is about perplexity).
    zigzag = zoo.build("mogrifier", M, N, 2, rounds=rounds, rank=3)
    _randomise(zigzag)
    plain = zoo.build("mogrifier", M, N, 2, rounds=rounds, rank=3, zigzag=False)
    plain.load_state_dict(zigzag.state_dict())
    x = torch.randn(3, 5, M)
    same = torch.allclose(zigzag(x)[0], plain(x)[0], atol=1e-6, rtol=0)
    assert same == (rounds <= 1)


@pytest.mark.parametrize("arch", ["mogrifier", "mlstm"])
@pytest.mark.parametrize("forget_bias", [1.0, 2.5])
def test_forget_bias_is_counted_once(arch: str, forget_bias: float) -> None:
    stack = zoo.build(arch, M, N, 2, forget_bias=forget_bias, init_range=0.1)
    for layer in stack.layers:
        effective = layer.rnn.bias_ih_l0 + layer.rnn.bias_hh_l0  # PyTorch sums the two (pytorch#750)
        torch.testing.assert_close(effective[N : 2 * N], torch.full((N,), forget_bias))


def test_presets_are_the_papers_24m_parameter_budget() -> None:
    # Table 1 / Table 3: 24M parameters on PTB with a 10k vocabulary and tied embeddings (embedding = hidden size).
    for arch in ("mogrifier", "mlstm"):
        options = zoo.preset(arch, "melis-ptb")
        stack = zoo.build(arch, **options)
        hidden = options["hidden_size"]
        total = sum(p.numel() for p in stack.parameters()) + 10_000 * hidden + 10_000  # + tied embedding, softmax bias
        assert 23.9e6 < total < 24.1e6, (arch, total)


# ------------------------------------------------------------------------------------------------------------ mLSTM
def _mlstm_by_hand(layer: torch.nn.Module, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """§4.2: mLSTM(x, c_prev, h_prev) = LSTM(x, c_prev, h_m), h_m = (W^{mx} x) * (W^{mh} h_prev)."""
    outputs = []
    for t in range(x.size(1)):
        h_m = (x[:, t] @ layer.weight_mx.T) * (h @ layer.weight_mh.T)
        h, c = _lstm(x[:, t], h_m, c, layer.rnn)
        outputs.append(h)
    return torch.stack(outputs, 1), h, c


def test_mlstm_matches_equations_written_out() -> None:
    stack = zoo.build("mlstm", M, N, 1)
    _randomise(stack)
    assert tuple(stack.layers[0].weight_mx.shape) == (N, M) and tuple(stack.layers[0].weight_mh.shape) == (N, N)
    _compare_with_gradients(stack, lambda x, h, c: _mlstm_by_hand(stack.layers[0], x, h, c))


def test_mlstm_step_is_the_lstm_step_on_h_m() -> None:
    # The definition itself, with the zoo LSTM as the LSTM function: one step of each from the same (h, c).
    stack = zoo.build("mlstm", M, N, 1)
    _randomise(stack)
    lstm = zoo.build("lstm", M, N, 1)
    lstm.load_state_dict(stack.state_dict(), strict=False)
    layer = stack.layers[0]
    x = torch.randn(2, 1, M)
    h0, c0 = torch.randn(1, 2, N), torch.randn(1, 2, N)
    h_m = (x[:, 0] @ layer.weight_mx.T) * (h0[0] @ layer.weight_mh.T)
    y, (_, c1) = stack(x, (h0, c0))
    y_lstm, (_, c_lstm) = lstm(x, (h_m[None], c0))
    torch.testing.assert_close(y, y_lstm, atol=1e-6, rtol=0)
    torch.testing.assert_close(c1, c_lstm, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------ the window kernel
def _grads_of_both_paths(options: dict, reset: bool, seed: int = 3) -> tuple[list, list]:
    """Outputs, final state and every gradient (parameters, input, incoming state) of the window kernel and of the
    per-step autograd path, on the same float64 weights, dropout masks and resets."""
    results = []
    for fused in (True, False):
        torch.manual_seed(seed)
        stack = zoo.build("mogrifier", M, N, 2, fused=fused, **options).double().train()
        _randomise(stack)
        torch.manual_seed(seed + 1)
        x = torch.randn(3, 6, M, dtype=torch.float64, requires_grad=True)
        state = tuple(torch.randn(2, 3, N, dtype=torch.float64, requires_grad=True) for _ in range(2))
        resets = torch.zeros(3, 6, dtype=torch.bool)
        if reset:
            resets[0, 2] = resets[2, 4] = True  # mid-window resets of two streams
        torch.manual_seed(seed + 2)  # the same dropout masks for both paths
        y, (h, c) = stack(x, state, resets)
        loss = (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)).sum() + (h * c).sum()
        grads = torch.autograd.grad(loss, [x, *state, *stack.parameters()])
        results.append([y, h, c, *grads])
    return results[0], results[1]


@pytest.mark.parametrize("rounds", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("rank", [0, 2])
def test_window_kernel_equals_the_per_step_path_with_gradients(rounds: int, rank: int) -> None:
    kernel, per_step = _grads_of_both_paths({"rounds": rounds, "rank": rank}, reset=True)
    for a, b in zip(kernel, per_step, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "options",
    [
        {"round_bias": True},
        {"state_dropout": 0.3, "weight_drop": 0.4, "dropout": 0.2},
        {"rank": 0, "round_bias": True, "state_dropout": 0.5},
    ],
    ids=["round-bias", "dropouts", "full-rank-bias-state-dropout"],
)
def test_window_kernel_equals_the_per_step_path_with_every_option(options: dict) -> None:
    kernel, per_step = _grads_of_both_paths({"rounds": 4, **options}, reset=True)
    for a, b in zip(kernel, per_step, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_window_kernel_gradients_pass_gradcheck() -> None:
    torch.manual_seed(0)
    stack = zoo.build("mogrifier", M, N, 1, rounds=3, rank=2, round_bias=True).double()
    _randomise(stack)
    x = torch.randn(2, 4, M, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, 2, N, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(1, 2, N, dtype=torch.float64, requires_grad=True)
    reset = torch.tensor([[False, False, True, False], [False, False, False, False]])
    assert torch.autograd.gradcheck(lambda *a: stack(a[0], (a[1], a[2]), reset)[0], (x, h0, c0))


@pytest.mark.slow
@pytest.mark.parametrize("input_size", [160, 16], ids=["input-as-wide", "narrow-input"])
@pytest.mark.parametrize("batch", [4, 40], ids=["view", "packed-transpose"])
def test_window_kernel_equals_the_per_step_path_through_onednn_in_float32(input_size: int, batch: int) -> None:
    """At a width whose LSTM weights take oneDNN's packed route (zoo.kernels.ONEDNN_MIN_WEIGHT), in float32. With a
    narrow input, W_x alone falls under the threshold while W_h is over it; the window loops take one layout for
    both, and once got W_h packed with the flag of W_x (the reverse-copy recipe, embedding 64, died on it)."""
    from zoo.kernels import ONEDNN_MIN_WEIGHT

    width = 160
    assert 4 * width * width >= ONEDNN_MIN_WEIGHT
    assert (4 * width * input_size >= ONEDNN_MIN_WEIGHT) == (input_size == width)
    results = []
    for fused in (True, False):
        torch.manual_seed(5)
        stack = zoo.build("mogrifier", input_size, width, 2, fused=fused)
        x = torch.randn(batch, 5, input_size, requires_grad=True)
        y, (h, c) = stack(x)
        grads = torch.autograd.grad((y * y).sum() + h.sum() + c.sum(), [x, *stack.parameters()])
        results.append([y, h, c, *grads])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
