"""The subcommands of ``lm-zoo``: one module each (``commands/<name>.py``, a ``cmd_<name>(argv)``), with what they share
in :mod:`commands.common`. ``cli.py`` dispatches to them from the table below.

This is the layer above the library (``checkpoints``, ``lightning_modules``, ``datamodules``, ``zoo``): argument
parsing, printing and exit codes live here and in ``cli.py``, never below.
"""

LIGHTNING_COMMANDS = {
    "fit": "train a model from a YAML config or a shipped recipe's name (lm-zoo fit --config ptb/lstm-small)",
    "validate": "run the validation split through a model (LightningCLI)",
    "test": "run the test split through a model (LightningCLI; --ckpt_path)",
    "predict": "LightningCLI predict",
}
COMMANDS = {
    "evaluate": "perplexity / bits per character (music: NLL per frame) of a SOURCE on a split (--json: one object)",
    "generate": "sample text from a SOURCE (temperature, top-k, prompt, seed); music: MIDI files and piano rolls",
    "models": "list the architectures in the zoo (--pretrained: the published models)",
    "recipes": "list the shipped recipes (configs/), each a name for fit --config: lm-zoo fit --config ptb/lstm-small",
    "export": "write a SOURCE as config.json + model.safetensors + tokenizer + model card (--out DIR)",
    "publish": "upload an exported directory to the Hugging Face Hub (--repo-id owner/name)",
    "download": "fetch a Hub repo id or registered model into the Hugging Face cache; prints the path",
    "parse": "unsupervised constituency parsing with an ON-LSTM SOURCE: F1 per layer on a treebank, or one --text",
    "syneval": "targeted syntactic evaluation (Marvin & Linzen 2018) of a word-level SOURCE: accuracy per condition",
    "score": "log-probability of each sentence of a FILE (JSON lines), or an n-best list with an LM score column",
    "tune": "search hyperparameters with Optuna (--config X --space S --trials N); writes the best config",
    "search": "Jozefowicz et al. 2015's architecture search (--config X --storage URL --workers N --budget 2h); "
    "`search report` lists the best cells",
    "bundle": "maintainers: build pretrained/NAME from a run, publish the bundled models, render their cards again, "
    "the README table",
}
