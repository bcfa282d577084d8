"""``lm-zoo``: train, evaluate and sample recurrent language models.

``fit``, ``validate``, ``test`` and ``predict`` go to LightningCLI (YAML configs, ``--print_config``, any option
overridable on the command line). The other subcommands take a SOURCE (a ``.ckpt``) and are plain argparse: they
need no Trainer, and LightningCLI cannot mix its subcommands with others (``run=False`` disables them all).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import zoo
from zoo.errors import ConfigError, LMZooError

if TYPE_CHECKING:  # imported lazily at run time: `lm-zoo --help` should not pay for them
    from checkpoints import LoadedModel
    from datamodules import TextDataModule

LIGHTNING_COMMANDS = {
    "fit": "train a model from a YAML config (lm-zoo fit --config configs/ptb/lstm-small.yaml)",
    "validate": "run the validation split through a model (LightningCLI)",
    "test": "run the test split through a model (LightningCLI; --ckpt_path)",
    "predict": "LightningCLI predict",
}
COMMANDS = {
    "evaluate": "perplexity / bits per character of a SOURCE on a split (--json for one JSON object)",
    "generate": "sample text from a SOURCE (temperature, top-k, prompt, seed)",
    "models": "list the architectures in the zoo",
}


def _usage() -> str:
    lines = ["usage: lm-zoo COMMAND [options]   (lm-zoo COMMAND --help for its options; --debug shows tracebacks)", ""]
    lines += [f"  {name:<10} {text}" for name, text in {**LIGHTNING_COMMANDS, **COMMANDS}.items()]
    lines += ["", "A SOURCE is a .ckpt written by `lm-zoo fit`."]
    return "\n".join(lines)


class LMZooCLI(LightningCLI):
    """LightningCLI with the vocabulary linked from the data and a default best/last checkpoint callback."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The vocabulary is built from the training split when the data module is created.
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val_loss",
                "checkpoint.mode": "min",
                "checkpoint.filename": "best",
                "checkpoint.save_last": True,
                "checkpoint.auto_insert_metric_name": False,
            }
        )


def run_lightning(argv: Sequence[str] | None) -> None:
    """Run a LightningCLI subcommand (``fit``, ``validate``, ``test``, ``predict``); ``None`` reads ``sys.argv``."""
    # Importing is what lets a config name these classes by their short names.
    from datamodules import TextDataModule
    from lightning_modules import LanguageModel, ZarembaDecay  # noqa: F401

    LMZooCLI(
        LanguageModel,
        TextDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if argv is None else list(argv),
    )


def _datamodule_for(loaded: LoadedModel, corpus: str | None, data_root: str | None) -> TextDataModule:
    """The data module a loaded model was trained with (or ``corpus``), using the model's own tokenizer."""
    from datamodules import TextDataModule

    settings = dict(loaded.data)
    if not settings.get("corpus") and corpus is None:
        raise ConfigError(f"{loaded.source} does not say which corpus it was trained on: pass --corpus")
    if corpus is not None:
        settings["corpus"] = corpus
    if data_root is not None:
        settings["data_root"] = data_root
    datamodule = TextDataModule(**settings)
    datamodule.load_state_dict({"tokenizer": loaded.tokenizer.state_dict()})
    return datamodule


