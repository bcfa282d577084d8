"""``lm-zoo``: train, evaluate and sample recurrent language models.

``fit``, ``validate``, ``test`` and ``predict`` go to LightningCLI (YAML configs, ``--print_config``, any option
overridable on the command line). The other subcommands take a SOURCE (a ``.ckpt``, an exported directory, a Hub
repo id or a registered model's short name) and are plain argparse: they need no Trainer, and LightningCLI cannot mix
its subcommands with others (``run=False`` disables them all).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import inspect
import json
import logging
import os
import re
import shlex
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import zoo
from zoo.allocator import keep_freed_memory
from zoo.errors import ConfigError, DataError, Interrupted, LMZooError

if TYPE_CHECKING:  # imported lazily at run time: `lm-zoo --help` should not pay for them
    from checkpoints.hub import Published

LIGHTNING_COMMANDS = {
    "fit": "train a model from a YAML config (lm-zoo fit --config configs/ptb/lstm-small.yaml)",
    "validate": "run the validation split through a model (LightningCLI)",
    "test": "run the test split through a model (LightningCLI; --ckpt_path)",
    "predict": "LightningCLI predict",
}
COMMANDS = {
    "evaluate": "perplexity / bits per character (music: NLL per frame) of a SOURCE on a split (--json: one object)",
    "generate": "sample text from a SOURCE (temperature, top-k, prompt, seed); music: MIDI files and piano rolls",
    "models": "list the architectures in the zoo (--pretrained: the published models)",
    "export": "write a SOURCE as config.json + model.safetensors + tokenizer + model card (--out DIR)",
    "publish": "upload an exported directory to the Hugging Face Hub (--repo-id owner/name)",
    "download": "fetch a Hub repo id or registered model into the Hugging Face cache; prints the path",
    "parse": "unsupervised constituency parsing with an ON-LSTM SOURCE: F1 per layer on a treebank, or one --text",
    "syneval": "targeted syntactic evaluation (Marvin & Linzen 2018) of a word-level SOURCE: accuracy per condition",
    "tune": "search hyperparameters with Optuna (--config X --space S --trials N); writes the best config",
    "search": "Jozefowicz et al. 2015's architecture search (--config X --storage URL --workers N --budget 2h); "
    "`search report` lists the best cells",
    "bundle": "maintainers: build pretrained/NAME from a run, publish the bundled models, render their README table",
}
SPLITS = ("train", "valid", "test")
SOURCE_HELP = (
    "a .ckpt written by lm-zoo fit, a run's directory (its newest best.ckpt, e.g. runs/ptb/lstm-small), a directory "
    "written by lm-zoo export, a Hub repo id or a registered name"
)


def _usage() -> str:
    lines = ["usage: lm-zoo COMMAND [options]   (lm-zoo COMMAND --help for its options; --debug shows tracebacks)", ""]
    lines += [f"  {name:<10} {text}" for name, text in {**LIGHTNING_COMMANDS, **COMMANDS}.items()]
    lines += ["", f"A SOURCE is {SOURCE_HELP} (lm-zoo models --pretrained)."]
    return "\n".join(lines)


class CommandParser(argparse.ArgumentParser):
    """The parser of lm-zoo's own subcommands: a bad argument is one line (``main`` prints it), not usage plus an
    error; ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}; {self.prog} --help lists the options")


DEVICE_HELP = "auto (a CUDA GPU where there is one, else cpu), cpu, cuda or cuda:N"


def device_argument(text: str) -> str:
    """``--device``: ``auto`` (the GPU where there is one), or a device PyTorch knows and this machine has."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is no device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: PyTorch sees no CUDA GPU on this machine: use --device cpu")
    return text


class LMZooArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, with its errors raised as one line (:class:`zoo.errors.ConfigError`, which ``main``
    prints) instead of 70-80 lines of usage before a multi-line report; ``--help`` still prints the usage.

    jsonargparse's own inner parsers are made with ``exit_on_error=False`` and catch their ``ArgumentError``s while
    trying alternatives (union types, subclasses); only the error that would end the program is turned into ours.
    """

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        raise ConfigError(parser_message(self, message)) from ex


# Lines of jsonargparse's reports that say how it searched rather than what is wrong.
_PARSER_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes:|Errors:|Expected a <class 'NoneType'>|"
    r"Given value type:|Given value:|Problem with given class_path)"
)


