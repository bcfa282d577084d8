"""What a scoring procedure of ``lm-zoo evaluate`` is: its flags, what it refuses, how it scores a split's windows and
what its result records.

Each procedure is one class in its own module: :class:`~evaluation.mc_dropout.MCDropout`,
:class:`~evaluation.dynamic.DynamicEvaluation`, and the deterministic pass
(:class:`~evaluation.deterministic.Deterministic`).
:func:`evaluation.perplexity.evaluate` runs whichever it is given the same way: it prepares the
procedure for the model and the corpus (a :class:`Scorer`), searches the softmax temperature with it when asked,
scores the split and records the procedure's settings, which the procedure also puts in words. ``lm-zoo evaluate``
offers the flags of every procedure in :data:`evaluation.procedures.SCORING_PROCEDURES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from datamodules.text_data import TextData
from datamodules.windows import IGNORE_INDEX, LMBatch
from evaluation.temperature import FeaturePass
from zoo.errors import ConfigError
from zoo.language_model import RecurrentLM


@dataclass(frozen=True)
class EvaluationSetup:
    """What a procedure is prepared for.

    Attributes:
        model: the language model, in eval mode on its device.
        datamodule: the corpus.
        split: the split to be scored.
        batch_size: its parallel streams (1 when the procedure reads one stream, or for long context).
        bptt: its window length.
        seed: seeds what the procedure samples.
        temperature: the softmax temperature anything scored while preparing uses (1 when it is searched after).
    """

    model: RecurrentLM
    datamodule: TextData
    split: str
    batch_size: int
    bptt: int
    seed: int
    temperature: float


@dataclass
class Scorer:
    """A procedure made ready for one model and corpus.

    Attributes:
        score: windows and a temperature -> summed nats and predicted tokens.
        steps: the window length every split is read in (dynamic evaluation's segment length, else the BPTT).
        features: the pass whose features the temperature search may keep and re-score at each temperature; ``None``
            when the result would differ from a re-run (the weights change as they read, the head samples its own
            dropout), so each trial temperature re-runs the pass.
        record: what the result records of the procedure, an export storing it: its :attr:`ScoringProcedure.records`.
        run_record: what only ``lm-zoo evaluate --json`` prints of it (this run's, not the figure's): its
            :attr:`ScoringProcedure.run_records`.
        scored_valid: the whole validation split's nats and tokens at the procedure's settings, where preparing it
            measured them already (dynamic evaluation's winning trial); ``None`` otherwise.
    """

    score: Callable[[Iterable[LMBatch], float], tuple[float, int]]
    steps: int
    features: FeaturePass | None = None
    record: dict[str, Any] = field(default_factory=dict)
    run_record: dict[str, Any] = field(default_factory=dict)
    scored_valid: tuple[float, int] | None = None


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a procedure, as data: the command layer makes it an option of ``lm-zoo evaluate``
    (a library module never parses arguments), and :meth:`ScoringProcedure.from_flags` reads what was given.

    Attributes:
        name: the flag as typed (``--mc-samples``).
        help: its line in ``--help``.
        setting: the procedure's field its value sets; ``None``: a switch the procedure reads itself.
        kind: ``int`` or ``float`` (a number of at least ``minimum``), or ``bool`` (a switch, no value).
        minimum: the smallest value taken.
        metavar: its value's name in ``--help`` and in messages.
        needs: the flag it applies only with; ``None``: the procedure's own (:attr:`ScoringProcedure.flag`).
    """

    name: str
    help: str
    setting: str | None = None
    kind: type = bool
    minimum: float = 0
    metavar: str | None = None
    needs: str | None = None


class ScoringProcedure(ABC):
    """A way of scoring a split (Melis et al. 2020 §3.3): a subclass declares its flags, its checks, its scorer, what
    its results record and how that reads (named by its ``method`` in
    :data:`evaluation.procedures.SCORING_PROCEDURES`).

    Attributes:
        method: what the result's ``procedure.method`` records.
        flag: the ``lm-zoo evaluate`` flag that chooses it (``None``: the default procedure).
        flags: every flag of its own, the choosing one first, in the order ``--help`` lists them.
        one_stream: it reads the split as one stream (batch size 1).
        needs_float_weights: why it cannot score a model quantized to int8, in words; ``None``: it can.
        records: the keys its scorer records in a result (:attr:`Scorer.record`), which an export stores.
        run_records: those it records for ``lm-zoo evaluate --json`` only (:attr:`Scorer.run_record`).
    """

    method: ClassVar[str]
    flag: ClassVar[str | None] = None
    flags: ClassVar[tuple[Flag, ...]] = ()
    one_stream: ClassVar[bool] = False
    needs_float_weights: ClassVar[str | None] = None
    records: ClassVar[tuple[str, ...]] = ()
    run_records: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def summary(cls, record: Mapping[str, Any]) -> list[str]:
        """Its settings in a few words, after its method in the model card's results table; ``record``: a result's
        :attr:`records`, read back."""
        return []

    @classmethod
    def details(cls, record: Mapping[str, Any], seed: int) -> list[str]:
        """Its settings in full, as ``lm-zoo evaluate`` prints them after the figure; ``seed``: the one it drew with."""
        return []

    @classmethod
    def from_flags(cls, given: Mapping[str, Any]) -> ScoringProcedure | None:
        """The procedure the given flags ask for, or ``None`` when its choosing flag is absent.

        Args:
            given: the flags given on the command line, by name, with their values (``True`` for a switch); any
                procedure's.

        Raises:
            ConfigError: one of its flags given without the flag it applies with.
        """
        own = {flag.name: flag for flag in cls.flags}
        mine = {name: value for name, value in given.items() if name in own}
        for flag in cls.flags:
            needed = flag.needs or cls.flag
            if flag.name in mine and flag.name != cls.flag and needed not in mine:
                spelt = " ".join(filter(None, (needed, own[needed].metavar if needed in own else None)))
                raise ConfigError(f"{flag.name} applies only with {spelt}: add it or drop the flag")
        if cls.flag not in mine:
            return None
        return cls.from_settings({own[name].setting: value for name, value in mine.items() if own[name].setting}, mine)

    @classmethod
    def from_settings(cls, settings: dict[str, Any], given: Mapping[str, Any]) -> ScoringProcedure:
        """The procedure with the ``settings`` its flags set (by field); ``given``: its flags as given, for a procedure
        whose switches mean more than a field (here: none)."""
        return cls(**settings)

    def check(self, batch_size: int | None, bptt: int | None) -> None:
        """Refuse evaluation sizes the procedure cannot work with (``None``: the data module's), before loading.

        Raises:
            ConfigError: the first problem, in one line that says what to do.
        """

    @abstractmethod
    def prepare(self, setup: EvaluationSetup) -> Scorer:
        """Everything the procedure computes before scoring (statistics, tuning) for ``setup``, and its scorer."""


def first_tokens(windows: Iterable[LMBatch], tokens: int | None) -> Iterator[LMBatch]:
    """The windows up to the one holding the ``tokens``-th predicted token (all if ``None``), in whole windows: of a
    one-stream split its first tokens; of ``B`` streams the same first windows of every stream (the split's text is
    cut into ``B`` columns, so each column's beginning)."""
    seen = 0
    for batch in windows:
        if tokens is not None and seen >= tokens:
            return
        seen += int((batch.targets != IGNORE_INDEX).sum())
        yield batch
