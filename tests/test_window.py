"""The captured-window path (zoo/window.py) where it can be checked without a GPU: what the graph runs equals the
plain path, and what decides whether a window is captured. The captures themselves are the GPU suite's
(tests/test_gpu.py)."""

from __future__ import annotations

import copy
import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch

import zoo
from tests.conftest import tiny_stack
from zoo import paths, settings, window
from zoo.state import Resets


def _grads(stack: torch.nn.Module, y: torch.Tensor, state: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    stack.zero_grad()
    loss = y.sin().sum() + sum(s.cos().sum() for s in state)
    extra = stack.regularization_loss()
    (loss if extra is None else loss + extra).backward()
    return [y, *state, *(p.grad for p in stack.parameters() if p.grad is not None)]


@pytest.mark.parametrize("name", zoo.names())
def test_a_keep_mask_at_every_step_equals_the_resets_where_they_fall(name: str) -> None:
    # What a graph runs (resets as a mask multiplied in at every step, no host decision) against the plain path, which
    # masks only at the steps where some stream resets. A keep of 1 multiplies exactly, so the forward is bit for bit;
    # the extra nodes can change the order in which autograd sums a state's gradient, so gradients to rounding.
    stack, size = tiny_stack(name)
    stack.train()
    x = torch.randn(3, 7, size)
    state = tuple(s + torch.randn_like(s) for s in stack.initial_state(3, x))
    reset = torch.zeros(3, 7, dtype=torch.bool)
    reset[1, 4] = True
    reset[2, 0] = True
    with settings.overridden(plain_kernels=True):  # a cell's fast kernels take the same keep masks as the loop
        torch.manual_seed(1)
        plain = [t.clone() for t in _grads(stack, *stack(x, state, reset=Resets.from_mask(reset)))]
        torch.manual_seed(1)
        masked = _grads(stack, *stack.run_layers(x, state, window.keep_mask(reset, x.dtype)))
    assert len(plain) == len(masked)
    assert torch.equal(plain[0], masked[0])
    for a, b in zip(plain, masked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _on(device: str) -> SimpleNamespace:
    """What :func:`zoo.paths.window_path` reads of a window's input (its device), without the device itself."""
    return SimpleNamespace(device=torch.device(device))


def _captured(stack: torch.nn.Module, x: SimpleNamespace) -> bool:
    return paths.window_path(stack, x, resets=False).stack == "captured"


def test_training_windows_on_cuda_are_captured_unless_switched_off() -> None:
    stack, _ = tiny_stack("mogrifier")
    assert _captured(stack.train(), _on("cuda"))
    assert not _captured(stack, _on("cpu"))
    assert not _captured(stack.eval(), _on("cuda"))
    stack.train()
    with torch.no_grad():
        assert not _captured(stack, _on("cuda"))
    with settings.overridden(window_graphs=False):
        assert not _captured(stack, _on("cuda"))
    with settings.overridden(plain_kernels=True):
        assert not _captured(stack, _on("cuda"))
    assert settings.from_environment({"LM_ZOO_WINDOW_GRAPHS": "0"}).window_graphs is False
    assert settings.from_environment({}).window_graphs is True


def test_stacks_on_cudnn_are_not_captured() -> None:
    # nn.LSTM/nn.GRU layers already run one kernel a window; with fused=False they run the per-step loop, captured.
    assert not _captured(zoo.build("lstm", 4, 4, 2).train(), _on("cuda"))
    assert _captured(zoo.build("lstm", 4, 4, 2, fused=False).train(), _on("cuda"))


def test_a_copy_of_a_stack_starts_without_graphs() -> None:
    stack, _ = tiny_stack("on_lstm")
    graphs = stack._window_graphs()
    graphs.failed[("a signature",)] = "refused"
    for copied in (copy.deepcopy(stack), pickle.loads(pickle.dumps(stack))):
        assert copied._window_graphs() is not graphs
        assert not copied._window_graphs().failed


def test_the_summary_line_says_how_windows_run_and_counts_captures_and_failures() -> None:
    stack, size = tiny_stack("on_lstm")
    model = torch.nn.Sequential(stack)
    assert window.summary(model) is None  # no training window yet
    stack.train()(torch.randn(2, 3, size))
    assert window.summary(model) == "training windows run layer by layer (layers: per-step, per-step)"  # the CPU
    graphs = stack._window_graphs()
    graphs.graphs[("a",)] = window._Graph(run=lambda *a: a, state_size=2, has_regularization=False, capture_seconds=0.5)
    graphs.graphs[("b",)] = window._Graph(
        run=lambda *a: a, state_size=2, has_regularization=False, capture_seconds=0.25
    )
    assert window.summary(model).endswith("; 2 window shape(s) captured in 0.75 s")
    graphs.failed[("c",)] = "RuntimeError: refused"
    assert window.summary(model).endswith("; 1 could not be and run eagerly (warned above)")


def test_windows_of_new_shapes_past_the_graph_limit_say_so_once_and_are_counted() -> None:
    """Past MAX_GRAPHS captured shapes a new one runs the plain path: one warning for the first, a count in the
    summary for all (variable BPTT without rounding meets many lengths)."""
    stack, size = tiny_stack("on_lstm")
    graphs = stack._window_graphs()
    for index in range(window.MAX_GRAPHS):
        graphs.graphs[(index,)] = window._Graph(lambda *a: a, 2, False, 0.1)
    state = tuple(torch.zeros(2, 3, 4) for _ in range(2))
    with pytest.warns(UserWarning, match=f"after {window.MAX_GRAPHS} captured ones runs eagerly"):
        assert graphs.run(stack, torch.randn(3, 5, size), state, None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphs.run(stack, torch.randn(3, 6, size), state, None) is None  # said once
        assert graphs.run(stack, torch.randn(3, 6, size), state, None) is None  # the same shape, counted once
    stack.train()(torch.randn(3, 5, size))  # a training window on the CPU: the summary says how it ran
    assert window.summary(torch.nn.Sequential(stack)).endswith(
        f"; 2 more past the limit of {window.MAX_GRAPHS} run eagerly"
    )


def test_a_replayed_window_reports_its_own_statistics_and_a_plain_one_its_layers() -> None:
    """Skip RNN's update fraction is an output of the window's graph: after a replay the stack reports the replayed
    window's (a layer keeps the tensor of its graph's capture, which the replay of another shape's graph leaves
    stale), and after a window on the plain path, the layers' own."""
    stack, size = tiny_stack("skip_lstm")
    stack.train()
    x = torch.randn(3, 5, size)
    y, state = stack(x)
    plain = stack.statistics()["update_fraction"]
    graphs = stack._window_graphs()
    key = window._signature(stack, (x, *state), False)
    replayed = torch.tensor(0.125)
    graphs.graphs[key] = window._Graph(lambda *a: (y, *state, replayed), len(state), False, 0.1, ("update_fraction",))
    graphs.run(stack, x, state, None)
    assert stack.statistics() == {"update_fraction": replayed}
    stack(x)  # the plain path (on the CPU nothing is captured)
    torch.testing.assert_close(stack.statistics()["update_fraction"], plain)
