"""The subcommands of ``lm-zoo``: one module each (``commands/<name>.py``, a ``cmd_<name>(argv)``), with what they share
in :mod:`commands.common`, listed once in :data:`COMMANDS`, the table ``cli.py`` dispatches from and prints as its
usage.

This is the layer above the library (``checkpoints``, ``lightning_modules``, ``datamodules``, ``zoo``): argument
parsing, printing and exit codes live here and in ``cli.py``, never below.
"""

from typing import NamedTuple


class Command(NamedTuple):
    """A subcommand: what it does in one line (its ``--help`` description and its line in ``lm-zoo --help``) and the
    function that runs it, ``module:function``, imported only when it runs (``lm-zoo --help`` imports no torch)."""

    summary: str
    runs: str
    lightning: bool = False  # a LightningCLI subcommand: its function takes the whole command line, subcommand first


_LIGHTNING = "commands.fit:run_lightning"
COMMANDS = {
    "fit": Command(
        "train a model from a YAML config or a shipped recipe's name (lm-zoo fit --config ptb/lstm-small)",
        _LIGHTNING,
        True,
    ),
    "validate": Command("run the validation split through a model (LightningCLI)", _LIGHTNING, True),
    "test": Command("run the test split through a model (LightningCLI; --ckpt_path)", _LIGHTNING, True),
    "predict": Command("LightningCLI predict", _LIGHTNING, True),
    "evaluate": Command(
        "perplexity / bits per character (music: NLL per frame) of a SOURCE on a split (--json: one object)",
        "commands.evaluate:cmd_evaluate",
    ),
    "generate": Command(
        "sample text from a SOURCE (temperature, top-k, prompt, seed); music: MIDI files and piano rolls",
        "commands.generate:cmd_generate",
    ),
    "models": Command(
        "list the architectures in the zoo (--pretrained: the published models)", "commands.models:cmd_models"
    ),
    "recipes": Command(
        "list the shipped recipes (configs/), each a name for fit --config: lm-zoo fit --config ptb/lstm-small",
        "commands.recipes:cmd_recipes",
    ),
    "export": Command(
        "write a SOURCE as config.json + model.safetensors + tokenizer + model card (--out DIR)",
        "commands.sharing:cmd_export",
    ),
    "publish": Command(
        "upload an exported directory to the Hugging Face Hub (--repo-id owner/name)", "commands.sharing:cmd_publish"
    ),
    "download": Command(
        "fetch a Hub repo id or registered model into the Hugging Face cache; prints the path",
        "commands.sharing:cmd_download",
    ),
    "parse": Command(
        "unsupervised constituency parsing with an ON-LSTM SOURCE: F1 per layer on a treebank, or one --text",
        "commands.parse:cmd_parse",
    ),
    "syneval": Command(
        "targeted syntactic evaluation (Marvin & Linzen 2018) of a word-level SOURCE: accuracy per condition",
        "commands.syneval:cmd_syneval",
    ),
    "score": Command(
        "log-probability of each sentence of a FILE (JSON lines), or an n-best list with an LM score column",
        "commands.score:cmd_score",
    ),
    "tune": Command(
        "search hyperparameters with Optuna (--config X --space S --trials N); writes the best config",
        "commands.tune:cmd_tune",
    ),
    "search": Command(
        "Jozefowicz et al. 2015's architecture search (--config X --storage URL --workers N --budget 2h); "
        "`search report` lists the best cells",
        "commands.search:cmd_search",
    ),
}
