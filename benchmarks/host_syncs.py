"""How many times a training step and a validation step make the host wait for the device, counted on any machine.

A GPU runs ahead of the Python that feeds it until something needs a value back on the host: ``.item()``,
``.tolist()``, ``.cpu()``, a tensor in an ``if``, ``nonzero`` or boolean-mask indexing (whose output size is data),
a blocking host-to-device copy (which waits for the stream). Each one stalls the step until every queued kernel has
run. :class:`HostSyncCounter` counts those calls on the CPU, where nothing would stall, by following which tensors
would live on the device: the module's parameters, buffers and metric states, whatever Lightning moves to the device
and everything computed from them; a tensor made on the host (an optimizer's step counter, a ``PackedSequence``'s
batch sizes) costs nothing to read. It sees the calls made from Python (a ``TorchFunctionMode``), not those inside
C++ kernels and backward functions: ``torch.cuda.set_sync_debug_mode`` is the complete check on a GPU.

The step is what runs between Lightning's ``on_train_batch_start`` and ``on_train_batch_end`` (forward, loss,
backward, clipping, ``on_before_optimizer_step``, the optimizer) of a real ``Trainer`` fit on the CPU; the validation
step likewise. Lightning's own per-step logging and progress bar come after and are not counted. Configurations:

- ``ptb-lstm``: a 2-layer LSTM with a softmax head on a small word corpus (TextDataModule), SGD, gradient clipping;
- ``gbw-lstm4``: a 4-layer LSTM with an NCE head on GBW-style multi-sequence batches (GBWDataModule: a sentence
  starts, and the state resets, inside nearly every window), SGD with momentum, gradient clipping; ``packed`` runs
  the windows with resets inside as packed sentence segments (``FusedLayer.packed_segments = True``: CUDA's path),
  ``per-step`` through the per-step loop (the CPU's).

Writes a new results file (``--out``, or ``benchmarks/results/host_syncs-<time>.json``)::

    python benchmarks/host_syncs.py --out benchmarks/results/host_syncs.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import output  # noqa: E402

NAME = "host_syncs"  # benchmarks/results/host_syncs.json

# Calls that bring a device tensor's data to the host.
READS = {
    "item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__", "__complex__",
    "__format__", "__repr__", "__str__", "cpu", "is_nonzero", "equal", "allclose",
}  # fmt: skip
# Calls whose output size depends on the data: the host waits to learn it (the output stays on the device).
DATA_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
FACTORIES_WITH_DATA = {"tensor", "as_tensor"}  # made on the host, then copied to ``device``
HOST, DEVICE = "host", "device"  # where a call's result lives


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples, lists, dicts and dataclasses (a batch, an op's arguments or its outputs)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for field in dataclasses.fields(tree):
            yield from _tensors(getattr(tree, field.name))


def _caller() -> str:
    """``path:line`` of the code that made the call being counted (paths relative to the site-packages or checkout)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename != __file__ and not frame.filename.endswith(("torch/overrides.py", "torch/_tensor.py")):
            path = frame.filename.split("site-packages/")[-1]
            return f"{path.removeprefix(str(ROOT) + '/')}:{frame.lineno}"
    return "?"


def _names_cpu(device: Any) -> bool:
    """``device`` spells the host out (``"cpu"``); a ``torch.device`` is taken for the device the model is on."""
    return isinstance(device, str) and device.startswith("cpu")


