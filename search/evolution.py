"""The search procedure of Jozefowicz et al. 2015 (§3.1, §3.3) over a shared store, and ``lm-zoo search``.

The procedure, as §3.1 describes it:
- a list of the best architectures (``top``, 100 in the paper), started with the LSTM and the GRU, which are first
  evaluated on ``baseline_settings`` hyperparameter settings per task (the paper: every allowable setting);
- an architecture's score is ``min over tasks of (its best accuracy on the task / the GRU's best)``;
- each step either re-evaluates a listed architecture on ``settings_per_task`` fresh settings per task (20 in the
  paper), or mutates a listed one (:mod:`search.mutation`) and puts the mutant through the ladder: one
  random setting of the memorisation task, kept only at ``memorise_threshold`` (95%) accuracy or more (once passed,
  never again); then per task in turn ``settings_per_task`` settings, going on only while the best exceeds
  ``task_threshold`` (90%) of the GRU's best; a mutant that passes every task joins the list if its score ranks in
  the top;
- no architecture is evaluated twice with one setting on one task;
- a mutant's settings (§3.3): from a parent evaluated on more than ``parent_history`` (420) settings, 80% from the
  parent's 100 best and 20% at random; otherwise a third at random, a third from the LSTM's and GRU's 100 best, a
  third from those tried on the parent.

Which of the two steps runs is a coin of weight ``reevaluate_probability`` (§3.1 does not give the ratio).

Many workers, no scheduler of ours: every evaluation is a trial of one Optuna study (``--storage``: SQLite or a
journal file on one machine; across machines ``grpc://HOST:PORT``, an ``lm-zoo search serve`` in front of a database,
or PostgreSQL/MySQL), with the genome, task and setting as the trial's attributes and the accuracy as its value.
Each worker reads the whole store before every step, so the list, the scores and the settings tried are always those
of all workers together, and runs the steady-state loop on its own. A killed worker's trial is failed after four of
its heartbeats (Optuna's on a database opened directly, :mod:`lightning_modules.storages`' on the others), so a kill
loses that one evaluation; a restarted search reads the store and goes on.

No (genome, task, setting) is evaluated twice, whatever the interleaving of the workers: two may choose alike between
reading the store and starting, so a trial first *claims* its evaluation by creating an empty study named
:func:`claim_name` -- study names are unique in every Optuna storage (a database's unique column, the journal's
ordered log, the gRPC proxy passing the database's refusal on as ``DuplicatedStudyError``), so exactly one creation
succeeds and the other trials are pruned. A claim is never deleted (deleting and re-creating one name races, and
SQLite reuses the deleted study's id); the claim of a trial that failed -- its worker was killed, or the evaluation
raised -- is superseded instead: the next claim is generation g + 1, which a worker creates only after reading the
owner of generation g failed. The owner marks its trial with its generation (``claim``) after winning; a reader that
missed a generation computes one that exists and loses, so no reading can let two trials hold one evaluation. A
worker killed between creating its claim and marking its trial (two storage calls) leaves a claim that no trial
carries: once its trial has been failed as silent (the heartbeat staleness above) and no other trial of that
evaluation runs or has finished, the claim is abandoned, and the next worker to want it claims generation g + 1
(:meth:`SearchStore.claim`). While the killed worker's trial still counts as running, nobody reclaims, so a live owner
between its two calls is never overtaken. Reports read the search's study only, so claims never show in them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna  # the search extra (pip install "lm-zoo[search]")
import yaml

from lightning_modules.storages import SilentTrials, beating, grpc_address, has_optuna_heartbeat, open_storage
from search.mutation import mutate
from search.tasks import MEMORISE, Grid, Outcome, Setting, Task, train_candidate
from zoo.errors import ConfigError, DataError
from zoo.genome import GenomeError, format_genome, parse

BASELINES = ("lstm", "gru_paper")  # the list's first members; the GRU is every score's yardstick
STUDY = "architecture-search"
CLAIMS = "lm-zoo-claim/"  # the prefix of the claim studies (module docstring)


@dataclass(frozen=True)
class SearchConfig:
    """A search: its tasks, the hyperparameter grid and the procedure's numbers (module docstring)."""

    memorise: Task
    tasks: tuple[Task, ...]
    grid: Grid = Grid()
    top: int = 100
    settings_per_task: int = 20
    baseline_settings: int = 20
    memorise_threshold: float = 0.95
    task_threshold: float = 0.9
    reevaluate_probability: float = 0.5
    parent_history: int = 420
    best_settings: int = 100
    max_nodes: int = 64

    def task(self, name: str) -> Task:
        for task in (self.memorise, *self.tasks):
            if task.name == name:
                return task
        raise KeyError(name)