def parser_message(parser: argparse.ArgumentParser, message: str) -> str:
    """One line from a jsonargparse error report, naming the option, with a "did you mean" for a misspelt one."""
    unknown = re.search(r"Problem with given class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message)
    key = re.match(r'Parser key "([^"]+)"', message)
    if unknown and key:
        class_path, option = unknown.groups()
        module, _, name = class_path.rpartition(".")
        accepted = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
        near = difflib.get_close_matches(option, accepted, n=1)
        hint = f" (did you mean --{key[1]}.init_args.{near[0]}?)" if near else ""
        return f"--{key[1]}.init_args.{option}: {name} has no option {option!r}{hint}"
    extra = re.match(r"unrecognized arguments: (--[\w.]+)", message)
    if extra:
        options = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
        near = difflib.get_close_matches(extra[1], options, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return f"{message}{hint}; lm-zoo {parser.prog.split()[-1]} --help lists the options"
    # A value's problem: the innermost report, under the option's full name (a class's options are under init_args).
    keys = re.findall(r'Parser key "([^"]+)"', message)
    key = ".init_args.".join(keys) if "Problem with given class_path" in message else keys[0] if keys else None
    lines = [re.sub(r'^Parser key "[^"]+":\s*', "", line.strip().removeprefix("- ")) for line in message.splitlines()]
    lines = [line for line in lines if line and not _PARSER_NOISE.match(line)]
    text = "; ".join(lines) or message.strip()
    text = re.sub(r"Expected a <class '([\w.]+)'>\. Got value: ([^;]*)", r"expected \1, got '\2'", text)
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = text[:1].lower() + text[1:]
    return text if key is None else f"--{key}: {text}"


class LMZooCLI(LightningCLI):
    """LightningCLI with the vocabulary linked from the data, ``best.ckpt`` (``checkpoint.*``) and ``last.ckpt``
    (``last_checkpoint.*``) callbacks, atomic checkpoint writes, and a ``--ckpt_path last`` that finds the last
    checkpoint of the config's previous runs."""

    @staticmethod
    def configure_optimizers(
        lightning_module: object,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> object:
        """The YAML's optimizer and scheduler, stepped at the scheduler's own ``interval`` / ``frequency`` if it has
        them (``lightning_modules.schedules.scheduler_config``)."""
        from lightning_modules.schedules import scheduler_config

        return scheduler_config(optimizer, lr_scheduler)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The vocabulary is built from the training split when the data module is created.
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val_loss",
                "checkpoint.mode": "min",
                "checkpoint.filename": "best",
                "checkpoint.save_last": False,  # last.ckpt is last_checkpoint's, kept fresher than this one would
                "checkpoint.auto_insert_metric_name": False,
            }
        )
        from checkpoints.writing import LastCheckpoint

        # last.ckpt, for `--ckpt_path last`: every 30 minutes (or every_n_train_steps / train_time_interval), after
        # every validation and at the end, in the best checkpoint's directory.
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.link_arguments("checkpoint.dirpath", "last_checkpoint.dirpath")

    def _parse_ckpt_path(self) -> None:
        """LightningCLI (2.6) reads a ``--ckpt_path`` file's hyperparameters here, first of all: a truncated or foreign
        file is said in one line (:func:`checkpoints.ckpt.unreadable`) instead of ``torch.load``'s traceback."""
        try:
            super()._parse_ckpt_path()
        except LMZooError:
            raise
        except Exception as err:
            from checkpoints.ckpt import unreadable

            subcommand = self.config.get("subcommand")
            raise unreadable(self.config[subcommand].get("ckpt_path"), err) from None

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, writing checkpoints atomically unless the config names a CheckpointIO plugin of its own, with
        lm-zoo's progress bar (:class:`lightning_modules.progress.FitProgressBar`) unless the config names one or turns
        it off, and the learning rate logged (``LearningRateMonitor``) wherever there is a logger."""
        from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar

        from checkpoints.writing import AtomicCheckpointIO
        from lightning_modules.progress import FitProgressBar

        trainer_config = self._get(self.config_init, "trainer", default={})
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.append(FitProgressBar())
        if trainer_config.get("logger") is not False and not any(isinstance(c, LearningRateMonitor) for c in callbacks):
            callbacks.append(LearningRateMonitor())  # the schedule, as TensorBoard's lr-<Optimizer> curve
        kwargs = {"callbacks": callbacks, **kwargs}
        from datamodules.base import StreamDataModule

        reloads = trainer_config.get("reload_dataloaders_every_n_epochs")
        if isinstance(self.datamodule, StreamDataModule) and not reloads:
            # A training epoch's number of windows can change from epoch to epoch (shuffled pieces or sentences packed
            # into columns, AWD's variable BPTT), but Lightning reads the loader's length once and validates when the
            # batch index reaches it: an epoch one window shorter would skip its validation, a longer one validate
            # mid-epoch. A loader made afresh each epoch has that epoch's length (the stream takes its epoch from the
            # trainer, so the orders and a resumed position are unchanged).
            kwargs["reload_dataloaders_every_n_epochs"] = 1
        accelerator = str(trainer_config.get("accelerator") or "auto")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ConfigError(
                f"--trainer.accelerator {accelerator}: PyTorch sees no CUDA GPU on this machine: use "
                "--trainer.accelerator cpu (or auto, which picks a GPU where there is one)"
            )
        plugins = self._get(self.config_init, "trainer", default={}).get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        if self.subcommand == "fit" and self._get(self.config_init, "ckpt_path"):
            # A resumed run logs where it was interrupted when there are no version_N directories (logger: false, a
            # fixed version): its config.yaml replaces the interrupted run's instead of stopping the resume.
            self.save_config_kwargs = {**self.save_config_kwargs, "overwrite": True}
        return super().instantiate_trainer(**{"plugins": plugins, **kwargs})

    def after_fit(self) -> None:
        """Say where the run's work is and what to do with it next."""
        trainer = self.trainer
        if trainer.state.status != "finished" or not trainer.is_global_zero:
            return
        from checkpoints.writing import LastCheckpoint

        best = next((c for c in trainer.checkpoint_callbacks if not isinstance(c, LastCheckpoint)), None)
        last = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)), None)
        lines = []
        if best is not None and best.best_model_path:
            score = f" ({best.monitor} {float(best.best_model_score):.4f})" if best.best_model_score is not None else ""
            lines.append(f"best checkpoint: {best.best_model_path}{score}")
        if last is not None and last.last_model_path:
            lines.append(f"last checkpoint: {last.last_model_path}")
        if trainer.loggers and trainer.log_dir:
            lines.append(f"logs: {trainer.log_dir}  (tensorboard --logdir {Path(trainer.log_dir).parent})")
        if best is not None and best.best_model_path:
            lines.append(f"evaluate: lm-zoo evaluate {shlex.quote(best.best_model_path)} --split test")
            lines.append(f"sample: lm-zoo generate {shlex.quote(best.best_model_path)} --num-samples 3")
        if last is not None and last.last_model_path:
            configs = " ".join(
                f"--config {shlex.quote(str(c))}" for c in self.config[self.subcommand].get("config") or []
            )
            limit = "--trainer.max_steps N" if trainer.max_steps and trainer.max_steps > 0 else "--trainer.max_epochs N"
            lines.append(f"train further: lm-zoo fit {configs} --ckpt_path {shlex.quote(last.last_model_path)} {limit}")
        for line in lines:
            print(f"lm-zoo: {line}", file=sys.stderr)

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path``: a resumed run logs on in its checkpoint's TensorBoard version; ``last`` without a
        ``checkpoint.dirpath`` takes the newest ``last*.ckpt`` of the earlier versions (Lightning would look only in
        this run's new ``version_N/checkpoints``), and ``last`` with nothing to resume is one line, not a fresh start
        after a warning."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") not in (None, "last"):
            continue_logging_in(self.trainer, Path(config["ckpt_path"]))
        if config.get("ckpt_path") != "last":
            return
        directories = [Path(c.dirpath) for c in self.trainer.checkpoint_callbacks if c.dirpath]
        if directories:  # Lightning finds last.ckpt there itself, but starts afresh with a warning if there is none
            found = max(
                (p for d in directories for p in d.glob("last*.ckpt") if p.is_file()),
                key=lambda p: p.stat().st_mtime,
                default=None,
            )
        else:
            found = latest_last_checkpoint(self.trainer)
            if found is not None:
                config["ckpt_path"] = str(found)
        if found is None:
            where = ", ".join(map(str, directories)) or f"{versions_root(self.trainer)}/*/checkpoints"
            raise ConfigError(
                f"--ckpt_path last: nothing to resume, no last.ckpt from an earlier run of this config (looked in "
                f"{where}): leave out --ckpt_path to start a new run"
            )
        continue_logging_in(self.trainer, found)