class HostSyncCounter(TorchFunctionMode):
    """Counts, per name, the calls that would synchronise the host with a GPU while :attr:`counting` is on.

    Use it as a context manager around the whole run (it follows which tensors live on the device from the start),
    :meth:`mark` the tensors that start there, and switch :attr:`counting` on around what is measured.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.counts: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # "what at file:line" of the innermost frame outside torch's overrides
        self._on_device: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def mark(self, *trees: Any) -> None:
        """Take the tensors in ``trees`` as living on the device."""
        for tensor in _tensors(trees):
            self._on_device[tensor] = True

    def on_device(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self._on_device

    def take(self) -> tuple[Counter[str], Counter[str]]:
        """The counts so far by what was called and by where, which start again from zero."""
        counts, sites, self.counts, self.sites = self.counts, self.sites, Counter(), Counter()
        return counts, sites

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        sync, placement = self._classify(getattr(func, "__name__", ""), args, kwargs)
        if self.counting and sync:
            self.counts[sync] += 1
            self.sites[f"{sync} at {_caller()}"] += 1
        result = func(*args, **kwargs)
        if placement is not None and any(result is t for t in _tensors(args)):
            # A copy to the CPU of a tensor on the CPU is the tensor itself; on a GPU it is a new tensor on the other
            # side, the original staying where it was (a view is a new tensor, and keeps autograd).
            if self.on_device(result) != (placement == DEVICE):
                result = result.view_as(result)
        if placement == DEVICE or (placement is None and any(self.on_device(t) for t in _tensors((args, kwargs)))):
            self.mark(result)
        return result

    def _classify(self, name: str, args: tuple, kwargs: dict) -> tuple[str | None, str | None]:
        """What the call would synchronise on (or ``None``), and where its result lives: :data:`HOST`, :data:`DEVICE`
        or ``None`` (on the device when any input is)."""
        this = args[0] if args else None
        if name in READS:
            return (name if self.on_device(this) else None), HOST
        if name in DATA_SIZED:
            return (name if self.on_device(this) else None), None
        if name == "where" and len(args) + len(kwargs) == 1:  # torch.where(condition) is nonzero
            return ("where(condition)" if self.on_device(this) else None), None
        if name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and "output_size" not in kwargs and self._any_on_device(args):
                return "repeat_interleave(tensor repeats)", None
            return None, None
        if name in INDEXING and len(args) > 1:
            index = list(_tensors(args[1]))
            if any(i.dtype in (torch.bool, torch.uint8) for i in index) and self._any_on_device((this, index)):
                return f"{name}[boolean mask]", None
            if self.on_device(this) and any(not self.on_device(i) for i in index):
                return f"{name}[host index] (blocking copy to the device)", None
            return None, None
        if name in ("to", "cuda"):
            return self._copy(name, args, kwargs)
        if name == "copy_" and len(args) > 1:
            # The copy lands where `this` lives. One to the host is asynchronous only into pinned memory, which this
            # counter cannot see (the CPU has none); the CUDA count, by CUDA's own sync debug mode, checks it.
            source_on_device = self.on_device(args[1])
            where = DEVICE if self.on_device(this) else HOST
            if self.on_device(this) != source_on_device and not kwargs.get("non_blocking", False):
                return ("copy_ to the host" if source_on_device else "copy_ from the host (blocking)"), where
            return None, where
        device = kwargs.get("device")
        if device is None:
            return None, None
        if _names_cpu(device):
            return None, HOST
        if name in FACTORIES_WITH_DATA and not self._any_on_device(args[:1]):
            return f"{name}(..., device=) (blocking copy to the device)", DEVICE
        return None, DEVICE

    def _any_on_device(self, tree: Any) -> bool:
        return any(self.on_device(t) for t in _tensors(tree))

    def _copy(self, name: str, args: tuple, kwargs: dict) -> tuple[str | None, str | None]:
        """``Tensor.to`` / ``Tensor.cuda``: a blocking copy from the host waits for the stream, one to the host too."""
        this, rest = args[0], args[1:]
        non_blocking = bool(kwargs.get("non_blocking", next((a for a in rest if isinstance(a, bool)), False)))
        if name == "cuda":
            copies = not self.on_device(this) and not non_blocking
            return ("cuda() (blocking copy to the device)" if copies else None), DEVICE
        target = kwargs.get("device", next((a for a in rest if isinstance(a, (str, torch.device))), None))
        other = next((a for a in rest if isinstance(a, torch.Tensor)), kwargs.get("other"))
        if other is not None:
            target = "device" if self.on_device(other) else "cpu"
        if target is None:
            return None, None  # a dtype or memory-format conversion where the tensor is
        if _names_cpu(target):
            return ("to('cpu')" if self.on_device(this) else None), HOST
        copies = not self.on_device(this) and not non_blocking
        return ("to(device) (blocking copy to the device)" if copies else None), DEVICE


class CountSteps(L.Callback):
    """Counts the synchronisations of every training and validation step of a fit, one ``Counter`` per step."""

    def __init__(self, counter: HostSyncCounter) -> None:
        self.counter = counter
        self.train: list[tuple[Counter[str], Counter[str]]] = []  # per step: (by call, by site)
        self.val: list[tuple[Counter[str], Counter[str]]] = []

    def _start(self, module: L.LightningModule) -> None:
        metric_states = [
            list(metric.metric_state.values()) for metric in module.modules() if hasattr(metric, "metric_state")
        ]
        self.counter.mark(list(module.parameters()), list(module.buffers()), metric_states)
        self.counter.take()
        self.counter.counting = True

    def _end(self, steps: list[tuple[Counter[str], Counter[str]]]) -> None:
        self.counter.counting = False
        steps.append(self.counter.take())

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        self._start(module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self._end(self.train)

    def on_validation_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self._start(module)

    def on_validation_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self._end(self.val)


class CountCudaSyncs(CountSteps):
    """The complete count on a GPU: CUDA's own sync debug mode warns at every call that waits for the device, from
    Python or from inside a kernel or backward function; each warning is one synchronisation, named by the Python
    line that made it (the one that called into C++)."""

    def __init__(self) -> None:
        super().__init__(HostSyncCounter())
        self._recording: contextlib.ExitStack | None = None
        self._caught: list[warnings.WarningMessage] = []

    def _start(self, module: L.LightningModule) -> None:
        torch.cuda.synchronize()  # what the step before queued is not this step's wait
        self._recording = contextlib.ExitStack()
        self._caught = self._recording.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def _end(self, steps: list[tuple[Counter[str], Counter[str]]]) -> None:
        torch.cuda.set_sync_debug_mode("default")
        assert self._recording is not None
        self._recording.close()
        syncs = [w for w in self._caught if "synchronizing" in str(w.message)]
        sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        steps.append((Counter({"synchronizing CUDA operation": len(syncs)}) if syncs else Counter(), sites))


# ------------------------------------------------------------------------------------------------ the settings
def write_word_corpus(directory: Path, words: int = 50) -> Path:
    """train/valid/test.txt of random lines over ``words`` word types (a PTB-shaped stream, small)."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", 200), ("valid", 40), ("test", 40)):
        rng = random.Random(split)
        text = "".join(
            " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(3, 15))) + "\n" for _ in range(lines)
        )
        (directory / f"{split}.txt").write_text(text)
    return directory


