"""Hand-offs between the house's packages as ``lm-zoo fit`` and ``lm-zoo evaluate`` run: how often control passes
from one package to another, in one training step and in one evaluation.

    python benchmarks/handoffs.py                  # a tiny word model: one training step, then evaluating it
    python benchmarks/handoffs.py --json out.json

A hand-off is a Python call into a function of one package from the nearest calling function of another, among
lm-zoo's packages (``zoo``, ``datamodules``, ``evaluation``, ``lightning_modules``, ``search``, ``checkpoints``,
``commands``, ``cli``) and Lightning (``lightning``); frames of torch, the standard library and other packages between
them are looked through, so ``nn.Module.__call__`` running a zoo layer for a LightningModule is one hand-off from
``lightning_modules`` to ``zoo``. Calls between two files of ``lightning_modules`` (the LightningModule, its base and
the training step handing control to each other) are counted apart. The code's files are put in the rooms they have
today (``lightning_modules/evaluation`` counts as ``evaluation``), so that an older commit is counted room for room.

The training step is the fifth of a fit (steps 0-3 warm everything up), from the start of its batch to the start of
the next; the evaluation is ``lm-zoo evaluate`` of that fit's ``last.ckpt`` on the first 400 validation tokens, the
whole command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zoo", "datamodules", "evaluation", "lightning_modules", "search", "checkpoints", "commands")
MOVED = {"lightning_modules/evaluation": "evaluation", "lightning_modules/search": "search"}  # today's rooms
TRACED_STEP = 4


def room(path: str) -> str | None:
    """The package a source file belongs to (see the module's docstring), or ``None`` where it is not counted."""
    parts = Path(path).parts
    if "site-packages" in parts:  # an installed package (a virtual environment may sit inside the checkout)
        return "lightning" if parts[parts.index("site-packages") + 1 :][:1] == ("lightning",) else None
    try:
        relative = Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    for old, new in MOVED.items():
        if relative.startswith(old + "/"):
            return new
    top = relative.split("/")[0]
    if top == "cli.py":
        return "cli"
    return top if top in PACKAGES else None


class HandOffs:
    """Counts hand-offs (caller's package, callee's package) while it is on (:meth:`start`, :meth:`stop`)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.files: Counter[tuple[str, str]] = Counter()  # between two files of lightning_modules
        self._rooms: dict[str, str | None] = {}

    def _room(self, frame: FrameType) -> str | None:
        path = frame.f_code.co_filename
        if path not in self._rooms:
            self._rooms[path] = room(path)
        return self._rooms[path]

    def _trace(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = self._room(frame)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and self._room(caller_frame) is None:
            caller_frame = caller_frame.f_back
        caller = None if caller_frame is None else self._room(caller_frame)
        if caller is not None and caller != callee:
            self.counts[(caller, callee)] += 1
        elif caller == callee == "lightning_modules" and caller_frame.f_code.co_filename != frame.f_code.co_filename:
            names = (Path(caller_frame.f_code.co_filename).name, Path(frame.f_code.co_filename).name)
            self.files[names] += 1

    def start(self) -> None:
        sys.setprofile(self._trace)

    def stop(self) -> None:
        sys.setprofile(None)

    def table(self) -> dict[str, Any]:
        """The total and each direction's count, most first; and the same between files of ``lightning_modules``."""
        pairs = sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))
        files = sorted(self.files.items(), key=lambda item: (-item[1], item[0]))
        return {
            "total": sum(self.counts.values()),
            "pairs": [f"{a} -> {b}: {n}" for (a, b), n in pairs],
            "within_lightning_modules": sum(self.files.values()),
            "files": [f"{a} -> {b}: {n}" for (a, b), n in files],
        }


class TraceStep(L.Callback):
    """Added to the fit: counts the hand-offs of training step :data:`TRACED_STEP`, from the start of its batch to
    the start of the next, into ``$HANDOFFS_OUT`` (JSON)."""

    def __init__(self) -> None:
        self.handoffs = HandOffs()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == TRACED_STEP:
            self.handoffs.start()
        elif trainer.global_step == TRACED_STEP + 1:
            self.handoffs.stop()
            Path(os.environ["HANDOFFS_OUT"]).write_text(json.dumps(self.handoffs.table()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the counts to this file")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import cli

    work = Path(tempfile.mkdtemp(prefix="handoffs-"))
    corpus = work / "corpus"
    corpus.mkdir()
    for split, lines in (("train", 300), ("valid", 40), ("test", 40)):
        text = "".join(" ".join(f"w{(start * 7 + i) % 23}" for i in range(9)) + "\n" for start in range(lines))
        (corpus / f"{split}.txt").write_text(text)
    os.environ["HANDOFFS_OUT"] = str(work / "step.json")
    fit = [
        "fit", "--config", "ptb/lstm-small", f"--data.init_args.corpus={corpus}", "--data.init_args.batch_size=4",
        "--data.init_args.bptt=10", "--model.init_args.embedding_size=8", "--model.init_args.hidden_size=8",
        f"--trainer.max_steps={TRACED_STEP + 2}", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={work / 'run'}", f"--checkpoint.dirpath={work / 'run' / 'checkpoints'}",
        "--trainer.callbacks+=benchmarks.handoffs.TraceStep",
    ]  # fmt: skip
    if cli.main(fit) != 0:
        raise SystemExit("the fit failed")
    step = json.loads((work / "step.json").read_text())
    evaluation = HandOffs()
    evaluation.start()
    code = cli.main(["evaluate", str(work / "run" / "checkpoints" / "last.ckpt"), "--split=valid", "--max-tokens=400"])
    evaluation.stop()
    if code != 0:
        raise SystemExit("the evaluation failed")
    result = {"fit, one training step": step, "evaluate, the whole command": evaluation.table()}
    for what, counted in result.items():
        print(f"{what}: {counted['total']} hand-offs between packages")
        for line in counted["pairs"]:
            print(f"    {line}")
        print(f"  and {counted['within_lightning_modules']} between files of lightning_modules")
        for line in counted["files"]:
            print(f"    {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
