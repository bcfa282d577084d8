"""Where a per-step cell's training step spends its time on a GPU: its kernels, counted and timed by kind.

For each ``--arch``, one training step as ``benchmarks/cells.py`` times it (forward over a window, backward, SGD update;
``--layers`` x ``--hidden``; BPTT ``--bptt``) is profiled with ``torch.profiler`` on the eager path
(``LM_ZOO_WINDOW_GRAPHS=0``): every CUDA kernel it ran, sorted into matrix products, pointwise and reduction kernels,
copies and fills, and the rest, with how many of each and their summed GPU time. Beside it, the median time of the same
step as the default path runs it, the window captured as a CUDA graph (``zoo/window.py``), and of ``nn.LSTM``'s.

A captured step replays those kernels back to back, so its time is their GPU time and the gaps between them: where the
two are close, what keeps the cell below cuDNN's ``nn.LSTM`` is its own arithmetic, so many kernels this short, and not
the host launching them. ::

    python benchmarks/cell_profile.py --device cuda --arch mogrifier fs_rnn lstm_no_forget --batch 20 64
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import zoo  # noqa: E402
from benchmarks import output  # noqa: E402
from benchmarks.cells import TorchLSTM, lstm_cells_per_layer, measure, training_step  # noqa: E402

NAME = "cell_profile"

#: Kernel kinds by name, first match wins: cuBLAS's and CUTLASS's products (``nvjet``, ``sm90_xmma``, ``gemm``,
#: ``cutlass``), PyTorch's and Triton's pointwise and reduction kernels, copies and fills.
KINDS = (
    ("matrix products", re.compile(r"gemm|nvjet|cutlass|xmma|sm\d+_|cublas|dot_kernel", re.I)),
    ("reductions", re.compile(r"reduce|triton_red|softmax|norm|sum_kernel", re.I)),
    ("copies and fills", re.compile(r"copy|memcpy|memset|fill|cat|stack|index|gather|scatter", re.I)),
    ("pointwise", re.compile(r"elementwise|vectorized|unrolled|triton_poi|pointwise|launch_kernel", re.I)),
)


def kind_of(kernel: str) -> str:
    """The kind of a CUDA kernel, by its name (:data:`KINDS`); ``other`` if none matches."""
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "other")


def kernels_of_one_step(step: object) -> tuple[Counter[str], Counter[str]]:
    """Run ``step`` once under the profiler: how many CUDA kernels of each kind it ran, and their GPU microseconds."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()  # type: ignore[operator]
        torch.cuda.synchronize()
    counts: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kind_of(event.name)
            counts[kind] += 1
            micros[kind] += event.time_range.elapsed_us()
    return counts, micros


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["mogrifier", "fs_rnn"])
    parser.add_argument("--batch", nargs="+", type=int, default=[20, 64])
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--hidden", type=int, default=650)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per path (median kept)")
    parser.add_argument("--device", default="cuda")
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        output.fail("profiles CUDA kernels: run it with --device cuda on a machine with a GPU")
    path = output.output_path(args, NAME)
    device = torch.device(args.device)
    hidden, layers = args.hidden, args.layers
    results = []
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, {layers} x {hidden}, BPTT {args.bptt}")
    for batch in args.batch:
        x = torch.randn(batch, args.bptt, hidden, device=device)
        direction = torch.randn_like(x)
        for name in args.arch:
            depth = layers * lstm_cells_per_layer(zoo.build(name, 8, 8, layers))
            model = zoo.build(name, hidden, hidden, layers).to(device).train()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            eager = training_step(model, x, direction, optimizer, eager=True)
            eager()  # warm-up
            counts, micros = kernels_of_one_step(eager)
            builders = {"graphed": lambda name=name: zoo.build(name, hidden, hidden, layers)}
            builders["nn.LSTM"] = lambda: TorchLSTM(hidden, hidden, depth)
            seconds, first = measure(builders, batch, args.bptt, hidden, args.rounds, device)
            row = {
                "arch": name,
                "batch": batch,
                "bptt": args.bptt,
                "lstm_layers": depth,
                "kernels": dict(counts),
                "kernel_ms": {kind: us / 1e3 for kind, us in micros.items()},
                "kernel_ms_total": sum(micros.values()) / 1e3,
                "graphed_step_ms": seconds["graphed"] * 1e3,
                "nn_lstm_step_ms": seconds["nn.LSTM"] * 1e3,
                "capture_s": first["graphed"],
            }
            results.append(row)
            kinds = ", ".join(
                f"{kind} {counts[kind]} ({micros[kind] / 1e3:.2f} ms)" for kind in sorted(counts, key=micros.get)[::-1]
            )
            print(
                f"{name}, batch {batch}: {sum(counts.values())} kernels a step, {row['kernel_ms_total']:.2f} ms of GPU "
                f"time ({kinds}); captured step {row['graphed_step_ms']:.2f} ms; nn.LSTM ({depth} layers) "
                f"{row['nn_lstm_step_ms']:.2f} ms",
                flush=True,
            )
    header = {
        "command": " ".join(["python", "benchmarks/cell_profile.py", *(sys.argv[1:] if argv is None else argv)]),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "provenance": output.provenance(str(device)),
        "hidden": hidden,
        "layers": layers,
    }
    output.write(path, {**header, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
