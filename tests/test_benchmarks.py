"""The cell benchmark runs end to end at a tiny size and compares each cell with the nn.LSTM of its size."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import cells


def test_cells_compares_fs_rnn_with_an_lstm_of_as_many_cells(tmp_path: Path) -> None:
    out = tmp_path / "cells.json"
    argv = ["--arch", "fs_rnn", "lstm", "mogrifier", "--batch", "2", "--bptt", "3", "--hidden", "8", "--rounds", "1"]
    cells.main([*argv, "--loop", "--device", "cpu", "--json", str(out)])  # no --threads: it is process-wide
    rows = {row["model"]: row for row in json.loads(out.read_text())["results"]}
    # Two FS-RNN blocks of k = 2 fast cells and a slow one: the size of a 6-layer LSTM, timed beside the 2-layer one.
    assert rows["fs_rnn"]["lstm_layers"] == 6 and rows["nn.LSTM (6 layers)"]["lstm_layers"] == 6
    assert rows["lstm"]["lstm_layers"] == rows["mogrifier"]["lstm_layers"] == 2
    assert rows["nn.LSTM (6 layers)"]["ratio_nn_lstm"] == 1.0 and rows["nn.LSTM"]["ratio_nn_lstm"] == 1.0
    # A per-step row only where the default model runs a kernel (nn.LSTM's, the Mogrifier's window kernel).
    assert "lstm (loop)" in rows and "mogrifier (loop)" in rows and "fs_rnn (loop)" not in rows
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
