"""The architecture search (Jozefowicz et al. 2015 §3): settings, scores, the acceptance ladder on a stubbed scorer,
the shared store, and a tiny real search of two worker processes writing to one SQLite file."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import cli
from search import evolution
from search.evolution import (
    BASELINES,
    SearchConfig,
    SearchStore,
    Standing,
    Worker,
    baseline,
    load_config,
)
from search.tasks import MEMORISE, Grid, Outcome, Setting, Task, train_candidate
from tests.conftest import TINY_SEARCH, one_line_error
from zoo.errors import ConfigError, DataError
from zoo.genome import format_genome, parse

ROOT = Path(__file__).resolve().parents[1]
TASKS = (Task("arithmetic", {}, (1000,)), Task("xml", {}, (1000,)))
GRU, LSTM = baseline("gru_paper"), baseline("lstm")


def config(**options: Any) -> SearchConfig:
    settings = {"settings_per_task": 2, "baseline_settings": 2, "top": 5}
    return SearchConfig(memorise=Task(MEMORISE, {}, (1000,)), tasks=TASKS, **{**settings, **options})


def test_a_setting_reads_back_from_its_key() -> None:
    grid, rng = Grid(), random.Random(0)
    for _ in range(50):
        setting = grid.draw(rng, (250_000, 1_000_000))
        assert Setting.from_key(setting.key()) == setting


def test_the_score_is_the_worst_task_relative_to_the_gru() -> None:
    """§3.1 eq. (1), written out: min over tasks of best accuracy / the GRU's best."""
    from search.evolution import Evaluation

    rows = [
        (GRU, "arithmetic", 0.8), (GRU, "arithmetic", 0.9), (GRU, "xml", 0.5),
        ("cell", "arithmetic", 0.95), ("cell", "xml", 0.4), ("cell", "xml", 0.46), ("cell", MEMORISE, 0.97),
    ]  # fmt: skip
    standing = Standing.of([Evaluation(g, t, f"s{i}", a, None) for i, (g, t, a) in enumerate(rows)], config())
    assert standing.score("cell", config()) == pytest.approx(min(0.95 / 0.9, 0.46 / 0.5))
    assert standing.score(GRU, config()) == 1.0
    assert "cell" in standing.memorised
    # 0.46 > 0.9 * 0.5 passes XML ("exceeds 90%"); raise the bar and it does not.
    assert standing.passes("cell", "xml", config())
    assert not standing.passes("cell", "xml", config(task_threshold=0.95))


class Scripted:
    """A stand-in for training: each (genome, task) gets the accuracy the test scripts, for every setting."""

    def __init__(self, accuracy: dict[tuple[str, str], float]) -> None:
        self.accuracy = accuracy
        self.calls: list[tuple[str, str, str]] = []

    def __call__(self, architecture: str, options: dict[str, Any], task: Task, setting: Setting, seed: int) -> Outcome:
        genome = options["genome"]
        self.calls.append((genome, task.name, setting.key()))
        return Outcome(self.accuracy.get((genome, task.name), 0.0), 1, 4, 100)


@pytest.fixture
def store(tmp_path: Path) -> SearchStore:
    return SearchStore(f"sqlite:///{tmp_path / 'search.db'}")


def scripted_worker(
    monkeypatch: pytest.MonkeyPatch, store: SearchStore, child: str, accuracy: dict[tuple[str, str], float], **options
) -> tuple[Worker, Scripted]:
    scorer = Scripted({(GRU, "arithmetic"): 0.8, (GRU, "xml"): 0.5, (LSTM, "arithmetic"): 0.7, (LSTM, "xml"): 0.4,
                       **accuracy})  # fmt: skip
    monkeypatch.setattr(evolution, "train_candidate", scorer)
    monkeypatch.setattr(evolution, "mutate", lambda graph, rng, **kw: parse(child))
    worker = Worker(config(reevaluate_probability=0.0, **options), store, random.Random(0), log=lambda line: None)
    while worker.baseline_step(worker.standing()) is not None:  # the LSTM and GRU get their settings first
        pass
    return worker, scorer


