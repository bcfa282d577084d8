"""The Mogrifier's window loops three ways on the CPU: the hand-written C++ loops (``zoo/csrc/mogrifier_window.cpp``),
their Python twins, and the Python twins compiled by inductor (``torch.compile``), side by side with ``nn.LSTM``.

The zoo's Mogrifier layer runs a window as one autograd Function whose forward and backward loops are written out
(``zoo/mogrifier.py``, ``_MogrifierWindow``): in C++ where ``zoo.native`` can build them, else as their Python twins.
If inductor's CPU code for the twins matched the C++, the C++ and the ``kernels`` extra could go: fewer hand-written
kernels to keep. This script measures it: one training step (forward over a window, backward, SGD update) of a stack
of ``--layers`` Mogrifier layers of ``--hidden`` units, with each of the three loop providers, timed in interleaved
rounds (median kept) beside ``nn.LSTM`` of the same depth, and each provider's first step (for inductor: compiling
the forward and the backward loop). Before timing, each provider's outputs and gradients are compared with the Python
twins' on the same small window. The C++ loops and the twins multiply by oneDNN's packed weights; inductor cannot
lower that op, so its window keeps the weights as plain tensors and inductor multiplies them its own way.

    python benchmarks/mogrifier_loops.py --batch 20 64 --bptt 35 --rounds 5 --out FILE

The loop provider is chosen inside the layer (``zoo.mogrifier._window_loops``), which has no setting for a compiled
provider, so this script swaps that function while a model runs its forward (the backward uses the loops its forward
saved).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")  # as benchmarks/cells.py, for the same reason

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import zoo  # noqa: E402
from benchmarks import output  # noqa: E402
from benchmarks.cells import TorchLSTM, measure  # noqa: E402
from zoo import mogrifier, native  # noqa: E402

NAME = "mogrifier_loops"


class _CompiledLoops:
    """The Python twins, each compiled once by inductor on first use (static shapes: one graph per window shape)."""

    mogrifier_window_forward = staticmethod(torch.compile(mogrifier._forward_loop, dynamic=False))
    mogrifier_window_backward = staticmethod(torch.compile(mogrifier._backward_loop, dynamic=False))


def providers() -> dict[str, Any]:
    """The loop providers to time: C++ (when it builds here), the Python twins, and the twins under inductor."""
    found = {"python": mogrifier._PythonLoops, "inductor": _CompiledLoops}
    cpp = native.ops()
    if cpp is not None:
        found = {"c++": cpp, **found}
    return found


@contextmanager
def loops_in_use(loops: Any) -> Iterator[None]:
    """``zoo.mogrifier`` picks ``loops`` for every window run meanwhile. Inductor cannot lower oneDNN's packed linear
    op (``mkldnn._linear_pointwise``: a LoweringException at 650 units), so for the compiled loops the window keeps its
    weights as plain tensors (no oneDNN packing), and inductor chooses how to multiply them."""
    chosen, onednn = mogrifier._window_loops, mogrifier._use_onednn
    mogrifier._window_loops = lambda: loops
    if loops is _CompiledLoops:
        mogrifier._use_onednn = lambda *args, **kwargs: False
    try:
        yield
    finally:
        mogrifier._window_loops, mogrifier._use_onednn = chosen, onednn


class WithLoops(nn.Module):
    """A Mogrifier stack whose windows run on the given loop provider."""

    def __init__(self, stack: nn.Module, loops: Any) -> None:
        super().__init__()
        self.stack = stack
        self.loops = loops

    def forward(self, x: Tensor) -> tuple[Tensor, Any]:
        with loops_in_use(self.loops):
            return self.stack(x)


def largest_difference(loops: Any, hidden: int, layers: int, batch: int, bptt: int) -> float:
    """The largest absolute difference between ``loops`` and the Python twins, over the outputs and every gradient of
    one window of a fresh model (the same weights and input for both)."""

    def run(provider: Any) -> list[Tensor]:
        torch.manual_seed(0)
        model = WithLoops(zoo.build("mogrifier", hidden, hidden, layers), provider).train()
        x = torch.randn(batch, bptt, hidden, requires_grad=True)
        y, _ = model(x)
        y.square().sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in model.parameters())]

    ours, twins = run(loops), run(mogrifier._PythonLoops)
    return max(float((a - b).abs().max()) for a, b in zip(ours, twins))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[20, 64])
    parser.add_argument("--bptt", nargs="+", type=int, default=[35])
    parser.add_argument("--hidden", type=int, default=650, help="input and hidden size (PTB medium: 650)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per model (median kept)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's)")
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hidden, layers = args.hidden, args.layers
    # Each provider against the Python twins on a small window (16 units, batch 3, 5 steps) first; one that fails
    # there (inductor cannot compile the loops) is reported and not timed.
    differences: dict[str, float] = {}
    failed: dict[str, str] = {}
    every = providers()
    for name, loops in every.items():
        try:
            differences[name] = largest_difference(loops, 16, 2, 3, 5)
        except Exception as error:  # noqa: BLE001 - what failed is the finding
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            print(f"# {name} loops failed on a small window: {failed[name]}")
    found = {name: loops for name, loops in every.items() if name in differences}
    builders: dict[str, Callable[[], nn.Module]] = {"nn.LSTM": lambda: TorchLSTM(hidden, hidden, layers)}
    for name, loops in found.items():
        builders[f"mogrifier ({name})"] = lambda loops=loops: WithLoops(
            zoo.build("mogrifier", hidden, hidden, layers), loops
        )

    print(f"# cpu ({torch.get_num_threads()} threads), torch {torch.__version__}, mogrifier {layers} x {hidden}")
    results = []
    for batch in args.batch:
        for bptt in args.bptt:
            seconds, first_step = measure(builders, batch, bptt, hidden, args.rounds, torch.device("cpu"))
            print(f"\n## batch {batch}, bptt {bptt}")
            print("| model | step ms | x nn.LSTM | x c++ loops | first step s | largest difference from the twins |")
            print("|---|---:|---:|---:|---:|---:|")
            cpp = seconds.get("mogrifier (c++)")
            for name, step in seconds.items():
                provider = name[len("mogrifier (") : -1] if name.startswith("mogrifier") else None
                row = {
                    "model": name,
                    "batch": batch,
                    "bptt": bptt,
                    "step_ms": step * 1e3,
                    "ratio_nn_lstm": seconds["nn.LSTM"] / step,
                    "ratio_cpp": cpp / step if cpp and provider else None,
                    "first_step_s": first_step[name],
                    "largest_difference": differences.get(provider) if provider else None,
                }
                results.append(row)
                print(
                    f"| {name} | {row['step_ms']:.1f} | {row['ratio_nn_lstm']:.2f} | "
                    f"{'' if row['ratio_cpp'] is None else format(row['ratio_cpp'], '.2f')} | "
                    f"{row['first_step_s']:.1f} | "
                    f"{'' if row['largest_difference'] is None else format(row['largest_difference'], '.1e')} |"
                )
            sys.stdout.flush()
    command = " ".join(["python", "benchmarks/mogrifier_loops.py", *(sys.argv[1:] if argv is None else argv)])
    header = {
        "command": command,
        "device": "cpu",
        "machine": output.hardware()["cpu"],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "provenance": output.provenance("cpu"),
    }
    output.write(path, {**header, "hidden": hidden, "layers": layers, "failed": failed, "results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