def latest_last_checkpoint(trainer: Trainer) -> Path | None:
    """The newest ``last*.ckpt`` under the first logger's version directories (``<save_dir>/<name>/*/checkpoints``),
    where checkpoints go when ``checkpoint.dirpath`` is not set; ``None`` if there is none (or no logger)."""
    root = versions_root(trainer)
    found = [] if root is None else [path for path in root.glob("*/checkpoints/last*.ckpt") if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


def continue_logging_in(trainer: Trainer, checkpoint: Path) -> None:
    """A run resumed from ``<root>/version_N/checkpoints/*.ckpt`` logs on in ``version_N``: one TensorBoard run with
    one curve, not two halves in two versions (and ``best.ckpt`` keeps being tracked in the same directory)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    root = versions_root(trainer)
    logger = trainer.loggers[0] if trainer.loggers else None
    version = checkpoint.resolve().parent.parent
    if root is None or version.parent != root.resolve() or checkpoint.parent.name != "checkpoints":
        return
    # TensorBoard adds an event file beside the earlier ones and shows them as one run; CSVLogger would delete the
    # earlier metrics.csv, so it gets a new version. TensorBoardLogger chooses its version when first asked for it
    # (`_version`); a version given in the config is the user's to keep.
    if isinstance(logger, TensorBoardLogger) and logger._version is None:
        number = re.fullmatch(r"version_(\d+)", version.name)
        logger._version = int(number[1]) if number else version.name  # type: ignore[union-attr]


def versions_root(trainer: Trainer) -> Path | None:
    """Where the first logger's ``version_N`` directories are (``None`` without a logger)."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    return Path(logger.save_dir or trainer.default_root_dir, str(logger.name or ""))


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_known_noise() -> None:
    """Filter, by message, third-party warnings that every fit prints and that say nothing about this run.

    - ``isinstance(treespec, LeafSpec)`` is deprecated: Lightning 2.6's ``_pytree`` calls an API that PyTorch 2.13
      deprecates; Lightning's to update, nothing for a user to change.
    - ``IterableDataset`` has ``__len__`` ... ``num_workers > 1``: lm-zoo's loaders use no worker processes
      (``datamodules.base``), so the length is exact.
    - Lightning's "Tip" advertising a logging service, logged at every Trainer creation.
    """
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdverts) for f in rank_zero.filters):
        rank_zero.addFilter(_DropAdverts())


