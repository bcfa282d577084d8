"""The benchmarks at a tiny size: each writes a new results file unless told to continue one (``--resume``), and
records what it ran (the trials a cell's study holds, the settings a cell was trained with)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks import cells, output
from datamodules.synthetic import xml_closing_tags_matched


def refused(capsys: pytest.CaptureFixture[str], run, *fragments: str) -> str:
    """``run()`` stops with status 2 and one line on stderr holding every fragment; that line."""
    with pytest.raises(SystemExit) as stop:
        run()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(f in err for f in fragments), err
    return err


def test_a_run_writes_a_new_file_and_continues_one_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(output, "RESULTS", tmp_path)
    committed = output.committed("table")
    committed.write_text("{}\n")

    def path(out: Path | None = None, resume: bool = False) -> Path:
        return output.output_path(argparse.Namespace(out=out, resume=resume), "table")

    fresh = path()  # the default: a new file beside the committed one, never the committed one
    assert fresh.parent == tmp_path and fresh.name.startswith("table-") and not fresh.exists()
    fresh.write_text("{}\n")
    assert path() != fresh  # a second run in the same second gets its own file too
    assert path(resume=True) == committed  # --resume continues the committed results by default
    assert path(tmp_path / "mine.json") == tmp_path / "mine.json"
    refused(capsys, lambda: path(committed), "--out", "exists", "--resume")
    refused(capsys, lambda: path(tmp_path / "missing.json", resume=True), "--resume", "does not exist")
    # A file is continued only with the settings it was written with (a setting it does not record is not held).
    output.check_same("cell 10/LSTM", {"epochs": 6}, {"epochs": 6, "eval_examples": 1000}, committed)
    refused(
        capsys,
        lambda: output.check_same("cell 10/LSTM", {"epochs": 6}, {"epochs": 10}, committed),
        "cell 10/LSTM",
        "epochs 6, not 10",
    )


@pytest.mark.slow
def test_cells_compares_fs_rnn_with_an_lstm_of_as_many_cells(tmp_path: Path) -> None:
    out = tmp_path / "cells.json"
    argv = ["--arch", "fs_rnn", "lstm", "mogrifier", "--batch", "2", "--bptt", "3", "--hidden", "8", "--rounds", "1"]
    cells.main([*argv, "--loop", "--device", "cpu", "--out", str(out)])  # no --threads: it is process-wide
    written = json.loads(out.read_text())
    assert written["command"].startswith("python benchmarks/cells.py --arch fs_rnn") and written["torch"]
    rows = {row["model"]: row for row in written["results"]}
    # Two FS-RNN blocks of k = 2 fast cells and a slow one: the size of a 6-layer LSTM, timed beside the 2-layer one.
    assert rows["fs_rnn"]["lstm_layers"] == 6 and rows["nn.LSTM (6 layers)"]["lstm_layers"] == 6
    assert rows["lstm"]["lstm_layers"] == rows["mogrifier"]["lstm_layers"] == 2
    assert rows["nn.LSTM (6 layers)"]["ratio_nn_lstm"] == 1.0 and rows["nn.LSTM"]["ratio_nn_lstm"] == 1.0
    # A per-step row only where the default model runs a kernel (nn.LSTM's, the Mogrifier's window kernel).
    assert "lstm (loop)" in rows and "mogrifier (loop)" in rows and "fs_rnn (loop)" not in rows
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    assert all(row["first_step_s"] > 0 for row in rows.values())
    # --eager adds a row only for the architectures whose CUDA windows are captured; on the CPU, none is.
    cells.main([*argv, "--eager", "--device", "cpu", "--out", str(tmp_path / "eager.json")])
    assert not any(
        row["model"].endswith("(eager)") for row in json.loads((tmp_path / "eager.json").read_text())["results"]
    )


def test_cells_times_queued_steps_and_the_whole_word_model(tmp_path: Path) -> None:
    """--queued steps between two synchronisations (recorded; 1 by default on the CPU), --vocab around every model
    alike: an embedding and a softmax of that many words, whose cross-entropy trains (the weights move)."""
    out = tmp_path / "lm.json"
    argv = ["--arch", "lstm", "--batch", "2", "--bptt", "3", "--hidden", "8", "--rounds", "2", "--no-naive"]
    cells.main([*argv, "--device", "cpu", "--vocab", "50", "--queued", "3", "--out", str(out)])
    written = json.loads(out.read_text())
    assert (written["queued"], written["rounds"], written["vocab"]) == (3, 2, 50)
    assert {row["model"] for row in written["results"]} == {"nn.LSTM", "lstm"}
    cells.main([*argv, "--device", "cpu", "--out", str(tmp_path / "stack.json")])
    assert json.loads((tmp_path / "stack.json").read_text())["queued"] == 1
    model = cells.WordModel(cells.TorchLSTM(8, 8, 1), 50, 8)
    ids, targets = torch.randint(50, (2, 3)), torch.randint(50, (2, 3))
    before = model.decoder.weight.detach().clone()
    cells.word_training_step(model, ids, targets, torch.optim.SGD(model.parameters(), lr=1.0))()
    assert not torch.equal(before, model.decoder.weight)
    expected = torch.nn.functional.cross_entropy(
        model.decoder(model.stack(model.embedding(ids))[0]).flatten(0, 1), targets.flatten()
    )
    torch.testing.assert_close(model.loss(ids, targets), expected)


def test_the_cell_profile_sorts_kernels_by_their_names() -> None:
    from benchmarks.cell_profile import kind_of

    assert kind_of("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTN") == "matrix products"
    assert kind_of("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32") == "matrix products"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda>") == "pointwise"
    assert kind_of("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>") == "reductions"
    assert kind_of("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>") == "copies and fills"
    assert kind_of("some_kernel_of_its_own") == "other"


@pytest.mark.slow
def test_reverse_copy_runs_both_models_at_one_budget_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/reverse_copy.py end to end at a tiny size: each cell is tuned, scored on the answers of the test
    split, sized to the budget, written to the results file as it ends and drawn. The file records the trials each
    cell's study holds; a rerun must say --resume, which skips finished cells and tops up a cell's study to --trials."""
    from benchmarks import reverse_copy

    results = tmp_path / "results.json"
    argv = ["--lengths", "3", "--num-symbols", "5", "--params", "20000", "--train-examples", "64"]
    argv += ["--eval-examples", "16", "--epochs", "1", "--workdir", str(tmp_path / "work"), "--out", str(results)]
    reverse_copy.main([*argv, "--trials", "1"])
    cells = json.loads(results.read_text())
    assert set(cells) == {"3/LSTM", "3/Mogrifier"}
    for cell in cells.values():
        assert cell["test_tokens"] == 16 * 3  # the answers only
        assert 19_000 < cell["parameters"] <= 20_000  # the most units inside the budget
        assert cell["test_loss"] > 0
        assert (cell["trials"], cell["trials_run"], cell["trials_complete"], cell["trials_diverged"]) == (1, 1, 1, 0)
    assert cells["3/Mogrifier"]["hidden_size"] < cells["3/LSTM"]["hidden_size"]  # its rounds cost parameters
    png = tmp_path / "results.png"  # the plot goes beside the results file
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    before = results.read_text()
    refused(capsys, lambda: reverse_copy.main([*argv, "--trials", "1"]), "exists", "--resume")  # no silent reuse
    # Nor of the studies: a new results file with the same --workdir would count their trials and train nothing.
    other = [*argv[:-2], "--out", str(tmp_path / "other.json"), "--trials", "1"]
    refused(capsys, lambda: reverse_copy.main(other), "already holds a study", "--resume", "--workdir")
    reverse_copy.main([*argv, "--trials", "1", "--resume"])  # nothing left to run
    assert results.read_text() == before
    refused(capsys, lambda: reverse_copy.main([*argv, "--trials", "1", "--resume", "--epochs", "2"]), "epochs 1, not 2")

    reverse_copy.main([*argv, "--trials", "2", "--resume"])  # one more trial in each cell's study, counted from it
    topped = json.loads(results.read_text())
    for key, cell in topped.items():
        assert (cell["trials"], cell["trials_run"], cell["trials_complete"]) == (2, 2, 2), key
        log = (tmp_path / "work" / key.replace("/", "-") / "tune.log").read_text()
        assert "holds 1 finished trial, --trials 2: running 1" in log