CHILD = format_genome(parse("h: h' = tanh(lin0(x) + lin1(h))"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("accuracy", "reached", "listed"),
    [
        ({(CHILD, MEMORISE): 0.94}, [MEMORISE], False),  # below 95% on memorisation: no task is tried
        ({(CHILD, MEMORISE): 0.96, (CHILD, "arithmetic"): 0.72}, [MEMORISE, "arithmetic"], False),  # 0.72 <= 0.9 x 0.8
        ({(CHILD, MEMORISE): 0.96, (CHILD, "arithmetic"): 0.73, (CHILD, "xml"): 0.44},
         [MEMORISE, "arithmetic", "xml"], False),  # 0.44 < 0.45 on the second task
        ({(CHILD, MEMORISE): 0.96, (CHILD, "arithmetic"): 0.73, (CHILD, "xml"): 0.46},
         [MEMORISE, "arithmetic", "xml"], True),  # every task above 90% of the GRU: listed
    ],
)  # fmt: skip
def test_the_acceptance_ladder(
    monkeypatch: pytest.MonkeyPatch,
    store: SearchStore,
    accuracy: dict[tuple[str, str], float],
    reached: list[str],
    listed: bool,
) -> None:
    worker, scorer = scripted_worker(monkeypatch, store, CHILD, accuracy)
    worker.step()
    child_calls = [(task, setting) for genome, task, setting in scorer.calls if genome == CHILD]
    assert [t for t in dict.fromkeys(t for t, _ in child_calls)] == reached
    assert sum(t == MEMORISE for t, _ in child_calls) == 1  # one random setting of the memorisation task
    for task in reached[1:]:
        assert sum(t == task for t, _ in child_calls) == 2  # settings_per_task
    standing = worker.standing()
    assert (CHILD in [g for _, g in standing.listed(worker.config)]) == listed
    # Every evaluation is in the store, none twice.
    keys = [(e.genome, e.task, e.setting) for e in store.evaluations()]
    assert len(keys) == len(set(keys)) == len(scorer.calls)


def test_a_memorised_mutant_skips_the_filter_when_drawn_again(
    monkeypatch: pytest.MonkeyPatch, store: SearchStore
) -> None:
    accuracy = {(CHILD, MEMORISE): 0.96, (CHILD, "arithmetic"): 0.5}
    worker, scorer = scripted_worker(monkeypatch, store, CHILD, accuracy)
    worker.step()
    worker.step()  # the same mutant again: memorised, so it goes straight to fresh arithmetic settings
    memorise_calls = [c for c in scorer.calls if c[0] == CHILD and c[1] == MEMORISE]
    arithmetic = [c[2] for c in scorer.calls if c[0] == CHILD and c[1] == "arithmetic"]
    assert len(memorise_calls) == 1 and len(arithmetic) == 4 and len(set(arithmetic)) == 4


def test_a_listed_cell_with_no_mutant_costs_a_step_not_the_worker(
    monkeypatch: pytest.MonkeyPatch, store: SearchStore
) -> None:
    """A store can list a cell no transformation applies to (``h' = x``; CI's two-worker search once drew one as a
    parent and the worker died). The real ``mutate`` refuses it; the step says so and the next step goes on."""
    dead_end = format_genome(parse("h: h' = x"))
    worker, scorer = scripted_worker(monkeypatch, store, CHILD, {(dead_end, "arithmetic"): 0.9, (dead_end, "xml"): 0.6})
    from search.mutation import mutate

    monkeypatch.setattr(evolution, "mutate", mutate)
    for task in TASKS:  # listed above the GRU, as if an older search had put it there
        worker.evaluate(dead_end, task, Grid().draw(random.Random(task.name), task.num_params))
    monkeypatch.setattr(worker.rng, "choice", lambda listed: dead_end)
    lines: list[str] = []
    worker.log = lines.append
    assert worker.step() == "no acceptable mutant of the chosen parent"
    assert any("no node to mutate" in line for line in lines)


def test_baselines_come_first_and_the_list_starts_with_them(
    monkeypatch: pytest.MonkeyPatch, store: SearchStore
) -> None:
    worker, scorer = scripted_worker(monkeypatch, store, CHILD, {})
    assert {(g, t) for g, t, _ in scorer.calls} == {(b, t.name) for b in (GRU, LSTM) for t in TASKS}
    assert len(scorer.calls) == 2 * 2 * 2  # baseline_settings per baseline and task
    assert [g for _, g in worker.standing().listed(worker.config)] == [GRU, LSTM]  # scores 1 and min(.7/.8, .4/.5)
    assert {baseline(name) for name in BASELINES} == {GRU, LSTM}


def test_a_mutants_settings_mix_its_parents_and_the_baselines() -> None:
    """§3.3: with a parent evaluated on few settings, about a third of a mutant's settings come from those tried on
    the parent, a third from the LSTM's and GRU's best, a third at random; with a long history, 80% from the parent's
    best."""
    from search.evolution import Evaluation

    rng, task = random.Random(1), TASKS[0]
    keys = list(dict.fromkeys(Grid().draw(rng, task.num_params).key() for _ in range(2000)))
    parent, lstm, gru = keys[:30], keys[30:60], keys[60:90]
    rows = [Evaluation(g, task.name, k, rng.random(), None) for g, ks in (("p", parent), (LSTM, lstm), (GRU, gru))
            for k in ks]  # fmt: skip
    worker = Worker(config(), None, random.Random(0), log=lambda line: None)  # type: ignore[arg-type]
    picked = [s.key() for s in worker.fresh_settings(CHILD, task, 60, Standing.of(rows, config()), parent="p")]
    assert len(set(picked)) == 60
    assert 12 <= sum(k in parent for k in picked) <= 30
    assert 12 <= sum(k in lstm or k in gru for k in picked) <= 30
    # A parent with more than parent_history settings: 80% of the mutant's from its best 100.
    long_history = keys[:500]
    rows = [Evaluation("p", task.name, k, i / 500, None) for i, k in enumerate(long_history)]
    best = set(long_history[-100:])
    picked = [s.key() for s in worker.fresh_settings(CHILD, task, 50, Standing.of(rows, config()), parent="p")]
    assert 32 <= sum(k in best for k in picked) <= 48


def test_a_task_ends_when_its_grid_is_exhausted(monkeypatch: pytest.MonkeyPatch, store: SearchStore) -> None:
    small = Grid(init_scale=(1.0,), learning_rate=(0.5,), max_grad_norm=(5.0,), num_layers=(1,))
    worker, _ = scripted_worker(monkeypatch, store, CHILD, {}, grid=small, baseline_settings=1)
    assert worker.fresh_settings(GRU, TASKS[0], 3, worker.standing()) == []  # its one setting is taken


def test_shipped_search_config_reads() -> None:
    loaded = load_config(ROOT / "configs" / "search" / "jozefowicz.yaml")
    assert [t.name for t in loaded.tasks] == ["arithmetic", "xml", "ptb"]
    assert loaded.memorise_threshold == 0.95 and loaded.task_threshold == 0.9 and loaded.top == 100
    assert loaded.memorise.data["init_args"]["reverse"] is False
    assert loaded.memorise.stop_at == 0.95 and all(task.stop_at is None for task in loaded.tasks)
    assert [t.scored_span for t in loaded.tasks] == [("=", "."), None, None]


def test_arithmetic_is_scored_on_its_answers() -> None:
    """§3.5: the network reads the problem until '=', then outputs the answer; accuracy counts the answer's
    characters and its end '.'. The scored targets, carried across windows that cut lines anywhere, are exactly the
    text after each '=' (found here by splitting strings), and the accuracy is the model's on those characters when
    it reads the whole text at once."""
    import torch

    from datamodules.synthetic import arithmetic_example
    from datamodules.tokenizers import CharTokenizer
    from datamodules.windows import LMBatch
    from search.tasks import Span, validation_accuracy
    from zoo import RecurrentLM

    rng = random.Random(0)
    text = "\n".join(arithmetic_example(rng) for _ in range(12)) + "\n"
    tokenizer = CharTokenizer.build(text)
    ids = torch.tensor(tokenizer.encode_text(text), dtype=torch.long)[None]  # (1, N)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    windows = [LMBatch(inputs[:, i : i + 7], targets[:, i : i + 7]) for i in range(0, inputs.size(1), 7)]
    span = Span.of(Task("arithmetic", {}, (1,), scored_span=("=", ".")), tokenizer)

    inside, scored = torch.zeros(1, dtype=torch.bool), []
    for window in windows:
        masked, inside = span.targets(window.inputs, window.targets, inside)
        scored.extend(int(t) for t in masked[0] if t != -100)
    answers = "".join(line.split("=")[1] for line in text.splitlines())
    assert tokenizer.decode(scored) == answers and answers.count(".") == 12

    torch.manual_seed(0)
    model = RecurrentLM(vocab_size=tokenizer.vocab_size, architecture="lstm", embedding_size=8, hidden_size=8)
    with torch.no_grad():
        predicted = model(inputs)[0].argmax(-1)[0].tolist()  # the whole text in one pass
    read = tokenizer.decode(inputs[0].tolist())  # one character per input: position t has read read[: t + 1]
    lines_so_far = [read[: t + 1].split("\n")[-1] for t in range(len(read))]
    in_answer = ["=" in line and not line.endswith(".") for line in lines_so_far]
    right = [p == int(y) for p, y, keep in zip(predicted, targets[0], in_answer) if keep]
    assert len(right) == len(answers)
    assert validation_accuracy(model, windows, None, span) == pytest.approx(sum(right) / len(right))
    assert validation_accuracy(model, windows, None) != validation_accuracy(model, windows, None, span)

    with pytest.raises(ConfigError, match="two symbols of the corpus"):
        Span.of(Task("arithmetic", {}, (1,), scored_span=("=", "#")), tokenizer)


def test_a_resumed_search_does_not_replay_its_first_run(tmp_path: Path) -> None:
    """A worker's random source is reproducible for a store as it stands, and another once the store has grown."""
    import optuna

    store = SearchStore(f"sqlite:///{tmp_path / 'search.db'}")
    first = [evolution.worker_random(0, store).random() for _ in range(2)]
    assert first[0] == first[1]
    store.study.add_trial(optuna.trial.create_trial(value=0.5))
    assert evolution.worker_random(0, store).random() != first[0]
    assert evolution.worker_random(1, store).random() != evolution.worker_random(0, store).random()


def test_the_rate_counts_the_hours_the_search_ran_not_the_gaps_between_its_runs() -> None:
    """Two workers' overlapping evaluations count once, and a search resumed two hours later adds only its own
    time: 0:00-1:00 and 0:30-1:30 (one run, 1.5 h), 3:30-4:00 (its resumption, 0.5 h), 2.0 hours in all."""
    from datetime import datetime, timedelta

    from search.evolution import Evaluation, searching_hours

    zero = datetime(2026, 1, 1)
    spans = [(0, 60), (30, 90), (210, 240), (215, 220)]  # minutes
    rows = [Evaluation(LSTM, "xml", f"s{i}", 0.5, zero + timedelta(minutes=b), started=zero + timedelta(minutes=a))
            for i, (a, b) in enumerate(spans)]  # fmt: skip
    assert searching_hours(rows) == pytest.approx(2.0)
    assert searching_hours(rows[::-1]) == pytest.approx(2.0)
    assert searching_hours([]) == 0.0


def test_a_bad_search_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:

    bad = tmp_path / "bad.yaml"
    bad.write_text("memorise: {data: {}, num_params: [1]}\ntasks: {a: {data: {}, num_params: [1], speed: 3}}\n")
    one_line_error(
        capsys, cli.main(["search", "--config", str(bad), "--storage", "sqlite:///x.db"]), "no setting speed"
    )
    one_line_error(capsys, cli.main(["search", "--config", str(bad), "--storage", "s", "--budget", "2x"]), "2x")
    bad.write_text("memorise: {data: {}, num_params: [1]}\ntasks: {a: {data: {}, num_params: [1], scored_span: 5}}\n")
    one_line_error(capsys, cli.main(["search", "--config", str(bad), "--storage", "s"]), "scored_span must be two")
    # The command's own arguments too, as every other command's: one line, not argparse's usage.
    one_line_error(capsys, cli.main(["search", "--config", str(bad), "--workers", "x"]), "--workers", "invalid int")
    one_line_error(capsys, cli.main(["search", "report"]), "required: --storage", "lm-zoo search report --help")


def test_a_report_on_a_storage_without_a_search_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A report never creates the store it is asked about, and a URL that cannot be parsed or opened, or whose
    database driver is missing, is one line."""
    import sqlite3

    monkeypatch.chdir(tmp_path)
    for missing in ("sqlite:///missing.db", "missing.log"):
        one_line_error(capsys, cli.main(["search", "report", "--storage", missing]), "missing", "no such file")
    assert not list(tmp_path.iterdir()), "the report created a store"
    sqlite3.connect(tmp_path / "other.db").execute("create table unrelated (x)").connection.close()
    one_line_error(capsys, cli.main(["search", "report", "--storage", "sqlite:///other.db"]), "holds no lm-zoo search")
    one_line_error(capsys, cli.main(["search", "report", "--storage", "nonsense"]), "--storage", "sqlite:///FILE.db")
    one_line_error(capsys, cli.main(["search", "report", "--storage", "sqlite:////proc/none/x.db"]), "/proc/none/x.db")
    one_line_error(
        capsys, cli.main(["search", "report", "--storage", "mysql://u@127.0.0.1:1/db"]), "driver", "not installed"
    )


def test_a_config_error_inside_an_evaluation_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A mistake found only when a task is first trained (a scored span whose symbol the corpus lacks) ends the search
    with one line, not Optuna's log of the failed trial's traceback first; the trial is failed, not an evaluation."""
    from tests.conftest import one_line_error

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "span.yaml"
    path.write_text(TINY_SEARCH.replace("    epochs: 1\n", '    epochs: 1\n    scored_span: ["=", "."]\n'))
    storage = f"sqlite:///{tmp_path / 'search.db'}"
    one_line_error(capfd, cli.main(["search", "--config", str(path), "--storage", storage, "--budget", "30s"]), "'='")
    store = SearchStore(storage)
    assert store.evaluations() == []
    assert [t.state.name for t in store.study.get_trials(deepcopy=False)] == ["FAIL"]


@pytest.mark.slow
def test_two_workers_search_one_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A real (tiny) search: two processes train candidates and write to one SQLite file; every evaluation is
    there once, both wrote, mutants were proposed, and the report counts them."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_SEARCH)
    storage = f"sqlite:///{tmp_path / 'search.db'}"
    assert cli.main(["search", "--config", str(path), "--storage", storage, "--workers", "2", "--budget", "8s"]) == 0
    store = SearchStore(storage)
    trials = store.study.get_trials(deepcopy=False)
    workers = {t.user_attrs.get("worker") for t in trials if t.state.name == "COMPLETE"}
    assert len(workers) == 2
    keys = [(e.genome, e.task, e.setting) for e in store.evaluations()]
    assert len(keys) == len(set(keys))
    capsys.readouterr()
    assert cli.main(["search", "report", "--storage", storage, "--config", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["evaluations"] == len(keys)
    assert result["workers"] == 2 and result["searching_hours"] > 0
    assert result["architectures_proposed"] >= 1
    # The baselines are always reported; the top list may be all mutants (every threshold here is 0).
    assert set(result["baselines"]) == {"lstm", "gru_paper"} and all(result["baselines"].values())
    scores = [row["score"] for row in result["top"]]
    assert scores and scores == sorted(scores, reverse=True)


def test_a_candidate_trains_and_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One evaluation for real: the LSTM genome on a small memorisation task beats chance (1 in 4) by far."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    task = Task(
        MEMORISE,
        {"class_path": "datamodules.ReverseCopyDataModule",
         "init_args": {"num_symbols": 4, "min_length": 3, "max_length": 3, "reverse": False, "train_examples": 400,
                       "eval_examples": 50, "batch_size": 10, "eval_batch_size": 25}},
        (3000,),
        epochs=6,
    )  # fmt: skip
    outcome = train_candidate("genome", {"genome": LSTM}, task, Setting(1.0, 0.5, 5.0, 1, 3000))
    assert outcome.parameters <= 3000 and outcome.epochs >= 4
    assert outcome.accuracy == max(outcome.history) > 0.6
    # A filter stops at its threshold: the same run (same seed), cut at the first epoch that reaches it.
    first = next(epoch for epoch, accuracy in enumerate(outcome.history) if accuracy >= 0.5)
    assert first < len(outcome.history) - 1
    stopped = train_candidate("genome", {"genome": LSTM}, replace(task, stop_at=0.5), Setting(1.0, 0.5, 5.0, 1, 3000))
    assert stopped.history == outcome.history[: first + 1]


def test_epochs_of_a_slice_read_on_through_the_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With train_windows (the PTB task's 300), epoch e trains on the split's windows e*k to e*k + k - 1, going round
    to the start when the split ends: the state is carried from epoch to epoch and zeroed only where a pass starts.
    (Every epoch used to restart at window 0, so a search's PTB candidates saw its first 23% again and again.)"""
    from zoo import RecurrentLM

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, lines in (("train", 25), ("valid", 5), ("test", 5)):
        (corpus / f"{split}.txt").write_text("".join(f"w{i % 7} w{i % 5} w{i % 3}\n" for i in range(lines)))
    data = {"class_path": "datamodules.TextDataModule",
            "init_args": {"corpus": str(corpus), "batch_size": 2, "bptt": 5, "eval_batch_size": 2}}  # fmt: skip
    task = Task("words", data, (2000,), epochs=4, train_windows=3, valid_windows=1)
    split = [window.inputs for window in task.datamodule().stream("train")]
    assert 3 < len(split) < 12, "the 4 x 3 windows must go round the split"
    seen: list[tuple[torch.Tensor, bool]] = []
    token_nll = RecurrentLM.token_nll

    def recorded(model: RecurrentLM, inputs: torch.Tensor, targets: torch.Tensor, state: Any = None, *rest: Any):
        if model.training:
            seen.append((inputs.clone(), state is None))
        return token_nll(model, inputs, targets, state, *rest)

    monkeypatch.setattr(RecurrentLM, "token_nll", recorded)
    outcome = train_candidate("genome", {"genome": LSTM}, task, Setting(1.0, 0.5, 5.0, 1, 2000))
    assert outcome.epochs == 4 and len(seen) == 12
    for index, (inputs, from_zeros) in enumerate(seen):
        assert torch.equal(inputs, split[index % len(split)]), index
        assert from_zeros == (index % len(split) == 0), index


@pytest.mark.slow
def test_a_killed_worker_loses_only_its_evaluation_and_a_restart_goes_on(tmp_path: Path) -> None:
    """kill -9 a worker mid-evaluation: once its heartbeat is stale the evaluation is failed (not counted, its setting
    free again), everything it finished stays, and a restarted search continues in the same store."""
    import os
    import signal
    import subprocess
    import sys
    import time

    slow, quick = tmp_path / "slow.yaml", tmp_path / "quick.yaml"
    # Memorisation stops at its first validation (threshold 0.0), so it is made slow by a long epoch: 10,000 steps,
    # seconds, not the milliseconds in which a 40-example epoch could finish between seeing it run and the kill.
    slow.write_text(TINY_SEARCH.replace("train_examples: 40,", "train_examples: 40000,"))
    quick.write_text(TINY_SEARCH)
    storage = f"sqlite:///{tmp_path / 'search.db'}"
    env = {**os.environ, "LM_ZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "cli", "search", "--storage", storage, "--heartbeat", "1"]
    worker = subprocess.Popen([*command, "--config", str(slow), "--budget", "120s"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL)  # fmt: skip
    store = SearchStore(storage, heartbeat=1)
    deadline = time.monotonic() + 60
    running: list[Any] = []
    while time.monotonic() < deadline and not running:  # wait for a mutant's (long) memorisation run
        time.sleep(0.5)
        running = [t for t in store.study.get_trials(deepcopy=False) if t.state.name == "RUNNING"
                   and t.user_attrs.get("task") == MEMORISE]  # fmt: skip
    assert running, "no memorisation run started"
    finished = len(store.evaluations())
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    time.sleep(5)  # past the grace period of 4 heartbeats
    evaluations = store.evaluations()  # reading fails the stale trial
    assert len(evaluations) == finished
    states = {t.number: t.state.name for t in store.study.get_trials(deepcopy=False)}
    assert states[running[0].number] == "FAIL" and "RUNNING" not in states.values()
    restart = subprocess.run([*command, "--config", str(quick), "--budget", "3s"], cwd=ROOT, env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert restart.returncode == 0, restart.stderr
    assert len(store.evaluations()) > finished


# ------------------------------------------------------------------------------------- claims and liveness
def test_the_interleaving_that_ran_one_evaluation_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stores on one SQLite file choose one (genome, task, setting). The first creates its trial and stops before
    writing any attribute; the second runs its whole record meanwhile, then the first goes on. Under the old rule (the
    lower trial number wins, judged from the attributes written so far) both trained; with claims, one does."""
    import threading

    import optuna

    storage = f"sqlite:///{tmp_path / 'search.db'}"
    first, second = SearchStore(storage), SearchStore(storage)
    created, second_done = threading.Event(), threading.Event()
    set_user_attr = optuna.Trial.set_user_attr

    def pausing(self: optuna.Trial, key: str, value: Any) -> None:
        if threading.current_thread().name == "first" and not created.is_set():
            created.set()  # the first trial exists (RUNNING), and has no attribute yet
            assert second_done.wait(60)
        set_user_attr(self, key, value)

    monkeypatch.setattr(optuna.Trial, "set_user_attr", pausing)
    ran: list[str] = []
    results: dict[str, float | None] = {}
    setting = Grid().draw(random.Random(0), (1000,))

    def record(name: str, store: SearchStore) -> None:
        results[name] = store.record(LSTM, "xml", setting, lambda: ran.append(name) or Outcome(0.5, 1, 4, 100))

    thread = threading.Thread(target=record, args=("first", first), name="first")
    thread.start()
    assert created.wait(60)
    record("second", second)
    second_done.set()
    thread.join(60)
    assert ran == ["second"] and results == {"first": None, "second": 0.5}
    assert [(e.genome, e.task, e.setting) for e in first.evaluations()] == [(LSTM, "xml", setting.key())]
    states = sorted(t.state.name for t in first.study.get_trials(deepcopy=False))
    assert states == ["COMPLETE", "PRUNED"]


@pytest.mark.parametrize("backend", ["sqlite", "journal", "grpc", "grpc-ipv6"])
def test_a_claim_is_held_once_and_a_failed_owners_claim_is_superseded(tmp_path: Path, backend: str) -> None:
    """On every storage lm-zoo opens: one of two stores wins a claim; an owner whose evaluation failed leaves the next
    generation to claim, once; claims are studies of their own, never evaluations of the search."""
    import optuna

    from lightning_modules.storages import StorageServer, host_port

    server = None
    if backend.startswith("grpc"):
        host = "::1" if backend == "grpc-ipv6" else "127.0.0.1"
        try:
            server = StorageServer(f"sqlite:///{tmp_path / 'served.db'}", host, 0).start()
        except DataError:
            pytest.skip(f"this machine cannot listen on {host}")
        url = f"grpc://{host_port(host, server.port)}"
    else:
        url = str(tmp_path / "search.log") if backend == "journal" else f"sqlite:///{tmp_path / 'search.db'}"
    try:
        a, b = SearchStore(url), SearchStore(url)
        taken = (LSTM, "xml", "s1")
        assert a.claim(taken) == 0 and b.claim(taken) is None and a.claim(taken) is None
        setting = Setting.from_key(Grid().draw(random.Random(1), (1000,)).key())
        wanted = (GRU, "xml", setting.key())

        def crash() -> Outcome:
            raise RuntimeError("the evaluation failed")

        with pytest.raises(RuntimeError, match="the evaluation failed"):
            a.record(GRU, "xml", setting, crash)
        assert b.claim_generation(wanted) == 1  # the owner of generation 0 failed
        assert b.record(GRU, "xml", setting, lambda: Outcome(0.25, 1, 4, 100)) == 0.25
        assert a.claim(wanted) is None and a.record(GRU, "xml", setting, lambda: Outcome(0.9, 1, 4, 100)) is None
        assert [(e.genome, e.accuracy) for e in a.evaluations()] == [(GRU, 0.25)]
        names = set(optuna.get_all_study_names(a.storage))
        assert names == {
            evolution.STUDY,
            evolution.claim_name(taken, 0),
            *(evolution.claim_name(wanted, g) for g in (0, 1)),
        }
    finally:
        if server is not None:
            server.stop()


def test_a_trial_failed_as_silent_while_it_trained_is_lost_not_fatal(tmp_path: Path) -> None:
    """A worker paused past the grace period finds its trial failed by a watcher: its result is refused, the record
    says the evaluation is lost (None), and the worker goes on."""
    import optuna

    store = SearchStore(str(tmp_path / "search.log"))

    def paused() -> Outcome:
        (running,) = store.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        store.storage.set_trial_state_values(running._trial_id, optuna.trial.TrialState.FAIL)  # as a watcher would
        return Outcome(0.5, 1, 4, 100)

    assert store.record(LSTM, "xml", Setting.from_key(Grid().draw(random.Random(2), (1000,)).key()), paused) is None
    assert store.evaluations() == []


def test_a_silent_trial_is_failed_after_four_of_its_heartbeats(tmp_path: Path) -> None:
    """The watcher compares the heartbeats it reads at times of its own clock: one that moves keeps its trial, one
    that stays for more than four of its intervals fails it; trials with no lm-zoo heartbeat are not its business."""
    import optuna

    from lightning_modules.storages import BEAT, SilentTrials

    store = SearchStore(str(tmp_path / "search.log"))
    beating, silent, other = (store.study.ask() for _ in range(3))
    for trial in (beating, silent):
        store.storage.set_trial_system_attr(trial._trial_id, BEAT, [1, 2])
    watcher = SilentTrials(evolution.STUDY)
    assert watcher.check(store.storage, now=0.0) == []
    store.storage.set_trial_system_attr(beating._trial_id, BEAT, [2, 2])
    assert watcher.check(store.storage, now=8.0) == []  # 4 x 2 s: not yet more than the grace
    store.storage.set_trial_system_attr(beating._trial_id, BEAT, [3, 2])
    assert watcher.check(store.storage, now=8.5) == [silent.number]
    states = {t.number: t.state for t in store.study.get_trials(deepcopy=False)}
    running = optuna.trial.TrialState.RUNNING
    assert states == {beating.number: running, silent.number: optuna.trial.TrialState.FAIL, other.number: running}


# Run in a child process: a worker that is SIGKILLed right after creating its claim, before marking its trial (the
# window between the two storage calls), with Optuna's heartbeat of 1 s running.
KILLED_IN_THE_CLAIM_WINDOW = """
import os, random, signal, sys
import optuna.storages._heartbeat as heartbeat
from search.evolution import SearchStore
from search.tasks import Grid, Outcome, Setting

# The worst case, which decided the test now and then: killed before Optuna's heartbeat thread wrote its first beat.
heartbeat.HeartbeatThread._record_heartbeat = staticmethod(lambda trial_id, beat, stop: stop.wait())

class KilledAfterClaiming(SearchStore):
    def claim(self, wanted, trial_id=None):
        generation = super().claim(wanted, trial_id)
        print(generation, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

store = KilledAfterClaiming(sys.argv[1], heartbeat=1)
setting = Setting.from_key(Grid().draw(random.Random(3), (1000,)).key())
store.record(sys.argv[2], "xml", setting, lambda: Outcome(0.9, 1, 4, 100))
"""


@pytest.mark.slow
def test_a_claim_left_by_a_worker_killed_before_marking_its_trial_is_claimed_again(tmp_path: Path) -> None:
    """The evaluation is not claimed for good: while the killed worker's trial still counts as running, nobody takes
    it; once its heartbeat is stale the next worker claims the next generation and evaluates it, once."""
    import os
    import subprocess
    import sys
    import time

    import optuna

    url = f"sqlite:///{tmp_path / 'search.db'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_THE_CLAIM_WINDOW, url, LSTM], capture_output=True, text=True, env=env
    )
    assert killed.returncode == -9 and killed.stdout.strip() == "0", killed.stderr
    setting = Setting.from_key(Grid().draw(random.Random(3), (1000,)).key())
    store = SearchStore(url, heartbeat=1)
    (orphan,) = store.study.get_trials(deepcopy=False)
    assert "claim" not in orphan.user_attrs  # killed in the window: its claim study exists, its mark does not
    if orphan.state == optuna.trial.TrialState.RUNNING:  # not yet stale (4 heartbeats): the claim still holds
        assert store.record(LSTM, "xml", setting, lambda: Outcome(0.5, 1, 4, 100)) is None
    time.sleep(5)  # past Optuna's grace period of 4 heartbeats of 1 s
    assert store.record(LSTM, "xml", setting, lambda: Outcome(0.5, 1, 4, 100)) == 0.5
    assert [(e.genome, e.accuracy) for e in store.evaluations()] == [(LSTM, 0.5)]
    owner = store.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))[0]
    assert owner.user_attrs["claim"] == 1
    other = SearchStore(url, heartbeat=1)  # and it is evaluated once: the new claim holds
    assert other.record(LSTM, "xml", setting, lambda: Outcome(0.7, 1, 4, 100)) is None