def run_lightning(argv: Sequence[str] | None, callbacks: Sequence[Any] = ()) -> None:
    """Run a LightningCLI subcommand (``fit``, ``validate``, ``test``, ``predict``); ``None`` reads ``sys.argv``.

    Args:
        argv: the subcommand and its arguments, or ``None``.
        callbacks: trainer callbacks a config cannot name (``lm-zoo tune``'s reporting to Optuna), added to the
            config's own.
    """
    # Importing is what lets a config name these classes by their short names.
    from lightning import LightningDataModule

    from datamodules import GBWDataModule, MusicDataModule, ReverseCopyDataModule, TextDataModule  # noqa: F401
    from lightning_modules import LanguageModel, MusicModel, ZarembaDecay  # noqa: F401
    from lightning_modules.stateful import StatefulTraining

    quiet_known_noise()
    check_config_files(sys.argv[2:] if argv is None else argv[1:])
    with warnings.catch_warnings():
        # Given argv (lm-zoo tune, tests), LightningCLI warns that the process's own command line differs: on purpose.
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter")
        LMZooCLI(
            StatefulTraining,  # LanguageModel (tokens) or MusicModel (piano rolls)
            LightningDataModule,  # any data module (TextDataModule, GBWDataModule, MusicDataModule, ...)
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_class=LMZooArgumentParser,
            args=None if argv is None else list(argv),
            trainer_defaults={"callbacks": list(callbacks)} if callbacks else None,
        )


def check_config_files(args: Sequence[str]) -> None:
    """Every ``--config FILE`` that exists parses as YAML, or one line naming the file, line and column.

    jsonargparse reports a YAML error without the file's name (``in "<unicode string>"``); a tab in the indentation,
    the usual cause, gets said in words.
    """
    import yaml

    paths = [b for a, b in zip(args, args[1:], strict=False) if a == "--config"]
    paths += [a.removeprefix("--config=") for a in args if a.startswith("--config=")]
    for path in map(Path, paths):
        if not path.is_file():
            continue  # the parser says that the file does not exist
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            lines = text.splitlines()
            tab = mark is not None and mark.line < len(lines) and "\t" in lines[mark.line]
            hint = ": YAML indents with spaces, not tabs" if tab else ""
            raise ConfigError(f"{path}{where}: not valid YAML ({problem}){hint}") from None