def write_gbw_corpus(directory: Path, words: int = 50) -> Path:
    """GBW's layout (two training shards, held-out shards 0 and 1) of short random sentences."""
    from datamodules.gbw import HELDOUT_DIR, TRAIN_DIR

    shards = [(f"{TRAIN_DIR}/news.en-0000{n}-of-00100", 100) for n in (1, 2)]
    shards += [(f"{HELDOUT_DIR}/news.en.heldout-0000{n}-of-00050", 30) for n in (0, 1)]
    for path, lines in shards:
        rng = random.Random(path)
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        text = "".join(
            " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(2, 9))) + " .\n" for _ in range(lines)
        )
        (directory / path).write_text(text)
    return directory


@contextlib.contextmanager
def packed_segments(value: bool | None) -> Iterator[None]:
    """``FusedLayer.packed_segments`` set to ``value`` for a while (``True``: the path CUDA takes, on any device)."""
    from zoo.layers import FusedLayer

    before = FusedLayer.packed_segments
    FusedLayer.packed_segments = value
    try:
        yield
    finally:
        FusedLayer.packed_segments = before


def count_fit(setting: str, workdir: Path, steps: int = 3, device: str = "cpu") -> CountSteps:
    """Fit ``steps`` training steps of ``setting`` on ``device``, then validate ``steps`` windows, counting each step
    (on the CPU with :class:`HostSyncCounter`, on CUDA with its sync debug mode)."""
    from datamodules import GBWDataModule, TextDataModule
    from lightning_modules import LanguageModel
    from lightning_modules.progress import FitProgressBar

    L.seed_everything(0, verbose=False)
    if setting == "ptb-lstm":
        data: L.LightningDataModule = TextDataModule(
            str(write_word_corpus(workdir / "words")), tokenizer="word", batch_size=4, bptt=8, eval_batch_size=4
        )
        model = LanguageModel(data.vocab_size, "lstm", 16, 16, num_layers=2, dropout=0.5)
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1.0)  # LightningCLI's job
    elif setting.startswith("gbw-lstm4"):
        data = GBWDataModule(
            str(write_gbw_corpus(workdir / "gbw")), min_count=1, batch_size=4, bptt=12, eval_batch_size=4
        )
        data.prepare_data()
        model = LanguageModel(
            data.vocab_size, "lstm", 16, 16, num_layers=4, init_range=0.1, head="nce", noise_samples=20
        )
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9, dampening=0.9)
    else:
        raise ValueError(f"unknown setting {setting!r}")
    counting = CountSteps(HostSyncCounter()) if device == "cpu" else CountCudaSyncs()
    # lm-zoo fit's own progress bar, before the counter so that its batch-end hook falls inside the counted step.
    bar = FitProgressBar()
    trainer = L.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=steps,
        limit_val_batches=steps,
        num_sanity_val_steps=0,
        gradient_clip_val=0.25,
        callbacks=[bar, counting],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    counter = counting.counter if device == "cpu" else contextlib.nullcontext()
    with counter, packed_segments(True if setting.endswith("packed") else None):
        trainer.fit(model, datamodule=data)
    return counting


