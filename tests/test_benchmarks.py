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


def test_reverse_copy_runs_both_models_at_one_budget_and_plots(tmp_path: Path) -> None:
    """benchmarks/reverse_copy.py end to end at a tiny size: each cell is tuned, scored on the answers of the test
    split, sized to the budget, written to the results file as it ends and drawn; a rerun skips finished cells."""
    from benchmarks import reverse_copy

    results, png = tmp_path / "results.json", tmp_path / "plot.png"
    argv = ["--lengths", "3", "--num-symbols", "5", "--params", "20000", "--train-examples", "64"]
    argv += ["--eval-examples", "16", "--epochs", "1", "--workdir", str(tmp_path / "work")]
    reverse_copy.main([*argv, "--results", str(results), "--plot", str(png)])
    cells = json.loads(results.read_text())
    assert set(cells) == {"3/LSTM", "3/Mogrifier"}
    for cell in cells.values():
        assert cell["test_tokens"] == 16 * 3  # the answers only
        assert 19_000 < cell["parameters"] <= 20_000  # the most units inside the budget
        assert cell["test_loss"] > 0
    assert cells["3/Mogrifier"]["hidden_size"] < cells["3/LSTM"]["hidden_size"]  # its rounds cost parameters
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = results.read_text()
    reverse_copy.main([*argv, "--results", str(results), "--plot", str(png)])  # nothing left to run
    assert results.read_text() == before


def test_search_table1_trains_each_cell_with_the_same_settings(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/search_table1.py at a tiny size: every architecture is trained with the same drawn settings, the
    best accuracy is one of its runs', and the table holds the paper's row beside ours."""
    from benchmarks import search_table1
    from tests.test_search import TINY

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format())
    results = tmp_path / "table1.json"
    argv = ["--config", str(config), "--tasks", "xml", "--architectures", "LSTM", "MUT1", "--settings", "2"]
    search_table1.main([*argv, "--results", str(results)])
    cells = json.loads(results.read_text())
    assert set(cells) == {"xml/LSTM", "xml/MUT1"}
    assert [r["setting"] for r in cells["xml/LSTM"]["runs"]] == [r["setting"] for r in cells["xml/MUT1"]["runs"]]
    for cell in cells.values():
        assert cell["accuracy"] == max(r["accuracy"] for r in cell["runs"]) > 0
        assert cell["parameters"] <= 2000
    assert "| xml (paper) |" in search_table1.table(cells, ["xml"])