def test_search_table1_trains_each_cell_with_the_same_settings(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/search_table1.py at a tiny size: every architecture is trained with the same drawn settings, the
    best accuracy is one of its runs', and the table holds the paper's row beside ours."""
    from benchmarks import search_table1
    from tests.conftest import TINY_SEARCH

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_SEARCH)
    results = tmp_path / "table1.json"
    argv = ["--config", str(config), "--tasks", "xml", "--architectures", "LSTM", "MUT1", "--out", str(results)]
    search_table1.main([*argv, "--settings", "2"])
    cells = json.loads(results.read_text())
    assert set(cells) == {"xml/LSTM", "xml/MUT1"}
    assert [r["setting"] for r in cells["xml/LSTM"]["runs"]] == [r["setting"] for r in cells["xml/MUT1"]["runs"]]
    for cell in cells.values():
        assert cell["accuracy"] == max(r["accuracy"] for r in cell["runs"]) > 0
        assert cell["parameters"] <= 2000
    assert "| xml (paper) |" in search_table1.table(cells, ["xml"])
    # --resume with more settings trains only the new one; the same first settings are drawn again.
    search_table1.main([*argv, "--settings", "3", "--resume"])
    more = json.loads(results.read_text())
    for key, cell in more.items():
        assert cell["settings"] == len(cell["runs"]) == 3 and cell["runs"][:2] == cells[key]["runs"]


def test_the_fit_profile_names_each_function_by_its_own_time_per_step() -> None:
    """``fit_overhead.py --profile``'s table: cProfile's own time per step, largest first, and the Python total."""
    import cProfile

    from benchmarks import fit_overhead

    def slow_python() -> int:
        total = 0
        for i in range(200_000):  # Python lines only: all of it is this function's own time
            total += i
        return total

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(4):  # four "steps"
        slow_python()
    profiler.disable()
    rows = fit_overhead.top_functions(profiler, steps=4, rows=3)
    assert len(rows) <= 4 and rows[-1]["function"].startswith("all Python functions")
    first = rows[0]
    assert "slow_python" in first["function"] and first["calls_per_step"] == 1.0
    assert first["ms_per_step"] > 1  # some 10 ms on this machine; far more than anything else here
    ranked = [r["ms_per_step"] for r in rows[:-1]]
    assert ranked == sorted(ranked, reverse=True)
    assert rows[-1]["ms_per_step"] >= first["ms_per_step"]


def test_fit_overhead_network_side_trains_the_network_lm_zoo_fit_builds() -> None:
    """The side that runs lm-zoo's network in the plain loop must be the network ``lm-zoo fit`` trains from the same
    config (else the split of the overhead between network and loop means nothing), at the width asked for."""
    import yaml

    from benchmarks import fit_overhead
    from lightning_modules import LanguageModel

    network, lr, clip = fit_overhead.lm_zoo_network(vocab_size=50, width=8)
    config = yaml.safe_load(fit_overhead.CONFIG.read_text())
    module = LanguageModel(**{**config["model"]["init_args"], "vocab_size": 50, "embedding_size": 8, "hidden_size": 8})
    expected = {name: tuple(t.shape) for name, t in module.model.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in network.state_dict().items()} == expected
    assert network.config == module.model.config
    assert (lr, clip) == (config["optimizer"]["init_args"]["lr"], config["trainer"]["gradient_clip_val"])


def test_fit_overhead_bare_lightning_side_trains_the_plain_network_in_lightnings_loop() -> None:
    """The floor of a Lightning application's overhead: the plain loop's network and windows in a bare Trainer, timed
    over the steps after the warm-up; it trains (the weights move)."""
    from benchmarks import fit_overhead

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.rnn = torch.nn.Embedding(11, 4), torch.nn.LSTM(4, 4, 2)
            self.decoder = torch.nn.Linear(4, 11)

        def forward(self, x: torch.Tensor, hidden: tuple | None) -> tuple:
            output, hidden = self.rnn(self.embedding(x), hidden)
            return self.decoder(output), hidden

    torch.manual_seed(0)
    model = Tiny()
    before = model.decoder.weight.detach().clone()
    columns = torch.randint(11, (60, 3))  # (N, B)
    seconds = fit_overhead._bare_lightning_loop(model, columns, 11, bptt=5, steps=4, warmup=2, device="cpu")
    assert seconds > 0 and not torch.equal(before, model.decoder.weight)


def test_fit_overhead_summary_differences_in_milliseconds_and_older_files_without_a_side() -> None:
    from benchmarks import fit_overhead

    sides = {fit_overhead.PLAIN_LM_ZOO_MALLOC: 1000.0, fit_overhead.NETWORK: 800.0, fit_overhead.FIT: 500.0}
    rounds = [{side: {"tokens_per_s": tokens, "peak": 1.0} for side, tokens in sides.items()}]
    summary = fit_overhead.summarise(rounds, tokens_per_step=100)
    assert summary["median_step_ms"] == {side: 100 / tokens * 1e3 for side, tokens in sides.items()}
    by_sides = {r["sides"]: r for r in summary["ratios"]}
    loop = by_sides[f"{fit_overhead.FIT} / {fit_overhead.NETWORK}"]
    assert loop["tokens_per_s"] == 0.625 and loop["step_ms_more"] == 75.0  # 200 ms a step against 125
    # A machine that slows down between rounds: each round's own ratio is 0.5 then 2, the medians' ratio neither.
    drift = [
        {
            fit_overhead.PLAIN_LM_ZOO_MALLOC: {"tokens_per_s": 1000.0, "peak": 1.0},
            fit_overhead.FIT: {"tokens_per_s": 500.0, "peak": 1.0},
        },
        {
            fit_overhead.PLAIN_LM_ZOO_MALLOC: {"tokens_per_s": 400.0, "peak": 1.0},
            fit_overhead.FIT: {"tokens_per_s": 800.0, "peak": 1.0},
        },
    ]
    (drifted,) = fit_overhead.summarise(drift, 100)["ratios"]
    assert drifted["per_round"] == [0.5, 2.0] and drifted["tokens_per_s"] == round(650 / 700, 3)
    # A file measured before a side existed (here glibc's sides and the network's) summarises what it holds.
    older = [{side: r[side] for side in (fit_overhead.PLAIN_LM_ZOO_MALLOC, fit_overhead.FIT)} for r in rounds]
    assert [r["sides"] for r in fit_overhead.summarise(older, 100)["ratios"]] == [
        f"{fit_overhead.FIT} / {fit_overhead.PLAIN_LM_ZOO_MALLOC}"
    ]


def test_xml_nesting_splits_closing_tags_by_how_far_back_their_tag_opened() -> None:
    from benchmarks import xml_nesting

    text = "<ab></ab><cd><ef></ef></xx><gh>" + "<ij></ij>" * 12 + "</gh></zz>"
    # </ab> at once (right); </ef> at once (right); </xx> closes cd after <ef></ef> (9 characters, wrong); the 12
    # <ij></ij> at once (right); </gh> after 12 elements (108 characters, right); </zz> with nothing open (wrong).
    expected = [(0, True), (0, True), (9, False), *[(0, True)] * 12, (108, True), (None, False)]
    assert xml_nesting.closing_tags_by_span(text) == expected
    rows = xml_nesting.by_span([text, "<a></b>"])
    assert [(r["closing_tags"], r["matched"]) for r in rows] == [(15, 14), (1, 0), (0, 0), (1, 1), (1, 0)]
    assert rows[-1]["span"] == xml_nesting.NOTHING_OPEN
    # The rows add up to the card's count.
    counts = [xml_closing_tags_matched(t) for t in (text, "<a></b>")]
    card = (sum(m for m, _ in counts), sum(c for _, c in counts))
    assert (sum(r["matched"] for r in rows), sum(r["closing_tags"] for r in rows)) == card


def test_xml_character_roles_mark_what_the_generator_decides_and_what_it_copies() -> None:
    from benchmarks import xml_nesting

    document = "<ab><c></c></ab>"
    roles = xml_nesting.character_roles(document)
    assert len(roles) == len(document)
    by_character = list(zip(document, roles))
    assert by_character[:4] == [("<", "structure"), ("a", "opening name"), ("b", "opening name"), (">", "structure")]
    at_once, after_one = "closing name 0: closed right after opening", "closing name 1-29 characters"
    assert by_character[7:11] == [("<", "structure"), ("/", "structure"), ("c", at_once), (">", at_once)]
    # </ab> closes after <c></c>: 7 characters between, and the name had to be kept meanwhile
    assert by_character[11:] == [
        ("<", "structure"),
        ("/", "structure"),
        ("a", after_one),
        ("b", after_one),
        (">", after_one),
    ]


def test_quantize_registers_the_int8_figure_it_measured_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks/quantize.py --register``: a rebuilt bundle's entry has no int8 figure until this writes one."""
    from benchmarks import quantize
    from checkpoints import registry

    path = tmp_path / "registry.json"
    path.write_text(registry.DEFAULT_PATH.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setenv("LM_ZOO_REGISTRY", str(path))
    before = registry.load_registry()
    quantize._register("ptb-lstm-medium", {"ppl": 82.5, "bptt": 35, "tokens": 82430, "seconds": 1.0})
    after = registry.load_registry()
    assert after["ptb-lstm-medium"].int8_results == {
        "test": {"ppl": 82.5, "eval_batch_size": 1, "bptt": 35, "tokens": 82430}
    }
    assert after["ptb-lstm-medium"].int8_results != before["ptb-lstm-medium"].int8_results
    assert {n: e for n, e in after.items() if n != "ptb-lstm-medium"} == {
        n: e for n, e in before.items() if n != "ptb-lstm-medium"
    }


def test_xml_bits_by_role_add_up_to_the_models_evaluation_and_the_generators_draws() -> None:
    """benchmarks/xml_nesting.py's per-character table on the shipped model: its bits, summed over the roles, are the
    evaluation path's (``token_nll``) on the same stream; the generator's are the bits of the draws that wrote the
    documents (read from their tags), and nothing on a copied closing name; accuracies are counts within reach."""
    import math
    import random

    import torch

    from benchmarks import xml_nesting
    from checkpoints import load
    from datamodules.synthetic import xml_document
    from tests.conftest import drawn_bits

    loaded = load("synthetic-xml-lstm")
    rng = random.Random(5)
    texts = [xml_document(rng) for _ in range(20)]
    rows = xml_nesting.bits_by_role(loaded, texts)
    stream = "".join(text + "\n" for text in texts)
    targets = torch.as_tensor(loaded.tokenizer.encode_text(stream), dtype=torch.long)
    inputs = torch.cat([torch.tensor([loaded.tokenizer.bos_id]), targets[:-1]])
    with torch.no_grad():
        nats, _ = loaded.model.eval().token_nll(inputs.unsqueeze(0), targets.unsqueeze(0))
    assert sum(r["bits_per_char"] * r["characters"] for r in rows) == pytest.approx(nats.sum().item() / math.log(2))
    assert sum(r["characters"] for r in rows) == len(stream)

    drawn = sum(map(drawn_bits, texts))
    assert sum(r["generator_bits_per_char"] * r["characters"] for r in rows) == pytest.approx(drawn)
    for row in rows:
        assert 0 <= row["correct"] <= row["characters"]
        if row["role"].startswith("closing name"):
            assert row["generator_bits_per_char"] == 0.0 and row["best_accuracy"] == 1.0


def test_within_window_is_the_chance_that_one_bptt_window_holds_the_name_and_its_copy() -> None:
    from benchmarks import xml_nesting

    # </cd> closes at once: from "c" (index 5) to its ">" (12), 7 characters; </ab> after the element <cd></cd>: from
    # "a" (1) to its ">" (17), 16. A window of W characters holds both with chance 1 - D/W (none when D >= W).
    rows = {row["span"]: row for row in xml_nesting.within_window(["<ab><cd></cd></ab>"], windows=(8, 32))}
    at_once, after_one = rows["0: closed right after opening"], rows["1-29 characters"]
    assert at_once["closing_tags"] == after_one["closing_tags"] == 1 and rows["100+"]["closing_tags"] == 0
    assert rows["100+"]["within"] == {"8": None, "32": None}  # no closing tag that far back: no chance to give
    assert at_once["within"] == pytest.approx({"8": 1 - 7 / 8, "32": 1 - 7 / 32})
    assert after_one["within"] == pytest.approx({"8": 0.0, "32": 1 - 16 / 32})


def test_generate_speed_times_each_side_and_records_what_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At a tiny size on the CPU: the plain loop and each architecture's generate (both paths with --eager), every
    side timed each round, ratios to the plain loop's median, and the machine and settings recorded."""
    from benchmarks import generate_speed

    out = tmp_path / "generate.json"
    generate_speed.main(["--arch", "lstm", "mogrifier", "--eager", "--width", "8", "--vocab", "30", "--tokens", "5",
                         "--rounds", "2", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    sides = [generate_speed.PLAIN, "lstm generate", "lstm generate, plain path", "mogrifier generate",
             "mogrifier generate, plain path"]  # fmt: skip
    assert list(result["tokens_per_s"]) == sides
    assert all(len(rates) == 2 and min(rates) > 0 for rates in result["tokens_per_s"].values())
    assert result["ratio_to_plain"][generate_speed.PLAIN] == 1.0
    assert result["settings"]["width"] == 8 and result["batch"] == 1 and result["cuda"] is None
    assert "1.00x the plain loop" in capsys.readouterr().out
    if not torch.cuda.is_available():
        refused(capsys, lambda: generate_speed.main(["--device", "cuda", "--out", str(tmp_path / "x.json")]), "no CUDA")


def test_sigterm_broadcast_times_lightnings_broadcast_beside_the_same_loop_without(tmp_path: Path) -> None:
    from benchmarks import sigterm_broadcast

    out = tmp_path / "broadcast.json"
    sigterm_broadcast.main(["--steps", "5", "--rounds", "1", "--out", str(out)])
    written = json.loads(out.read_text())
    assert set(written["median_us_per_step"]) == {"with the broadcast", "without"}
    assert len(written["us_per_step"]) == 2 and written["settings"]["backend"] == "gloo"
    assert written["broadcast_us"] == pytest.approx(
        written["median_us_per_step"]["with the broadcast"] - written["median_us_per_step"]["without"]
    )


def test_handoffs_puts_each_file_in_todays_room() -> None:
    """benchmarks/handoffs.py counts calls between packages: a checkout's files by their top folder (an older
    commit's lightning_modules/evaluation as today's evaluation), Lightning's installed files as ``lightning``, and
    nothing else (torch, a virtual environment inside the checkout)."""
    from benchmarks import handoffs

    root = handoffs.ROOT
    assert handoffs.room(str(root / "zoo" / "stack.py")) == "zoo"
    assert handoffs.room(str(root / "lightning_modules" / "evaluation" / "perplexity.py")) == "evaluation"
    assert handoffs.room(str(root / "lightning_modules" / "stateful.py")) == "lightning_modules"
    assert handoffs.room(str(root / "cli.py")) == "cli"
    venv = root / ".venv" / "lib" / "python3.11" / "site-packages"
    assert handoffs.room(str(venv / "lightning" / "pytorch" / "trainer" / "call.py")) == "lightning"
    assert handoffs.room(str(venv / "torch" / "nn" / "modules" / "module.py")) is None
    assert handoffs.room(str(root / "tests" / "conftest.py")) is None