SETTINGS = ("ptb-lstm", "gbw-lstm4-per-step", "gbw-lstm4-packed")


def measure(setting: str, steps: int = 3, device: str = "cpu") -> dict[str, Any]:
    """The per-step counts of ``setting``: totals per step and what each is, for training and validation."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LM_ZOO_CACHE"] = str(Path(tmp) / "cache")
        counted = count_fit(setting, Path(tmp), steps, device)
    row: dict[str, Any] = {"setting": setting}
    for stage, steps in (("train", counted.train), ("val", counted.val)):
        row[f"{stage}_per_step"] = [sum(calls.values()) for calls, _ in steps]
        row[f"{stage}_calls"] = dict(sum((calls for calls, _ in steps), Counter()))
        row[f"{stage}_sites"] = dict(sum((sites for _, sites in steps), Counter()))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps, then validation steps, per setting")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: count with CUDA's sync debug mode"
    )
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)
    torch.set_num_threads(1)
    rows = [measure(setting, args.steps, args.device) for setting in args.settings]
    result = {
        "command": "python benchmarks/host_syncs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "provenance": output.provenance(args.device),
        "counted": "calls from Python that would synchronise the host with a GPU, per step (HostSyncCounter)"
        if args.device == "cpu"
        else "synchronizing CUDA operations per step (torch.cuda.set_sync_debug_mode('warn'))",
        "note": "a first training step's to(device) in lightning/fabric/utilities/apply_func.py is Lightning's first "
        "self.log of each key moving its accumulators, asynchronous on a GPU (Lightning passes non_blocking there)",
        "results": rows,
    }
    output.write(path, result)
    for row in rows:
        print(
            f"{row['setting']}: train {row['train_per_step']} per step {row['train_calls']}; "
            f"val {row['val_per_step']} per step {row['val_calls']}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
