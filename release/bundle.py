"""The pretrained models lm-zoo ships: ``pretrained/<name>/`` exports, their registry entries, publishing them.

``python -m release`` is the maintainer's command::

    python -m release build ptb-lstm-small --ckpt runs/ptb/lstm-small/lightning_logs/version_0/checkpoints/best.ckpt \\
        --config configs/ptb/lstm-small.yaml
    python -m release publish                 # every bundled model to its registered repo id and revision (HF_TOKEN)
    python -m release table                   # the README's "Pretrained models" table, from the registry
    python -m release card ptb-lstm-small     # its card rendered again from config.json (registry hashes updated)
    python -m release check                   # every bundled model's check figure measured again into the registry
    python -m release continues wikitext-2-lstm 2bf2a04   # its run carried on from the revision bundled at 2bf2a04

``build`` turns a finished run into what a user downloads: it exports the checkpoint (float32, or float16 with
``--dtype``), loads that export back and measures it — valid and test at eval batch size 1 (the papers' convention)
and at the run's own eval batch size, with the check figure the tests re-measure over a fixed part of the test split
(:func:`check_figure`) — so every recorded figure is one of the stored weights; draws the learning curve
from the run's TensorBoard events, in the card's unit, with the exported checkpoint marked, and keeps its points in
``config.json`` (``training.run.curve``); samples three texts; writes the model card with how the model was made
(command, seed, commit, torch version, hardware, wall time, tokens/s); and records the sha256 of every file in the
registry. ``python -m release card`` renders a bundled card (and the pictures that need no run) again from its
``config.json``, after its notes or the card's wording changed (:func:`render_again`). Weights that several runs made
in turn (a run started from an earlier revision's export, ``checkpoints.callbacks.InitialWeights``) keep each earlier
run's record, taken from that revision's ``config.json`` in git, under ``training.run.earlier_runs``
(``python -m release continues``, or ``build --continues``), and the card and registry show every run.

A music model (a ``MusicModel`` run on piano rolls) is measured by its NLL per frame on valid and test at the run's
eval batch size (every piece starts from a zero state, so no other batch size could change it), and instead of texts
one piece is sampled from silence with the fixed seed and shipped as ``sample.mid`` and ``sample.png``, which the card
links and shows. Its "tokens" (per step, per second) are frames.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

from checkpoints import hub, registry
from checkpoints.ckpt_read import load_checkpoint
from checkpoints.export_read import (
    CARD_NAME,
    CONFIG_NAME,
    CURVE_NAME,
    HASHES_KEY,
    SAMPLE_MIDI_NAME,
    SAMPLE_PNG_NAME,
    LoadedModel,
    export_file_hashes,
    is_export_file,
    lm_zoo_version,
    load_export,
)
from checkpoints.export_write import export_model, measure
from checkpoints.model_card import render_card, validation_figure
from datamodules.corpora import REPORTED_SPLITS, corpus_level, corpus_measures, sha256_file
from datamodules.kinds import BPC, MUSIC, NLL_PER_STEP, PPL
from datamodules.midi import write_midi, write_png
from datamodules.piano_rolls import music_dataset
from datamodules.synthetic import xml_closing_tags_matched
from lightning_modules.training import hardware, source_commit
from release.curves import (
    VALID_TAGS,
    RunLog,
    curve_record,
    curve_unit,
    read_run,
    render_record,
)
from zoo.errors import CheckpointError, ConfigError

SAMPLE_SEED = 1
NUM_SAMPLES = 3
# A music model's sampled piece: 128 frames are 32 bars of 4/4 in JSB's quarter notes, 16 in the others' eighths.
SAMPLE_FRAMES = 128
SAMPLE_BPM = 120.0
XML_SAMPLES, XML_MAX_TOKENS = 100, 1000  # documents sampled to measure the XML task's nesting
REPO_OWNER = "lm-zoo"  # the Hub organisation the registry names (published with `python -m release publish`)
# Where and how a run was made, which the registry and the record of an earlier run both keep.
RUN_PROVENANCE_KEYS = (
    "command",
    "config_file",
    "seed",
    "commit",
    "hardware",
    "torch_version",
    "cuda_version",
    "wall_time_s",
)
# What the registry keeps of how a model was made (the card and config.json keep all of it).
REGISTRY_TRAINING_KEYS = (*RUN_PROVENANCE_KEYS, "tokens_per_s", "epochs", "steps", "xml_nesting")
# What the record of an earlier run that made the weights keeps (``training.run.earlier_runs``): its run record's
# provenance and length, and its validation curve (:func:`earlier_run_record`).
EARLIER_RUN_KEYS = (*RUN_PROVENANCE_KEYS, "steps", "tokens", "tokens_per_s", "epochs")
ROOT = Path(__file__).resolve().parents[1]  # the clone python -m release runs in: git reads earlier revisions here
TABLE_START = "<!-- pretrained-table: generated by `python -m release table` from checkpoints/registry.json -->"
TABLE_END = "<!-- /pretrained-table -->"


def _run_config(log_dir: Path) -> dict[str, Any] | None:
    """The LightningCLI ``config.yaml`` a run saved in its log directory, if any."""
    path = log_dir / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def _results(loaded: LoadedModel, data_root: str | None) -> list[dict[str, Any]]:
    """Valid and test at eval batch size 1 (the papers' convention) and at the run's own, at the run's eval BPTT.

    A sentence-level corpus (GBW) starts every sentence from a zero state, so the batch size cannot change its figure
    (on gbw-sample the two agreed to 3e-9 relative); it is measured at the run's batch size alone, which is ~50x faster.
    So is a music model, each of whose pieces starts from a zero state (at the data module's eval batch size).
    """
    if loaded.kind is MUSIC:
        return measure(loaded, REPORTED_SPLITS, None, None, data_root)
    own = int(loaded.data.get("eval_batch_size") or 1)
    batch_sizes = [own] if loaded.tokenizer.sentences else sorted({1, own})
    return [result for size in batch_sizes for result in measure(loaded, REPORTED_SPLITS, size, None, data_root)]


def music_sample(loaded: LoadedModel, directory: Path) -> dict[str, Any]:
    """Sample one piece from a music model, from silence with the fixed seed, and write it into ``directory`` as
    ``sample.mid`` and ``sample.png``; return its record for the card (``training.run.sample``).

    The frame length in beats is the dataset's (a quarter note for JSB Chorales, an eighth for the others).
    """
    beats = music_dataset(str(loaded.data.get("dataset"))).frame_beats
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    roll = loaded.model.generate(SAMPLE_FRAMES, generator=generator)[0].numpy()  # (T, 88) uint8
    write_midi(roll, directory / SAMPLE_MIDI_NAME, frame_beats=beats, bpm=SAMPLE_BPM)
    write_png(roll, directory / SAMPLE_PNG_NAME)
    return {
        "seed": SAMPLE_SEED,
        "frames": SAMPLE_FRAMES,
        "temperature": 1.0,
        "frame_beats": beats,
        "bpm": SAMPLE_BPM,
        "notes_sounding": int(roll.sum()),  # note-frames: 0 would be a silent sample, worth seeing at a glance
        "midi": SAMPLE_MIDI_NAME,
        "png": SAMPLE_PNG_NAME,
    }


def xml_nesting(loaded: LoadedModel) -> dict[str, Any]:
    """The XML task's measure (Jozefowicz et al. 2015 §3.5): of the closing tags in sampled documents, the fraction
    that close the innermost open tag (:func:`datamodules.synthetic.xml_closing_tags_matched`). Each sample is one
    document, from the start of a line to its end."""
    texts, temperature = loaded.sample("", XML_SAMPLES, XML_MAX_TOKENS, seed=SAMPLE_SEED)
    counts = [xml_closing_tags_matched(text) for text in texts]
    matched, closing = sum(m for m, _ in counts), sum(c for _, c in counts)
    return {
        "samples": XML_SAMPLES,
        "max_tokens": XML_MAX_TOKENS,
        "seed": SAMPLE_SEED,
        "temperature": temperature,
        "closing_tags": closing,
        "matched": matched,
        "fraction": matched / closing if closing else 0.0,
    }


#: How each measure a corpus's spec names (``measures``) is computed on the bundled model.
CORPUS_MEASURES = {"xml_nesting": xml_nesting}


def build(
    name: str,
    ckpt: Path,
    config_file: Path,
    *,
    command: str | None = None,
    logs: Sequence[Path] = (),
    commit: str | None = None,
    hardware_name: str | None = None,
    dtype: str = "float32",
    repo_id: str | None = None,
    revision: str = "v1",
    description: str = "",
    max_sample_tokens: int = 60,
    data_root: str | None = None,
    notes: str = "",
    max_shard_size: int | None = None,
    continues: str | None = None,
) -> registry.RegistryEntry:
    """Build ``pretrained/<name>/`` from a run's checkpoint and write its registry entry.

    Args:
        name: the short name (``lm-zoo models --pretrained``).
        ckpt: the run's best checkpoint, or its export (``lm-zoo export``; then ``logs`` are needed).
        config_file: the recipe it was trained from (``configs/...``).
        command: how it was trained (default ``lm-zoo fit --config <config_file>``).
        logs: the run's TensorBoard log directories, several for a resumed run (default: the checkpoint's
            ``version_N`` directory).
        commit: the lm-zoo commit it was trained at (default: the one the checkpoint recorded, else this checkout's).
        hardware_name: the machine it was trained on, in words (default: the one the checkpoint recorded, else
            this one's, :func:`lightning_modules.training.hardware`): a run trained on another machine (a GPU) is
            bundled on this one.
        dtype: how the weights are stored: ``float32`` or ``float16``.
        repo_id: its Hub repo (default ``lm-zoo/<name>``).
        revision: the tag it is published under.
        description: one line for the registry.
        max_sample_tokens: most tokens per sample on the card (a music model's sample is 128 frames).
        data_root: where the corpus lives (default ``$LM_ZOO_DATA``).
        notes: a paragraph for the card (e.g. the target and what budget would reach it).
        max_shard_size: store the weights as shards of at most this many bytes (a bundle made on another machine
            may have to come back in files of limited size); ``None``: one file.
        continues: the lm-zoo commit at which the revision of ``name`` bundled then is the one this run started from
            (:func:`earlier_runs_at`); ``None``: the run started afresh.

    Returns:
        The registry entry, as written to the registry.

    Raises:
        LMZooError: the checkpoint, its logs or the corpus cannot be read; the message says which.
    """
    if not registry.NAME_PATTERN.match(name):
        raise ConfigError(f"{name!r} is no short name: lower case letters, digits, '.', '_' or '-'")
    if ckpt.is_dir():  # an export: a run trained on a GPU machine comes back as one (benchmarks/gpu_session.sh)
        if not logs:
            raise ConfigError(f"{ckpt} is an export, which keeps no TensorBoard logs: name the run's with --logs")
        source = load_export(ckpt)
    else:
        source = load_checkpoint(ckpt)
    logs = list(logs) or [ckpt.parent.parent]
    corpus = source.data.get("corpus")
    level = None if corpus is None else corpus_level(str(corpus))
    unit = curve_unit(source.kind, None if source.tokenizer is None else source.tokenizer.kind, level)
    log = read_run(logs, VALID_TAGS[unit])
    # The logs end at the last logged step; the exported checkpoint counts every step taken, which can be later (a
    # run stopped between two logged steps validates and checkpoints there): the run took at least that many.
    log.steps = max(log.steps, int(source.training.get("global_step") or 0))
    tokens_per_step = step_tokens(source.data)
    source = _with_run_config(source, logs[0])
    out = registry.bundle_root() / name
    repo_id = repo_id or f"{REPO_OWNER}/{name}"
    run = _run_record(
        name,
        command or f"lm-zoo fit --config {config_file}",
        config_file,
        source.training.get("config") or {},
        commit,
        hardware_name,
        source.training.get("environments") or [],
        log,
        tokens_per_step,
        notes,
    )
    run["curve"] = curve_record(log, unit, tokens_per_step, source.training.get("global_step"))
    if continues is not None:
        run["earlier_runs"] = earlier_runs_at(name, continues)
    out.mkdir(parents=True, exist_ok=True)
    curve = render_record(run["curve"], out.parent / f".{name}.{CURVE_NAME}", curve_title(name, run))
    try:
        check = _export_measured(
            source, out, run, curve, dtype, repo_id, revision, max_sample_tokens, data_root, max_shard_size
        )
    finally:
        curve.unlink(missing_ok=True)
    entry = _registry_entry(out, name, repo_id, revision, description, run, check)
    registry.write_entry(entry)
    return entry


def _with_run_config(source: LoadedModel, log_dir: Path) -> LoadedModel:
    """``source`` with the LightningCLI config of its run under ``training.config``, found in ``log_dir`` when the
    checkpoint lacks it (a run with its own ``checkpoint.dirpath``)."""
    if "config" not in source.training:
        found = _run_config(log_dir)
        if found is not None:
            return replace(source, training={**source.training, "config": found})
    return source


def curve_title(name: str, run: dict[str, Any]) -> str:
    """The learning curve's title: the short name and the command that trained it."""
    return f"{name}: {run.get('command')}"


def step_tokens(data: dict[str, Any]) -> int:
    """The tokens (a music model's frames) one training step of a run trains on, from its data module's settings:
    ``batch_size x bptt x windows_per_step`` (1 window in a run older than that setting)."""
    return int(data.get("batch_size") or 0) * int(data.get("bptt") or 0) * int(data.get("windows_per_step") or 1)


def _run_record(
    name: str,
    command: str,
    config_file: Path,
    run_config: dict[str, Any],
    commit: str | None,
    hardware_name: str | None,
    environments: list[dict[str, Any]],
    log: RunLog,
    tokens_per_step: int,
    notes: str,
) -> dict[str, Any]:
    """How the model was made, for the card (``training.run``) and the registry (:data:`REGISTRY_TRAINING_KEYS`).

    Args:
        name: the short name.
        command: how it was trained.
        config_file: the recipe it was trained from.
        run_config: the run's LightningCLI config (its ``seed_everything``), ``{}`` if unknown.
        commit: the lm-zoo commit it was trained at; ``None``: the one the checkpoint recorded, else this checkout's.
        hardware_name: the machine it was trained on, in words; ``None``: the one the checkpoint recorded, else this
            one.
        environments: where the run trained, as its checkpoint recorded (``lightning_modules.training.RunSettings``;
            several for a run resumed on another machine, ``[]`` for a checkpoint older than the record): its
            hardware, torch and CUDA versions and commit, which a run trained on one machine and bundled on another
            needs.
        log: the run's TensorBoard record (:func:`release.curves.read_run`): wall time, steps, epochs.
        tokens_per_step: batch size x BPTT x windows of a training step (frames for a music model).
        notes: a paragraph for the card.
    """

    def recorded(key: str) -> str | None:  # each machine's value once, in the order the run met them
        values = dict.fromkeys(str(e[key]) for e in environments if e.get(key))
        return ", then ".join(values) or None

    record = {
        "name": name,
        "command": command,
        "config_file": str(config_file),
        "seed": run_config.get("seed_everything"),
        "commit": commit or recorded("commit") or source_commit(),
        "torch_version": recorded("torch_version") or torch.__version__,
        "lm_zoo_version": lm_zoo_version(),
        "hardware": hardware_name or recorded("hardware") or hardware(),
        "wall_time_s": round(log.wall_time, 3),  # a tiny run spans milliseconds
        "steps": log.steps,
        "tokens": log.steps * tokens_per_step,
        "tokens_per_s": round(log.steps * tokens_per_step / log.wall_time, 1) if log.wall_time else None,
        "epochs": log.epochs,
        "notes": notes,
    }
    cuda = recorded("cuda_version") if environments else torch.version.cuda if torch.cuda.is_available() else None
    if cuda is not None:  # a CPU run's record has no such key
        record["cuda_version"] = cuda
    return record


def _export_measured(
    source: LoadedModel,
    out: Path,
    run: dict[str, Any],
    curve: Path,
    dtype: str,
    repo_id: str,
    revision: str,
    max_sample_tokens: int,
    data_root: str | None,
    max_shard_size: int | None = None,
) -> dict[str, Any]:
    """Export ``source`` into ``out`` with the figures, samples and card of its stored weights; return its check
    figure (:func:`check_figure`), which the registry keeps and the card does not show.

    Args:
        source: the checkpoint, with its run's config.
        out: the bundle directory.
        run: :func:`_run_record`'s record; the samples (and the XML task's nesting) are added to it.
        curve: the learning curve, drawn outside ``out``.
        dtype: how the weights are stored.
        repo_id: the Hub repo the card names.
        revision: the registered revision (the card names the model by its short name).
        max_sample_tokens: most tokens per sampled text.
        data_root: where the corpus lives.
        max_shard_size: shards of at most this many bytes; ``None``: one weights file.
    """
    # Written once to round the weights to their stored precision, then measured as loaded back from disk.
    export_model(source, out, results=[], dtype=dtype, curve=curve, max_shard_size=max_shard_size)
    stored = load_export(out)
    stored = replace(stored, data=source.data, training={**source.training, "run": run})
    results = _results(stored, data_root)
    check = check_figure(stored, data_root)
    with tempfile.TemporaryDirectory() as staging:
        assets = {}
        if stored.kind.sample_files:
            run["sample"] = music_sample(stored, Path(staging))
            assets = {f: Path(staging) / f for f in (SAMPLE_MIDI_NAME, SAMPLE_PNG_NAME)}
        else:
            samples, temperature = stored.sample("", NUM_SAMPLES, max_sample_tokens, seed=SAMPLE_SEED)
            run["samples"] = {
                "seed": SAMPLE_SEED,
                "temperature": temperature,
                "max_tokens": max_sample_tokens,
                "texts": samples,
            }
        for measure in corpus_measures(Path(str(source.data.get("corpus"))).name):  # the corpus's spec says which
            run[measure] = CORPUS_MEASURES[measure](stored)
        export_model(
            stored,
            out,
            results,
            dtype=dtype,
            curve=out / CURVE_NAME,
            repo_id=repo_id,
            assets=assets,
            revision=revision,
            max_shard_size=max_shard_size,
        )
    return check


def check_figure(
    loaded: LoadedModel, data_root: str | None = None, batch_size: int | None = None, bptt: int | None = None
) -> dict[str, Any]:
    """A model's check figure: its test split up to the window holding the :data:`checkpoints.registry.CHECK_TOKENS`-th
    token (frame), at ``batch_size`` and ``bptt`` (default: the run's eval batch size and BPTT), as ``lm-zoo evaluate
    --max-tokens`` measures it; the figure the test suite re-measures on every run (:mod:`checkpoints.registry`)."""
    if batch_size is None and loaded.kind is not MUSIC:
        batch_size = int(loaded.data.get("eval_batch_size") or 1)
    [result] = measure(loaded, ("test",), batch_size, bptt, data_root, max_tokens=registry.CHECK_TOKENS)
    return result.to_json(stored=True)


def measure_checks(names: Sequence[str] = (), data_root: str | None = None) -> dict[str, dict[str, Any]]:
    """Measure every bundled model's check figure again (or those named) and record it in the registry's
    ``check_results`` (that field only), at the batch size and BPTT it records (a model without one: the run's).

    For when :data:`checkpoints.registry.CHECK_TOKENS` or the evaluation changes; the whole-split ``results`` stay.

    Returns:
        Each model's check result, as the registry now records it.

    Raises:
        ConfigError: a name is not registered.
        CheckpointError: a bundle is missing or does not match the registry.
    """
    entries = registry.load_registry()
    unknown = [n for n in names if n not in entries]
    if unknown:
        raise ConfigError(f"{unknown[0]!r} is not in the registry: lm-zoo models --pretrained lists the models")
    measured = {}
    for entry in [entries[n] for n in names] if names else entries.values():
        directory = registry.bundled(entry)
        if directory is None:
            raise CheckpointError(
                f"{entry.name} has no bundle at {registry.bundle_root() / entry.name}: build it first"
            )
        old = entry.check_results.get("test") or {}
        check = check_figure(
            load_export(directory, source=entry.name), data_root, old.get("eval_batch_size"), old.get("bptt")
        )
        measured[entry.name] = {"test": registry.registry_result(check)}
        registry.update_check_results(entry.name, measured[entry.name])
    return measured


def _check_drawn_from(entry: registry.RegistryEntry, directory: Path, run: dict[str, Any]) -> None:
    """Check that every file of a bundle that :func:`render_again` does not write matches the registry: all but
    ``config.json`` (its notes or records edited), the card and the pictures drawn from ``run``.

    Raises:
        CheckpointError: naming the first file that differs.
    """
    inputs = {CONFIG_NAME, CARD_NAME, *([CURVE_NAME] if run.get("curve") else [])}
    inputs |= {SAMPLE_PNG_NAME} if run.get("sample") else set()
    for file in sorted(set(entry.files) - inputs):  # never register a damaged file's hash
        if not (directory / file).is_file() or sha256_file(directory / file) != entry.files[file]:
            raise CheckpointError(
                f"{directory}/{file} does not match the sha256 the registry lists for {entry.name}: restore it (git "
                "checkout -- pretrained/) before rendering the card again"
            )


def render_again(name: str) -> dict[str, str]:
    """Render a bundled model's card again from its ``config.json``, with the registry's repo id and revision, and its
    pictures where that needs no run: the learning curve when ``config.json`` keeps its points
    (``training.run.curve``), a music model's piano roll by sampling again with the fixed seed. Then record the
    changed files' sha256 and the bundle's size in the registry (those fields only).

    For a change to the card's wording or to the notes in ``config.json``; the weights and results stay as they are
    (every other file must still match the registry, and the export must still load). A bundle exported before
    configs recorded their files' sha256 gets them here, from the files just checked against the registry.

    Returns:
        The new sha256 of each file that changed.

    Raises:
        ConfigError: ``name`` is not registered.
        CheckpointError: the bundle is missing or does not load, a file other than ``config.json`` and those drawn
            here differs from the registry, or the music sample drawn again is not the shipped ``sample.mid``.
    """
    entry = registry.load_registry().get(name)
    if entry is None:
        raise ConfigError(f"{name!r} is not in the registry: lm-zoo models --pretrained lists the models")
    directory = registry.bundle_root() / name
    if not directory.is_dir():
        raise CheckpointError(f"{name} has no bundle at {directory}: build it first")
    config = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
    run = config.get("training", {}).get("run") or {}
    _check_drawn_from(entry, directory, run)
    if config.get(HASHES_KEY) != export_file_hashes(directory):  # a bundle exported before configs recorded them
        config[HASHES_KEY] = export_file_hashes(directory)  # of files just checked against the registry
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    loaded = load_export(directory, source=name)  # and config.json still describes these weights
    if run.get("curve"):
        render_record(run["curve"], directory / CURVE_NAME, curve_title(name, run))
    if run.get("sample"):
        with tempfile.TemporaryDirectory() as staging:
            sample = music_sample(loaded, Path(staging))
            if (Path(staging) / SAMPLE_MIDI_NAME).read_bytes() != (directory / SAMPLE_MIDI_NAME).read_bytes():
                raise CheckpointError(
                    f"{name}: sampling again (seed {sample['seed']}) gave another piece than the shipped "
                    f"{SAMPLE_MIDI_NAME}; rebuild the bundle instead"
                )
            (directory / SAMPLE_PNG_NAME).write_bytes((Path(staging) / SAMPLE_PNG_NAME).read_bytes())
    (directory / CARD_NAME).write_text(render_card(config, entry.repo_id, entry.revision), encoding="utf-8")
    files = {f: sha256_file(directory / f) for f in entry.files}
    registry.update_files(name, files, sum((directory / f).stat().st_size for f in files))
    return {f: h for f, h in files.items() if entry.files.get(f) != h}


def _registry_entry(
    out: Path,
    name: str,
    repo_id: str,
    revision: str,
    description: str,
    run: dict[str, Any],
    check: dict[str, Any],
) -> registry.RegistryEntry:
    """The registry entry of the export in ``out``: its config's summary, its check figure, the sha256 and size of its
    files, and the run's record (:data:`REGISTRY_TRAINING_KEYS`)."""
    config = json.loads((out / CONFIG_NAME).read_text(encoding="utf-8"))
    entry = registry.entry_for(config, name, repo_id, revision, check)
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file() and is_export_file(p.name)}
    return replace(
        entry,
        description=description or entry.description,
        num_parameters=config["num_parameters"],
        size_bytes=sum((out / f).stat().st_size for f in files),
        files=files,
        training=registry_training(run),
    )


def registry_training(run: dict[str, Any]) -> dict[str, Any]:
    """What the registry keeps of how a model was made (``training``): :data:`REGISTRY_TRAINING_KEYS` of its run
    record, and of each earlier run that made the weights (``earlier_runs``) the same keys, its revision and where its
    record was taken from; the card and ``config.json`` keep all of it."""
    training = {k: run[k] for k in REGISTRY_TRAINING_KEYS if k in run}
    if run.get("earlier_runs"):
        keys = ("revision", *REGISTRY_TRAINING_KEYS, "source")
        training["earlier_runs"] = [{k: r[k] for k in keys if k in r} for r in run["earlier_runs"]]
    return training


def _git(*args: str) -> str:
    """What ``git ARGS`` prints in this clone.

    Raises:
        ConfigError: git cannot run here or fails; the message has git's last line.
    """
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
    except OSError as err:
        raise ConfigError(f"cannot run git {args[0]} in {ROOT}: {err}") from err
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise ConfigError(f"git {' '.join(args)} failed in {ROOT}: {why}")
    return done.stdout


def earlier_run_record(config: dict[str, Any], revision: str, source: dict[str, str]) -> dict[str, Any]:
    """The record of an earlier run that made the weights, from the ``config.json`` of the revision it exported.

    Args:
        config: that revision's ``config.json`` contents.
        revision: the registered revision it was published as.
        source: where ``config`` was read (``{"commit", "file"}``), said on the card beside the figures.

    Returns:
        ``{"revision", <EARLIER_RUN_KEYS of its training.run>, "exported_step", "valid_after", "curve", "source"}``:
        the validation figure its export was registered with (where it has one), and its curve without the training
        loss (its validation points and the exported step), as stored.

    Raises:
        ConfigError: ``config`` records no run (``training.run`` with its wall time).
    """
    training = config.get("training") or {}
    run = training.get("run") or {}
    if not run.get("wall_time_s"):
        raise ConfigError(f"{source.get('file')} at {source.get('commit')} records no run (training.run)")
    record: dict[str, Any] = {"revision": revision, **{k: run[k] for k in EARLIER_RUN_KEYS if k in run}}
    record["exported_step"] = training.get("global_step")
    valid = validation_figure(config.get("results") or [])
    if valid is not None:  # the validation figure its export was registered with: the hop ledger's column
        record["valid_after"] = valid
    if run.get("curve"):
        record["curve"] = {k: v for k, v in run["curve"].items() if k != "train_loss"}
    record["source"] = dict(source)
    return record


def earlier_runs_at(name: str, commit: str) -> list[dict[str, Any]]:
    """The runs that made the revision of ``name`` bundled at lm-zoo's ``commit``, first to last: the runs it carried
    on from (its own ``earlier_runs``) and its run, read with git from ``pretrained/<name>/config.json`` and the
    registry at that commit (which names the revision). A run that starts from that revision's export carries on
    from them.

    Raises:
        ConfigError: git cannot read them, or that commit's registry does not list ``name``.
    """
    resolved = _git("rev-parse", "--verify", f"{commit}^{{commit}}").strip()
    registry_file = "checkpoints/registry.json"  # where the clone keeps it (registry.DEFAULT_PATH)
    entry = (json.loads(_git("show", f"{resolved}:{registry_file}")).get("models") or {}).get(name)
    if not isinstance(entry, dict) or not entry.get("revision"):
        raise ConfigError(f"{registry_file} at {resolved} lists no {name!r}")
    file = f"pretrained/{name}/{CONFIG_NAME}"
    config = json.loads(_git("show", f"{resolved}:{file}"))
    before = (config.get("training") or {}).get("run", {}).get("earlier_runs") or []
    return [*before, earlier_run_record(config, str(entry["revision"]), {"commit": resolved, "file": file})]


def record_continued(name: str, commit: str) -> list[dict[str, Any]]:
    """Record that ``name``'s bundled run carried on from the revision of it bundled at ``commit``: the earlier runs'
    records (:func:`earlier_runs_at`) go into its ``config.json`` (``training.run.earlier_runs``, replacing any), its
    card is rendered again (:func:`render_again`: the changed files' sha256 in the registry), and the registry's
    ``training`` repeats them (:func:`registry_training`). The weights and results stay as they are.

    Returns:
        The earlier runs as recorded.

    Raises:
        ConfigError: ``name`` is not registered, or git cannot read the earlier revision.
        CheckpointError: the bundle is missing or does not match the registry.
    """
    entry = registry.load_registry().get(name)
    if entry is None:
        raise ConfigError(f"{name!r} is not in the registry: lm-zoo models --pretrained lists the models")
    directory = registry.bundle_root() / name
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{name} has no bundle at {directory}: build it first")
    config = json.loads(path.read_text(encoding="utf-8"))
    run = config.setdefault("training", {}).setdefault("run", {})
    _check_drawn_from(entry, directory, run)  # before anything is written
    earlier = earlier_runs_at(name, commit)
    run["earlier_runs"] = earlier
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    render_again(name)
    registry.write_entry(replace(registry.load_registry()[name], training=registry_training(run)))
    return earlier


def publish_all(names: Sequence[str] = (), *, endpoint: str | None = None) -> list[tuple[str, str]]:
    """Publish every bundled model (or those named) at its registered repo id, tagged with its revision.

    Returns:
        ``(name, commit url)`` per model.

    Raises:
        CheckpointError: a bundle is missing or does not match the registry, or the Hub refused.
    """
    entries = registry.load_registry()
    unknown = [n for n in names if n not in entries]
    if unknown:
        raise ConfigError(f"{unknown[0]!r} is not in the registry: lm-zoo models --pretrained lists the models")
    published = []
    for entry in [entries[n] for n in names] if names else entries.values():
        directory = registry.bundled(entry)
        if directory is None:
            raise CheckpointError(
                f"{entry.name} has no bundle at {registry.bundle_root() / entry.name}: build it first"
            )
        done = hub.publish(directory, entry.repo_id, tag=entry.revision, endpoint=endpoint)
        registry.verify_files(entry, directory, str(directory))  # publishing left the bundle as registered
        published.append((entry.name, done.commit_url))
    return published


# How the table writes a registry result's figure (a music model's: nats per frame, summed over the notes).
_TABLE_FIGURES = {NLL_PER_STEP: "{:.2f} NLL/step", BPC: "{:.3f} bpc", PPL: "{:.2f} ppl"}


def _figure(result: dict[str, Any]) -> str:
    metric = next(m for m in _TABLE_FIGURES if m in result)
    return _TABLE_FIGURES[metric].format(result[metric])


def table(entries: dict[str, registry.RegistryEntry]) -> str:
    """The README's table of pretrained models: what each is, its test figure, its size and a command to try it.

    The figures' provenance (valid split, training run, wall time) is in each model's card, so the README stays one
    screen wide.
    """
    lines = [
        "| name | data | parameters | test | eval batch | size | try it |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for entry in entries.values():
        test = entry.results.get("test")
        out = " --out samples/" if entry.kind.sample_files else ""  # a music model's samples are MIDI files
        lines.append(
            f"| [`{entry.name}`](pretrained/{entry.name}/README.md) | {entry.dataset} | "
            f"{entry.num_parameters or 0:,} | {_figure(test) if test else '—'} | "
            f"{test['eval_batch_size'] if test else '—'} | {(entry.size_bytes or 0) / 1e6:.1f} MB | "
            f"`lm-zoo generate {entry.name} --num-samples 3 --seed 1{out}` |"
        )
    return "\n".join(lines)


def write_table(readme: Path) -> None:
    """Replace the table between the README's markers with the one the registry gives.

    Raises:
        ConfigError: the README lacks the markers.
    """
    text = readme.read_text(encoding="utf-8")
    if TABLE_START not in text or TABLE_END not in text:
        raise ConfigError(f"{readme} has no {TABLE_START!r} ... {TABLE_END!r} markers to put the table between")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    readme.write_text(f"{head}{TABLE_START}\n{table(registry.load_registry())}\n{TABLE_END}{tail}", encoding="utf-8")
