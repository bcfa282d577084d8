"""Export size against the ``.ckpt`` it came from, and load times of both (and of a Hub snapshot, if given).

    python benchmarks/export_size.py runs/.../checkpoints/best.ckpt         # a checkpoint from lm-zoo fit
    python benchmarks/export_size.py --medium                               # Zaremba medium (2 x 650, 10k vocab)

``--medium`` builds the Zaremba-medium model in Python (untrained: sizes and load times do not depend on the values)
and writes it as Lightning does (``Trainer.save_checkpoint``), so no training run is needed. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoints  # noqa: E402
from checkpoints.export_write import export_model  # noqa: E402


def _medium_checkpoint(directory: Path) -> Path:
    """Zaremba medium with a 10,000-word vocabulary, saved as a Lightning checkpoint with its tokenizer."""
    import lightning as L

    from datamodules.tokenizers import WordTokenizer
    from lightning_modules import LanguageModel

    words = [f"w{i}" for i in range(9998)]
    tokenizer = WordTokenizer(["<eos>", "<unk>", *words], [1] * 10000)
    model = LanguageModel(vocab_size=10000, embedding_size=650, hidden_size=650, num_layers=2, dropout=0.5)

    class Data(L.LightningDataModule):
        def state_dict(self) -> dict:
            return {"tokenizer": tokenizer.state_dict()}

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer._data_connector.attach_datamodule(model, datamodule=Data())
    path = directory / "medium.ckpt"
    trainer.save_checkpoint(path, weights_only=False)  # as ModelCheckpoint writes it
    return path


def _median_seconds(load, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        load()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", nargs="?", help="a .ckpt written by lm-zoo fit")
    parser.add_argument("--medium", action="store_true", help="build Zaremba medium in Python instead")
    parser.add_argument("--repeats", type=int, default=5, help="loads timed (the median is printed)")
    args = parser.parse_args()
    if not args.ckpt and not args.medium:
        parser.error("pass a .ckpt or --medium")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else _medium_checkpoint(Path(tmp))
        out = export_model(checkpoints.load(ckpt), Path(tmp) / "export", results=[])
        files = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
        report = {
            "ckpt": str(ckpt) if args.ckpt else "zaremba-medium (2 x 650, vocab 10,000, untrained)",
            "parameters": json.loads((out / "config.json").read_text())["num_parameters"],
            "ckpt_bytes": ckpt.stat().st_size,
            "export_bytes": sum(files.values()),
            "export_files": files,
            "export_over_ckpt": round(sum(files.values()) / ckpt.stat().st_size, 4),
            "load_ckpt_s": round(_median_seconds(lambda: checkpoints.load(ckpt), args.repeats), 3),
            "load_export_s": round(_median_seconds(lambda: checkpoints.load(out), args.repeats), 3),
            "repeats": args.repeats,
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