def cmd_evaluate(argv: Sequence[str]) -> None:
    """``lm-zoo evaluate SOURCE``: score a split with the full softmax (deterministic, MC dropout or dynamic)."""
    from lightning_modules.evaluation import add_procedure_arguments

    parser = CommandParser(prog="lm-zoo evaluate", description=COMMANDS["evaluate"])
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("--revision", help="for a Hub source: branch, tag or commit (default main)")
    parser.add_argument("--split", choices=("train", "valid", "test"), default="test")
    parser.add_argument("--batch-size", type=int, help="parallel streams (default: the training run's eval batch size)")
    parser.add_argument("--bptt", type=int, help="window length (default: the training run's eval BPTT)")
    parser.add_argument("--corpus", help="another corpus or directory to score (default: the training corpus)")
    parser.add_argument("--data-root", help="where corpora live (default: $LM_ZOO_DATA)")
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_procedure_arguments(parser)  # --long-context, --temperature, --mc-samples, --dynamic, --tune, ...
    args = parser.parse_args(argv)

    import checkpoints
    from lightning_modules.evaluation import check_settings, describe, evaluate, procedure_from_args

    procedure = procedure_from_args(args)  # mc, dynamic, tune_trials
    check_settings(args.batch_size, args.bptt, args.long_context, args.temperature, **procedure)  # before loading
    loaded = checkpoints.load(args.source, args.revision)
    datamodule = loaded.datamodule(args.corpus, args.data_root)
    if loaded.is_music:
        _evaluate_music(args, loaded, datamodule, procedure)
        return
    options = {"long_context": args.long_context, "temperature": args.temperature, "seed": args.seed, **procedure}
    result = evaluate(loaded.model, datamodule, args.split, args.batch_size, args.bptt, args.device, **options)
    result["source"] = loaded.source
    if args.json:
        print(json.dumps(result))
        return
    print(describe(result, char_level=datamodule.level == "char"))


def _evaluate_music(args: argparse.Namespace, loaded: Any, datamodule: Any, procedure: dict[str, Any]) -> None:
    """``lm-zoo evaluate`` of a piano-roll model: NLL per frame (the procedures are for softmax models)."""
    from lightning_modules.music import describe_music, evaluate_music

    if procedure["mc"] or procedure["dynamic"] or args.long_context or args.temperature != 1.0:
        raise ConfigError(
            f"{loaded.source} is a music model, scored as it is: --temperature, --long-context, --mc-samples and "
            "--dynamic apply to text models; drop them"
        )
    result = evaluate_music(loaded.model, datamodule, args.split, args.batch_size, args.bptt, args.device)
    result["source"] = loaded.source
    print(json.dumps(result) if args.json else describe_music(result))


def cmd_generate(argv: Sequence[str]) -> None:
    """``lm-zoo generate SOURCE``: sample text, one sample per line."""
    parser = CommandParser(prog="lm-zoo generate", description=COMMANDS["generate"])
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("--revision", help="for a Hub source: branch, tag or commit (default main)")
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
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    music = parser.add_argument_group("music models (piano rolls): each sample a MIDI file and a PNG piano roll")
    music.add_argument("--out", help="the directory to write sample-K.mid and sample-K.png into (required)")
    music.add_argument("--frames", type=int, default=128, help="frames sampled per piece (default 128)")
    music.add_argument("--primer-piece", type=int, help="start from the opening of this piece of the test split")
    music.add_argument("--primer-frames", type=int, default=16, help="frames of that opening (default 16)")
    music.add_argument("--data-root", help="where the dataset lives, for --primer-piece (default: $LM_ZOO_DATA)")
    args = parser.parse_args(argv)
    if args.num_samples < 1 or args.max_tokens < 1:
        raise ConfigError("--num-samples and --max-tokens must be at least 1")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {args.top_k}")

    import checkpoints

    loaded = checkpoints.load(args.source, args.revision)
    if loaded.is_music:
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
        print(
            json.dumps(
                {
                    "source": loaded.source,
                    "prompt": args.prompt,
                    "temperature": temperature,
                    "top_k": args.top_k,
                    "seed": args.seed,
                    "samples": texts,
                }
            )
        )
    else:
        print("\n".join(text.replace("\n", " ") for text in texts))


def _generate_music(args: argparse.Namespace, loaded: Any) -> None:
    """``lm-zoo generate`` of a piano-roll model: each sample a MIDI file and a piano-roll PNG under ``--out``."""
    import numpy as np

    from datamodules.midi import write_midi, write_png
    from datamodules.music import music_dataset

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


