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


def write_png(roll: np.ndarray, path: str | Path, cell: int = 4, lowest_note: int = LOWEST_NOTE) -> Path:
    """Draw a piano roll: time to the right, pitch upwards, each note-frame a ``cell x cell`` block.

    The rows of every C are shaded, so the octaves can be read off (middle C, MIDI 60, is the fourth shaded row from
    the bottom on an 88-key roll).

    Args:
        roll: ``(T, N)`` 0/1.
        path: the ``.png`` file to write.
        cell: pixels per frame and per note.
        lowest_note: the MIDI number of column 0.

    Returns:
        ``path``.
    """
    from PIL import Image  # Pillow comes with tensorboard

    roll = np.asarray(roll, dtype=bool)
    notes = np.arange(roll.shape[1]) + lowest_note
    picture = np.full((roll.shape[1], roll.shape[0]), 255, dtype=np.uint8)  # (N, T), white
    picture[notes % 12 == 0, :] = 225  # the C rows, light grey
    picture[roll.T] = 0  # sounding notes, black
    picture = picture[::-1]  # high notes at the top
    image = Image.fromarray(np.kron(picture, np.ones((cell, cell), dtype=np.uint8)), mode="L")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
