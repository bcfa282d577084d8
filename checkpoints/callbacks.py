"""Lightning callbacks between a run and trained models: start from one, export (and publish) the best.

In a config::

    trainer:
      callbacks:
        - class_path: checkpoints.callbacks.InitialWeights
          init_args:
            source: wikitext-2-lstm               # a registered name, an export directory, a Hub repo, a .ckpt

    trainer:
      callbacks:
        - class_path: checkpoints.callbacks.PublishBest
          init_args:
            out_dir: exported/ptb-lstm-small      # default: <log dir>/export
            repo_id: someone/ptb-lstm-small       # optional: also publish (HF_TOKEN with write access)
            tag: v1
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from checkpoints import hub, load
from checkpoints.export_read import load_weights
from checkpoints.export_write import export_model, measure
from datamodules.corpora import REPORTED_SPLITS
from datamodules.tokenizers import Tokenizer
from lightning_modules.averaging import WeightAveragingOnPlateau
from lightning_modules.lightning_private import count_on_from
from lightning_modules.training import log_dir_here
from zoo.errors import CheckpointError, ConfigError


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _symbols(tokenizer: Tokenizer) -> dict[str, Any]:
    """What a tokenizer maps between text and ids: its state without the training counts, which may differ where the
    ids do not (another corpus with the same vocabulary)."""
    return {k: v for k, v in tokenizer.state_dict().items() if k != "counts"}


def _first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    mine, other = ours.get("symbols"), theirs.get("symbols")
    if ours.get("kind") != theirs.get("kind") or not isinstance(mine, list) or not isinstance(other, list):
        return f"a {theirs.get('kind')} tokenizer, where this run's is {ours.get('kind')}"
    where = next((i for i, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b), min(len(mine), len(other)))
    if where == len(mine) == len(other):
        return "another tokenizer setting"
    return f"{len(other):,} symbols where this run has {len(mine):,}; they first differ at id {where:,}"


class InitialWeights(Callback):
    """Start a fresh ``fit`` from a trained model's weights: fine-tuning, or carrying a run on from its export.

    Lightning's ``--ckpt_path`` resumes a run exactly, but only from a ``.ckpt`` with its optimizer, loops and RNG;
    what is published is an export (weights, tokenizer and record, no training state), which this loads instead. The
    optimizer, schedule and loops start anew from the run's own config, so a continuation sets its learning rate and
    schedule where the earlier run left them, or says ``carry_on``. The weights are loaded at ``setup``, before the
    optimizer is built and before Lightning restores a ``--ckpt_path``, whose weights therefore win when a run is
    resumed. A weight-averaging callback copies the network at its own ``setup``: one that may read that copy before
    its first update must come after this one in ``trainer.callbacks`` (lm-zoo's ``WeightAveragingOnPlateau`` never
    does: its first update copies the live weights).

    With ``carry_on`` the run is the next hop of one run trained over several sittings (a GPU's few minutes each): it
    carries on from what the source's export recorded of its checkpoint, the epochs and optimizer steps done (the loops
    count on from them, so the data's per-epoch draws go on too), each parameter group's learning rate, and whether
    its weights were averaged; if they were, a ``WeightAveragingOnPlateau`` averages from this hop's first step, from
    those averaged weights, as AWD-LSTM's fine-tuning restarts ASGD from the averaged model. The hops' ledger is the
    model card's, from the revisions each hop shipped as (``python -m release build --continues``).
    A learning-rate scheduler is not carried (an export records no scheduler state): it starts anew from its own
    settings, so a hop's recipe keeps a constant rate (the GPU recipes do) or sets the schedule where the last left it.

    Args:
        source: a registered name, an export directory, a Hub repo id or a ``.ckpt`` (what ``lm-zoo evaluate``
            takes). Its architecture, sizes and tokenizer must be this run's.
        revision: for a Hub repo: a branch, tag or commit.
        carry_on: carry the source's run on (above); ``False`` only takes its weights.
    """

    def __init__(self, source: str, revision: str | None = None, carry_on: bool = False) -> None:
        self.source = source
        self.revision = revision
        self.carry_on = carry_on
        self._carried: dict[str, Any] | None = None  # what this hop starts from: the source's record

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Load the weights, after checking that they fit this run's network and vocabulary."""
        if stage != "fit":
            return
        earlier = trainer.callbacks[: trainer.callbacks.index(self)] if self in trainer.callbacks else []
        copies = [type(c).__name__ for c in earlier if isinstance(c, WeightAveraging | StochasticWeightAveraging)]
        copies = [name for name in copies if name != WeightAveragingOnPlateau.__name__]
        if copies:
            raise ConfigError(
                f"InitialWeights comes after {', '.join(copies)} in trainer.callbacks, which would average from the "
                "network's random start: list InitialWeights first"
            )
        loaded = load(self.source, self.revision)
        where = f"the initial weights ({loaded.source or self.source})"
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if loaded.tokenizer is not None and tokenizer is not None:
            ours, theirs = _symbols(tokenizer), _symbols(loaded.tokenizer)
            if ours != theirs:
                raise ConfigError(
                    f"{where} were trained with another vocabulary ({_first_difference(ours, theirs)}): train on "
                    "the corpus and tokenizer they were trained with"
                )
        ours, theirs = asdict(pl_module.model.config), asdict(loaded.model.config)
        differences = ", ".join(
            f"{k} {theirs.get(k)!r} where this run has {v!r}" for k, v in ours.items() if theirs.get(k) != v
        )
        remedy = f"give this run the network they were trained with ({differences or 'no setting differs'})"
        # load_state_dict copies into this run's float32 parameters, whatever the export stored (float16, say).
        load_weights(pl_module.model, loaded.model.state_dict(), where, remedy=remedy)
        if trainer.is_global_zero:  # with the run's other start-up lines (lightning_modules.training.RunSettings)
            print(f"lm-zoo: the run starts from {where}", file=sys.stderr)
        if self.carry_on and trainer.ckpt_path is None:  # a resumed hop has its checkpoint's counters
            self._carried = _carried_record(loaded.training, where)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With ``carry_on``: the loops' counters, the learning rates and the averaging where the source left them
        (here: the optimizers exist, and a ``--ckpt_path`` would restore its own state after this)."""
        record = self._carried
        if record is None:
            return
        epochs, steps = record["epoch"] + 1, record["global_step"]  # its checkpoint was written in its last epoch
        groups = [group for optimizer in record["optimizers"] for group in optimizer["param_groups"]]
        ours = [group for optimizer in trainer.optimizers for group in optimizer.param_groups]
        if len(groups) != len(ours):
            raise ConfigError(
                f"the run carried on had {len(groups)} parameter group(s) where this one has {len(ours)}: carry it "
                "on with its own recipe's optimizer"
            )
        for group, carried in zip(ours, groups, strict=True):
            group["lr"] = carried["lr"]
        count_on_from(trainer, epochs, steps)
        if record.get("weight_averaged"):
            for callback in (c for c in trainer.callbacks if isinstance(c, WeightAveragingOnPlateau)):
                callback.switch_on(steps, "the run this hop carries on averaged its weights")
        if trainer.is_global_zero:
            rates = ", ".join(f"{group['lr']:g}" for group in ours)
            print(
                f"lm-zoo: the run carries on from epoch {epochs} and step {steps:,}, learning rate {rates}, weights "
                f"{'averaged' if record.get('weight_averaged') else 'not averaged'} before",
                file=sys.stderr,
            )


def _carried_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """The source's training record, checked to hold what a hop carries on from."""
    missing = [key for key in ("epoch", "global_step", "optimizers") if record.get(key) is None]
    if missing or not record["optimizers"]:
        raise ConfigError(
            f"{where} record no {', '.join(missing) or 'optimizer'} of the run that made them, so a run cannot carry "
            "on from them: start from their weights alone (carry_on: false), or from an export lm-zoo wrote"
        )
    return record


class PublishBest(Callback):
    """Export the best checkpoint (by the ModelCheckpoint's monitor; else the last) at the end of ``fit``.

    The export holds the checkpoint's weights (a weight-averaged run's averaged weights), the results measured on
    ``eval_splits`` for the model card, and the optimizer and scheduler classes the run used.

    Args:
        out_dir: the export directory; default ``<trainer.log_dir>/export``.
        repo_id: publish the export to this Hub repo (``owner/name``) too; ``None`` only exports.
        private: create the repo private.
        revision: branch to commit to (default ``main``).
        tag: tag the commit (e.g. ``v1``).
        endpoint: the Hub's URL (default ``$HF_ENDPOINT`` or huggingface.co).
        eval_splits: splits evaluated for the model card; empty to measure nothing.
        eval_batch_size: eval batch size for those results (default: the data module's).
        eval_bptt: eval BPTT for those results (default: the data module's).
    """

    def __init__(
        self,
        out_dir: str | None = None,
        repo_id: str | None = None,
        private: bool = False,
        revision: str | None = None,
        tag: str | None = None,
        endpoint: str | None = None,
        eval_splits: list[str] | None = None,
        eval_batch_size: int | None = None,
        eval_bptt: int | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.repo_id = repo_id
        self.private = private
        self.revision = revision
        self.tag = tag
        self.endpoint = endpoint
        self.eval_splits = list(REPORTED_SPLITS if eval_splits is None else eval_splits)
        self.eval_batch_size = eval_batch_size
        self.eval_bptt = eval_bptt
        self.exported: Path | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Export (and publish) once, on the global-zero process, after the last checkpoint is written."""
        if not trainer.is_global_zero:
            return

        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", "") or getattr(callback, "last_model_path", "")
        if not best or not Path(best).is_file():
            rank_zero_warn("PublishBest: no checkpoint was written in this run, so nothing is exported")
            return
        out = Path(self.out_dir) if self.out_dir else log_dir_here(trainer) / "export"  # no broadcast: rank 0 alone
        loaded = load(best)
        # A .ckpt does not record which classes the optimizer and scheduler were; the trainer knows.
        for record, optimizer in zip(loaded.training.get("optimizers", []), trainer.optimizers, strict=False):
            record["class"] = _class_name(optimizer)
        if trainer.lr_scheduler_configs:
            loaded.training["lr_schedulers"] = [_class_name(c.scheduler) for c in trainer.lr_scheduler_configs]
        results = measure(loaded, self.eval_splits, self.eval_batch_size, self.eval_bptt, device=str(pl_module.device))
        self.exported = export_model(loaded, out, results)
        rank_zero_info(f"PublishBest: exported {best} to {out}")
        if self.repo_id is None:
            return
        try:
            published = hub.publish(
                out, self.repo_id, private=self.private, revision=self.revision, tag=self.tag, endpoint=self.endpoint
            )
        except CheckpointError as err:
            raise CheckpointError(f"{err} (the export is in {out}: publish it later with lm-zoo publish)") from None
        rank_zero_info(f"PublishBest: published {out} as {published.url} (commit {published.commit})")
