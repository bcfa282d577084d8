"""Every way ``lm-zoo evaluate`` scores a text split, by the ``method`` its results record. A new procedure is a module
holding a :class:`~evaluation.scoring.ScoringProcedure` subclass (its flags, checks, scorer, recorded settings and
their text) and one line in :data:`SCORING_PROCEDURES`.

The table names each class as ``module:Class`` and imports it when first asked, as ``commands.COMMANDS`` does: reading
a stored result (:mod:`evaluation.results`, which asks this table for a procedure's keys and words) then imports no
torch, and results.py, which the procedures' callers import, imports no procedure module in turn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from zoo.errors import CheckpointError

if TYPE_CHECKING:
    from evaluation.scoring import ScoringProcedure

#: The procedures by the ``method`` a result records, the default first, then in the order ``lm-zoo evaluate --help``
#: lists their flags.
SCORING_PROCEDURES: dict[str, str] = {
    "deterministic": "evaluation.deterministic:Deterministic",
    "mc-dropout": "evaluation.mc_dropout:MCDropout",
    "dynamic": "evaluation.dynamic:DynamicEvaluation",
}
DEFAULT_METHOD = next(iter(SCORING_PROCEDURES))


def procedure_class(method: str) -> type[ScoringProcedure]:
    """The procedure a result's ``method`` names.

    Raises:
        CheckpointError: a method this lm-zoo does not know (a result written by another version).
    """
    if method not in SCORING_PROCEDURES:
        raise CheckpointError(
            f"an evaluation result was scored by {method!r}, which this lm-zoo does not know (it knows "
            f"{', '.join(SCORING_PROCEDURES)}): pass the output of `lm-zoo evaluate --json` of this version"
        )
    module, name = SCORING_PROCEDURES[method].split(":")
    return getattr(importlib.import_module(module), name)


def chosen_by_flag() -> list[type[ScoringProcedure]]:
    """The procedures a flag of ``lm-zoo evaluate`` chooses (all but the default), in the table's order."""
    return [procedure_class(method) for method in SCORING_PROCEDURES if method != DEFAULT_METHOD]