def cmd_parse(argv: Sequence[str]) -> None:
    """``lm-zoo parse SOURCE``: trees from an ON-LSTM's master forget gate (Shen et al. 2019 §5.2)."""
    parser = CommandParser(prog="lm-zoo parse", description=COMMANDS["parse"])
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("--revision", help="for a Hub source: branch, tag or commit (default main)")
    parser.add_argument(
        "--treebank", help="bracketed Penn Treebank trees: a zip or directory of .mrg files "
        "(default: $LM_ZOO_DATA/treebank/treebank.zip, NLTK's WSJ sample)"
    )  # fmt: skip
    parser.add_argument("--text", help="parse this sentence instead (words separated by spaces) and draw its tree")
    parser.add_argument("--layer", type=int, help="the layer whose split points parse --text (default: the 2nd)")
    parser.add_argument("--draw", metavar="PNG", help="with --text: also draw the tree into this PNG file")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per forward pass")
    parser.add_argument("--seed", type=int, default=0, help="of the random-tree baseline")
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.draw and args.text is None:
        raise ConfigError("--draw draws the tree of --text: give the sentence with --text")

    import checkpoints
    from datamodules.corpora import data_root
    from lightning_modules import parsing

    trees = None
    if args.text is None:  # before loading a model: a missing treebank stops at once
        treebank = Path(args.treebank) if args.treebank else data_root() / "treebank" / "treebank.zip"
        trees = parsing.read_treebank(treebank)
    loaded = checkpoints.load(args.source, args.revision)
    model = loaded.model.to(args.device)
    if trees is None:
        words, d_hat = parsing.parse_text(model, loaded.tokenizer, args.text)
        layer = args.layer or min(2, d_hat.shape[0])
        if not 1 <= layer <= d_hat.shape[0]:
            raise ConfigError(f"--layer must be between 1 and {d_hat.shape[0]} (the model's layers), got {layer}")
        tree = parsing.greedy_split(words, d_hat[layer - 1].tolist())
        if args.draw:
            parsing.draw_png(tree, args.draw)
        if args.json:
            split_points = [[round(v, 4) for v in row] for row in d_hat.tolist()]
            print(json.dumps({"source": loaded.source, "words": words, "layer": layer, "tree": tree,
                              "split_points": split_points}))  # fmt: skip
        else:
            print(parsing.draw_text(tree))
        return
    result = parsing.evaluate_parsing(model, loaded.tokenizer, trees, args.batch_size, args.seed)
    result = {"source": loaded.source, "treebank": str(treebank), **result}
    if args.json:
        print(json.dumps(result))
        return
    print(parsing.describe(result))


def cmd_syneval(argv: Sequence[str]) -> None:
    """``lm-zoo syneval SOURCE``: Marvin & Linzen's minimal pairs, accuracy per condition (Shen et al. 2019 §5.3)."""
    parser = CommandParser(prog="lm-zoo syneval", description=COMMANDS["syneval"])
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("--revision", help="for a Hub source: branch, tag or commit (default main)")
    parser.add_argument(
        "--templates", help="templates.tar.xz or emnlp2018_templates.tar.xz (MANIFEST.md), or a directory of the "
        "original pickles (default: $LM_ZOO_DATA/syneval/templates.tar.xz)"
    )  # fmt: skip
    parser.add_argument("--max-tuples", type=int, help="score only the first N tuples of each condition (a quick look)")
    parser.add_argument("--batch-size", type=int, default=256, help="sentences per forward pass")
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.max_tuples is not None and args.max_tuples < 1):
        raise ConfigError("--batch-size and --max-tuples must be at least 1")

    import checkpoints
    from datamodules.corpora import data_root
    from lightning_modules import syneval

    templates = Path(args.templates) if args.templates else data_root() / "syneval" / "templates.tar.xz"
    conditions = syneval.read_templates(templates)  # before loading a model: a refused file stops at once
    loaded = checkpoints.load(args.source, args.revision)
    if loaded.tokenizer.kind not in ("word", "sentence"):
        raise ConfigError(
            f"syneval scores sentences word by word, and {args.source} reads {loaded.tokenizer.kind} tokens: "
            "give a word-level model"
        )
    result = syneval.evaluate_syneval(
        loaded.model.to(args.device), loaded.tokenizer, conditions, args.batch_size, args.max_tuples
    )
    result = {"source": loaded.source, "templates": str(templates), **result}
    print(json.dumps(result) if args.json else syneval.describe(result))


