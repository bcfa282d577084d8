"""What atomic checkpoint writes cost: Lightning's ``TorchCheckpointIO`` against
``checkpoints.ckpt_write.AtomicCheckpointIO`` on the same checkpoint, side by side, in the same directory.

    python benchmarks/checkpoint_write.py                       # Zaremba medium + Adam moments (~240 MB), in ./
    python benchmarks/checkpoint_write.py --dir /scratch/x --repeats 5 --params 50_000_000

Times alternate between the two writers (so drift on a busy machine hits both), and the Python-heap peak of one save
of each is taken with ``tracemalloc`` (Lightning serialises into a ``BytesIO`` first; the atomic writer streams).
Prints one JSON object; ``atomic / lightning`` ratios above 1 mean the atomic writer is slower (its ``fsync`` waits for
the disk, which Lightning's write does not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402

from checkpoints.ckpt_write import AtomicCheckpointIO  # noqa: E402

# Zaremba medium: 2 x 650 LSTM, 650-wide embedding and softmax over 10,000 words.
MEDIUM_PARAMS = 4 * 650 * (650 + 650) * 2 + 2 * 4 * 650 * 2 + 2 * 10_000 * 650 + 10_000


def _checkpoint(params: int) -> dict:
    """Weights plus Adam's two moments, as a Lightning checkpoint of that model holds them."""
    weights = torch.randn(params)
    return {
        "state_dict": {"weights": weights},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(params), "exp_avg_sq": torch.rand(params)}}}],
        "global_step": 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=".", help="where to write (the checkpoint disk to measure)")
    parser.add_argument("--params", type=int, default=MEDIUM_PARAMS, help="model parameters (x3 with Adam)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    checkpoint = _checkpoint(args.params)
    writers = {"lightning": TorchCheckpointIO(), "atomic": AtomicCheckpointIO()}
    times: dict[str, list[float]] = {name: [] for name in writers}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = Path(directory) / "last.ckpt"
        for _ in range(args.repeats):
            for name, writer in writers.items():
                start = time.perf_counter()
                writer.save_checkpoint(checkpoint, path)
                times[name].append(time.perf_counter() - start)
        size = path.stat().st_size
        peaks = {}
        for name, writer in writers.items():
            tracemalloc.start()
            writer.save_checkpoint(checkpoint, path)
            peaks[name] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        json.dumps(
            {
                "checkpoint_mb": round(size / 2**20, 1),
                "directory": str(Path(args.dir).resolve()),
                "seconds": {name: [round(t, 3) for t in values] for name, values in times.items()},
                "median_seconds": {name: round(t, 3) for name, t in median.items()},
                "time_ratio_atomic_over_lightning": round(median["atomic"] / median["lightning"], 2),
                "python_heap_peak_mb": {name: round(peak / 2**20, 1) for name, peak in peaks.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
