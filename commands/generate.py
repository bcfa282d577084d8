"""``lm-zoo generate SOURCE``: sampled text, one sample per line; for a music model, MIDI files and piano rolls."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import checkpoints
from commands import COMMANDS
from commands.common import (
    CommandParser,
    quantize_model,
    source_arguments,
)
from datamodules.kinds import MUSIC
from datamodules.midi import write_midi, write_png
from datamodules.piano_rolls import music_dataset
from zoo.errors import ConfigError


def _parser() -> CommandParser:
    parser = CommandParser(prog="lm-zoo generate", description=COMMANDS["generate"].summary)
    source_arguments(parser, quantize=True)
    parser.add_argument("--prompt", default="", help="text to continue (default: the start of a new line / sentence)")
    parser.add_argument("--num-samples", type=int, default=5, help="samples (sentence models: sentences), one per line")
    parser.add_argument(
        "--max-tokens", type=int, default=100, help="most tokens per sample (a sample ends at <eos>, or </S>)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="softmax temperature (default: 0.7 for sentence models such as GBW's, as Léonard 2016 samples; else 1.0)",
    )
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    music = parser.add_argument_group("music models (piano rolls): each sample a MIDI file and a PNG piano roll")
    music.add_argument("--out", help="the directory to write sample-K.mid and sample-K.png into (required)")
    music.add_argument("--frames", type=int, default=128, help="frames sampled per piece (default 128)")
    music.add_argument("--primer-piece", type=int, help="start from the opening of this piece of the test split")
    music.add_argument("--primer-frames", type=int, default=16, help="frames of that opening (default 16)")
    music.add_argument("--data-root", help="where the dataset lives, for --primer-piece (default: $LM_ZOO_DATA)")
    return parser


def cmd_generate(argv: Sequence[str]) -> None:
    """``lm-zoo generate SOURCE``: sample text, one sample per line."""
    args = _parser().parse_args(argv)
    if args.num_samples < 1 or args.max_tokens < 1:
        raise ConfigError("--num-samples and --max-tokens must be at least 1")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {args.top_k}")

    loaded = checkpoints.load(args.source, args.revision)
    quantize_model(loaded, args.quantize, args.device)
    if loaded.kind is MUSIC:
        _generate_music(args, loaded)
        return
    if args.out is not None:
        raise ConfigError(f"--out is for music models; {loaded.source} samples text, printed on stdout")
    unknown = loaded.tokenizer.unknown(args.prompt)
    if unknown:  # still sampled, from <unk>: say so rather than continue a prompt the model never saw
        lower = [w.lower() for w in unknown if not loaded.tokenizer.unknown(w.lower())]
        hint = f" (its vocabulary is lower-case: {', '.join(lower)} would be known)" if lower else ""
        print(
            f"lm-zoo: note: {len(unknown)} prompt word(s) not in the model's vocabulary, read as <unk>: "
            f"{', '.join(unknown)}{hint}",
            file=sys.stderr,
        )
    texts, temperature = loaded.sample(
        args.prompt, args.num_samples, args.max_tokens, args.temperature, args.top_k, args.seed, args.device
    )
    if args.json:
        said = {"source": loaded.source, "prompt": args.prompt, "temperature": temperature, "top_k": args.top_k}
        print(json.dumps({**said, "seed": args.seed, "samples": texts}))
    else:
        print("\n".join(text.replace("\n", " ") for text in texts))


def _generate_music(args: argparse.Namespace, loaded: Any) -> None:
    """``lm-zoo generate`` of a piano-roll model: each sample a MIDI file and a piano-roll PNG under ``--out``."""
    if args.out is None:
        raise ConfigError(f"{loaded.source} is a music model, whose samples are MIDI files: pass --out DIR")
    if args.prompt or args.top_k is not None:
        raise ConfigError("--prompt and --top-k are for text models; a music sample starts from --primer-piece")
    if args.frames < 1 or args.primer_frames < 1:
        raise ConfigError(
            f"--frames and --primer-frames must be at least 1, got {args.frames} and {args.primer_frames}"
        )
    primer = None
    if args.primer_piece is not None:
        rolls = loaded.datamodule(data_root=args.data_root).encoded("test")
        if not 0 <= args.primer_piece < rolls.num_pieces:
            raise ConfigError(
                f"--primer-piece {args.primer_piece}: the test split has pieces 0 to {rolls.num_pieces - 1}"
            )
        primer = torch.from_numpy(rolls.piece(args.primer_piece)[: args.primer_frames]).float()  # (P, 88)
    temperature = 1.0 if args.temperature is None else args.temperature
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    model = loaded.model.to(args.device)
    frames = model.generate(args.frames, args.num_samples, primer, temperature, generator).numpy()  # (S, T, 88)
    beats = music_dataset(loaded.data["dataset"]).frame_beats
    out = Path(args.out)
    samples = []
    for index, roll in enumerate(frames, start=1):
        if primer is not None:  # the opening it continues, then the sample
            roll = np.concatenate([primer.numpy().astype(np.uint8), roll])
        midi = write_midi(roll, out / f"sample-{index}.mid", frame_beats=beats)
        png = write_png(roll, out / f"sample-{index}.png")
        samples.append({"midi": str(midi), "png": str(png), "frames": len(roll), "notes_sounding": int(roll.sum())})
    if args.json:
        record = {"source": loaded.source, "temperature": temperature, "seed": args.seed, "samples": samples}
        record["primer"] = None if primer is None else {"piece": args.primer_piece, "frames": len(primer)}
        print(json.dumps(record))
    else:
        print("\n".join(f"{s['midi']}  {s['png']}  ({s['frames']} frames)" for s in samples))
