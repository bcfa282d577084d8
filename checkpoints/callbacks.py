"""A Lightning callback that exports (and optionally publishes) the best checkpoint when ``fit`` ends.

In a config::

    trainer:
      callbacks:
        - class_path: checkpoints.callbacks.PublishBest
          init_args:
            out_dir: exported/ptb-lstm-small      # default: <log dir>/export
            repo_id: someone/ptb-lstm-small       # optional: also publish (HF_TOKEN with write access)
            tag: v1
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from checkpoints import hub, load
from checkpoints.export_write import export_model, measure
from datamodules.corpora import REPORTED_SPLITS
from zoo.errors import CheckpointError


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


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
        out = Path(self.out_dir) if self.out_dir else Path(trainer.log_dir or trainer.default_root_dir) / "export"
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
