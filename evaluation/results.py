"""What scoring a split gives: a typed result, which the scoring procedures fill, an export stores, and the model card
and ``lm-zoo evaluate`` render.

A result's JSON (:meth:`TextResult.to_json`) is the record ``lm-zoo evaluate --json`` prints; ``stored=True`` leaves
out what only this run knows (the source's local path, the MC batching, ...) and is what an export's ``config.json``
keeps under ``"results"``. A procedure's own settings, and the words for them, are the procedure's
(:class:`~evaluation.scoring.ScoringProcedure`): a new one records, stores and reads back its keys with nothing here to
change. The module imports no torch, nor any procedure until a result is put in words or holds a procedure's own key.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from datamodules.kinds import BPC, MUSIC, TEXT, ModelKind, kind_of_result, result_figures
from evaluation.procedures import DEFAULT_METHOD, procedure_class
from zoo.errors import CheckpointError
from zoo.settings import DEFAULT_MATMUL_PRECISION

# A field's metadata: not stored by an export (it names this machine or run, not the figure), or left out of the
# JSON when it is None (a figure or count that does not apply).
_LOCAL = {"stored": False}
_OPTIONAL = {"omit_none": True}
_LOCAL_OPTIONAL = {**_LOCAL, **_OPTIONAL}


def _to_json(record: Any, stored: bool) -> dict[str, Any]:
    """``record``'s fields in order, its procedure's settings flattened into it."""
    out: dict[str, Any] = {}
    for item in fields(record):
        value = getattr(record, item.name)
        if (stored and not item.metadata.get("stored", True)) or (value is None and item.metadata.get("omit_none")):
            continue
        if isinstance(value, ProcedureSettings):
            out.update(value.to_json(stored))
        else:
            out[item.name] = value
    return out


#: The procedures' keys every stored text result spelt before each procedure kept its own (MC dropout's and dynamic
#: evaluation's, at their values without them), and the one ``lm-zoo evaluate --json`` printed besides. Every result
#: still spells them, whatever its procedure, so that the shipped ``config.json`` files and saved ``--json`` outputs
#: read back and re-render byte for byte. Frozen: a new procedure's keys appear in its own results only.
SPELT_BY_EVERY_RESULT: dict[str, Any] = {"mc_samples": 0, "dropout_scale": None, "dynamic": None}
PRINTED_BY_EVERY_RESULT: dict[str, Any] = {"mc_rows_per_call": None}


@dataclass(kw_only=True)
class ProcedureSettings:
    """How a text result was obtained (Melis et al. 2020 §3.3), so that a tempered, MC-dropout or dynamic-evaluation
    figure is never shown as a plain deterministic one.

    What every procedure shares is a field; what one procedure records is its own
    (:class:`~evaluation.scoring.ScoringProcedure`'s ``records``), and so are the words for it.

    Attributes:
        method: the procedure, a key of :data:`evaluation.procedures.SCORING_PROCEDURES`.
        long_context: the split read as one stream (batch size 1).
        temperature: the softmax temperature.
        temperature_search: how an ``auto`` temperature was found (its validation figures), else ``None``.
        recorded: what the procedure recorded, stored by an export (MC dropout's samples and dropout scale, dynamic
            evaluation's settings, gradient statistics and tuning).
        run_record: what it recorded of this run alone (MC dropout's rows per forward pass; not stored: it does not
            change the figure).
        seed: seeds the MC masks and the tuning draws (not stored).
    """

    method: str = DEFAULT_METHOD
    long_context: bool = False
    temperature: float = 1.0
    temperature_search: dict[str, Any] | None = None
    recorded: dict[str, Any] = field(default_factory=dict)
    run_record: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def to_json(self, stored: bool) -> dict[str, Any]:
        """The settings as a result's JSON holds them, the procedure's keys among them (see :meth:`_Result.to_json`)."""
        out: dict[str, Any] = {
            "method": self.method,
            "long_context": self.long_context,
            "temperature": self.temperature,
            "temperature_search": self.temperature_search,
            **SPELT_BY_EVERY_RESULT,
            **self.recorded,
        }
        if not stored:
            out.update({**PRINTED_BY_EVERY_RESULT, **self.run_record, "seed": self.seed})
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> tuple[ProcedureSettings, list[str]]:
        """The settings among a result's keys (its own fields taken out), and the keys that are none of theirs."""
        common = [item.name for item in fields(cls) if item.name not in ("recorded", "run_record")]
        settings = cls(**{name: data[name] for name in common if name in data})
        shared = {**SPELT_BY_EVERY_RESULT, **PRINTED_BY_EVERY_RESULT}
        rest = [name for name in data if name not in common]
        own = procedure_class(settings.method) if set(rest) - set(shared) else None
        for name in rest:
            if own is not None and name in own.records:
                settings.recorded[name] = data[name]
            elif own is not None and name in own.run_records:
                settings.run_record[name] = data[name]
            elif name in shared and data[name] != shared[name]:  # what every result spells, where this one set it
                (settings.recorded if name in SPELT_BY_EVERY_RESULT else settings.run_record)[name] = data[name]
        known = set(shared) | set(own.records + own.run_records if own else ())
        return settings, [name for name in rest if name not in known]

    def summary(self) -> str:
        """The procedure in a few words, as the model card gives it: ``deterministic``, or the method and its
        settings."""
        parts = [self.method]
        if self.temperature != 1.0:
            found = " (searched on valid)" if self.temperature_search else ""
            parts.append(f"temperature {self.temperature:.4g}{found}")
        return ", ".join(parts + procedure_class(self.method).summary(self.recorded))

    def details(self) -> list[str]:
        """The settings in full, as ``lm-zoo evaluate`` prints them after the figure."""
        settings = ["long context"] if self.long_context else []
        if self.temperature_search:
            there = _headline_text(self.temperature_search["valid"])
            settings.append(f"temperature {self.temperature:.3f} searched on valid ({there} there)")
        elif self.temperature != 1.0:
            settings.append(f"temperature {self.temperature:g}")
        return settings + procedure_class(self.method).details(self.recorded, self.seed)


class _Result:
    """What a text and a music result share: JSON both ways, and the settings their figure was measured at."""

    kind: ClassVar[ModelKind]
    split: str
    eval_batch_size: int
    bptt: int
    max_tokens: int | None
    matmul_precision: str | None
    quantize: str | None

    def to_json(self, stored: bool = False) -> dict[str, Any]:
        """The result as ``lm-zoo evaluate --json`` prints it; ``stored``: as an export's ``config.json`` keeps it
        (no local paths, nothing that does not change the figure)."""
        return _to_json(self, stored)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        """Read a result back from its JSON (an export's ``config.json``, a saved ``lm-zoo evaluate --json``).

        Raises:
            CheckpointError: a key this lm-zoo does not know, or one a model card must state is missing.
        """
        own = {item.name: item for item in fields(cls)}  # type: ignore[arg-type]
        values: dict[str, Any] = {name: data[name] for name in own if name in data}
        unknown = [name for name in data if name not in own]
        if "procedure" in own:
            values["procedure"], unknown = ProcedureSettings.from_json({name: data[name] for name in unknown})
        if unknown:
            raise CheckpointError(
                f"an evaluation result holds {', '.join(sorted(unknown))}, which this lm-zoo does not know: pass the "
                "output of `lm-zoo evaluate --json` of this version"
            )
        required = [name for name, item in own.items() if item.default is MISSING and item.default_factory is MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise CheckpointError(
                f"an evaluation result lacks {', '.join(missing)}: pass the output of `lm-zoo evaluate --json`"
            )
        return cls(**values)

    def _part(self, units: str) -> list[str]:
        """How much of the split was scored, where it was not the whole (``max_tokens``)."""
        return [f"the first {self.max_tokens:,} {units}' windows"] if self.max_tokens else []

    def _precision(self) -> list[str]:
        """The matmul precision in words, where it is not the default full float32 (the JSON always records it)."""
        if self.matmul_precision in (None, DEFAULT_MATMUL_PRECISION):
            return []
        return [f"float32 matmuls at {self.matmul_precision} precision"]


def _headline_text(result: dict[str, Any]) -> str:
    """A text result's figure to quote first, in words: ``bpc 1.2345`` or ``ppl 123.45``."""
    name = result_figures(result)[0]
    return f"bpc {result[name]:.4f}" if name == BPC else f"ppl {result[name]:.2f}"


@dataclass(kw_only=True)
class TextResult(_Result):
    """A text model's figures on a split (``evaluation.perplexity.evaluate``).

    Attributes:
        split: ``train``, ``valid`` or ``test``.
        corpus: the corpus (its name, or a directory).
        tokenizer: the tokenizer's kind.
        tokens: the predicted tokens scored.
        loss: mean nats per token.
        ppl: ``exp(loss)``.
        bpc: bits per character, where :func:`datamodules.kinds.text_figures` reports them.
        word_ppl: perplexity per word of the original text (SentencePiece).
        eval_batch_size: parallel streams (each starts without context, so the figure depends on it).
        bptt: window length.
        procedure: how it was scored.
        max_tokens: only the windows up to the one holding the split's this-many-th token were scored (a check
            figure, never to be read as the whole split's); ``None``: the whole split.
        unk_rate: the share of ``<unk>`` tokens, for a tokenizer that has one (not stored).
        source: the model scored (not stored: a local path).
        matmul_precision: float32 matmul precision (not stored).
        quantize: ``int8`` for a quantized model (not stored).
    """

    kind: ClassVar[ModelKind] = TEXT
    split: str
    corpus: str | None = field(default=None, metadata=_OPTIONAL)
    tokenizer: str | None = field(default=None, metadata=_OPTIONAL)
    tokens: int | None = field(default=None, metadata=_OPTIONAL)
    loss: float
    ppl: float
    bpc: float | None = field(default=None, metadata=_OPTIONAL)
    word_ppl: float | None = field(default=None, metadata=_OPTIONAL)
    eval_batch_size: int
    bptt: int
    procedure: ProcedureSettings = field(default_factory=ProcedureSettings)
    max_tokens: int | None = field(default=None, metadata=_OPTIONAL)
    unk_rate: float | None = field(default=None, metadata=_LOCAL_OPTIONAL)
    source: str | None = field(default=None, metadata=_LOCAL_OPTIONAL)
    matmul_precision: str | None = field(default=None, metadata=_LOCAL_OPTIONAL)
    quantize: str | None = field(default=None, metadata=_LOCAL_OPTIONAL)

    def figures(self) -> list[tuple[str, float]]:
        """``(name, value)`` of what it reports, the headline first (:func:`datamodules.kinds.text_figures`: a result
        holds bits per character exactly where its text was scored per character or is SentencePiece's)."""
        names = self.kind.figures(self.bpc is not None, self.tokenizer)
        return [(name, getattr(self, name)) for name in names if getattr(self, name) is not None]

    def headline(self) -> str:
        """The figure to quote first, in a few words: ``bpc 1.2345`` or ``ppl 123.45``."""
        return _headline_text(self.to_json())

    def describe(self) -> str:
        """The human-readable line of ``lm-zoo evaluate``: the figure, then every setting it depends on."""
        sizes = [f"eval batch size {self.eval_batch_size}", f"bptt {self.bptt}"]
        settings = [*sizes, *self.procedure.details(), *self._part("tokens"), *self._precision()]
        unknown = f", {self.unk_rate:.2%} of them <unk>" if self.unk_rate else ""
        return (
            f"{self.corpus} {self.split}: {self.headline()}  (loss {self.loss:.4f} nats/token over "
            f"{self.tokens:,} tokens{unknown}; {'; '.join(settings)})"
        )


@dataclass(kw_only=True)
class MusicResult(_Result):
    """A piano-roll model's negative log-likelihood on a split (``evaluation.music``).

    Attributes:
        split: ``train``, ``valid`` or ``test``.
        dataset: the dataset's name.
        nll_per_step: nats per frame, summed over the notes (Jozefowicz et al. 2015, Table 2).
        nll_per_note: the same per note.
        frames: the frames scored.
        pieces: the pieces they belong to.
        eval_batch_size: pieces side by side (each from a zero state: it does not change the figure).
        bptt: frames per window (nor does it).
        max_tokens: only the windows up to the one holding the split's this-many-th frame were scored; ``None``: the
            whole split.
        source, matmul_precision, quantize: as :class:`TextResult`'s (not stored).
    """

    kind: ClassVar[ModelKind] = MUSIC
    split: str
    dataset: str | None = field(default=None, metadata=_OPTIONAL)
    nll_per_step: float
    nll_per_note: float | None = field(default=None, metadata=_OPTIONAL)
    frames: int | None = field(default=None, metadata=_OPTIONAL)
    pieces: int | None = field(default=None, metadata=_OPTIONAL)
    eval_batch_size: int
    bptt: int
    max_tokens: int | None = field(default=None, metadata=_OPTIONAL)
    source: str | None = field(default=None, metadata=_LOCAL_OPTIONAL)
    matmul_precision: str | None = field(default=None, metadata=_LOCAL_OPTIONAL)
    quantize: str | None = field(default=None, metadata=_LOCAL_OPTIONAL)

    def figures(self) -> list[tuple[str, float]]:
        """``(name, value)`` of what it reports: the NLL per frame."""
        return [(name, getattr(self, name)) for name in self.kind.figures(False, None)]

    def headline(self) -> str:
        """The figure in a few words: ``NLL per step 8.1234``."""
        return f"NLL per step {self.nll_per_step:.4f}"

    def describe(self) -> str:
        """One line for a human: the NLL per frame and per note, what was read, and how."""
        settings = [
            f"eval batch size {self.eval_batch_size}, bptt {self.bptt}",
            *self._part("frames"),
            *self._precision(),
        ]
        return (
            f"{self.split}: {self.nll_per_step:.4f} nats per frame (negative log-likelihood per time step, summed "
            f"over the notes), {self.nll_per_note:.5f} per note; {self.frames:,} frames in {self.pieces:,} pieces of "
            f"{self.dataset} ({'; '.join(settings)})"
        )


EvaluationResult = TextResult | MusicResult
_TYPES: dict[ModelKind, type[TextResult] | type[MusicResult]] = {TEXT: TextResult, MUSIC: MusicResult}


def result_from_json(data: dict[str, Any]) -> EvaluationResult:
    """A text or music result from its JSON, told apart by its figures (:func:`datamodules.kinds.kind_of_result`).

    Raises:
        CheckpointError: as :meth:`_Result.from_json`.
    """
    return _TYPES[kind_of_result(data)].from_json(data)
