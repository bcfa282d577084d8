"""Training throughput of every zoo architecture, side by side with ``nn.LSTM`` and a naive per-step LSTM.

For each (batch, BPTT) setting the script times one training step (forward over a window, backward, SGD update) of a
stack of ``--layers`` layers of ``--hidden`` units, for:

* ``nn.LSTM``: PyTorch's fused kernel (cuDNN on GPU, oneDNN on CPU), the yardstick;
* ``naive``: an LSTM written the way the peers write their custom cells (one ``nn.Linear`` per gate and input,
  ``x[:, t]`` indexing, nothing hoisted out of the loop): what a custom cell costs without care;
* every architecture in the zoo with its default options (``--arch`` picks some).

Each architecture is compared with the ``nn.LSTM`` (and naive LSTM) of its size: as many layers as the LSTM cells it
runs per step. That is ``--layers`` for every cell but FS-RNN, whose layer is a block of ``k + 1`` LSTM cells (k fast,
one slow) with the parameters and matmul FLOPs of ``k + 1`` LSTM layers of its width; the table names the depth.

Measurements are interleaved (every model once per round, ``--rounds`` rounds, median kept) so that the ratios are
measured under the same conditions; only ratios from one run should be compared. A round times ``--queued`` steps
queued one after another between two synchronisations of the device (20 on a GPU, as training queues them; a step's
own latency, one step per synchronisation, favours the models whose step launches fewer kernels from the host: the
tables stored before this measured that way, so their ratios to ``nn.LSTM`` are upper bounds).

``--vocab V`` times the whole language model's step instead of the stack's: an embedding of ``V`` words, the stack, and
a ``V``-way softmax's cross-entropy (PTB: 10,000), around every model alike (what a user trains).

oneDNN's primitive cache is made large enough for every model's primitives (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
below). Example::

    python benchmarks/cells.py                                # hidden 650, batch 20 and 64, BPTT 35 and 70
    python benchmarks/cells.py --arch lstm mogrifier --batch 20 --bptt 35 --rounds 3
    python benchmarks/cells.py --arch lstm gru_paper --loop --genomes lstm gru_paper    # genomes vs hand-written
    python benchmarks/cells.py --device cuda --batch 20 64 --bptt 35 --vocab 10000     # the whole LM's step

The table is printed and written to a new results file (``--out``; see benchmarks/output.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Each model's oneDNN primitives stay cached, as they would in its own training process. With some twenty-five models
# in one process, oneDNN's default cache (1,024 primitives) thrashed: the models that run the most oneDNN shapes kept
# re-creating theirs. Measured (`--loop --no-naive --batch 64 --bptt 35 --threads 1`): 3 min 39 s with 37 s of
# system time by default, 2 min 3 s with 7 s at 16,384; the Mogrifier's kernel 0.52x `nn.LSTM` against 0.65x. Read
# when oneDNN makes its first primitive, so it is set before torch is imported.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import zoo  # noqa: E402
from benchmarks import output  # noqa: E402
from zoo import paths, settings  # noqa: E402
from zoo.genome import GENOMES  # noqa: E402

NAME = "cells"  # results: a new benchmarks/results/cells-<time>.json, or --out


class NaiveLSTM(nn.Module):
    """The straightforward per-step LSTM of the peers' custom cells: eight ``nn.Linear`` per layer, nothing hoisted."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    f"{source}{gate}": nn.Linear(input_size if (source == "x" and i == 0) else hidden_size, hidden_size)
                    for source in "xh"
                    for gate in "ifgo"
                }
            )
            for i in range(num_layers)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        for layer in self.layers:
            h = x.new_zeros(x.size(0), self.hidden_size)
            c = torch.zeros_like(h)
            outputs = []
            for t in range(x.size(1)):
                x_t = x[:, t]
                i = torch.sigmoid(layer["xi"](x_t) + layer["hi"](h))
                f = torch.sigmoid(layer["xf"](x_t) + layer["hf"](h))
                g = torch.tanh(layer["xg"](x_t) + layer["hg"](h))
                o = torch.sigmoid(layer["xo"](x_t) + layer["ho"](h))
                c = f * c + i * g
                h = o * torch.tanh(c)
                outputs.append(h)
            x = torch.stack(outputs, 1)
        return x, None


