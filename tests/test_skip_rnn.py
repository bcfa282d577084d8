"""Skip RNN (Campos et al. 2018) over the LSTM: its update-gate equations, the copy on skipped steps, the equality with
the plain LSTM when every step updates, the straight-through gradient and the budget loss."""

from __future__ import annotations

import copy

import torch

import zoo
from zoo.skip_rnn import round_straight_through


def _set_update_gate(stack, weight: float | None, bias: float) -> None:
    with torch.no_grad():
        for layer in stack.layers:
            if weight is not None:
                layer.update_gate.weight.fill_(weight)
            layer.update_gate.bias.fill_(bias)


def test_skip_lstm_matches_equations_written_out() -> None:
    torch.manual_seed(0)
    H, B, T = 6, 4, 12
    stack = zoo.build("skip_lstm", 3, H, 1)
    layer = stack.layers[0]
    with torch.no_grad():
        layer.update_gate.weight.mul_(4)
        layer.update_gate.bias.fill_(-1.0)  # Δũ around 0.3: some steps update, some are skipped
    rnn = layer.rnn
    W_ih, W_hh, b = rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.bias_ih_l0 + rnn.bias_hh_l0
    W_p, b_p = layer.update_gate.weight, layer.update_gate.bias
    x = torch.randn(B, T, 3)
    h, c = torch.zeros(B, H), torch.zeros(B, H)
    u_tilde = torch.ones(B, 1)  # ũ_1 = 1: the first step always updates
    outputs, gates = [], []
    for t in range(T):
        u = torch.round(u_tilde)  # u_t = round(ũ_t)
        z = x[:, t] @ W_ih.T + h @ W_hh.T + b  # the candidate LSTM(s_{t-1}, x_t)
        i, f, g, o = torch.sigmoid(z[:, :H]), torch.sigmoid(z[:, H : 2 * H]), torch.tanh(z[:, 2 * H : 3 * H]), None
        o = torch.sigmoid(z[:, 3 * H :])
        c_new = f * c + i * g
        h_new = o * torch.tanh(c_new)
        h = u * h_new + (1 - u) * h  # s_t = u_t · LSTM(s_{t-1}, x_t) + (1 - u_t) · s_{t-1}
        c = u * c_new + (1 - u) * c
        delta = torch.sigmoid(c @ W_p.T + b_p)  # Δũ_t = σ(W_p s_t + b_p), on the cell state
        u_tilde = u * delta + (1 - u) * (u_tilde + torch.minimum(delta, 1 - u_tilde))
        outputs.append(h)
        gates.append(u)
    y, (h_n, c_n, v_n) = stack(x)
    torch.testing.assert_close(y, torch.stack(outputs, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(h_n[0], h, atol=1e-6, rtol=0)
    torch.testing.assert_close(c_n[0], c, atol=1e-6, rtol=0)
    torch.testing.assert_close(v_n[0], 1 - u_tilde, atol=1e-6, rtol=0)  # the state stores 1 - ũ
    expected_gates = torch.cat(gates, 1)
    assert torch.equal(layer.last_updates, expected_gates)
    assert 0 < expected_gates.mean() < 1, "the test should see both updated and skipped steps"


def test_all_updates_equal_the_zoo_lstm_with_the_same_weights() -> None:
    torch.manual_seed(1)
    lstm = zoo.build("lstm", 5, 7, 2)
    skip = zoo.build("skip_lstm", 5, 7, 2)
    missing, unexpected = skip.load_state_dict(lstm.state_dict(), strict=False)
    assert not unexpected and all(".update_gate." in key for key in missing)
    _set_update_gate(skip, 0.0, 30.0)  # Δũ = σ(30) = 1: u_t = 1 at every step
    x = torch.randn(3, 9, 5)
    y_lstm, (h_lstm, c_lstm) = lstm(x)
    y_skip, (h_skip, c_skip, _) = skip(x)
    torch.testing.assert_close(y_skip, y_lstm, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h_skip, h_lstm, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c_skip, c_lstm, atol=1e-6, rtol=1e-5)
    assert skip.statistics()["update_fraction"] == 1.0
    # and from a carried (h, c) too (the update-gate part of the state at its fresh value 0, i.e. ũ = 1)
    h0, c0 = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    torch.testing.assert_close(skip(x, (h0, c0, torch.zeros(2, 3, 1)))[0], lstm(x, (h0, c0))[0], atol=1e-6, rtol=1e-5)


def test_skipped_steps_copy_the_state() -> None:
    torch.manual_seed(2)
    stack = zoo.build("skip_lstm", 5, 6, 1)
    _set_update_gate(stack, 0.0, -30.0)  # Δũ ≈ 1e-13: after the first step ũ never reaches 1/2 again
    x = torch.randn(3, 8, 5)
    y, (h_n, c_n, _) = stack(x)
    assert torch.equal(y, y[:, :1].expand_as(y))  # every later step outputs the copied h exactly
    assert torch.equal(h_n[0], y[:, 0])
    torch.testing.assert_close(stack.statistics()["update_fraction"], torch.tensor(1 / 8))
    _, (_, c_1, _) = stack(x[:, :1])
    torch.testing.assert_close(c_n, c_1, atol=1e-6, rtol=0)  # (another window length: another GEMM blocking)
    # a carried ũ below 1/2 skips the very first step too: the incoming (h, c) come out unchanged
    state = (torch.randn(1, 3, 6), torch.randn(1, 3, 6), torch.full((1, 3, 1), 0.8))  # ũ = 0.2
    y, (h_n, c_n, _) = stack(x, state)
    assert torch.equal(y, state[0][0, :, None].expand_as(y))
    assert torch.equal(h_n, state[0]) and torch.equal(c_n, state[1])


def test_round_is_straight_through() -> None:
    x = torch.tensor([0.2, 0.5, 0.51, 0.9], requires_grad=True)
    y = round_straight_through(x)
    assert torch.equal(y, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    (y * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # identity backward


def test_task_loss_gradient_reaches_the_update_gate() -> None:
    torch.manual_seed(3)
    stack = zoo.build("skip_lstm", 5, 6, 2)
    y, _ = stack(torch.randn(3, 7, 5))
    (y * torch.randn_like(y)).sum().backward()
    for layer in stack.layers:
        assert layer.update_gate.weight.grad.abs().sum() > 0 and layer.update_gate.bias.grad.abs().sum() > 0


def test_budget_loss_is_lambda_times_the_updates_summed_over_time_averaged_over_the_batch() -> None:
    torch.manual_seed(4)
    stack = zoo.build("skip_lstm", 5, 6, 2, budget_weight=0.01).train()
    _set_update_gate(stack, None, -1.0)
    y, _ = stack(torch.randn(4, 9, 5))
    updates = [layer.last_updates for layer in stack.layers]  # (B, T) each
    budget = stack.regularization_loss()
    expected = sum(0.01 * u.sum() / 4 for u in updates)  # λ · Σ_t u_t, mean over the 4 streams, per layer
    torch.testing.assert_close(budget, expected)
    assert any(0 < u.mean() < 1 for u in updates)
    budget.backward()  # the budget alone trains the update gate, through the straight-through round
    assert all(layer.update_gate.bias.grad.abs().sum() > 0 for layer in stack.layers)
    assert stack.regularization_loss() is None  # handed over once: no autograd graph stays on the module
    copy.deepcopy(stack)  # (which weight averaging needs)
    # fraction of updated steps, averaged over layers
    torch.testing.assert_close(stack.statistics()["update_fraction"], torch.stack([u.mean() for u in updates]).mean())


def test_budget_loss_only_in_training_with_a_positive_weight() -> None:
    x = torch.randn(2, 5, 5)
    stack = zoo.build("skip_lstm", 5, 6, 1, budget_weight=0.5)
    stack.eval()(x)
    assert stack.regularization_loss() is None
    stack.train()(x)
    assert stack.regularization_loss() is not None
    unbudgeted = zoo.build("skip_lstm", 5, 6, 1).train()
    unbudgeted(x)
    assert unbudgeted.regularization_loss() is None
    assert "update_fraction" in unbudgeted.statistics()


def test_reset_stream_starts_with_an_update_like_a_fresh_one() -> None:
    # The zero state means ũ = 1; a reset zeroes the state, so the stream's first step after it always updates.
    torch.manual_seed(5)
    stack = zoo.build("skip_lstm", 5, 6, 1)
    _set_update_gate(stack, 0.0, -30.0)
    x = torch.randn(2, 6, 5)
    reset = torch.zeros(2, 6, dtype=torch.bool)
    reset[0, 3] = True
    stack(x, None, reset)
    assert stack.layers[0].last_updates.tolist() == [[1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
