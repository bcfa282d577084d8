"""The C++ window loops of the Mogrifier (zoo/csrc) against their Python twins, and the fallback when they cannot be
built. The window kernel as a whole is held to the per-step autograd path in tests/test_mogrifier.py."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import zoo
from zoo import mogrifier, native
from zoo.kernels import ONEDNN_MIN_WEIGHT, RecurrentMatmul

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture()
def cpp():
    if native.disabled():
        pytest.skip("LM_ZOO_CPP=0")
    ops = native.ops()
    assert ops is not None, "a C++ compiler is here, so the kernels must build"
    return ops


def _window_inputs(rounds: int, rank: int, bias: bool, masks: bool, width: int = 0, dtype=torch.float64) -> dict:
    """Random inputs of the window loops, as _MogrifierWindow passes them (m != n unless ``width`` sets both)."""
    torch.manual_seed(rounds * 10 + rank)
    m, n = (width, width) if width else (5, 7)
    batch, steps = 3, 6

    def rand(*shape: int) -> torch.Tensor:  # at width 160, weights of its scale keep the gradients O(1)
        return torch.randn(*shape, dtype=dtype) * (width**-0.5 if width else 0.5)

    firsts, lefts, biases = [], [], []
    for i in range(1, rounds + 1):
        out, inp = (m, n) if i % 2 else (n, m)
        firsts.append(rand(rank, inp) if rank > 0 else rand(out, inp))
        lefts.append(rand(out, rank) if rank > 0 else None)
        biases.append(rand(out) if bias else None)
    keep = [None] * steps
    if masks:
        keep[2] = torch.tensor([1.0, 0.0, 1.0], dtype=dtype)
        keep[4] = torch.tensor([0.0, 1.0, 1.0], dtype=dtype)
    return {
        "x": rand(batch, steps, m),
        "h0": rand(batch, n),
        "c0": rand(n, batch).t(),  # a state need not be contiguous
        "keep": keep,
        "state_mask": (torch.rand(batch, n) > 0.3).to(dtype) / 0.7 if masks else None,
        "weight_x": rand(4 * n, m),
        "weight_h": rand(4 * n, n),
        "bias": rand(4 * n),
        "firsts": firsts,
        "lefts": lefts,
        "biases": biases,
    }


def _run(loops, inputs: dict, products: tuple[RecurrentMatmul, RecurrentMatmul] | None = None) -> list[torch.Tensor]:
    """Forward then backward through ``loops``; every output and saved tensor, flat."""
    rounds = (inputs["firsts"], inputs["lefts"], inputs["biases"])
    if products is None:
        forward_operands = (inputs["weight_x"], inputs["weight_h"], False)
        backward_operands = (inputs["weight_x"], inputs["weight_h"], False)
    else:
        (weight_x, packed), (weight_h, _) = (p.forward_operand() for p in products)
        (operand_x, onednn), (operand_h, _) = (p.input_grad_operand() for p in products)
        forward_operands, backward_operands = (weight_x, weight_h, packed), (operand_x, operand_h, onednn)
    y, h, c, saved = loops.mogrifier_window_forward(
        inputs["x"], inputs["h0"], inputs["c0"], inputs["keep"], inputs["state_mask"], *forward_operands,
        inputs["bias"], *rounds,
    )  # fmt: skip
    torch.manual_seed(99)
    # Incoming gradients as autograd hands them over: a transposed view, and the expanded ones of a sum.
    grad_y = torch.randn(y.size(1), y.size(0), y.size(2), dtype=y.dtype).transpose(0, 1)
    grad_h, grad_c = torch.randn_like(h), torch.ones((), dtype=c.dtype).expand_as(c)
    grads = loops.mogrifier_window_backward(
        saved, grad_y, grad_h, grad_c, inputs["keep"], inputs["state_mask"], *backward_operands, *rounds
    )
    return [y, h, c, *saved, *grads]


@pytest.mark.parametrize("rounds", [1, 2, 5])
@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("bias, masks", [(False, False), (True, True)], ids=["plain", "bias-resets-state-dropout"])
def test_cpp_loops_equal_their_python_twins_in_float64(cpp, rounds: int, rank: int, bias: bool, masks: bool) -> None:
    inputs = _window_inputs(rounds, rank, bias, masks)
    cpp_results, python_results = _run(cpp, inputs), _run(mogrifier._PythonLoops, inputs)
    assert len(cpp_results) == len(python_results)
    for a, b in zip(cpp_results, python_results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ATen ops in the same order


@pytest.mark.slow
def test_cpp_loops_equal_their_python_twins_through_onednn_in_float32(cpp) -> None:
    width = 160  # W_x, W_h take oneDNN's packed route
    assert 4 * width * width >= ONEDNN_MIN_WEIGHT
    for pack_transposed in (False, True):  # the backward reads W's transposed view, or W^T packed
        inputs = _window_inputs(5, 40, True, True, width=width, dtype=torch.float32)
        products = tuple(RecurrentMatmul(inputs[k], 3, 6, pack_transposed) for k in ("weight_x", "weight_h"))
        assert products[0].forward_operand()[1] and products[0].input_grad_operand()[1]
        for a, b in zip(_run(cpp, inputs, products), _run(mogrifier._PythonLoops, inputs, products), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_the_kernels_build_where_a_compiler_exists(cpp) -> None:
    assert mogrifier._window_loops() is cpp  # the Mogrifier runs them


def test_lm_zoo_cpp_0_runs_the_python_loops(zoo_settings) -> None:
    zoo_settings(cpp_kernels=False)
    native.ops.cache_clear()
    try:
        assert native.ops() is None and mogrifier._window_loops() is mogrifier._PythonLoops
        stack = zoo.build("mogrifier", 5, 7, 1)
        y, _ = stack(torch.randn(2, 3, 5))
        y.sum().backward()
        assert all(p.grad is not None for p in stack.parameters())
    finally:
        native.ops.cache_clear()


@pytest.mark.skipif(not HAS_COMPILER, reason="needs a compiler to fail on a real compile error")
def test_a_failed_build_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, zoo_settings
) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(native, "SOURCES", [broken])
    monkeypatch.setattr(native, "NAME", "lm_zoo_broken_test")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    zoo_settings(cpp_kernels=True)
    native.ops.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"C\+\+ kernels could not be built \(.+\); the Mogrifier runs its Python"):
            assert native.ops() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.ops() is None  # cached: no second attempt, no second warning
            assert mogrifier._window_loops() is mogrifier._PythonLoops
    finally:
        native.ops.cache_clear()


# ----------------------------------------------------------------------- the C++ loops are feature-tested
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_the_built_loops_agree_with_the_python_twins() -> None:
    from zoo import mogrifier

    assert mogrifier._loops_agree(native.ops())


class _ChangedSignature:
    """What a PyTorch release that changed oneDNN's private op would make of the C++ loops: a call that fails."""

    @staticmethod
    def mogrifier_window_forward(*args):  # noqa: ANN002, ANN205
        raise RuntimeError("Expected 6 arguments for mkldnn::_linear_pointwise, got 5")


