"""The matmul fast paths of zoo.kernels against the plain PyTorch expressions they replace."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import fused_kernel_calls
from zoo import kernels, paths
from zoo.kernels import RecurrentMatmul, window_linear


@pytest.mark.parametrize("onednn", [False, True])
def test_window_linear_equals_linear_with_gradients(onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if onednn and not kernels._use_onednn(torch.ones(1)):
        pytest.skip("this PyTorch build has no working oneDNN packed linear")
    if onednn:  # oneDNN at a tiny size, where it normally steps aside
        monkeypatch.setattr(kernels, "ONEDNN_MIN_WEIGHT", 0)
    else:  # the plain route (GPU, float64, small weights, builds without oneDNN)
        monkeypatch.setattr(kernels, "_use_onednn", lambda x, numel=None: False)
    _check_window_linear(with_bias=True)
    _check_window_linear(with_bias=False)


def _check_window_linear(with_bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, requires_grad=True)
    w = torch.randn(11, 7, requires_grad=True)
    b = torch.randn(11, requires_grad=True) if with_bias else None
    leaves = (x, w, b) if with_bias else (x, w)
    grad = torch.randn(3, 5, 11)
    expected = F.linear(x, w, b)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    got = window_linear(x, w, b)
    torch.testing.assert_close(got, expected)
    assert all(step.is_contiguous() for step in got.unbind(1))  # what the per-step loop reads
    for g, e in zip(torch.autograd.grad(got, leaves, grad), expected_grads):
        torch.testing.assert_close(g, e)


def _recurrence(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, add: str, deferred: bool) -> torch.Tensor:
    """h_t = tanh(x_t + h_{t-1} W^T + b), with the recurrent product done plainly or by RecurrentMatmul.

    ``add`` says what RecurrentMatmul adds inside its product: ``"step"`` the step's ``x_t + b`` ``(B, O)``,
    ``"bias"`` the vector ``b`` ``(O,)`` (then ``x_t`` is added outside), ``"none"`` nothing.
    """
    matmul = RecurrentMatmul(weight, x.size(0), x.size(1)) if deferred else None
    h = x.new_zeros(x.size(0), weight.size(1))
    outputs = []
    for x_t in x.unbind(1):
        if matmul is None:
            pre = x_t + h @ weight.t() + bias
        elif add == "step":
            pre = matmul(h, add=x_t + bias)
        elif add == "bias":
            pre = x_t + matmul(h, add=bias)
        else:
            pre = x_t + matmul(h) + bias
        h = torch.tanh(pre)
        outputs.append(h)
    return torch.stack(outputs, 1)


@pytest.mark.parametrize("add", ["step", "bias", "none"])
@pytest.mark.parametrize("onednn", [False, True])
def test_recurrent_matmul_matches_autograd_values_and_gradients(
    onednn: bool, add: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if onednn:  # the per-step oneDNN product, which normally starts at large weights and needs two threads
        if not kernels._packed_linear_works():
            pytest.skip("this PyTorch build has no working oneDNN packed linear")
        monkeypatch.setattr(kernels, "ONEDNN_MIN_WEIGHT", 0)
        monkeypatch.setattr(kernels, "_use_onednn", lambda x, numel=None: x.dtype == torch.float32)
    torch.manual_seed(1)
    raw = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(2, 7, 6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    grad = torch.randn(2, 7, 6)
    leaves = (raw, x, bias)
    expected = _recurrence(raw * 0.5, x, bias, add, deferred=False)  # a non-leaf weight, as with weight drop
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    got = _recurrence(raw * 0.5, x, bias, add, deferred=True)
    assert (RecurrentMatmul(raw, 2, 7)._packed is not None) == onednn
    torch.testing.assert_close(got, expected)
    for g, e in zip(torch.autograd.grad(got, leaves, grad), expected_grads):
        torch.testing.assert_close(g, e)
    with torch.no_grad():
        torch.testing.assert_close(_recurrence(raw * 0.5, x, bias, add, deferred=True), expected)


@pytest.mark.parametrize("pack_transposed", [True, False])
def test_recurrent_matmul_input_grad_packed_or_on_the_transposed_view(pack_transposed: bool) -> None:
    """Both routes of the backward's product (a packed W^T, or oneDNN reading W.t() as it is) give grad @ W."""
    if not kernels._packed_linear_works():
        pytest.skip("this PyTorch build has no working oneDNN packed linear")
    torch.manual_seed(2)
    weight = torch.randn(640, 160)  # at the oneDNN size
    assert weight.numel() >= kernels.ONEDNN_MIN_WEIGHT
    matmul = RecurrentMatmul(weight, 4, 3, pack_transposed)
    grad = torch.randn(4, 640)
    torch.testing.assert_close(matmul.input_grad(grad), grad @ weight, rtol=1e-4, atol=1e-4)
    assert (matmul._packed_t is not None) == pack_transposed


