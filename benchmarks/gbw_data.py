"""How fast the GBW data pipeline is: vocabulary building, encoding, and the MultiSequence batch iterator.

Measures, on the real GBW sample (``$LM_ZOO_DATA/gbw-sample``, four held-out shards, 617k words) and optionally on a
synthetic corpus it writes into a temp directory (``--synthetic-tokens 20000000``: Zipf-distributed words over a
200k-word vocabulary, GBW-like sentence lengths), in tokens (words) per second:

- counting + vocabulary: ``datamodules.gbw.count_words`` then ``SentenceTokenizer.from_counts`` (cutoff 3), in one
  process and with ``--workers`` forked processes (one file each at a time), with the ratio;
- encoding: ``datamodules.gbw.encode_files`` writing the flat int32 ids and sentence offsets, the same two ways;
- the batch iterator: one epoch of ``MultiSequenceWindows`` (shuffled, batch 128 x bptt 50 by default), tokens being
  the ``B x T`` slots of the windows, side by side with ``StreamWindows`` (the PTB-style contiguous stream, no resets)
  over the same ids, in alternating rounds, with the ratio.

The machine's load changes absolute figures; the ratio is measured in the same run. For scale: Léonard 2016 trained
the 4 x 2048 model at about 3,800 words/s, so anything in the millions of tokens/s keeps the data off the critical
path.

    python benchmarks/gbw_data.py                                   # the sample
    python benchmarks/gbw_data.py --synthetic-tokens 20000000      # and 20M synthetic tokens
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datamodules.corpora import data_root  # noqa: E402
from datamodules.gbw import count_words, encode_files, load_encoded  # noqa: E402
from datamodules.multisequence import MultiSequenceWindows  # noqa: E402
from datamodules.tokenizers import SentenceTokenizer  # noqa: E402
from datamodules.windows import StreamWindows  # noqa: E402


def write_synthetic(directory: Path, tokens: int, seed: int = 0, shards: int = 4) -> list[Path]:
    """Zipf-distributed words (exponent 1.1, 200k types) in sentences of 1-60 words (mean ~26), ``shards`` files."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(200_000)])
    words = vocabulary[np.minimum(rng.zipf(1.1, size=tokens), 200_000) - 1]
    lengths = np.clip(rng.gamma(3.0, 26 / 3.0, size=tokens // 10 + 1).astype(np.int64), 1, 60)
    ends = np.cumsum(lengths)
    ends = ends[ends < tokens]
    files, per_shard = [], len(ends) // shards + 1
    for shard in range(shards):
        cut = ends[shard * per_shard : (shard + 1) * per_shard]
        if len(cut) == 0:
            continue
        first = 0 if shard == 0 else int(ends[shard * per_shard - 1])
        sentences = np.split(words[first : int(cut[-1])], cut[:-1] - first)
        path = directory / f"news.en-{shard + 1:05d}-of-00100"
        path.write_text("".join(" ".join(s) + "\n" for s in sentences))
        files.append(path)
    return files


def timed(fn, rounds: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(name: str, files: list[Path], batch_size: int, bptt: int, rounds: int, workers: int) -> None:
    words = sum(len(p.read_bytes().split()) for p in files)
    print(f"\n{name}: {len(files)} file(s), {words:,} words, {sum(p.stat().st_size for p in files) / 1e6:.1f} MB")

    def vocabulary(processes: int) -> SentenceTokenizer:
        counts, sentences = count_words(files, workers=processes)
        return SentenceTokenizer.from_counts(counts, sentences, min_count=3)

    def encode(processes: int) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            encode_files(files, tokenizer, Path(tmp), workers=processes)

    for label, task in (("vocabulary (count + cutoff 3)", vocabulary), ("encoding to int32 + offsets", encode)):
        rates: dict[int, list[float]] = {1: [], workers: []}
        for _ in range(rounds):  # alternating, so both see the same machine load
            for processes in rates:
                start = time.perf_counter()
                result = task(processes)
                rates[processes].append(words / (time.perf_counter() - start))
                if isinstance(result, SentenceTokenizer):
                    tokenizer = result
        one, many = (statistics.median(rates[k]) for k in (1, workers))
        print(
            f"  {label + ':':<30} {one / 1e6:8.2f} M words/s in 1 process, {many / 1e6:.2f} with {workers} "
            f"(x{many / one:.2f})"
        )
    print(f"  vocabulary: {tokenizer.vocab_size:,} ids")
    with tempfile.TemporaryDirectory() as tmp:
        encode_files(files, tokenizer, Path(tmp), workers=1)
        encoded = load_encoded(Path(tmp))
        assert encoded is not None
        print(f"  encoded: {encoded.num_sentences:,} sentences, {len(encoded.ids):,} ids")
        ids = np.asarray(encoded.ids)
        multi = MultiSequenceWindows(encoded.ids, encoded.offsets, batch_size, bptt, tokenizer.eos_id, shuffle=True)
        stream = StreamWindows(ids, batch_size, bptt, start_id=tokenizer.eos_id)
        results: dict[str, list[float]] = {"multi": [], "stream": []}
        for _ in range(rounds):  # alternating, so both see the same machine load
            for label, dataset in (("multi", multi), ("stream", stream)):
                start = time.perf_counter()
                slots = sum(w.inputs.numel() for w in dataset)
                results[label].append(slots / (time.perf_counter() - start))
        multi_rate, stream_rate = (statistics.median(results[k]) for k in ("multi", "stream"))
        print(
            f"  MultiSequenceWindows epoch:   {multi_rate / 1e6:8.2f} M tokens/s  (B {batch_size} x T {bptt}; "
            f"layout + windows, reset/mask included)"
        )
        print(
            f"  StreamWindows, same ids:      {stream_rate / 1e6:8.2f} M tokens/s  (contiguous, no resets; its "
            "column copy is built once, outside the timing)"
        )
        print(f"  ratio MultiSequence / Stream: {multi_rate / stream_rate:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", default=None, help="the GBW sample directory (default $LM_ZOO_DATA/gbw-sample)")
    parser.add_argument("--synthetic-tokens", type=int, default=0, help="also measure a synthetic corpus this large")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--bptt", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="repetitions; the median is printed")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    args = parser.parse_args()
    sample = Path(args.sample) if args.sample else data_root() / "gbw-sample"
    files = sorted(sample.glob("news.en*"))
    if files:
        measure(f"GBW sample ({sample})", files, args.batch_size, args.bptt, args.rounds, args.workers)
    else:
        print(f"no GBW sample in {sample}: set LM_ZOO_DATA or --sample", file=sys.stderr)
    if args.synthetic_tokens > 0:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            start = time.perf_counter()
            synthetic = write_synthetic(Path(tmp), args.synthetic_tokens)
            print(f"\n(wrote {args.synthetic_tokens:,} synthetic tokens in {time.perf_counter() - start:.1f} s)")
            measure("synthetic", synthetic, args.batch_size, args.bptt, args.rounds, args.workers)


if __name__ == "__main__":
    main()
