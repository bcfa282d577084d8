"""The zoo against its equations, and its two implementations (fused kernel, per-step loop) against each other."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.errors import ConfigError

ARCHS = zoo.names()


def _pair(name: str, **options):
    """Two stacks with identical weights: one fused, one always per-step."""
    torch.manual_seed(0)
    fused = zoo.build(name, 5, 7, 2, **options)
    loop = zoo.build(name, 5, 7, 2, fused=False, **options)
    loop.load_state_dict(fused.state_dict())
    return fused, loop


def test_lstm_matches_equations_written_out() -> None:
    torch.manual_seed(0)
    stack = zoo.build("lstm", 3, 4, 1, fused=False)
    rnn = stack.layers[0].rnn
    W_ih, W_hh = rnn.weight_ih_l0, rnn.weight_hh_l0
    b = rnn.bias_ih_l0 + rnn.bias_hh_l0
    x = torch.randn(2, 5, 3)
    h = torch.zeros(2, 4)
    c = torch.zeros(2, 4)
    expected = []
    for t in range(5):
        z = x[:, t] @ W_ih.T + h @ W_hh.T + b
        i = torch.sigmoid(z[:, 0:4])
        f = torch.sigmoid(z[:, 4:8])
        g = torch.tanh(z[:, 8:12])
        o = torch.sigmoid(z[:, 12:16])
        c = f * c + i * g
        h = o * torch.tanh(c)
        expected.append(h)
    y, (h_n, c_n) = stack(x)
    torch.testing.assert_close(y, torch.stack(expected, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(c_n[0], c, atol=1e-6, rtol=0)


def test_gru_matches_equations_written_out() -> None:
    torch.manual_seed(0)
    stack = zoo.build("gru", 3, 4, 1, fused=False)
    rnn = stack.layers[0].rnn
    W_ih, W_hh = rnn.weight_ih_l0, rnn.weight_hh_l0
    b_ih, b_hh = rnn.bias_ih_l0, rnn.bias_hh_l0
    x = torch.randn(2, 5, 3)
    h = torch.zeros(2, 4)
    expected = []
    for t in range(5):
        gx = x[:, t] @ W_ih.T + b_ih
        gh = h @ W_hh.T + b_hh
        r = torch.sigmoid(gx[:, 0:4] + gh[:, 0:4])
        z = torch.sigmoid(gx[:, 4:8] + gh[:, 4:8])
        n = torch.tanh(gx[:, 8:12] + r * gh[:, 8:12])
        h = (1 - z) * n + z * h
        expected.append(h)
    y, _ = stack(x)
    torch.testing.assert_close(y, torch.stack(expected, 1), atol=1e-6, rtol=0)


def test_tanh_rnn_matches_equation_written_out() -> None:
    torch.manual_seed(0)
    stack = zoo.build("rnn_tanh", 3, 4, 1, fused=False)
    rnn = stack.layers[0].rnn
    x = torch.randn(2, 5, 3)
    h = torch.zeros(2, 4)
    expected = []
    for t in range(5):
        h = torch.tanh(x[:, t] @ rnn.weight_ih_l0.T + rnn.bias_ih_l0 + h @ rnn.weight_hh_l0.T + rnn.bias_hh_l0)
        expected.append(h)
    torch.testing.assert_close(stack(x)[0], torch.stack(expected, 1), atol=1e-6, rtol=0)


FUSED_ARCHS = [name for name in ARCHS if "fused" in zoo.get(name).options()]  # the others only have the loop


@pytest.mark.parametrize("name", FUSED_ARCHS)
def test_fused_equals_per_step_outputs_states_and_gradients(name: str) -> None:
    fused, loop = _pair(name)
    x = torch.randn(3, 6, 5)
    state = tuple(torch.randn_like(s) for s in fused.initial_state(3, x))
    y_f, s_f = fused(x, state)
    y_l, s_l = loop(x, state)
    torch.testing.assert_close(y_f, y_l, atol=1e-6, rtol=1e-5)
    for a, b in zip(s_f, s_l):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    (y_f.sum() + sum(s.sum() for s in s_f)).backward()
    (y_l.sum() + sum(s.sum() for s in s_l)).backward()
    for (n, p_f), p_l in zip(fused.named_parameters(), loop.parameters()):
        assert p_f.grad is not None and p_l.grad is not None, n
        torch.testing.assert_close(p_f.grad, p_l.grad, atol=1e-5, rtol=1e-4, msg=n)


def _variants(names: list[str]) -> list[tuple[str, dict]]:
    """Every architecture, and for those with a fused kernel also the always-per-step variant."""
    out = []
    for name in names:
        out.append((name, {}))
        if "fused" in zoo.get(name).options():
            out.append((name, {"fused": False}))
    return out


VARIANTS = _variants(ARCHS)
VARIANT_IDS = [name + ("-loop" if options else "") for name, options in VARIANTS]


def _random_state(stack, batch: int, x: torch.Tensor):
    return tuple(torch.rand_like(s) * 0.5 for s in stack.initial_state(batch, x))


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_reset_mid_window_equals_fresh_start(name: str, options: dict) -> None:
    torch.manual_seed(1)
    stack = zoo.build(name, 5, 8, 2, **options)
    x = torch.randn(3, 8, 5)
    state = _random_state(stack, 3, x)
    reset = torch.zeros(3, 8, dtype=torch.bool)
    reset[1, 4] = True  # stream 1 starts a new sequence at step 4
    y, final = stack(x, state, reset)
    fresh, fresh_final = stack(x[1:2, 4:])  # the same stream from step 4 with a zero state
    torch.testing.assert_close(y[1:2, 4:], fresh, atol=1e-6, rtol=1e-5)
    for a, b in zip(final, fresh_final):
        torch.testing.assert_close(a[:, 1:2], b, atol=1e-6, rtol=1e-5)
    # the other streams did not notice
    unreset, _ = stack(x, state)
    torch.testing.assert_close(y[[0, 2]], unreset[[0, 2]], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y[1, :4], unreset[1, :4], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ARCHS)
def test_reset_at_first_step_zeroes_incoming_state(name: str) -> None:
    stack = zoo.build(name, 5, 8, 2)
    x = torch.randn(2, 4, 5)
    state = _random_state(stack, 2, x)
    reset = torch.zeros(2, 4, dtype=torch.bool)
    reset[:, 0] = True
    torch.testing.assert_close(stack(x, state, reset)[0], stack(x)[0])


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_carried_state_equals_one_pass(name: str, num_layers: int) -> None:
    stack = zoo.build(name, 5, 8, num_layers)
    x = torch.randn(2, 9, 5)
    whole, whole_state = stack(x)
    assert whole.shape == (2, 9, 8)
    assert all(s.size(0) == num_layers and s.size(1) == 2 for s in whole_state)
    first, state = stack(x[:, :4])
    second, state = stack(x[:, 4:], zoo.detach_state(state))
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-6, rtol=1e-5)
    for a, b in zip(state, whole_state):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_gradients_reach_every_parameter(name: str, options: dict) -> None:
    torch.manual_seed(2)
    stack = zoo.build(name, 5, 8, 2, **options)
    x = torch.randn(3, 6, 5)
    y, state = stack(x, _random_state(stack, 3, x))
    loss = (y * torch.randn_like(y)).sum()
    extra = stack.regularization_loss()
    (loss if extra is None else loss + extra).backward()
    for parameter_name, p in stack.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: {parameter_name} gets no gradient"


@pytest.mark.parametrize("name", ARCHS)
def test_recurrent_regularisers_are_off_in_eval_and_on_in_training(name: str) -> None:
    torch.manual_seed(3)
    plain = zoo.build(name, 5, 8, 2)
    options = {"dropout": 0.5, "locked_dropout": True, "state_dropout": 0.5, "weight_drop": 0.5}
    regularised = zoo.build(name, 5, 8, 2, **options)
    regularised.load_state_dict(plain.state_dict())
    x = torch.randn(3, 6, 5)
    before = {k: v.clone() for k, v in regularised.state_dict().items()}
    torch.testing.assert_close(regularised.eval()(x)[0], plain.eval()(x)[0])
    y, _ = regularised.train()(x)
    assert not torch.allclose(y, plain(x)[0])
    y.sum().backward()
    assert all(p.grad is not None for p in regularised.parameters())
    for key, value in regularised.state_dict().items():  # weight drop never edits the parameters themselves
        torch.testing.assert_close(value, before[key], msg=key)


def test_weight_drop_is_dropconnect_on_the_hidden_to_hidden_matrix() -> None:
    # DropConnect (Merity et al. 2017): the same window through an LSTM whose W_hh is W_hh * mask / (1 - p).
    torch.manual_seed(4)
    stack = zoo.build("lstm", 3, 4, 1, weight_drop=0.5).train()
    x = torch.randn(2, 5, 3)
    torch.manual_seed(5)
    y, _ = stack(x)
    torch.manual_seed(5)  # the same draw, as a mask on a tensor of ones
    w_hh = stack.layers[0].rnn.weight_hh_l0
    dropped = w_hh * torch.nn.functional.dropout(torch.ones_like(w_hh), 0.5)
    reference = zoo.build("lstm", 3, 4, 1).eval()
    reference.load_state_dict(stack.state_dict())
    with torch.no_grad():
        reference.layers[0].rnn.weight_hh_l0.copy_(dropped)
    torch.testing.assert_close(y, reference(x)[0])
    assert (dropped == 0).any() and not torch.equal(y, stack.eval()(x)[0])


def test_locked_dropout_uses_one_mask_per_sequence() -> None:
    stack = zoo.build("rnn_tanh", 4, 64, 2, dropout=0.5, locked_dropout=True).train()
    layer_output = torch.ones(2, 7, 64)
    dropped = stack._between_layers(layer_output)
    assert torch.equal(dropped, dropped[:, :1].expand_as(dropped))  # the same units are zero at every step
    assert 0 < (dropped == 0).float().mean() < 1


@pytest.mark.parametrize("forget_bias", [1.0, 2.5])
def test_lstm_forget_bias_is_counted_once(forget_bias: float) -> None:
    # PyTorch sums bias_ih and bias_hh: the *effective* forget bias must be the configured value (pytorch#750).
    stack = zoo.build("lstm", 4, 6, 3, forget_bias=forget_bias, init_range=0.1)
    for layer in range(3):
        rnn = stack.layers[layer].rnn
        effective = rnn.bias_ih_l0 + rnn.bias_hh_l0
        torch.testing.assert_close(effective[6:12], torch.full((6,), forget_bias))
        assert effective[:6].abs().max() <= 0.2  # the other gates keep the uniform init


def test_lstm_forget_bias_none_keeps_init() -> None:
    torch.manual_seed(0)
    stack = zoo.build("lstm", 4, 6, 1, forget_bias=None, init_range=0.1)
    assert stack.layers[0].rnn.bias_hh_l0[6:12].abs().max() > 0
    assert all(p.abs().max() <= 0.1 for p in stack.parameters())


def test_unknown_architecture_and_option_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown architecture 'lstmx'.*lstm"):
        zoo.build("lstmx", 4, 4)
    with pytest.raises(ConfigError, match="no option 'forget_gate'"):
        zoo.build("lstm", 4, 4, forget_gate=1.0)


@pytest.mark.parametrize("name", ARCHS)
def test_presets_build_and_run(name: str) -> None:
    presets = zoo.get(name).presets
    assert "tiny" in presets and len(presets) >= 2, "every architecture has a tiny and a paper-size preset"
    stack = zoo.build(name, **zoo.preset(name, "tiny"))
    y, _ = stack(torch.randn(2, 3, zoo.preset(name, "tiny")["input_size"]))
    assert y.shape == (2, 3, 16)


# ------------------------------------------------------------ sum_layer_outputs (lamb's lstm_skip_connection)
@pytest.mark.parametrize("name", ARCHS)
def test_sum_layer_outputs_is_the_sum_of_each_layers_output(name: str) -> None:
    """lamb's SkipMultiRNNCell: ``output = Σ_l h^l``, each layer's output before the dropout between layers, the
    layers run one after another as usual. Written out here layer by layer through the layers themselves."""
    options = {**zoo.preset(name, "tiny"), "num_layers": 3}
    torch.manual_seed(0)
    summed = zoo.build(name, **options, sum_layer_outputs=True).double().eval()
    plain = zoo.build(name, **options).double().eval()
    plain.load_state_dict(summed.state_dict())
    x = torch.randn(2, 5, options["input_size"], dtype=torch.float64)
    y, state = summed(x)
    y_last, state_plain = plain(x)
    layer_input, expected = x, torch.zeros_like(y)
    zeros = summed.initial_state(2, x)
    for index, layer in enumerate(summed.layers):
        layer_input, _ = layer(layer_input, tuple(s[index] for s in zeros), {}, None)
        expected = expected + layer_input
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y_last, layer_input, rtol=1e-10, atol=1e-10)  # off: the last layer's, as before
    for a, b in zip(state, state_plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the state does not change


def test_units_for_budget_is_the_largest_size_within_the_budget() -> None:
    def lstm_parameters(units: int) -> int:
        return sum(p.numel() for p in zoo.build("lstm", 10, units, 2).parameters())

    units = zoo.units_for_budget(lstm_parameters, 50_000)
    assert lstm_parameters(units) <= 50_000 < lstm_parameters(units + 1)
    with pytest.raises(ConfigError, match="too small for a 2-layer lstm"):
        zoo.units_for_budget(lstm_parameters, 10, what="a 2-layer lstm")