def test_recurrent_matmul_must_be_called_once_per_step() -> None:
    weight = torch.randn(4, 4, requires_grad=True)
    matmul = RecurrentMatmul(weight, 2, 3)
    y = matmul(torch.randn(2, 4)) + matmul(torch.randn(2, 4))  # two of three steps
    with pytest.raises(RuntimeError, match="called 2 times in a window of 3 steps"):
        y.sum().backward()


@pytest.mark.parametrize("name", ["on_lstm", "mut1", "mogrifier"])
def test_a_trained_window_frees_its_recurrent_matmuls(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: the weight-gradient node once held its RecurrentMatmul strongly while the matmul held that node's
    # outputs, a cycle through autograd's C++ graph that Python's collector cannot free: every training window's
    # matmuls (packed weights included) stayed in memory, ~20 MB a window for a 3 x 400 ON-LSTM (23 GB in an epoch).
    import gc
    import weakref

    import zoo

    made: list[weakref.ref] = []
    build = RecurrentMatmul.__init__

    def spy(self, *args, **kwargs) -> None:
        build(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(RecurrentMatmul, "__init__", spy)
    stack = zoo.build(name, 8, 16, num_layers=2)
    state = None
    for _ in range(2):  # two windows, the state carried and detached as in training
        y, state = stack(torch.randn(3, 5, 8), state)
        y.sum().backward()
        state = tuple(s.detach() for s in state)
    assert made, "the per-step path made no RecurrentMatmul"
    del y, state
    gc.collect()
    assert [ref() for ref in made] == [None] * len(made)


def _gated_window(inp: torch.Tensor, x: torch.Tensor, bias, w_first, w_left, fused: bool) -> torch.Tensor:
    """y_t = 2 sigm(L (F inp_t) + b) * x_t over a window, by gated_product or by plain autograd ops.

    ``w_first``/``w_left`` may be ``None`` (that product left out); the gated vector is chained (x_{t+1} = y_t), as a
    Mogrifier round's output feeds the next round.
    """
    batch, steps = inp.shape[:2]
    first = RecurrentMatmul(w_first, batch, steps) if fused and w_first is not None else None
    left = RecurrentMatmul(w_left, batch, steps) if fused and w_left is not None else None
    outputs = []
    for inp_t in inp.unbind(1):
        if fused:
            x = kernels.gated_product(inp_t, x, first, left, bias)
        else:
            pre = inp_t if w_first is None else inp_t @ w_first.t()
            pre = pre if w_left is None else pre @ w_left.t()
            x = 2 * torch.sigmoid(pre if bias is None else pre + bias) * x
        outputs.append(x)
    return torch.stack(outputs, 1)


def test_gated_product_gradcheck_without_products() -> None:
    """The hand-written backward of the gate itself (no products: ``inp`` is the pre-activation), in float64."""
    torch.manual_seed(2)
    opts = {"dtype": torch.float64, "requires_grad": True}
    pre, x, b = torch.randn(3, 6, **opts), torch.randn(3, 6, **opts), torch.randn(6, **opts)
    assert torch.autograd.gradcheck(lambda p, v, c: kernels.gated_product(p, v, bias=c), (pre, x, b))
    assert torch.autograd.gradcheck(lambda p, v: kernels.gated_product(p, v), (pre, x))


@pytest.mark.parametrize(("first", "left", "bias"), [(True, True, False), (True, False, True), (False, True, True)])
def test_gated_product_matches_autograd_of_the_plain_formula(first: bool, left: bool, bias: bool) -> None:
    """With the products (whose weight gradients come once per window, so a graph runs backward once: no gradcheck),
    values and every gradient in float64 equal autograd's through 2 sigm(L F inp + b) * x, for several directions."""
    torch.manual_seed(2)
    opts = {"dtype": torch.float64, "requires_grad": True}
    inp = torch.randn(2, 4, 5 if first else 3, **opts)
    x = torch.randn(2, 6, **opts)
    b = torch.randn(6, **opts) if bias else None
    w_first = torch.randn(3 if left else 6, 5, **opts) if first else None
    w_left = torch.randn(6, 3, **opts) if left else None
    args = [a for a in (inp, x, b, w_first, w_left) if a is not None]
    expected = _gated_window(inp, x, b, w_first, w_left, fused=False)
    torch.testing.assert_close(_gated_window(inp, x, b, w_first, w_left, fused=True), expected)
    for _ in range(3):
        grad = torch.randn_like(expected)
        got = torch.autograd.grad(_gated_window(inp, x, b, w_first, w_left, fused=True), args, grad)
        for g, e in zip(got, torch.autograd.grad(expected, args, grad, retain_graph=True)):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_gated_product_through_onednn_matches_the_plain_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernels._use_onednn(torch.ones(1)):
        pytest.skip("this PyTorch build has no working oneDNN packed linear")
    monkeypatch.setattr(kernels, "ONEDNN_MIN_WEIGHT", 0)  # the packed per-step products at a tiny size
    torch.manual_seed(3)
    inp = torch.randn(2, 4, 5, requires_grad=True)
    x = torch.randn(2, 6, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    w_first = torch.randn(3, 5, requires_grad=True)
    w_left = torch.randn(6, 3, requires_grad=True)
    args = (inp, x, b, w_first, w_left)
    got = _gated_window(*args, fused=True)
    expected = _gated_window(*args, fused=False)
    assert RecurrentMatmul(w_first, 2, 4)._packed is not None
    torch.testing.assert_close(got, expected)
    grad = torch.randn_like(expected)
    for g, e in zip(torch.autograd.grad(got, args, grad), torch.autograd.grad(expected, args, grad)):
        torch.testing.assert_close(g, e)


# --------------------------------------------------------------------------------- the plain reference path
@pytest.mark.parametrize("name", __import__("zoo").names())
def test_every_architecture_fast_equals_the_plain_reference_path(name: str, zoo_settings) -> None:
    """``LM_ZOO_KERNELS=plain`` (plain autograd ops, no oneDNN private op, no C++, no fused nn.LSTM) against the
    default fast paths: the same outputs, state and gradients, in training mode with a mid-window reset and with
    none (where the fused kernels run)."""
    import zoo

    options = dict(zoo.preset(name, "tiny"))
    size, hidden = options.pop("input_size"), options.pop("hidden_size")
    options.pop("num_layers")
    torch.manual_seed(0)
    # Training mode, but no dropout between the layers: F.dropout draws its mask in memory order, and the fused
    # kernel's output is laid out otherwise than the per-step loop's, so the same seed would give other masks.
    stack = zoo.build(name, size, hidden, 2, **options).train()
    x = torch.randn(3, 8, size)
    reset = torch.zeros(3, 8, dtype=torch.bool)
    reset[2, 5] = True
    for window_reset in (None, reset):

        def run(plain: bool) -> tuple[torch.Tensor, ...]:
            zoo_settings(plain_kernels=plain)
            stack.zero_grad()
            torch.manual_seed(1)
            y, state = stack(x, reset=window_reset)
            (y.sin().sum() + sum(s.cos().sum() for s in state)).backward()
            return (y, *state, *(p.grad.clone() for p in stack.parameters()))

        for fast, plain in zip(run(False), run(True), strict=True):
            torch.testing.assert_close(fast, plain, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn_tanh"])
def test_packed_sentence_segments_equal_the_per_step_loop(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GBW's windows reset mid-window in some column nearly always; as packed segments they run the fused kernel
    (cuDNN on a GPU) and must compute what the per-step loop does: outputs, final state, every gradient."""
    import zoo
    from zoo.layers import FusedLayer

    torch.manual_seed(0)
    stack = zoo.build(name, 6, 7, 2).train()
    x = torch.randn(4, 9, 6, requires_grad=True)
    reset = torch.zeros(4, 9, dtype=torch.bool)
    reset[0, 3] = reset[0, 6] = reset[2, 8] = reset[1, 0] = True  # two cuts in one column, one at the last step
    carried = tuple(torch.randn(2, 4, 7) for _ in range(stack.layers[0].state_size))
    results = []
    for packed in (False, True):
        monkeypatch.setattr(FusedLayer, "packed_segments", packed)
        stack.zero_grad()
        x.grad = None
        y, state = stack(x, carried, reset)
        (y.sin().sum() + sum(s.cos().sum() for s in state)).backward()
        results.append([y, *state, x.grad.clone(), *(p.grad.clone() for p in stack.parameters())])
    for loop, packed in zip(*results, strict=True):
        torch.testing.assert_close(packed, loop, atol=2e-5, rtol=1e-4)


def test_packed_segments_are_for_cuda_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the packed kernel is PyTorch's native loop, slower than lm-zoo's (benchmarks/gbw_fused.py)."""
    import zoo
    from zoo.layers import FusedLayer

    stack = zoo.build("lstm", 4, 5, 1)
    monkeypatch.setattr(FusedLayer, "_segments", lambda *args: pytest.fail("packed segments ran on CPU"))
    reset = torch.zeros(2, 6, dtype=torch.bool)
    reset[0, 3] = True
    stack(torch.randn(2, 6, 4), reset=reset)


def test_the_fast_paths_self_checks_pass_when_first_run_under_autocast() -> None:
    """The feature tests of oneDNN's packed linear and of the C++ Mogrifier loops run once per process, at the first
    window; when that window ran under bf16 autocast they compared a bf16 product with a float32 one and turned the
    fast paths off for the whole process (with a warning that the C++ loops "compute other numbers")."""
    from zoo import mogrifier, native

    cpp = native.ops()
    if cpp is None:
        pytest.skip("no C++ toolchain here: the C++ loops are not built")
    checks = (kernels._packed_linear_works, lambda: mogrifier._usable(cpp))
    try:
        kernels._packed_linear_works.cache_clear()
        mogrifier._usable.cache_clear()
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("error")  # "the C++ Mogrifier loops are not used" would fail the test
            under_autocast = [check() for check in checks]
        kernels._packed_linear_works.cache_clear()
        mogrifier._usable.cache_clear()
        assert under_autocast == [check() for check in checks]
        assert under_autocast[1], "the C++ loops were refused"
    finally:
        kernels._packed_linear_works.cache_clear()
        mogrifier._usable.cache_clear()


def _layer_by_layer(stack: torch.nn.Module, x: torch.Tensor, state: tuple) -> tuple[torch.Tensor, tuple]:
    """The stack's per-layer path written out: each layer's fused kernel on the previous layer's output."""
    finals = []
    for index, layer in enumerate(stack.layers):
        x, final = layer._fused(x, tuple(s[index] for s in state))
        finals.append(final)
    return x, tuple(torch.stack(parts) for parts in zip(*finals))


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("steps", [1, 9])
def test_inference_runs_the_stack_as_one_kernel_call_bit_for_bit(name: str, steps: int) -> None:
    """Without gradients in eval mode on the CPU, a fused stack is one multi-layer nn.LSTM/GRU/RNN call over its own
    parameters (what makes a sampling step as cheap as a plain two-layer loop's): the same bits as layer by layer,
    no per-layer call, and the per-layer path whenever training or a gradient is on."""
    import zoo

    torch.manual_seed(0)
    stack = zoo.build(name, 6, 7, 3).eval()
    x = torch.randn(4, steps, 6)
    state = tuple(torch.randn(3, 4, 7) for _ in range(stack.layers[0].state_size))
    with fused_kernel_calls() as calls:
        with torch.no_grad():
            y, final = stack(x, state)
            assert not calls, "a layer's own kernel ran: the stack was not one call"
        calls.clear()
        stack(x, state)  # a gradient is on (dynamic evaluation): the per-layer path
        assert len(calls) == 3
        calls.clear()
        with torch.no_grad():
            stack.train()(x, state)
        assert len(calls) == 3
    with torch.no_grad():
        expected_y, expected_final = _layer_by_layer(stack.eval(), x, state)
    assert torch.equal(y, expected_y)
    assert len(final) == len(expected_final) and all(map(torch.equal, final, expected_final))


def test_the_one_call_follows_replaced_weights_and_skips_what_it_cannot_run() -> None:
    import zoo

    torch.manual_seed(0)
    stack = zoo.build("lstm", 5, 5, 2).eval()
    x = torch.randn(2, 3, 5)
    with torch.no_grad():
        before = stack(x)[0]
        replaced = {key: torch.randn_like(value) for key, value in stack.state_dict().items()}
        stack.load_state_dict(replaced, assign=True)  # new Parameter objects: the one call is built again over them
        after = stack(x)[0]
        zero = tuple(torch.zeros(2, 2, 5) for _ in range(2))
        assert torch.equal(after, _layer_by_layer(stack, x, zero)[0]) and not torch.equal(after, before)
        assert paths.window_path(stack, x, resets=False).stack == "merged"
        assert zoo.build("mogrifier", 5, 5, 2)._merged_kernel() is None  # not fused layers
        summed = zoo.build("lstm", 5, 5, 2, sum_layer_outputs=True).eval()
        assert paths.window_path(summed, x, resets=False).stack == "layers"