class _OtherNumbers:
    """C++ loops that run but compute something else (here: the Python forward, off by one in its output)."""

    @staticmethod
    def mogrifier_window_forward(*args):  # noqa: ANN002, ANN205
        from zoo.mogrifier import _forward_loop

        y, h, c, saved = _forward_loop(*args)
        return y + 1, h, c, saved

    @staticmethod
    def mogrifier_window_backward(*args):  # noqa: ANN002, ANN205
        from zoo.mogrifier import _backward_loop

        return _backward_loop(*args)


@pytest.mark.parametrize(
    ("loops", "reason"), [(_ChangedSignature, "fail on a small window"), (_OtherNumbers, "other numbers")]
)
def test_loops_that_fail_or_disagree_fall_back_to_python(
    loops: type, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zoo import mogrifier

    monkeypatch.setattr(native, "ops", lambda: loops)
    try:
        with pytest.warns(UserWarning, match=f"C\\+\\+ Mogrifier loops are not used: .*{reason}"):
            assert mogrifier._window_loops() is mogrifier._PythonLoops
        # ...and a Mogrifier trains on them.
        stack = zoo.build("mogrifier", 4, 6, 1, rounds=2, rank=0)
        y, _ = stack(torch.randn(2, 3, 4))
        y.sum().backward()
    finally:
        mogrifier._usable.cache_clear()


def test_the_feature_checks_leave_the_random_stream_alone() -> None:
    """They run at a model's first window, after the user seeded: drawing from the global generator would change the
    dropout masks of that window, and a run would depend on whether the checks had run before."""
    from zoo import kernels

    torch.manual_seed(1)
    expected = torch.rand(4)
    kernels._packed_linear_works.cache_clear()
    mogrifier._usable.cache_clear()
    torch.manual_seed(1)
    assert kernels._packed_linear_works() in (True, False)
    mogrifier._window_loops()
    assert torch.equal(torch.rand(4), expected)