class TorchLSTM(nn.Module):
    """``nn.LSTM`` with the zoo's call signature."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True)

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return self.rnn(x)[0], None


def lstm_cells_per_layer(model: nn.Module) -> int:
    """How many LSTM cells of the model's width one of its layers runs per step (its size in LSTM layers)."""
    if isinstance(model, zoo.fs_rnn.FSRNN):
        return model.fast_cells + 1  # k fast cells and the slow one, each an LSTM cell with its own weights
    return 1


def runs_a_kernel(model: nn.Module) -> bool:
    """Whether the default model runs a kernel (``nn.LSTM``/``nn.GRU``/``nn.RNN``'s, or the Mogrifier's window
    kernel), so that ``fused=False`` times a different path: its per-step autograd loop."""
    return any(getattr(layer, "fused", False) or getattr(layer, "window_kernel", False) for layer in model.layers)


def training_step(
    model: nn.Module,
    x: Tensor,
    direction: Tensor,
    optimizer: torch.optim.Optimizer,
    autocast: bool = False,
    eager: bool = False,
) -> Callable:
    """A closure that runs one training step; the loss projects the outputs on a fixed random direction. With
    ``autocast``, the forward runs under bf16 autocast (Lightning's ``bf16-mixed``); with ``eager``, a per-step
    cell's window runs eagerly on CUDA instead of as a captured graph (``LM_ZOO_WINDOW_GRAPHS=0``, zoo/window.py)."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with (
            settings.overridden(window_graphs=not eager),
            torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast),
        ):
            y, _ = model(x)
            loss = (y.float() * direction).sum()
        extra = model.regularization_loss() if hasattr(model, "regularization_loss") else None
        (loss if extra is None else loss + extra).backward()
        optimizer.step()

    return step


class WordModel(nn.Module):
    """A stack inside a language model: embedding, the stack, a linear softmax layer, the mean cross-entropy."""

    def __init__(self, stack: nn.Module, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embedding, self.stack, self.decoder = nn.Embedding(vocab, hidden), stack, nn.Linear(hidden, vocab)

    def regularization_loss(self) -> Tensor | None:
        return self.stack.regularization_loss() if hasattr(self.stack, "regularization_loss") else None

    def loss(self, ids: Tensor, targets: Tensor) -> Tensor:
        y, _ = self.stack(self.embedding(ids))  # (B, T, H)
        return nn.functional.cross_entropy(self.decoder(y).flatten(0, 1).float(), targets.flatten())


def word_training_step(
    model: WordModel,
    ids: Tensor,
    targets: Tensor,
    optimizer: torch.optim.Optimizer,
    autocast: bool = False,
    eager: bool = False,
) -> Callable:
    """:func:`training_step` for a :class:`WordModel`: its cross-entropy over ``targets`` is the loss."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with (
            settings.overridden(window_graphs=not eager),
            torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast),
        ):
            loss = model.loss(ids, targets)
        extra = model.regularization_loss()
        (loss if extra is None else loss + extra).backward()
        optimizer.step()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    builders: dict[str, Callable[[], nn.Module]],
    batch: int,
    bptt: int,
    hidden: int,
    rounds: int,
    device: torch.device,
    queued: int = 1,
    vocab: int = 0,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per training step of each model, timed in interleaved rounds of ``queued`` steps between two
    synchronisations, and each model's first step (allocator, oneDNN/cuDNN plans, a window graph's capture).
    ``vocab``: each model inside a :class:`WordModel` of that many words."""
    x = torch.randn(batch, bptt, hidden, device=device)
    direction = torch.randn(batch, bptt, hidden, device=device)
    ids = torch.randint(vocab or 1, (batch, bptt), device=device)
    targets = torch.randint(vocab or 1, (batch, bptt), device=device)
    steps = {}
    first_step: dict[str, float] = {}
    for name, build in builders.items():
        bf16, eager = name.endswith(BF16), name.endswith(EAGER)
        if vocab:
            model = WordModel(build(), vocab, hidden).to(device).train()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            steps[name] = word_training_step(model, ids, targets, optimizer, bf16, eager)
        else:
            model = build().to(device).train()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            steps[name] = training_step(model, x, direction, optimizer, bf16, eager)
        _sync(device)
        start = time.perf_counter()
        steps[name]()  # warm-up
        _sync(device)
        first_step[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in builders}
    order = list(steps)
    for round_index in range(rounds):
        # A fresh order every round: in a fixed one, `nn.LSTM` always ran first, right after the previous round's last
        # model, and the fused zoo `lstm` (the same kernel) measured anywhere from 0.63x to 1.04x of it.
        random.Random(round_index).shuffle(order)
        for name in order:
            step = steps[name]
            _sync(device)
            start = time.perf_counter()
            for _ in range(queued):
                step()
            _sync(device)
            times[name].append((time.perf_counter() - start) / queued)
    return {name: statistics.median(values) for name, values in times.items()}, first_step


BF16 = " (bf16)"  # a model timed under bf16 autocast: its name ends with this
EAGER = " (eager)"  # a per-step cell whose CUDA windows run eagerly, not as captured graphs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=None, help="zoo architectures (default: all)")
    parser.add_argument("--batch", nargs="+", type=int, default=[20, 64])
    parser.add_argument("--bptt", nargs="+", type=int, default=[35, 70])
    parser.add_argument("--hidden", type=int, default=650, help="input and hidden size (PTB medium: 650)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per model (median kept)")
    parser.add_argument(
        "--queued",
        type=int,
        default=None,
        help="steps queued between two synchronisations in a round (default: 20 on a GPU, 1 on the CPU)",
    )
    parser.add_argument(
        "--vocab", type=int, default=0, help="time the whole language model's step with a softmax over this many words"
    )
    parser.add_argument("--no-naive", action="store_true", help="skip the naive loop (it is slow)")
    parser.add_argument(
        "--loop", action="store_true", help="also time the per-step path of architectures that have a fused kernel"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: PyTorch's). On a shared machine a multi-threaded op waits for its preempted "
        "threads, so when another job runs, 1-thread ratios are the reliable ones",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="also time every zoo architecture under bf16 autocast (bf16-mixed)"
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="also time every per-step architecture with its CUDA windows run eagerly (LM_ZOO_WINDOW_GRAPHS=0): "
        "the path before zoo/window.py",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--genomes",
        nargs="+",
        default=[],
        choices=list(GENOMES),
        help="also time the genome architecture running these cells (zoo/genome.py), to compare with the "
        "hand-written cell of the same name (with --loop: its per-step path)",
    )
    output.add_arguments(parser, NAME, resumable=False)  # one run's side-by-side ratios: nothing to continue
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)

    device = torch.device(args.device)
    queued = args.queued or (20 if device.type == "cuda" else 1)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hidden, layers = args.hidden, args.layers
    builders: dict[str, Callable[[], nn.Module]] = {}
    yardstick_depth: dict[str, int] = {}  # model -> layers of the nn.LSTM (and naive LSTM) it is compared with

    def suffix(depth: int) -> str:
        return "" if depth == layers else f" ({depth} layers)"

    def add_yardsticks(depth: int) -> None:
        builders.setdefault(f"nn.LSTM{suffix(depth)}", lambda: TorchLSTM(hidden, hidden, depth))
        yardstick_depth[f"nn.LSTM{suffix(depth)}"] = depth
        if not args.no_naive:
            builders.setdefault(f"naive{suffix(depth)}", lambda: NaiveLSTM(hidden, hidden, depth))
            yardstick_depth[f"naive{suffix(depth)}"] = depth

    add_yardsticks(layers)
    for name in args.arch or zoo.names():
        probe = zoo.build(name, 8, 8, layers)  # a tiny copy, to read the structure of the default model
        depth = layers * lstm_cells_per_layer(probe)
        add_yardsticks(depth)
        builders[name] = lambda name=name: zoo.build(name, hidden, hidden, layers)
        yardstick_depth[name] = depth
        if args.bf16:
            builders[name + BF16] = builders[name]
            yardstick_depth[name + BF16] = depth
        captured = paths.window_path(probe.train(), torch.empty(0, device=device), resets=False).stack == "captured"
        if args.eager and captured:
            builders[name + EAGER] = builders[name]
            yardstick_depth[name + EAGER] = depth
        if args.loop and runs_a_kernel(probe):
            builders[f"{name} (loop)"] = lambda name=name: zoo.build(name, hidden, hidden, layers, fused=False)
            yardstick_depth[f"{name} (loop)"] = depth

    for cell in args.genomes:
        builders[f"genome={cell}"] = lambda cell=cell: zoo.build("genome", hidden, hidden, layers, genome=cell)
        yardstick_depth[f"genome={cell}"] = layers

    threads = torch.get_num_threads()
    print(f"# {device} ({threads} threads), torch {torch.__version__}, hidden {hidden} x {layers} layers")
    if hasattr(os, "getloadavg"):  # ratios are comparable only when the machine is as quiet in every round
        print("# load average at start: " + ", ".join(f"{load:.2f}" for load in os.getloadavg()))
    model = f"an embedding, the stack and a {args.vocab:,}-word softmax" if args.vocab else "the stack"
    print(f"# training step of {model} = forward + backward + SGD update; tokens/s = batch * bptt / median step time")
    print(f"# each round: {queued} step(s) queued between two synchronisations, {args.rounds} rounds")
    results = []
    for batch in args.batch:
        for bptt in args.bptt:
            seconds, first_step = measure(builders, batch, bptt, hidden, args.rounds, device, queued, args.vocab)
            print(f"\n## batch {batch}, bptt {bptt}")
            print(
                f"| {'model':<22} | {'LSTM layers':>11} | {'tokens/s':>9} | {'x nn.LSTM':>9} | {'x naive':>8} "
                f"| {'step ms':>8} | {'first step s':>12} |"
            )
            print(f"|{'-' * 24}|{'-' * 12}:|{'-' * 10}:|{'-' * 10}:|{'-' * 9}:|{'-' * 9}:|{'-' * 13}:|")
            for name, step_time in seconds.items():
                depth = yardstick_depth[name]
                tokens_per_s = batch * bptt / step_time
                vs_fused = seconds[f"nn.LSTM{suffix(depth)}"] / step_time
                naive = f"naive{suffix(depth)}"
                vs_naive = seconds[naive] / step_time if naive in seconds else float("nan")
                print(
                    f"| {name:<22} | {depth:>11} | {tokens_per_s:>9.0f} | {vs_fused:>9.2f} | {vs_naive:>8.2f} "
                    f"| {step_time * 1e3:>8.2f} | {first_step[name]:>12.2f} |"
                )
                results.append(
                    {
                        "model": name,
                        "batch": batch,
                        "bptt": bptt,
                        "lstm_layers": depth,
                        "tokens_per_s": tokens_per_s,
                        "ratio_nn_lstm": vs_fused,
                        "ratio_naive": vs_naive,
                        "step_ms": step_time * 1e3,
                        "first_step_s": first_step[name],
                    }
                )
            if hasattr(os, "getloadavg"):
                print(f"# load average after this setting: {os.getloadavg()[0]:.2f}")
            sys.stdout.flush()
    command = " ".join(["python", "benchmarks/cells.py", *(sys.argv[1:] if argv is None else argv)])
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else output.hardware()["cpu"]
    header = {
        "command": command,
        "device": str(device),
        "machine": machine,
        "threads": threads,
        "torch": torch.__version__,
        "provenance": output.provenance(str(device)),
    }
    header |= {"queued": queued, "rounds": args.rounds, "vocab": args.vocab}
    output.write(path, {**header, "hidden": hidden, "layers": layers, "results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
