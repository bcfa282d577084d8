"""Piano rolls out of lm-zoo: as MIDI files to listen to, and as PNG pictures to look at.

MIDI is written with ``mido``, a small pure-Python library that reads and writes standard MIDI files message by
message and has no dependencies of its own. ``pretty_midi`` was the other candidate: it is built on ``mido`` and
reads a MIDI file into a piano roll, but writing one from a piano roll is not part of it (only an example script in
its repository), so it would add a dependency for the half we do not need.

A piano roll cannot tell a held note from one struck again in the next frame; like every piano-roll-to-MIDI
conversion, a note that sounds in consecutive frames is one held note. The tempo is not in the data: a frame is
``frame_beats`` quarter notes (an eighth note for Nottingham, MuseData and Piano-midi.de, a quarter note for JSB
Chorales, :data:`datamodules.piano_rolls.MUSIC_DATASETS`) at 120 beats per minute unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zoo.music import LOWEST_NOTE

TICKS_PER_BEAT = 480
VELOCITY = 80


def write_midi(
    roll: np.ndarray, path: str | Path, frame_beats: float = 0.5, bpm: float = 120.0, lowest_note: int = LOWEST_NOTE
) -> Path:
    """Write a piano roll as a one-track standard MIDI file (type 1, acoustic grand piano).

    Args:
        roll: ``(T, N)`` 0/1, column ``j`` = MIDI note ``lowest_note + j``.
        path: the ``.mid`` file to write.
        frame_beats: the length of a frame in quarter notes.
        bpm: quarter notes per minute.
        lowest_note: the MIDI number of column 0.

    Returns:
        ``path``.
    """
    import mido  # deferred: only writing MIDI needs it (pip install "lm-zoo[music]")

    roll = np.asarray(roll, dtype=bool)
    ticks_per_frame = round(TICKS_PER_BEAT * frame_beats)
    # A note starts where it sounds and did not in the frame before, and stops where it no longer sounds.
    padded = np.concatenate([np.zeros((1, roll.shape[1]), bool), roll, np.zeros((1, roll.shape[1]), bool)])
    change = padded[1:].astype(np.int8) - padded[:-1].astype(np.int8)  # (T + 1, N): +1 on, -1 off
    frames, columns = np.nonzero(change)
    starts = change[frames, columns] > 0
    # (tick, on, note), sorted: at the same tick a note stops before another starts.
    events = sorted(zip((frames * ticks_per_frame).tolist(), starts.tolist(), (columns + lowest_note).tolist()))
    track = mido.MidiTrack()
    track.append(mido.MetaMessage("set_tempo", tempo=mido.bpm2tempo(bpm), time=0))
    track.append(mido.Message("program_change", program=0, time=0))
    now = 0
    for tick, on, note in sorted(events):
        kind = "note_on" if on else "note_off"
        track.append(mido.Message(kind, note=int(note), velocity=VELOCITY if on else 0, time=int(tick - now)))
        now = tick
    track.append(mido.MetaMessage("end_of_track", time=0))
    midi = mido.MidiFile(type=1, ticks_per_beat=TICKS_PER_BEAT)
    midi.tracks.append(track)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    midi.save(str(path))
    return path


NOTE_NAMES = ("C", "C#", "D", "D#", "E", "F", "F#", "G", "G#", "A", "A#", "B")


def note_name(midi_number: int) -> str:
    """Scientific pitch notation: MIDI 60 is ``C4`` (middle C), 21 is ``A0``, 108 is ``C8``."""
    return f"{NOTE_NAMES[midi_number % 12]}{midi_number // 12 - 1}"


@dataclass(frozen=True)
class RollLayout:
    """Where :func:`write_png` puts a piano roll and its axes, in pixels of the picture.

    Attributes:
        size: the picture's ``(width, height)``.
        box: the roll's ``(left, top, right, bottom)``: ``right - left`` is frames x cell, ``bottom - top`` is
            notes x cell.
        x_ticks: ``(x, label)`` along the time axis under the roll: a frame number at the left edge of its column.
        y_ticks: ``(y, label)`` up the pitch axis left of the roll: every C, named and numbered (``C4 (60)``), at the
            middle of its row.
        x_title: the time axis's title, under the tick labels.
        y_title: the pitch axis's title, above the roll.
    """

    size: tuple[int, int]
    box: tuple[int, int, int, int]
    x_ticks: list[tuple[int, str]]
    y_ticks: list[tuple[int, str]]
    x_title: str = "time (frames)"
    y_title: str = "pitch (note, MIDI number)"


# Margins of the axes (pixels): the pitch labels on the left, the frame numbers and the title below, a title above.
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 12, 22, 32
_MIN_TICK_GAP = 40  # pixels between frame numbers, so that their labels never touch


def roll_layout(frames: int, notes: int, cell: int = 4, lowest_note: int = LOWEST_NOTE) -> RollLayout:
    """The layout of a ``frames x notes`` piano roll drawn with ``cell``-pixel cells: the roll inside margins that
    hold a time axis (frame numbers at a round spacing of at least 40 pixels) and a pitch axis (every C)."""
    left, top = _LEFT, _TOP
    right, bottom = left + frames * cell, top + notes * cell
    every = next(n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if n * cell >= _MIN_TICK_GAP or n == 1024)
    x_ticks = [(left + frame * cell, str(frame)) for frame in range(0, frames + 1, every)]
    y_ticks = [
        (bottom - column * cell - cell // 2, f"{note_name(lowest_note + column)} ({lowest_note + column})")
        for column in range(notes)
        if (lowest_note + column) % 12 == 0
    ]
    return RollLayout((right + _RIGHT, bottom + _BOTTOM), (left, top, right, bottom), x_ticks, y_ticks)


def write_png(roll: np.ndarray, path: str | Path, cell: int = 4, lowest_note: int = LOWEST_NOTE) -> Path:
    """Draw a piano roll: time to the right, pitch upwards, each note-frame a ``cell x cell`` block, with a time axis
    (frame numbers) below and a pitch axis (every C, named and numbered: ``C4 (60)`` is middle C) on the left.

    The rows of every C are shaded, so the octaves can be read off across the roll. :func:`roll_layout` says where
    everything goes.

    Args:
        roll: ``(T, N)`` 0/1.
        path: the ``.png`` file to write.
        cell: pixels per frame and per note.
        lowest_note: the MIDI number of column 0.

    Returns:
        ``path``.
    """
    from PIL import Image, ImageDraw  # Pillow comes with tensorboard

    roll = np.asarray(roll, dtype=bool)
    layout = roll_layout(roll.shape[0], roll.shape[1], cell, lowest_note)
    notes = np.arange(roll.shape[1]) + lowest_note
    picture = np.full((roll.shape[1], roll.shape[0]), 255, dtype=np.uint8)  # (N, T), white
    picture[notes % 12 == 0, :] = 225  # the C rows, light grey
    picture[roll.T] = 0  # sounding notes, black
    picture = picture[::-1]  # high notes at the top
    image = Image.new("L", layout.size, 255)
    left, top, right, bottom = layout.box
    image.paste(Image.fromarray(np.kron(picture, np.ones((cell, cell), dtype=np.uint8)), mode="L"), (left, top))
    draw = ImageDraw.Draw(image)
    draw.rectangle((left - 1, top - 1, right, bottom), outline=0)  # the frame, outside the roll's cells
    for x, label in layout.x_ticks:
        draw.line((x, bottom, x, bottom + 4), fill=0)
        draw.text((x, bottom + 5), label, fill=0, anchor="ma")
    for y, label in layout.y_ticks:
        draw.line((left - 5, y, left - 1, y), fill=0)
        draw.text((left - 7, y), label, fill=0, anchor="rm")
    draw.text(((left + right) // 2, layout.size[1] - 2), layout.x_title, fill=0, anchor="md")
    draw.text((2, 2), layout.y_title, fill=0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
