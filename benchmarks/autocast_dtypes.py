"""What every architecture computes in under each autocast mode: the dtype table of ``docs/training.md``.

For each architecture of ``zoo.names()`` (its ``tiny`` preset, two layers, in training mode) and each autocast dtype,
two windows: one that takes the layers' fast path (no reset, no state dropout: the fused kernels, the hand-written
window kernels) and one that forces the per-step loops (state dropout and a reset mid-window). A dispatch mode records
the dtype every matrix product (and fused recurrent kernel) inside the layers ran in, after autocast cast its inputs:
what ran, not what was asked for; the carried state's dtype is recorded too. ``tests/test_precision.py`` asserts the
same per architecture with this recorder, so the table is a record of the run, and the tests hold the code to it.

    python benchmarks/autocast_dtypes.py                  # CPU; writes benchmarks/results/autocast_dtypes-<time>.json
    python benchmarks/autocast_dtypes.py --device cuda    # the same on a GPU (not yet run: no GPU has been lent)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zoo  # noqa: E402
from benchmarks import output  # noqa: E402

NAME = "autocast_dtypes"  # benchmarks/results/autocast_dtypes.json
MODES = {"bf16": torch.bfloat16, "fp16": torch.float16}
B, T = 3, 9


def is_product(op: str) -> bool:
    """Whether an aten op is a matrix product or a fused recurrent kernel (aten's, or lm-zoo's C++ Mogrifier window,
    whose products the dispatcher sees as one op): the work autocast lowers, or the hand-written kernels keep in
    float32."""
    return any(key in op for key in ("mm", "linear", "rnn", "lstm", "gru", "window"))


class DtypesRan(TorchDispatchMode):
    """The dtypes the aten ops of a forward computed in, by the tracked module that ran them.

    A dispatch mode sees every op as it executes, after autocast has cast its inputs: what ran, not what was asked
    for. ``ran[scope][op]`` is the set of floating output dtypes of ``op`` inside ``modules[scope]`` (the innermost
    tracked module; ``"outside"`` for ops outside them all).
    """

    def __init__(self, modules: dict[str, torch.nn.Module] | None = None) -> None:
        super().__init__()
        self.modules = modules or {}
        self.ran: dict[str, dict[str, set[torch.dtype]]] = defaultdict(lambda: defaultdict(set))
        self._scopes = ["outside"]
        self._hooks: list[Any] = []

    def __enter__(self) -> DtypesRan:
        for scope, module in self.modules.items():
            self._hooks.append(module.register_forward_pre_hook(lambda m, a, s=scope: self._scopes.append(s)))
            self._hooks.append(module.register_forward_hook(lambda m, a, o: self._scopes.pop() and None))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.ran[self._scopes[-1]][op].add(t.dtype)
        return out

    def products(self, scope: str) -> set[torch.dtype]:
        """The dtypes the products (and fused recurrent kernels) in ``scope`` computed in."""
        return {d for op, dtypes in self.ran[scope].items() if is_product(op) for d in dtypes}


def _short(dtypes: set[torch.dtype]) -> str:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return " + ".join(sorted(names.get(d, str(d)) for d in dtypes))


def measure(name: str, dtype: torch.dtype, per_step: bool, device: str) -> dict[str, str]:
    """One window of ``name``'s tiny two-layer stack under ``dtype`` autocast: the layers' product dtypes and the
    carried state's."""
    options = dict(zoo.preset(name, "tiny"))
    size, hidden = options.pop("input_size"), options.pop("hidden_size")
    options.pop("num_layers")
    torch.manual_seed(0)
    regularisers = {"state_dropout": 0.2} if per_step else {}
    stack = zoo.build(name, size, hidden, 2, **regularisers, **options).train().to(device)
    reset = None
    if per_step:
        reset = torch.zeros(B, T, dtype=torch.bool, device=device)
        reset[1, 4] = True
    ran = DtypesRan({f"layer {i}": layer for i, layer in enumerate(stack.layers)})
    with torch.autocast(device, dtype=dtype), ran:
        _, state = stack(torch.randn(B, T, size, device=device), reset=reset)
    products = set().union(*(ran.products(f"layer {i}") for i in range(len(stack.layers))))
    return {"products": _short(products), "state": _short({s.dtype for s in state})}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)
    rows = []
    for name in zoo.names():
        row: dict[str, Any] = {"architecture": name}
        for mode, dtype in MODES.items():
            row[mode] = {
                "fast path": measure(name, dtype, per_step=False, device=args.device),
                "per-step loop": measure(name, dtype, per_step=True, device=args.device),
            }
        rows.append(row)
        print(name, {mode: {path_: r["products"] for path_, r in row[mode].items()} for mode in MODES})
    results = {
        "command": "python benchmarks/autocast_dtypes.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": args.device,
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else output.hardware()["cpu"],
        "torch": torch.__version__,
        "provenance": output.provenance(args.device),
        "rows": rows,
    }
    output.write(path, results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