def cmd_evaluate(argv: Sequence[str]) -> None:
    """``lm-zoo evaluate SOURCE``: score a split deterministically with the full softmax."""
    parser = argparse.ArgumentParser(prog="lm-zoo evaluate", description=COMMANDS["evaluate"])
    parser.add_argument("source", help="a .ckpt written by lm-zoo fit")
    parser.add_argument("--split", choices=("train", "valid", "test"), default="test")
    parser.add_argument("--batch-size", type=int, help="parallel streams (default: the training run's eval batch size)")
    parser.add_argument("--bptt", type=int, help="window length (default: the training run's eval BPTT)")
    parser.add_argument("--corpus", help="another corpus or directory to score (default: the training corpus)")
    parser.add_argument("--data-root", help="where corpora live (default: $LM_ZOO_DATA)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    import checkpoints
    from lightning_modules.evaluation import evaluate

    loaded = checkpoints.load(args.source)
    datamodule = _datamodule_for(loaded, args.corpus, args.data_root)
    result = evaluate(loaded.model, datamodule, args.split, args.batch_size, args.bptt, args.device)
    result["source"] = loaded.source
    if args.json:
        print(json.dumps(result))
        return
    char_level = "bpc" in result and datamodule.level == "char"
    metric = f"bpc {result['bpc']:.4f}" if char_level else f"ppl {result['ppl']:.2f}"
    print(
        f"{result['corpus']} {result['split']}: {metric}  (loss {result['loss']:.4f} nats/token over "
        f"{result['tokens']:,} tokens; eval batch size {result['eval_batch_size']}, bptt {result['bptt']})"
    )


def cmd_generate(argv: Sequence[str]) -> None:
    """``lm-zoo generate SOURCE``: sample text, one sample per line."""
    parser = argparse.ArgumentParser(prog="lm-zoo generate", description=COMMANDS["generate"])
    parser.add_argument("source", help="a .ckpt written by lm-zoo fit")
    parser.add_argument("--prompt", default="", help="text to continue (default: the start of a new line)")
    parser.add_argument("--num-samples", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=100, help="most tokens per sample (a sample ends at <eos>)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.num_samples < 1 or args.max_tokens < 1:
        raise ConfigError("--num-samples and --max-tokens must be at least 1")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {args.top_k}")

    import checkpoints

    loaded = checkpoints.load(args.source)
    tokenizer, model = loaded.tokenizer, loaded.model.to(args.device)
    # Every sample starts at the beginning of a line: the end-of-line token is its context, then the prompt.
    prompt_ids = [tokenizer.eos_id] + tokenizer.encode(args.prompt)
    prompt = torch.tensor([prompt_ids] * args.num_samples, device=args.device)
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    samples = model.generate(
        prompt, args.max_tokens, args.temperature, args.top_k, stop_id=tokenizer.eos_id, generator=generator
    )
    texts = [tokenizer.decode(prompt_ids[1:] + ids).rstrip("\n") for ids in samples]
    if args.json:
        print(json.dumps({"source": loaded.source, "prompt": args.prompt, "temperature": args.temperature,
                          "top_k": args.top_k, "seed": args.seed, "samples": texts}))
    else:
        print("\n".join(text.replace("\n", " ") for text in texts))


def cmd_models(argv: Sequence[str]) -> None:
    """``lm-zoo models``: the architectures in the zoo."""
    parser = argparse.ArgumentParser(prog="lm-zoo models", description=COMMANDS["models"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [
        {"name": name, "description": text, "reference": ref, "presets": list(zoo.get(name).presets)}
        for name, text, ref in zoo.describe()
    ]
    if args.json:
        print(json.dumps(rows))
        return
    for row in rows:
        print(f"{row['name']:<10} {row['description']}  [{row['reference']}; presets: {', '.join(row['presets'])}]")


HANDLERS: dict[str, Callable[[Sequence[str]], None]] = {
    "evaluate": cmd_evaluate,
    "generate": cmd_generate,
    "models": cmd_models,
}


def _lm_zoo_error(err: BaseException) -> LMZooError | None:
    """Our error, also when jsonargparse or Lightning re-raised it wrapped in one of theirs."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, LMZooError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lm-zoo`` console script; returns the exit status."""
    from_sys_argv = argv is None and "--debug" not in sys.argv
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command in LIGHTNING_COMMANDS:
            run_lightning(None if from_sys_argv else argv)
        elif command in HANDLERS:
            HANDLERS[command](rest)
        else:
            raise ConfigError(f"unknown command {command!r}: use one of {', '.join([*LIGHTNING_COMMANDS, *HANDLERS])}")
    except Exception as err:
        ours = _lm_zoo_error(err)
        if ours is None or debug:
            raise
        print(f"lm-zoo: error: {ours}", file=sys.stderr)
        return ours.exit_code
    except KeyboardInterrupt:
        print("lm-zoo: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