def cmd_models(argv: Sequence[str]) -> None:
    """``lm-zoo models``: the architectures in the zoo, or (``--pretrained``) the registry of published models."""
    parser = CommandParser(prog="lm-zoo models", description=COMMANDS["models"])
    parser.add_argument("--pretrained", action="store_true", help="the published models ($LM_ZOO_REGISTRY overrides)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.pretrained:
        _print_registry(args.json)
        return
    rows = [
        {"name": name, "description": text, "reference": ref, "presets": list(zoo.get(name).presets)}
        for name, text, ref in zoo.describe()
    ]
    if args.json:
        print(json.dumps(rows))
        return
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        presets = ", ".join(row["presets"])
        print(f"{row['name']:<{width}}  {row['description']}  [{row['reference']}; presets: {presets}]")


def _print_registry(as_json: bool) -> None:
    from checkpoints import registry

    entries = registry.load_registry()
    if as_json:
        print(json.dumps([entry.to_json() for entry in entries.values()]))
        return
    if not entries:
        print(f"no pretrained models are registered yet ({registry.registry_path()})")
    for entry in entries.values():
        scores = "; ".join(
            ", ".join(
                f"{split} {metric} {value:.6g}"
                for metric, value in result.items()
                if metric in ("ppl", "bpc", "nll_per_step")
            )
            + f" (eval batch {result['eval_batch_size']}, bptt {result['bptt']})"
            for split, result in entry.results.items()
        )
        size = f"{entry.num_parameters:,} parameters, " if entry.num_parameters else ""
        size += f"{entry.size_bytes / 1e6:.1f} MB" if entry.size_bytes else "not bundled"
        where = f"{entry.repo_id}@{entry.revision}"
        print(f"{entry.name:<20} {entry.dataset} {entry.architecture} ({size})  {scores}  [{where}]")


def cmd_export(argv: Sequence[str]) -> None:
    """``lm-zoo export SOURCE --out DIR``: the shareable format, with the results measured for its model card."""
    parser = CommandParser(prog="lm-zoo export", description=COMMANDS["export"])
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("--out", required=True, help="the export directory (created; a previous export is replaced)")
    splits_help = "splits to evaluate for the model card (default: valid test; none: no evaluation)"
    parser.add_argument("--splits", nargs="*", default=["valid", "test"], choices=SPLITS, help=splits_help)
    results_help = "use `lm-zoo evaluate --json` outputs saved in these files instead of evaluating"
    parser.add_argument("--results", nargs="+", metavar="JSON", help=results_help)
    parser.add_argument("--batch-size", type=int, help="eval batch size (default: the training run's)")
    parser.add_argument("--bptt", type=int, help="eval BPTT (default: the training run's)")
    parser.add_argument("--data-root", help="where corpora live (default: $LM_ZOO_DATA)")
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    from checkpoints.export import CONFIG_NAME, export

    results = [_read_result(path) for path in args.results] if args.results else None
    evaluation = {"batch_size": args.batch_size, "bptt": args.bptt, "data_root": args.data_root, "device": args.device}
    out = export(args.source, args.out, splits=args.splits, results=results, **evaluation)
    config = json.loads((out / CONFIG_NAME).read_text())
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    if args.json:
        print(json.dumps({"out": str(out), "files": files, "results": config["results"]}))
        return
    print(f"{out}: " + ", ".join(f"{name} ({size:,} bytes)" for name, size in files.items()))
    for result in config["results"]:
        if "nll_per_step" in result:  # a music model: nats per frame
            metric = f"NLL per step {result['nll_per_step']:.4f}"
        else:
            metric = f"bpc {result['bpc']:.4f}" if "bpc" in result else f"ppl {result['ppl']:.2f}"
        print(f"  {result['split']}: {metric} (eval batch size {result['eval_batch_size']}, bptt {result['bptt']})")


def _read_result(path: str) -> dict:
    try:
        return json.loads(open(path, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--results {path}: not a saved `lm-zoo evaluate --json` output ({err})") from None


def cmd_publish(argv: Sequence[str]) -> None:
    """``lm-zoo publish DIR --repo-id owner/name``: create the repo if needed, upload, print the URL."""
    parser = CommandParser(prog="lm-zoo publish", description=COMMANDS["publish"])
    parser.add_argument("directory", help="a directory written by lm-zoo export")
    parser.add_argument("--repo-id", required=True, help="owner/name on the Hub (HF_TOKEN: a token with write access)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", help="the branch to commit to, created if missing (default main)")
    parser.add_argument("--tag", help="also tag the commit (e.g. v1), so downloads can pin it")
    parser.add_argument("--commit-message")
    parser.add_argument("--endpoint", help="the Hub's URL (default: $HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--name", help="short name for the registry entry printed with --json (default: repo name)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (with a registry entry)")
    args = parser.parse_args(argv)

    from checkpoints import hub, registry
    from checkpoints.export import CONFIG_NAME

    options = {"revision": args.revision, "tag": args.tag, "commit_message": args.commit_message}
    published: Published = hub.publish(
        args.directory, args.repo_id, private=args.private, endpoint=args.endpoint, **options
    )
    if args.json:
        config = json.loads(open(f"{args.directory}/{CONFIG_NAME}", encoding="utf-8").read())
        name = args.name or args.repo_id.split("/")[-1].lower()
        entry = registry.entry_for(config, name, args.repo_id, published.tag or published.commit)
        print(json.dumps({**published.__dict__, "registry_entry": entry.to_json()}))
        return
    print(published.url)
    print(f"commit {published.commit} on {published.revision}" + (f", tagged {published.tag}" if published.tag else ""))


def cmd_download(argv: Sequence[str]) -> None:
    """``lm-zoo download ID``: a repo id or registered short name into the Hugging Face cache; prints the path."""
    parser = CommandParser(prog="lm-zoo download", description=COMMANDS["download"])
    parser.add_argument("model", help="owner/name, or a short name from lm-zoo models --pretrained")
    parser.add_argument("--revision", help="branch, tag or commit (default main, or the registry's pinned revision)")
    parser.add_argument("--endpoint", help="the Hub's URL (default: $HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    from checkpoints import hub, registered_directory, registry

    entry = registry.lookup(args.model) if "/" not in args.model else None
    if entry is not None:
        repo_id, revision = entry.repo_id, args.revision or entry.revision
        path = registered_directory(entry, args.revision, endpoint=args.endpoint)
    elif "/" in args.model:
        repo_id, revision = args.model, args.revision
        path = hub.download(repo_id, revision, endpoint=args.endpoint)
    else:
        raise ConfigError(f"{args.model!r} is no registered model (lm-zoo models --pretrained) and no owner/name")
    print(json.dumps({"repo_id": repo_id, "revision": revision, "path": str(path)}) if args.json else path)


def cmd_tune(argv: Sequence[str]) -> None:
    """``lm-zoo tune``: Optuna search over a space of config keys (``lightning_modules.tuning``)."""
    from lightning_modules.tuning import cmd_tune as tune

    tune(argv)


def cmd_search(argv: Sequence[str]) -> None:
    """``lm-zoo search``: the architecture search (:mod:`lightning_modules.evolution`)."""
    from lightning_modules.evolution import cmd_search as search

    search(argv)


def cmd_bundle(argv: Sequence[str]) -> None:
    """``lm-zoo bundle``: the shipped pretrained models (:mod:`checkpoints.bundle`)."""
    from checkpoints.bundle import cmd_bundle as bundle

    bundle(argv)


HANDLERS: dict[str, Callable[[Sequence[str]], None]] = {
    "evaluate": cmd_evaluate,
    "generate": cmd_generate,
    "models": cmd_models,
    "export": cmd_export,
    "publish": cmd_publish,
    "download": cmd_download,
    "parse": cmd_parse,
    "syneval": cmd_syneval,
    "tune": cmd_tune,
    "search": cmd_search,
    "bundle": cmd_bundle,
}


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


# errno values that say something about the user's paths (permissions, a file where a directory should be, a full
# disk), not about lm-zoo: these become one line too.
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def user_error(err: BaseException) -> LMZooError | None:
    """The one-line error for ``err``, or ``None`` for a bug (which keeps its traceback).

    This is the one place where exceptions become messages: lm-zoo's own errors (also when jsonargparse or Lightning
    re-raised them wrapped in one of theirs), Lightning's verdicts on a configuration, and operating-system errors
    about the user's paths.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    chain = _chain(err)
    ours = next((e for e in chain if isinstance(e, LMZooError)), None)
    if ours is not None:
        return ours
    for current in chain:
        if isinstance(current, MisconfigurationException):
            text = " ".join(str(current).split())
            return ConfigError(f"Lightning: {text}")
        if isinstance(current, OSError) and current.filename and current.errno in _PATH_ERRNOS:
            from datamodules.corpora import cache_root

            path = Path(current.filename)
            cache = cache_root()
            hint = "set LM_ZOO_CACHE to a writable directory" if path.is_relative_to(cache) else "check the path"
            return DataError(f"{path}: {current.strerror.lower()}: {hint}")
    return None


def resume_hint(argv: Sequence[str], checkpoint: str | None) -> str:
    """``"; resume: lm-zoo ARGV --ckpt_path CHECKPOINT"``, the interrupted command continued (``""`` if nothing was
    written)."""
    if checkpoint is None:
        return ""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return f"; resume: lm-zoo {shlex.join([*kept, '--ckpt_path', checkpoint])}"


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
    keep_freed_memory()  # before the first step's allocations: see zoo.allocator
    try:
        if command in LIGHTNING_COMMANDS:
            run_lightning(None if from_sys_argv else argv)
        elif command in HANDLERS:
            HANDLERS[command](rest)
        else:
            raise ConfigError(f"unknown command {command!r}: use one of {', '.join([*LIGHTNING_COMMANDS, *HANDLERS])}")
        sys.stdout.flush()  # here, where a closed pipe is caught below, rather than at interpreter exit
    except BrokenPipeError:
        # The reader went away (`lm-zoo models | head -3`): stop quietly, as Unix tools do. Python would otherwise
        # print a traceback now and another one when it flushes stdout at exit, so point stdout at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the signal
    except Exception as err:
        ours = user_error(err)
        if ours is None or debug:
            raise
        if isinstance(ours, Interrupted):
            print(f"lm-zoo: interrupted: {ours}{resume_hint(argv, ours.checkpoint)}", file=sys.stderr)
        else:
            print(f"lm-zoo: error: {ours}", file=sys.stderr)
        return ours.exit_code
    except KeyboardInterrupt:
        print("lm-zoo: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
