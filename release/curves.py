"""The learning curve of a run, read from its TensorBoard event files, kept in ``config.json`` and drawn to a PNG for
the model card.

Drawn with Pillow (which tensorboard already requires), not matplotlib: two line plots with labelled axes need no
plotting library, and lm-zoo should not pull one in for a maintainer's picture.

The curve is drawn in the unit of the card's results (:func:`curve_unit`): bits per character for a character-level
model, perplexity for a word-level one (its training loss stays in nats per token: the exponential of a noisy window
loss would hide the curve's shape), nats per frame for a music model. Its points are kept in the export's
``config.json`` (``training.run.curve``, :func:`curve_record`), so the card's picture can be drawn again
(:func:`render_record`) once the run's event files are gone; the exported checkpoint's step is marked on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules.kinds import BPC as BPC_FIGURE
from datamodules.kinds import NLL_PER_STEP, PPL, ModelKind, per_character
from zoo.errors import CheckpointError

CURVE_NAME = "learning_curve.png"
TRAIN_TAG, VALID_TAG = "train_loss", "val_ppl"
BPC_TAG = "val_bpc"  # a character-level run's validation bits per character (lightning_modules.LanguageModel)
MUSIC_VALID_TAG = "val_loss"  # a music model's validation figure: NLL per frame (it has no perplexity)
# What a curve's panels show, by the card's unit: (training panel, validation panel, what the x axis counts).
BPC, PERPLEXITY, NATS_PER_FRAME = "bpc", "perplexity", "nats per frame"
_PANELS = {
    BPC: ("training loss (bits per character)", "validation bits per character", "training characters"),
    PERPLEXITY: ("training loss (nats per token)", "validation perplexity", "training tokens"),
    NATS_PER_FRAME: ("training NLL (nats per frame)", "validation NLL (nats per frame)", "training frames"),
}
# The unit a curve is drawn in, by the model's headline figure (datamodules.kinds), and the validation tags a run may
# have logged it under, in order of preference (older character-level runs logged no bits per character).
_UNITS = {BPC_FIGURE: BPC, PPL: PERPLEXITY, NLL_PER_STEP: NATS_PER_FRAME}
VALID_TAGS = {BPC: (BPC_TAG, VALID_TAG), PERPLEXITY: (VALID_TAG,), NATS_PER_FRAME: (MUSIC_VALID_TAG,)}
_SIGNIFICANT = 6  # digits kept per stored point: finer than any picture, and config.json stays small


@dataclass
class RunLog:
    """What a run's TensorBoard events say, over every directory of a run resumed in several (``--ckpt_path last``).

    Attributes:
        train_loss: ``(step, loss)`` of the logged training windows (nats per token, or per frame).
        valid: ``(step, figure)`` after each validation, under ``valid_tag``: perplexity, bits per character
            (``val_bpc``), or a music model's NLL per frame.
        wall_time: seconds between the first and last event of each events file, summed (time between resumptions
            is left out, also where a resumed run logged on into the same directory).
        steps: training steps run (Lightning logs a step's index, from 0).
        epochs: epochs begun (Lightning logs the epoch index with the training loss).
        valid_tag: the tag ``valid`` was read from.
    """

    train_loss: list[tuple[int, float]] = field(default_factory=list)
    valid: list[tuple[int, float]] = field(default_factory=list)
    wall_time: float = 0.0
    steps: int = 0
    epochs: int = 0
    valid_tag: str = VALID_TAG


def _training_span(directory: Path, valid_tag: str) -> float:
    """Seconds between the first and last training or validation event of each events file in ``directory``,
    summed: a run resumed with ``--ckpt_path last`` logs on into the same directory, in a file of its own, and the
    time between the two runs is no training time."""
    files = sorted(directory.glob("events.out.tfevents.*")) or [directory]
    total = 0.0
    for file in files:
        events = EventAccumulator(str(file), size_guidance={"scalars": 0})
        events.Reload()
        tags = events.Tags().get("scalars", [])
        times = [e.wall_time for tag in (TRAIN_TAG, valid_tag) if tag in tags for e in events.Scalars(tag)]
        total += max(times) - min(times) if times else 0.0
    return total


def read_run(directories: Sequence[Path], valid_tag: str | Sequence[str] = VALID_TAG) -> RunLog:
    """Read the training loss and the validation figure logged in ``directories`` (TensorBoard log dirs).

    Args:
        directories: the run's log directories, in order.
        valid_tag: the validation figure's tag (:data:`MUSIC_VALID_TAG` for a music model), or tags in order of
            preference: the first one the run logged is read (``(BPC_TAG, VALID_TAG)`` for a character-level model,
            whose older runs logged no bits per character).

    Raises:
        CheckpointError: a directory holds no events with a training loss.
    """
    wanted = [valid_tag] if isinstance(valid_tag, str) else list(valid_tag)
    accumulators = []
    for directory in directories:
        events = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        tags = events.Tags().get("scalars", [])
        if TRAIN_TAG not in tags:
            raise CheckpointError(f"{directory} holds no TensorBoard events with {TRAIN_TAG}: pass the run's log dir")
        accumulators.append((directory, events, tags))
    logged = {tag for _, _, tags in accumulators for tag in tags}
    log = RunLog(valid_tag=next((tag for tag in wanted if tag in logged), wanted[0]))
    for directory, events, tags in accumulators:
        train = events.Scalars(TRAIN_TAG)
        valid = events.Scalars(log.valid_tag) if log.valid_tag in tags else []
        log.train_loss += [(e.step, e.value) for e in train]
        log.valid += [(e.step, e.value) for e in valid]
        log.wall_time += _training_span(Path(directory), log.valid_tag)
        log.steps = max([log.steps] + [e.step + 1 for e in train + valid])
        if "epoch" in tags:
            log.epochs = max([log.epochs] + [int(e.value) + 1 for e in events.Scalars("epoch")])
    log.train_loss.sort()
    log.valid.sort()
    return log


def curve_unit(kind: ModelKind, tokenizer_kind: str | None, corpus_level: str | None = None) -> str:
    """The unit of the figure a model's card quotes first (:func:`datamodules.kinds.text_figures`), which its curve
    is drawn in: :data:`NATS_PER_FRAME` for a music model, :data:`BPC` for text scored per character
    (:func:`datamodules.kinds.per_character`: its tokenizer's kind and its corpus's level), :data:`PERPLEXITY`
    otherwise (words, sentences, subwords)."""
    return _UNITS[kind.figures(per_character(tokenizer_kind, corpus_level), tokenizer_kind)[0]]


def _round(value: float) -> float:
    return float(f"{value:.{_SIGNIFICANT}g}")


def curve_record(log: RunLog, unit: str, tokens_per_step: int, exported_step: int | None) -> dict[str, Any]:
    """The curve as ``config.json`` keeps it (``training.run.curve``), in the card's ``unit``.

    A character-level curve is converted to bits per character: the training loss (nats per character) divided by
    ln 2, and the validation perplexity per character, when the run logged no ``val_bpc``, as its log2.

    Returns:
        ``{"unit", "tokens_per_step", "exported_step", "train_loss": {"label", "points"}, "valid": {"label",
        "points"}}``, each point ``[step, value]`` with the step as Lightning logged it.
    """
    if unit not in _PANELS:
        raise CheckpointError(f"a learning curve's unit is one of {', '.join(_PANELS)}, not {unit!r}")
    train = [(step, value / math.log(2) if unit == BPC else value) for step, value in log.train_loss]
    per_character_ppl = unit == BPC and log.valid_tag == VALID_TAG
    valid = [(step, math.log2(value) if per_character_ppl else value) for step, value in log.valid]
    train_label, valid_label, _ = _PANELS[unit]
    return {
        "unit": unit,
        "tokens_per_step": tokens_per_step,
        "exported_step": exported_step,
        "train_loss": {"label": train_label, "points": [[step, _round(v)] for step, v in train]},
        "valid": {"label": valid_label, "points": [[step, _round(v)] for step, v in valid]},
    }


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values spanning [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


Series = tuple[list[tuple[float, float]], tuple[int, int, int], str | None]  # points, colour, legend label


def render_record(record: dict[str, Any], out: Path, title: str) -> Path:
    """Draw a stored curve (:func:`curve_record`) to ``out``: the training loss and the validation figure against
    training tokens (characters, frames), side by side, with the exported checkpoint's step marked in both."""
    unit = record.get("unit", PERPLEXITY)
    per_step = int(record.get("tokens_per_step") or 1)
    _, _, x_label = _PANELS.get(unit, _PANELS[PERPLEXITY])
    exported = record.get("exported_step")
    marks = [] if exported is None else [(exported * per_step, f"exported checkpoint: step {exported:,}")]
    panels = [
        (
            record[key]["label"],
            x_label,
            [([(step * per_step, value) for step, value in record[key]["points"]], colour, None)],
        )
        for key, colour in (("train_loss", (31, 119, 180)), ("valid", (214, 39, 40)))
    ]
    return render_panels(panels, out, title, marks=marks)


def _dashed(draw: Any, x: float, top: int, bottom: int, colour: tuple[int, int, int], dash: int = 5) -> None:
    for y in range(top, bottom, 2 * dash):
        draw.line((x, y, x, min(y + dash, bottom)), fill=colour, width=1)


MARK_COLOUR = (90, 90, 90)


def render_panels(
    panels: Sequence[tuple[str, str, Sequence[Series]]],
    out: Path,
    title: str,
    marks: Sequence[tuple[float, str]] = (),
) -> Path:
    """Line plots side by side in one PNG: each panel ``(name, x-axis label, series)``, each series drawn as a
    line (with dots when it has few points) and named in the panel's corner when it has a label.

    The panel's name, above it, is its y axis's label; the x axis's label sits under its ticks, at the right. Each of
    ``marks``, ``(x, label)``, is a dashed vertical line in every panel, named at its top, with the point of each
    series nearest to it ringed (e.g. the exported checkpoint).
    """
    from PIL import Image, ImageDraw

    width, height, margin = 1000, 380, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((margin, 8), title, fill="black")
    panel_width = (width - (len(panels) + 1) * margin) // len(panels)
    for index, (name, x_label, series) in enumerate(panels):
        left, top = margin + index * (panel_width + margin), 46
        right, bottom = left + panel_width, height - 45
        draw.rectangle((left, top, right, bottom), outline="black")
        draw.text((left, top - 14), name, fill="black")
        draw.text((right, bottom + 22), x_label, fill="black", anchor="ra")
        every = [point for points, _, _ in series for point in points]
        if not every:
            draw.text((left + 10, top + 10), "not logged", fill="black")
            continue
        xs, ys = [x for x, _ in every], [y for _, y in every]
        x_low, x_high = 0.0, max(xs + [x for x, _ in marks]) or 1.0
        y_low, y_high = min(ys), max(ys)
        pad = (y_high - y_low) * 0.05 or 1.0
        y_low, y_high = y_low - pad, y_high + pad

        def at(x: float, y: float, box: tuple[int, int, int, int] = (left, top, right, bottom)) -> tuple[float, float]:
            x0, y0, x1, y1 = box
            return x0 + (x - x_low) / (x_high - x_low) * (x1 - x0), y1 - (y - y_low) / (y_high - y_low) * (y1 - y0)

        for tick in _ticks(x_low, x_high):
            x, _ = at(tick, y_low)
            draw.line((x, bottom, x, bottom + 4), fill="black")
            draw.text((x - 10, bottom + 6), _label(tick), fill="black")
        for tick in _ticks(y_low, y_high):
            _, y = at(x_low, tick)
            draw.line((left - 4, y, left, y), fill="black")
            draw.line((left + 1, y, right - 1, y), fill=(230, 230, 230))
            draw.text((left - 44, y - 6), _label(round(tick, 6)), fill="black")
        for mark_x, mark_label in marks:
            x, _ = at(mark_x, y_low)
            _dashed(draw, x, top + 1, bottom, MARK_COLOUR)
            draw.text((x - 4, top + 4), mark_label, fill=MARK_COLOUR, anchor="ra")
        for number, (points, colour, label) in enumerate(series):
            coordinates = [at(x, y) for x, y in points]
            if len(coordinates) > 1:
                draw.line(coordinates, fill=colour, width=2)
            for x, y in coordinates if len(coordinates) < 40 else []:
                draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=colour)
            if label is not None:
                draw.text((right - 120, top + 8 + 14 * number), label, fill=colour)
            for mark_x, _ in marks if points else []:
                x, y = at(*min(points, key=lambda point: abs(point[0] - mark_x)))
                draw.ellipse((x - 6, y - 6, x + 6, y + 6), outline=MARK_COLOUR, width=2)
    image.save(out, format="PNG", optimize=True)
    return out