def load_config(path: str | Path) -> SearchConfig:
    """Read a search config (``configs/search/*.yaml``: ``search``, ``grid``, ``memorise``, ``tasks``)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read the search config {path}: {error}") from None
    if not isinstance(raw, dict) or not raw.get("tasks") or "memorise" not in raw:
        raise ConfigError(f"{path}: a search config needs 'memorise' and one or more 'tasks' (see configs/search/)")

    def task(name: str, spec: dict[str, Any]) -> Task:
        known = {f.name for f in fields(Task)} - {"name"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ConfigError(f"{path}: task {name!r} has no setting {', '.join(unknown)}")
        span = spec.get("scored_span")
        if span is not None and not (
            isinstance(span, list) and len(span) == 2 and all(isinstance(s, str) for s in span)
        ):
            raise ConfigError(f"{path}: task {name!r}: scored_span must be two symbols, e.g. ['=', '.'], not {span!r}")
        return Task(
            name=name,
            **{**spec, "num_params": tuple(spec.get("num_params", ())), "scored_span": span and tuple(span)},
        )

    procedure = raw.get("search", {}) or {}
    known = {f.name for f in fields(SearchConfig)} - {"memorise", "tasks", "grid"}
    unknown = sorted(set(procedure) - known)
    if unknown:
        raise ConfigError(f"{path}: the search has no setting {', '.join(unknown)}")
    grid = Grid(**{k: tuple(v) for k, v in (raw.get("grid", {}) or {}).items()})
    tasks = tuple(task(name, spec) for name, spec in raw["tasks"].items())
    config = SearchConfig(memorise=task(MEMORISE, raw["memorise"]), tasks=tasks, grid=grid, **procedure)
    if config.memorise.stop_at is None:  # memorisation only filters: done once it passes
        config = replace(config, memorise=replace(config.memorise, stop_at=config.memorise_threshold))
    return config


# ---------------------------------------------------------------------------------------------------- the store
@dataclass(frozen=True)
class Evaluation:
    """One finished evaluation: a genome (canonical string) on a task with a setting."""

    genome: str
    task: str
    setting: str
    accuracy: float
    finished: datetime | None
    parent: str | None = None
    started: datetime | None = None
    worker: str | None = None  # host:pid of the worker that ran it


class SearchStore:
    """The search's state in an Optuna storage (module docstring).

    Args:
        storage: ``grpc://HOST:PORT`` (an ``lm-zoo search serve``), an SQLAlchemy URL (``sqlite:///search.db``,
            ``postgresql://host/db``, ...) or a journal file path ending in ``.log``.
        heartbeat: seconds between a running trial's heartbeats; a trial silent for four of them is failed.
        create: start a new search when the storage holds none; ``False`` (a report) refuses, and never creates a
            SQLite or journal file that is not there.

    Raises:
        DataError: ``create`` is ``False`` and the storage holds no search, or no server answers at a ``grpc://``
            address.
    """

    def __init__(self, storage: str, heartbeat: int = 60, create: bool = True) -> None:
        local = storage.removeprefix("sqlite:///") if storage.startswith("sqlite:///") else storage
        if not create and (storage.endswith(".log") or storage.startswith("sqlite:///")) and not Path(local).exists():
            raise DataError(f"{local}: no such file, so no search to report: give the workers' --storage")
        self.storage = open_storage(storage, heartbeat=None if grpc_address(storage) else heartbeat)
        self.heartbeat = heartbeat
        # Storages without Optuna's heartbeat (gRPC, journal): this worker beats its own trials and fails others'
        # silent ones whenever it reads the store (the server does too).
        self.watcher = None if has_optuna_heartbeat(self.storage) else SilentTrials(STUDY)
        if not create:
            try:
                self.storage.get_study_id_from_name(STUDY)
            except KeyError:
                raise DataError(
                    f"{storage} holds no lm-zoo search (no study {STUDY!r}): give the workers' --storage"
                ) from None
        self.study = optuna.create_study(
            storage=self.storage, study_name=STUDY, direction="maximize", load_if_exists=True
        )

    def evaluations(self) -> list[Evaluation]:
        """Every finished evaluation of every worker (failed runs of killed workers are not evaluations)."""
        self.fail_stale()
        found = []
        for trial in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            attrs = trial.user_attrs
            found.append(
                Evaluation(
                    attrs["genome"], attrs["task"], attrs["setting"], float(trial.value), trial.datetime_complete,
                    attrs.get("parent"), trial.datetime_start, attrs.get("worker"),
                )
            )  # fmt: skip
        return found

    def fail_stale(self) -> None:
        """Fail the running trials of workers whose heartbeat stopped (killed)."""
        if self.watcher is not None:
            self.watcher.check(self.storage)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # as for the storage, above
            optuna.storages.fail_stale_trials(self.study)

    def claimed(self) -> set[tuple[str, str, str]]:
        """``(genome, task, setting)`` of every evaluation finished or under way in any worker."""
        states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
        return {
            (t.user_attrs["genome"], t.user_attrs["task"], t.user_attrs["setting"])
            for t in self.study.get_trials(deepcopy=False, states=states)
            if "setting" in t.user_attrs
        }

    def claim_generation(self, wanted: tuple[str, str, str]) -> int:
        """The generation of the claim a new trial for ``wanted`` makes: one past the last whose owner failed."""
        failed = [
            int(t.user_attrs["claim"])
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
            if "claim" in t.user_attrs
            and (t.user_attrs.get("genome"), t.user_attrs.get("task"), t.user_attrs.get("setting")) == wanted
        ]
        return max(failed, default=-1) + 1

    def claim(self, wanted: tuple[str, str, str], trial_id: int | None = None) -> int | None:
        """Claim ``wanted`` (module docstring): its generation if this call created the claim, else ``None``.

        Args:
            wanted: ``(genome, task, setting)``.
            trial_id: the claiming trial (already carrying ``wanted``'s attributes), left out when deciding whether a
                claim held by nobody's trial was abandoned.
        """
        generation = self.claim_generation(wanted)
        while True:
            try:
                self.storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], claim_name(wanted, generation))
            except optuna.exceptions.DuplicatedStudyError:
                if not self._abandoned(wanted, generation, trial_id):
                    return None
                generation += 1  # the next generation; a worker that reclaims at once too loses to this one there
                continue
            return generation

    def _abandoned(self, wanted: tuple[str, str, str], generation: int, trial_id: int | None) -> bool:
        """Whether claim ``generation`` of ``wanted`` was left by a worker killed between creating it and marking its
        trial: no trial carries it, no other trial of ``wanted`` is running or complete (a live owner's trial runs from
        before its claim to its end), and one failed without a mark (the killed owner's, failed once its heartbeat
        went stale)."""
        self.fail_stale()
        killed = False
        for trial in self.study.get_trials(deepcopy=False):
            attrs = trial.user_attrs
            if trial._trial_id == trial_id or (attrs.get("genome"), attrs.get("task"), attrs.get("setting")) != wanted:
                continue
            if attrs.get("claim") == generation or trial.state in (
                optuna.trial.TrialState.RUNNING,
                optuna.trial.TrialState.COMPLETE,
            ):
                return False
            killed |= trial.state == optuna.trial.TrialState.FAIL and "claim" not in attrs
        return killed

    def record(self, genome: str, task: str, setting: Setting, run: Any, parent: str | None = None) -> float | None:
        """Run ``run()`` (an :class:`~search.tasks.Outcome`) as a trial of the study and store it.

        The trial runs through ``study.optimize``, which marks it failed if ``run`` raises (Ctrl-C included), and
        keeps a heartbeat while it trains. Returns the accuracy, or ``None`` when another worker holds the
        evaluation's claim (module docstring) -- workers choose from what they read, and two may choose alike -- or
        when a watcher failed this trial as silent while it trained (a worker paused past the grace period).
        """
        accuracy: list[float] = []
        wanted = (genome, task, setting.key())

        def objective(trial: optuna.Trial) -> float:
            beat = contextlib.nullcontext() if self.watcher is None else beating(self.storage, trial._trial_id,
                                                                                self.heartbeat)  # fmt: skip
            with beat:
                for key, value in zip(("genome", "task", "setting"), wanted, strict=True):
                    trial.set_user_attr(key, value)
                trial.set_user_attr("parent", parent)
                trial.set_user_attr("worker", f"{os.uname().nodename}:{os.getpid()}")
                if self.watcher is None:
                    # Optuna's heartbeat thread writes the trial's first beat when it first gets to run: a worker
                    # killed before that left a trial that never went stale, holding its claim for good.
                    self.storage.record_heartbeat(trial._trial_id)
                generation = self.claim(wanted, trial._trial_id)
                if generation is None:
                    raise optuna.TrialPruned("another worker holds this evaluation")
                trial.set_user_attr("claim", generation)  # the owner's mark, which a later generation needs
                outcome = run()
                trial.set_user_attr("outcome", outcome.record())
            accuracy.append(outcome.accuracy)
            return outcome.accuracy

        # Optuna logs a failed trial's traceback before re-raising; the error is ours to report (the CLI turns a
        # ConfigError into one line and shows any other exception's traceback itself), so its log would only repeat it.
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        try:
            self.study.optimize(objective, n_trials=1, catch=())
        except ValueError as error:
            # A watcher failed this trial while it trained: its attributes and its result are refused, and
            # optimize's report of the result is this ValueError. The evaluation is lost; the worker goes on.
            if not str(error).startswith("Cannot tell a FAIL trial"):
                raise
            return None
        finally:
            optuna.logging.set_verbosity(verbosity)
        return accuracy[0] if accuracy else None


def claim_name(wanted: tuple[str, str, str], generation: int) -> str:
    """The claim study of ``(genome, task, setting)``'s ``generation``-th claim: ``lm-zoo-claim/<sha256>/<g>``."""
    digest = hashlib.sha256("|".join(wanted).encode()).hexdigest()
    return f"{CLAIMS}{digest}/{generation}"


@dataclass
class Standing:
    """What the store says: every genome's best accuracy per task, the settings tried, who passed memorisation."""

    best: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    tried: dict[tuple[str, str], dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    memorised: set[str] = field(default_factory=set)
    parents: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, evaluations: Sequence[Evaluation], config: SearchConfig) -> Standing:
        standing = cls()
        for e in evaluations:
            standing.tried[(e.genome, e.task)][e.setting] = e.accuracy
            standing.best[e.genome][e.task] = max(standing.best[e.genome].get(e.task, 0.0), e.accuracy)
            if e.task == MEMORISE and e.accuracy >= config.memorise_threshold:
                standing.memorised.add(e.genome)
            if e.parent is not None:
                standing.parents.setdefault(e.genome, e.parent)
        return standing

    def gru_best(self, task: str) -> float:
        return self.best.get(baseline(BASELINES[1]), {}).get(task, 0.0)

    def score(self, genome: str, config: SearchConfig) -> float:
        """§3.1 eq. (1): min over tasks of the genome's best accuracy over the GRU's best (0 if one is missing)."""
        ratios = []
        for task in config.tasks:
            gru = self.gru_best(task.name)
            mine = self.best.get(genome, {}).get(task.name)
            ratios.append(0.0 if mine is None or gru <= 0 else mine / gru)
        return min(ratios)

    def passes(self, genome: str, task: str, config: SearchConfig) -> bool:
        return self.best.get(genome, {}).get(task, 0.0) > config.task_threshold * self.gru_best(task)

    def listed(self, config: SearchConfig) -> list[tuple[float, str]]:
        """The top list: the baselines, and the genomes that passed memorisation and every task's threshold, by
        score, best first."""
        baselines = {baseline(name) for name in BASELINES}
        candidates = [
            g
            for g in self.best
            if g in baselines or (g in self.memorised and all(self.passes(g, t.name, config) for t in config.tasks))
        ]
        ranked = sorted(((self.score(g, config), g) for g in candidates), key=lambda p: (-p[0], p[1]))
        return ranked[: config.top]


def baseline(name: str) -> str:
    """The canonical genome string of a registered cell."""
    return format_genome(parse(name))


# ----------------------------------------------------------------------------------------------- the procedure
class Worker:
    """One process of the search: the steady-state loop over the shared store.

    Args:
        config: the search.
        store: the shared store.
        rng: this worker's randomness (mutations, coins, settings).
        log: called with one line per event worth printing.
    """

    def __init__(self, config: SearchConfig, store: SearchStore, rng: random.Random, log: Any = print) -> None:
        self.config, self.store, self.rng, self.log = config, store, rng, log

    def standing(self) -> Standing:
        """The store's standing, with the evaluations other workers have under way counted as tried."""
        standing = Standing.of(self.store.evaluations(), self.config)
        for genome, task, setting in self.store.claimed():
            standing.tried[(genome, task)].setdefault(setting, 0.0)
        return standing

    def evaluate(self, genome: str, task: Task, setting: Setting, parent: str | None = None) -> float | None:
        """Train and score ``genome`` on ``task`` with ``setting``, and store it (a genome the layer refuses
        scores 0); ``None`` if another worker took this evaluation."""
        seed = int(hashlib.sha256(f"{genome}|{task.name}|{setting.key()}".encode()).hexdigest()[:8], 16)

        def run() -> Outcome:
            try:
                return train_candidate("genome", {"genome": genome}, task, setting, seed)
            except GenomeError:
                return Outcome(0.0, 0, 0, 0)

        return self.store.record(genome, task.name, setting, run, parent)

    def fresh_settings(
        self, genome: str, task: Task, count: int, standing: Standing, parent: str | None = None
    ) -> list[Setting]:
        """``count`` settings ``genome`` has not been evaluated with on ``task`` (§3.3's mix for a mutant)."""
        tried = set(standing.tried.get((genome, task.name), {}))
        pools: list[list[str]] = []
        if parent is not None:
            history = standing.tried.get((parent, task.name), {})
            best_of_parent = [s for s, _ in sorted(history.items(), key=lambda p: -p[1])[: self.config.best_settings]]
            if len(history) > self.config.parent_history:
                weights, pools = [0.8, 0.2], [best_of_parent, []]
            else:
                baselines: dict[str, float] = {}
                for name in BASELINES:
                    baselines.update(standing.tried.get((baseline(name), task.name), {}))
                best_baselines = [s for s, _ in sorted(baselines.items(), key=lambda p: -p[1])]
                weights = [1 / 3, 1 / 3, 1 / 3]
                pools = [[], best_baselines[: self.config.best_settings], list(history)]
        else:
            weights, pools = [1.0], [[]]
        chosen: list[Setting] = []
        limit = self.config.grid.size(task.num_params)
        while len(chosen) < count and len(tried) < limit:
            pool = self.rng.choices(pools, weights)[0]
            options = [s for s in pool if s not in tried]
            key = self.rng.choice(options) if options else self.config.grid.draw(self.rng, task.num_params).key()
            if key in tried:
                continue
            tried.add(key)
            chosen.append(Setting.from_key(key))
        return chosen

    def evaluate_on_tasks(self, genome: str, parent: str | None, ladder: bool) -> bool:
        """``settings_per_task`` fresh settings per task; with ``ladder``, stop at the first task whose best stays
        at or below the threshold. Returns whether every task passed."""
        for task in self.config.tasks:
            standing = self.standing()
            for setting in self.fresh_settings(genome, task, self.config.settings_per_task, standing, parent):
                self.evaluate(genome, task, setting, parent)
            if ladder and not self.standing().passes(genome, task.name, self.config):
                self.log(f"search: {genome} stops at {task.name}")
                return False
        return True

    def baseline_step(self, standing: Standing) -> str | None:
        """One more setting for the LSTM or the GRU on a task where they have fewer than ``baseline_settings``
        (the list starts with them, evaluated first); ``None`` once they have them all."""
        for name in BASELINES:
            genome = baseline(name)
            for task in self.config.tasks:
                if len(standing.tried.get((genome, task.name), {})) < self.config.baseline_settings:
                    settings = self.fresh_settings(genome, task, 1, standing)
                    if settings:  # else the grid is exhausted: nothing left to try
                        self.evaluate(genome, task, settings[0])
                        return f"baseline {name} on {task.name}"
        return None

    def step(self) -> str:
        """One step of the procedure; returns what it did."""
        standing = self.standing()
        did = self.baseline_step(standing)
        if did is not None:
            return did
        listed = [g for _, g in standing.listed(self.config)]
        chosen = self.rng.choice(listed)
        if self.rng.random() < self.config.reevaluate_probability:
            self.evaluate_on_tasks(chosen, None, ladder=False)
            return "re-evaluated"
        try:
            child = format_genome(mutate(parse(chosen), self.rng, max_nodes=self.config.max_nodes))
        except (ValueError, RuntimeError) as error:
            # A listed cell with no acceptable mutant (a store written before mutation refused such cells, or one
            # that max_nodes has boxed in) is a dead end, not a reason to stop the worker: the next step draws again.
            self.log(f"search: {error}")
            return "no acceptable mutant of the chosen parent"
        if child not in standing.memorised:
            memorise = self.config.memorise
            settings = self.fresh_settings(child, memorise, 1, standing)
            accuracy = self.evaluate(child, memorise, settings[0], chosen) if settings else None
            if accuracy is None or accuracy < self.config.memorise_threshold:
                return "mutant failed memorisation"
        passed = self.evaluate_on_tasks(child, chosen, ladder=True)
        return "mutant passed every task" if passed else "mutant stopped on a task"

    def run(self, budget_seconds: float) -> int:
        """Steps until the budget is spent (the step under way finishes); returns the steps taken."""
        deadline, steps = time.monotonic() + budget_seconds, 0
        while time.monotonic() < deadline:
            what = self.step()
            steps += 1
            self.log(f"search: step {steps}: {what}")
        return steps


def worker_random(seed: int, store: SearchStore) -> random.Random:
    """The random source of a worker: its seed and the number of trials the store held when it started.

    A fresh one-worker search is reproducible from ``--seed`` (parallel workers interleave their reads of the store, so
    theirs is not); a search resumed in the same store with the same seed does not replay the first run's mutations
    (measured: a restart re-proposed the same first mutants, which fresh settings then evaluated again).
    """
    return random.Random(f"{seed}/{len(store.study.get_trials(deepcopy=False))}")


# ------------------------------------------------------------------------------------------------------ report
def searching_hours(evaluations: Sequence[Evaluation]) -> float:
    """Hours during which at least one evaluation ran: the union of their [started, finished] intervals.

    A search resumed later in the same store would otherwise count the time between its runs (first to last
    evaluation) and understate the rate; overlapping evaluations of parallel workers count once.
    """
    spans = sorted((e.started, e.finished) for e in evaluations if e.started is not None and e.finished is not None)
    seconds, end = 0.0, None
    for start, finish in spans:
        begin = start if end is None else max(start, end)  # what the intervals so far already cover is not counted
        if finish > begin:
            seconds, end = seconds + (finish - begin).total_seconds(), finish
    return seconds / 3600


def report(store: SearchStore, config: SearchConfig | None, top: int = 100) -> dict[str, Any]:
    """Statistics of the search and its top list (§3.4's figures and the best genomes)."""
    evaluations = store.evaluations()
    baselines = {baseline(name): name for name in BASELINES}
    tasks = [t.name for t in config.tasks] if config else sorted({e.task for e in evaluations} - {MEMORISE})
    settings = config or _report_config(tasks)
    standing = Standing.of(evaluations, settings)
    proposed = {e.genome for e in evaluations if e.genome not in baselines}
    hours = searching_hours(evaluations)
    listed = standing.listed(settings)[:top]
    return {
        "evaluations": len(evaluations),
        "architectures_proposed": len(proposed),
        "passed_memorisation": len(standing.memorised & proposed),
        "passed_every_task": sum(1 for _, g in listed if g not in baselines),
        "evaluations_per_hour": len(evaluations) / hours if hours > 0 else None,
        "searching_hours": hours,
        "workers": len({e.worker for e in evaluations if e.worker is not None}),
        "baselines": {name: dict(standing.best.get(g, {})) for g, name in baselines.items()},
        "top": [
            {
                "rank": rank,
                "score": score,
                "genome": genome,
                "name": baselines.get(genome),
                "best": dict(standing.best.get(genome, {})),
                "settings": {t: len(standing.tried.get((genome, t), {})) for t in tasks},
                "parent": standing.parents.get(genome),
            }
            for rank, (score, genome) in enumerate(listed, start=1)
        ],
    }


def _report_config(tasks: list[str]) -> SearchConfig:
    """The procedure's defaults over the tasks the store holds (a report without the search's config)."""
    placeholder = Task(MEMORISE, {}, (1,))
    return SearchConfig(memorise=placeholder, tasks=tuple(Task(t, {}, (1,)) for t in tasks))


def format_report(result: dict[str, Any], shown: int = 10) -> str:
    lines = [
        f"evaluations: {result['evaluations']}"
        + (f" ({result['evaluations_per_hour']:.0f} per hour)" if result["evaluations_per_hour"] else ""),
        f"architectures proposed: {result['architectures_proposed']}, passed memorisation: "
        f"{result['passed_memorisation']}, passed every task: {result['passed_every_task']}",
    ]
    for name, best in result["baselines"].items():
        lines.append(f"{name}: " + ", ".join(f"{t} {a:.4f}" for t, a in sorted(best.items())))
    for row in result["top"][:shown]:
        label = row["name"] or row["genome"]
        accuracies = ", ".join(f"{t} {a:.4f}" for t, a in sorted(row["best"].items()))
        lines.append(f"{row['rank']:>3}. score {row['score']:.4f}  {accuracies}  {label}")
    return "\n".join(lines)
